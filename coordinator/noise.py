"""The gradient noise scale, measured from the rounds themselves. Pure: numbers in, numbers out
(no torch, no clock).

The simple noise scale of McCandlish et al. (2018), "An Empirical Model of Large-Batch
Training", is B_simple = tr(Sigma) / |G|^2: G the true gradient (the mean of the per-sample
gradients), Sigma their covariance. It is the batch size past which a larger batch mostly buys
less noise, not more progress (the critical batch size is of its order): a fleet whose round
batch is well below it gains from larger rounds; one well above spends samples for little.

A round gives both estimates for free. Its slots are gradients of disjoint partitions at one
model version (a round never mixes versions), and the decoded round is their mean:

- each used slot s returns f_s = sum_j c_j g_j, the coded sum of the partition sums g_j it
  covers (code none and replicate: one partition, c = 1), partition j of b_j samples;
- the round's mean gradient m = (1 / B) sum_j g_j over its B samples.

For a sum f = sum_n w_n x_n of independent per-sample gradients x_n (mean G, covariance Sigma),
E |f|^2 = (sum_n w_n)^2 |G|^2 + (sum_n w_n^2) tr(Sigma). So, with a_s = (sum_j c_j b_j)^2 and
q_s = sum_j c_j^2 b_j for slot s, and T = tr(Sigma):

    E |f_s|^2 = a_s |G|^2 + q_s T             (each used slot)
    E |m|^2   = |G|^2 + T / B                 (the round)

Weighting slot s by 1 / q_s (by its samples, for plain partitions) and summing over the k used
slots, U = sum_s |f_s|^2 / q_s and N = sum_s a_s / q_s, E U = N |G|^2 + k T. With V = |m|^2 the
two moment equations solve to unbiased estimates of each (not of their ratio):

    T     = (U - N V) / (k - N / B)
    |G|^2 = V - T / B

For k plain partitions of b_i samples (N = B, U = sum_i b_i |g_i / b_i|^2), with the small
batches' mean square weighted by samples, S_small = sum_i (b_i / B) |g_i / b_i|^2, and
S_big = |m|^2, this is T = (S_small - S_big) B / (k - 1) and
|G|^2 = (k S_big - S_small) / (k - 1): the paper's two-batch estimator, exactly, for equal b_i
(B = k b). A coded slot (cyclic) is one more linear observation of the same two unknowns:
slots that overlap, or replicas of one row, are dependent, which changes the variance of U but
not its expectation. (Samples drawn without replacement from a finite training set are slightly
anti-correlated; negligible for a data set much larger than a round.)

Each round's |G|^2 and T are smoothed by their own exponential moving average (bias-corrected,
as Adam's moments are) before the ratio is taken: one round's |G|^2 is noisy and may come out
negative, the ratio of the averages is what the paper reports. A round whose slots carry too
little information on the split (k - N / B below `MIN_SPREAD`: one partition, or every slot a
copy of the whole batch) is not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

SMOOTHING = 0.95  # each EMA's decay per round: about 20 rounds' memory
MIN_SPREAD = 0.5  # k - N / B below this: the slots say nothing about the split


@dataclass(frozen=True)
class RoundNoise:
    gradient_sq: float  # the round's unbiased estimate of |G|^2
    trace: float  # of tr(Sigma)
    slots: int
    samples: int


def round_estimate(slots: Sequence[tuple[float, Sequence[tuple[int, float]]]],
                   counts: Sequence[int], mean_square: float) -> Optional[RoundNoise]:
    """One round's estimates from its used slots, each (|f_s|^2, its row: (partition,
    coefficient) pairs), the samples of each partition (`counts`) and `mean_square` = |m|^2, the
    round's decoded mean gradient's squared norm. None when the round cannot tell (module
    docstring), or a figure is not finite."""
    total = sum(counts)
    if total <= 0 or not math.isfinite(mean_square):
        return None
    weighted = effective = 0.0  # U and N
    used = 0
    for square, row in slots:
        if not math.isfinite(square):
            return None
        sum_w = sum(c * counts[j] for j, c in row)
        sum_w2 = sum(c * c * counts[j] for j, c in row)
        if not sum_w2 > 0:
            continue  # a row of no samples observes nothing
        weighted += square / sum_w2
        effective += sum_w * sum_w / sum_w2
        used += 1
    spread = used - effective / total
    if spread < MIN_SPREAD:
        return None
    trace = (weighted - effective * mean_square) / spread
    gradient_sq = mean_square - trace / total
    if not (math.isfinite(trace) and math.isfinite(gradient_sq)):
        return None
    return RoundNoise(gradient_sq, trace, used, total)


class NoiseScale:
    """The smoothed estimates over the rounds seen, and B_simple from them."""

    def __init__(self, smoothing: float = SMOOTHING):
        self.smoothing = smoothing
        self.rounds = 0  # rounds counted
        self.last: Optional[RoundNoise] = None
        self._gradient_sq = 0.0  # the EMAs, not yet bias-corrected
        self._trace = 0.0

    def observe(self, estimate: Optional[RoundNoise]) -> None:
        if estimate is None:
            return
        beta = self.smoothing
        self._gradient_sq = beta * self._gradient_sq + (1 - beta) * estimate.gradient_sq
        self._trace = beta * self._trace + (1 - beta) * estimate.trace
        self.rounds += 1
        self.last = estimate

    def _corrected(self, value: float) -> float:
        return value / (1 - self.smoothing ** self.rounds)

    @property
    def gradient_sq(self) -> Optional[float]:
        return self._corrected(self._gradient_sq) if self.rounds else None

    @property
    def trace(self) -> Optional[float]:
        return self._corrected(self._trace) if self.rounds else None

    @property
    def b_simple(self) -> Optional[float]:
        """tr(Sigma) / |G|^2 in samples; None before any round, or while the smoothed |G|^2 is
        not positive (the noise swamps the signal: larger than any batch seen can tell)."""
        gradient_sq, trace = self.gradient_sq, self.trace
        if gradient_sq is None or trace is None or not gradient_sq > 0:
            return None
        return max(0.0, trace) / gradient_sq

    def state_dict(self) -> dict:
        """The estimator's state, for checkpoints (plain numbers): a resumed run measures on
        from where it was, rather than from no rounds."""
        last = self.last
        return {"smoothing": self.smoothing, "rounds": self.rounds,
                "gradient_sq": self._gradient_sq, "trace": self._trace,
                "last": None if last is None else [last.gradient_sq, last.trace, last.slots,
                                                   last.samples]}

    def load_state_dict(self, state: dict) -> None:
        self.smoothing = float(state.get("smoothing", self.smoothing))
        self.rounds = int(state.get("rounds", 0))
        self._gradient_sq = float(state.get("gradient_sq", 0.0))
        self._trace = float(state.get("trace", 0.0))
        last = state.get("last")
        self.last = (None if last is None else
                     RoundNoise(float(last[0]), float(last[1]), int(last[2]), int(last[3])))

    def summary(self) -> dict:
        """For the status snapshot and the metrics log (plain numbers: msgpack and JSON)."""
        def rounded(value: Optional[float]) -> Optional[float]:
            return None if value is None else float(f"{value:.6g}")
        return {"b_simple": rounded(self.b_simple), "gradient_sq": rounded(self.gradient_sq),
                "trace": rounded(self.trace), "rounds": self.rounds,
                "batch": self.last.samples if self.last is not None else None}
