"""How fast each worker computes, and what the scheduler expects of it. Pure: no clock.

A worker's speed is its seconds per sample, an EWMA (weight `alpha` on the newest result) with
an EWMA variance, kept in its `WorkerSpeed`. The `SpeedModel` updates those records and keeps the
fleet's recent readings, which stand in for a worker's own until it has `min_results` results.
From a prediction follow a slot's deadline (generous: a missed one requeues the slot), the
moment a slot turns late (tight: a late slot is only speculated, its holder keeps it), and how
many slots a worker that keeps missing its predictions may hold at once (`size_factor`).

Times are arguments: `started`, `elapsed` and readings come from the caller's clock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

Prediction = tuple[float, float]  # (mean, sd) of seconds per sample


@dataclass
class SlotTimes:
    """A worker's slot times as t = fixed + per_sample * n: what its slots take from hand-out to
    answer (model down, compute, gradient up) against their samples, fitted by least squares
    weighted to its recent slots. A slot has costs that do not shrink with it (the model and
    the gradient are the same size whatever the part; a slow machine pays its per-slot Python
    at its pace too), so seconds per sample alone overstate a small part's time: the slowest
    workers' parts of a short round (an epoch's end) ran long by that fixed part."""

    DECAY = 0.8  # weight of a reading per newer one: the fit follows about the last five
    weight: float = 0.0
    n: float = 0.0
    nn: float = 0.0
    t: float = 0.0
    nt: float = 0.0

    def observe(self, samples: int, seconds: float) -> None:
        d = self.DECAY
        self.weight = d * self.weight + 1.0
        self.n = d * self.n + samples
        self.nn = d * self.nn + samples * samples
        self.t = d * self.t + seconds
        self.nt = d * self.nt + samples * seconds

    def fit(self) -> Optional[tuple[float, float]]:
        """(fixed seconds, seconds per sample), or None before three readings. Slots of sizes
        too alike to tell the two apart (spread under 10%) give fixed 0, their mean rate: at
        one size the two cut parts alike."""
        if self.weight < 2.0 or self.n <= 0:
            return None
        mean_n, mean_t = self.n / self.weight, self.t / self.weight
        var_n = self.nn / self.weight - mean_n * mean_n
        if var_n > (0.1 * mean_n) ** 2:
            per_sample = (self.nt / self.weight - mean_n * mean_t) / var_n
            fixed = mean_t - per_sample * mean_n
            if per_sample > 0 and fixed >= 0:
                return fixed, per_sample
        return 0.0, mean_t / mean_n


@dataclass
class WorkerSpeed:
    """One worker's measurements; the `SpeedModel` writes them."""

    s_per_sample: Optional[float] = None
    s_var: float = 0.0  # EWMA variance of seconds per sample
    observed: int = 0  # results that fed the EWMA
    # its recent readings, censored ones (a bound from a late slot) included: adaptive
    # redundancy simulates rounds from them
    recent: deque = field(default_factory=lambda: deque(maxlen=32))
    size_factor: float = 1.0  # < 1: it keeps missing predictions, so it holds fewer slots
    late: int = 0  # slots of its that turned late past its prediction
    late_streak: int = 0
    # A slot of its turned late and it has answered nothing since: --sync rounds reserve it no
    # part until it does, or until `owes_until` rounds have decoded and it has been heard from
    # since `owed_at` (round_book.py): one that never answers would hold up every round, and
    # one whose late part a copy made moot (it is cancelled, so it never answers that one)
    # would never get a part again
    owes: bool = False
    owes_until: int = 0
    owed_at: float = 0.0  # when its slot turned late
    # Seconds its recent slots that came with a model spent on the link (down and up): from task
    # sent to result arrived, less compute and the wait in its queue. Local tasks size H from it.
    link_times: deque = field(default_factory=lambda: deque(maxlen=8))
    slot_times: SlotTimes = field(default_factory=SlotTimes)  # sizes sync parts
    # --sync rounds in a row that left it out, its fixed slot time past the round's end, and the
    # probes it has had since it last took part (round_book.py `slot_shares`)
    left_out: int = 0
    probes: int = 0

    def slots_allowed(self, credits: int) -> int:
        """Slots it may hold at once: its credits, fewer while it keeps missing predictions."""
        if credits <= 0:
            return 0
        return max(1, int(credits * self.size_factor + 1e-9))

    @property
    def link_s(self) -> Optional[float]:
        """The median of `link_times`: a result resent after a lost connection, or a coordinator
        busy when it arrived, makes one slot's reading far too long."""
        if not self.link_times:
            return None
        ordered = sorted(self.link_times)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class SpeedModel:
    FLEET_READINGS = 256  # the fleet's most recent readings kept

    def __init__(self, alpha: float = 0.3, min_deadline_s: float = 30.0,
                 deadline_factor: float = 4.0, spec_sd: float = 3.0, spec_floor_s: float = 0.5,
                 min_results: int = 3):
        self.alpha = alpha
        self.min_deadline_s = min_deadline_s
        self.deadline_factor = deadline_factor
        self.spec_sd = spec_sd
        self.spec_floor_s = spec_floor_s
        self.min_results = min_results
        self.times: deque[float] = deque(maxlen=self.FLEET_READINGS)
        self.observations = 0  # readings ever taken (adaptive redundancy re-chooses by it)
        # Sums of `times`, kept as it slides, so that a fleet prediction costs no pass over it.
        self._times_sum = self._times_sq = 0.0

    # readings -----------------------------------------------------------------------------

    def observe_result(self, speed: WorkerSpeed, s_per_sample: float) -> None:
        """A result's compute time per sample: it moves the worker's EWMA and variance."""
        a = self.alpha
        old = speed.s_per_sample
        if old is None:
            speed.s_per_sample = s_per_sample
        else:
            diff = s_per_sample - old
            speed.s_per_sample = old + a * diff
            speed.s_var = (1 - a) * (speed.s_var + a * diff * diff)
        speed.observed += 1
        self.observe(s_per_sample, speed)

    def observe(self, s_per_sample: float, speed: Optional[WorkerSpeed] = None) -> None:
        """A reading for the fleet's record (and the worker's `recent`) only. A slot cancelled or
        late gives a lower bound, which must not move the worker's EWMA."""
        times = self.times
        if len(times) == times.maxlen:
            old = times[0]
            self._times_sum -= old
            self._times_sq -= old * old
        times.append(s_per_sample)
        self._times_sum += s_per_sample
        self._times_sq += s_per_sample * s_per_sample
        if self.observations % self.FLEET_READINGS == 0:  # shed the rounding of the sliding sums
            self._times_sum = math.fsum(times)
            self._times_sq = math.fsum(t * t for t in times)
        if speed is not None:
            speed.recent.append(s_per_sample)
        self.observations += 1

    @staticmethod
    def observe_link(speed: WorkerSpeed, wall_s: float, compute_s: float,
                     waited_s: float) -> None:
        """A slot sent with its model took `wall_s` from task sent to result arrived: what its
        compute and its wait in the worker's queue leave is link time."""
        link_s = wall_s - max(0.0, compute_s) - max(0.0, waited_s)
        if link_s >= 0:  # below: the worker misreports its times
            speed.link_times.append(link_s)

    # predictions --------------------------------------------------------------------------

    def judged_by_fleet(self, speed: WorkerSpeed) -> bool:
        """Whether the worker has too few results for its own prediction to count."""
        return speed.observed < self.min_results

    def prediction(self, speed: WorkerSpeed) -> Optional[Prediction]:
        """(mean, sd) of the worker's seconds per sample; the fleet's while it has few results;
        None while the fleet has too few as well."""
        if speed.observed >= self.min_results and speed.s_per_sample is not None:
            return speed.s_per_sample, math.sqrt(max(0.0, speed.s_var))
        n = len(self.times)
        if n >= self.min_results:
            mean = self._times_sum / n
            return mean, math.sqrt(max(0.0, self._times_sq / n - mean * mean))
        return None

    def sizing(self, speed: WorkerSpeed) -> Optional[float]:
        """Seconds per sample to size the worker's part of a sync round by: its own EWMA from its
        first result on, the mean of the fleet's readings before (None while it has none).

        Deadlines and lateness wait for `min_results` of its own (`prediction`): a worker judged
        late on one reading would be speculated against for nothing. A part sized on one
        reading costs nothing of the sort, and the fleet's mean in its place cuts equal parts
        for a whole fleet that has just started (every worker with fewer than `min_results`),
        so that its first rounds went at the slowest worker's pace."""
        if speed.observed >= 1 and speed.s_per_sample is not None:
            return speed.s_per_sample
        return self._times_sum / len(self.times) if self.times else None

    def deadline_s(self, speed: WorkerSpeed, samples: int, credits: int) -> float:
        """Seconds a worker holding up to `credits` slots gets for one of `samples` samples
        before it is handed to another: it may run its other slots first."""
        wait = self.min_deadline_s
        if speed.s_per_sample is not None:
            predicted = speed.s_per_sample * samples * max(1, credits)
            wait = max(wait, self.deadline_factor * predicted)
        return wait

    def late_at(self, prediction: Prediction, samples: int, queued: int,
                started: float, floor: Optional[float] = None) -> float:
        """The first moment a slot started at `started` may be late (see `is_late`)."""
        mean, sd = prediction
        floor = self.spec_floor_s if floor is None else floor
        return started + (mean + self.spec_sd * sd) * samples * queued + floor

    def is_late(self, prediction: Prediction, samples: int, queued: int,
                elapsed: float, floor: Optional[float] = None) -> bool:
        """Whether a slot of `samples` samples running `elapsed` seconds, on a worker that
        computes its `queued` slots one after another, is past its prediction by `spec_sd`
        deviations and `floor` seconds (default `spec_floor_s`)."""
        mean, sd = prediction
        floor = self.spec_floor_s if floor is None else floor
        return elapsed > (mean + self.spec_sd * sd) * samples * queued + floor

    # missed predictions -------------------------------------------------------------------

    def slot_late(self, speed: WorkerSpeed) -> None:
        """A slot of the worker turned late: two in a row halve the slots it may hold (to a
        quarter of its credits), so that a slow machine does not sit on a queue of them."""
        speed.late += 1
        speed.late_streak += 1
        speed.owes = True
        if speed.late_streak >= 2:
            speed.size_factor = max(0.25, speed.size_factor / 2)

    @staticmethod
    def slot_answered(speed: WorkerSpeed, speculated: bool) -> None:
        """A result arrived: the worker regains slots, unless it answers a slot that was late
        while it is missing predictions (that answer proves nothing about its next slot).
        Any answer says it computes: sync rounds cut it a part again."""
        speed.owes = False
        if not speculated or speed.late_streak == 0:
            speed.late_streak = 0
            speed.size_factor = min(1.0, speed.size_factor * 1.5)
