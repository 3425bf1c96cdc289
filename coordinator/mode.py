"""Which rounds a coordinator runs: synchronous or asynchronous, and why. Pure.

`--sync` and `--async` choose; with neither (`auto`, the default) the rule is:

- synchronous rounds, sized to each worker's measured speed (round_book.py `slot_shares`), with
  late parts speculated to idle workers, unless a flag asks for something only asynchronous
  rounds do. Their updates are DDP's (every gradient at the current model: no staleness, which
  costs an adaptive optimizer ~3x the samples, docs/scaling.md), and sized parts finish together,
  so the round takes the fleet's total throughput rather than the slowest worker's pace;
- asynchronous rounds where the flags say so: `--task local:...` (parameter changes of slow
  links), `--redundancy` other than none or `--verify-replicas` (their copies and coded rows are
  for asynchronous rounds), `--partitions K` above 1 or `--open-rounds N` (the shape of
  asynchronous rounds), `--delay-compensation` (it corrects stale gradients).

The rule is stated, not learned: benchmarks/fleet.py measures it against the other modes and
DDP on heterogeneous fleets with churn (docs/scaling.md, "The default mode").
"""

from __future__ import annotations

from dataclasses import dataclass

from ..common.errors import ConfigError

MODES = ("auto", "sync", "async")


@dataclass(frozen=True)
class Mode:
    sync: bool
    reason: str  # one line for the status and the start-up log

    @property
    def name(self) -> str:
        return "sync" if self.sync else "async"


def resolve(requested: str, *, local_tasks: bool, redundancy: str, verify_replicas: bool,
            partitions: int, open_rounds: int, compensation: bool) -> Mode:
    """The mode `requested` (auto, sync or async) comes to, given what else was asked for."""
    if requested not in MODES:
        raise ConfigError(f"the round mode must be one of {', '.join(MODES)}, not "
                          f"{str(requested)[:40]!r}")
    if requested == "sync":
        return Mode(True, "--sync")
    if requested == "async":
        return Mode(False, "--async")
    wants_async = [flag for flag, asked in (
        ("--task local", local_tasks),
        (f"--redundancy {redundancy}", redundancy != "none"),
        ("--verify-replicas", verify_replicas),
        (f"--partitions {partitions}", partitions > 1),
        (f"--open-rounds {open_rounds}", open_rounds > 0),
        ("--delay-compensation", compensation),
    ) if asked]
    if wants_async:
        return Mode(False, f"auto: asynchronous rounds, for {', '.join(wants_async)}")
    return Mode(True, "auto: synchronous rounds sized to each worker's speed, late parts "
                      "speculated to idle workers (DDP's updates without waiting for the "
                      "slowest)")
