"""An evaluation handed to workers: the model at one version, cut into ranges of the test set,
whose answers (sums and counts per metric) add up to the evaluation's metrics. Pure: no torch,
no clock (`now` is an argument).

Which slot computes which range, who holds it, deadlines and a vanished holder's range going to
another worker are the scheduler's side slots (scheduler.py); this holds what the ranges are
and what has come back. The metrics are those the coordinator's own evaluation reports
(common/eval_sums.py): each metric's sums over its counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..common.eval_sums import combine_sums

# Test samples per evaluation slot, in training batches: an evaluation slot's forward passes
# cost about a third of a training slot of as many samples, so two batches are roughly one
# training slot of the round's batch, whatever the partitions.
EVAL_SLOT_BATCHES = 2


def plan_ranges(total: int, per_slot: int) -> list[list[int]]:
    """[0, offset, count] parts covering test samples [0, total), `per_slot` each (the last
    one shorter)."""
    per_slot = max(1, int(per_slot))
    return [[0, start, min(per_slot, total - start)] for start in range(0, max(0, total), per_slot)]


@dataclass
class WorkerEvaluation:
    """One evaluation in flight on workers."""

    version: int
    samples: int  # samples applied when it was planned (for the metrics log)
    started: float
    ranges: dict[int, list[int]]  # slot id -> its part
    sums: dict[int, dict[str, tuple[float, float]]] = field(default_factory=dict)
    compute_s: float = 0.0  # the answers' compute seconds, summed

    def answer(self, slot: int, sums: dict[str, tuple[float, float]],
               compute_s: float = 0.0) -> bool:
        """A slot's sums and its compute seconds; whether the evaluation is complete."""
        if slot in self.ranges and slot not in self.sums:
            self.sums[slot] = sums
            self.compute_s += max(0.0, compute_s)
        return self.complete

    @property
    def complete(self) -> bool:
        return len(self.sums) == len(self.ranges)

    def metrics(self) -> dict[str, float]:
        return combine_sums([self.sums[s] for s in sorted(self.sums)])

    def seconds(self, workers: int) -> float:
        """What it cost, as the evaluation plan's cadence counts an evaluation's seconds: the
        fleet's compute seconds per worker (its wall time is mostly training interleaved with
        it, and waiting for a free credit)."""
        return self.compute_s / max(1, workers)


@dataclass(frozen=True)
class EvalChoice:
    """Where evaluations run (`--eval-on`), and why, as `choose` decided."""

    where: str  # "workers" | "coordinator"
    reason: str


# auto: one evaluation costs the coordinator under this share of the run ...
AUTO_SHARE = 0.01
# ... or under this many seconds: less than the model sends and round trips of handing it out
AUTO_CHEAP_S = 0.02


def choose(wanted: str, sums_evaluable: bool, eval_s: Optional[float] = None,
           run_s: Optional[float] = None) -> EvalChoice:
    """`--eval-on` resolved. `eval_s`: one evaluation's estimated seconds here; `run_s`: the
    run's estimated seconds of training (both needed for auto only)."""
    if not sums_evaluable:
        return EvalChoice("coordinator", "the job's evaluate returns means, not sums")
    if wanted != "auto":
        return EvalChoice(wanted, f"--eval-on {wanted}")
    if eval_s is None or run_s is None:
        return EvalChoice("coordinator", "auto: no estimate")
    if eval_s < AUTO_CHEAP_S:
        return EvalChoice("coordinator", f"auto: one evaluation ~{eval_s * 1000:.1f} ms here")
    if eval_s < AUTO_SHARE * run_s:
        return EvalChoice("coordinator", f"auto: one evaluation ~{eval_s:.2f}s here, under "
                                         f"{AUTO_SHARE:.0%} of the run (~{run_s:.0f}s)")
    return EvalChoice("workers", f"auto: one evaluation ~{eval_s:.2f}s here, over "
                                 f"{AUTO_SHARE:.0%} of the run (~{run_s:.0f}s)")
