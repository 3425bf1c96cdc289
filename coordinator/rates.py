"""Samples applied per second, in all and per worker, over one window: the header's rate and the
workers' rates of a status snapshot, from one record, so that the workers' add up to the
header's. A worker's rate is the samples of its results used in applied rounds (its share of
each round, as credits.py counts it), not its compute speed: a copy that was not used, a
slot cancelled, time spent waiting or on the link count for nothing. Pure: `now` is passed in."""

from __future__ import annotations

from collections import deque
from typing import Iterable

WINDOW_S = 5.0
MAX_ENTRIES = 65536  # (time, worker, samples) kept: a window of a large fleet's steps


class AppliedRates:
    def __init__(self, window: float = WINDOW_S):
        self.window = window
        self._log: deque[tuple[float, str, int]] = deque(maxlen=MAX_ENTRIES)

    def applied(self, now: float, shares: Iterable[tuple[str, int]]) -> None:
        """A round applied at `now`: each (worker, samples of its used result)."""
        for worker, samples in shares:
            self._log.append((now, worker, samples))

    def rates(self, now: float, started: float) -> tuple[float, dict[str, float]]:
        """(samples/s in all, samples/s per worker) over the last window, or since `started`."""
        while self._log and self._log[0][0] <= now - self.window:
            self._log.popleft()
        span = min(self.window, now - started)
        if span <= 0:
            return 0.0, {}
        per: dict[str, float] = {}
        for _, worker, samples in self._log:
            per[worker] = per.get(worker, 0.0) + samples / span
        return sum(per.values()), per
