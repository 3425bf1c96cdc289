"""A line a second at most: for log lines that a hostile or broken peer could otherwise flood.
Pure: the caller passes the time in."""

from __future__ import annotations

import math


class Throttle:
    def __init__(self, period_s: float = 1.0):
        self.period_s = period_s
        self._last = -math.inf

    def ready(self, now: float) -> bool:
        """Whether a line may go out at `now` (and, if so, the period starts again)."""
        if now - self._last <= self.period_s:
            return False
        self._last = now
        return True
