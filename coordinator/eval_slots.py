"""An evaluation handed to workers: the model at one version, cut into ranges of the test set,
whose answers (sums and counts per metric) add up to the evaluation's metrics. Pure: no torch,
no clock (`now` is an argument).

Which slot computes which range, who holds it, deadlines and a vanished holder's range going to
another worker are the scheduler's side slots (scheduler.py); this holds what the ranges are
and what has come back. The metrics are those the coordinator's own evaluation reports
(common/eval_sums.py): each metric's sums over its counts.

An answer is a worker's word: `EvalShape` says what an honest one can look like for the job (its
metric names, each count, each sum's range), and one that cannot be honest is its sender's
offence (the round core's `evaluated`). An answer of honest shape may still lie: the run stops
only on the coordinator's own evaluation (run.py).
"""

from __future__ import annotations

import math
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


def is_fraction(metric: str) -> bool:
    """Whether a metric counts each sample as 0 or 1 (an accuracy: the default's correct count),
    so that its sum lies between 0 and its count."""
    return metric.lower().endswith("accuracy")


@dataclass(frozen=True)
class EvalShape:
    """What an honest answer for a range of the test set looks like for the job: exactly these
    metric names (`EvalShape.of` the coordinator's own sums of a few test samples), the
    `per_sample` ones counted once per sample of the range, every number finite, and a fraction
    (`is_fraction`) summed between 0 and its count."""

    metrics: frozenset[str]
    per_sample: frozenset[str] = frozenset()

    @classmethod
    def of(cls, probes: list[tuple[int, dict[str, tuple[float, float]]]]) -> "EvalShape":
        """From the coordinator's own sums of (samples, sums) ranges: the metrics all report; per
        sample, those counted as many times as each range has samples (two ranges of other
        sizes, so that a count that happens to match one is not taken for it)."""
        names = frozenset.intersection(*(frozenset(sums) for _, sums in probes))
        return cls(names, frozenset(n for n in names
                                    if all(sums[n][1] == samples for samples, sums in probes)))

    def fault(self, sums: dict[str, tuple[float, float]], samples: int) -> Optional[str]:
        """Why `sums` cannot be an honest answer for a range of `samples` test samples; None
        when it can."""
        if set(sums) != self.metrics:
            got = ", ".join(sorted(sums)[:8])[:120]
            return f"metrics [{got}] are not the job's [{', '.join(sorted(self.metrics))}]"
        fault = impossible(sums)
        if fault is not None:
            return fault
        for name in sorted(self.per_sample):
            if sums[name][1] != samples:
                return f"{name} counted {sums[name][1]:g} times over a range of {samples} samples"
        return None


def impossible(sums: dict[str, tuple[float, float]]) -> Optional[str]:
    """Why `sums` can be no evaluation's, whatever the job: a number that is not finite, a
    negative count, a fraction summed outside [0, its count]; None when none is."""
    for name, (total, count) in sorted(sums.items()):
        if not (math.isfinite(total) and math.isfinite(count) and count >= 0):
            return f"{name} is [{total:g}, {count:g}]: not a sum over a count"
        if is_fraction(name) and not 0 <= total <= count:
            return f"{name} sums to {total:g} over {count:g} samples"
    return None


@dataclass
class WorkerEvaluation:
    """One evaluation in flight on workers."""

    version: int
    samples: int  # samples applied when it was planned (for the metrics log)
    started: float
    ranges: dict[int, list[int]]  # slot id -> its part
    sums: dict[int, dict[str, tuple[float, float]]] = field(default_factory=dict)
    compute_s: float = 0.0  # the answers' compute seconds, summed
    shape: Optional[EvalShape] = None  # what an honest answer looks like; None: any possible one

    def fault(self, slot: int, sums: dict[str, tuple[float, float]]) -> Optional[str]:
        """Why `sums` cannot be an honest answer for `slot`'s range; None when it can."""
        if self.shape is not None:
            return self.shape.fault(sums, self.ranges[slot][2])
        return impossible(sums)

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
