"""A worker waiting for its coordinator says so, every so often: a worker that waits forever
(the default) must not be taken for a hung one, nor its silence for a wrong key. Pure: the
time is passed in."""

from __future__ import annotations

from typing import Optional

# the first report after 30 s, then at 2 and 10 minutes, then every 10 minutes
REPORT_AT_S = (30.0, 120.0, 600.0)
REPORT_EVERY_S = 600.0


def duration(seconds: float) -> str:
    """30s, 2m, 1h5m: how long a person reads a wait."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    return f"{s // 3600}h{(s % 3600) // 60}m" if s % 3600 >= 60 else f"{s // 3600}h"


class Waiting:
    """Since when no answer came from `address`, and when to say so next."""

    def __init__(self, address: str, keys: bool, since: float):
        self.address, self.keys, self.since = address, keys, since
        self._reports = 0

    def _due_at(self) -> float:
        if self._reports < len(REPORT_AT_S):
            return REPORT_AT_S[self._reports]
        return REPORT_AT_S[-1] + REPORT_EVERY_S * (self._reports - len(REPORT_AT_S) + 1)

    def report(self, now: float) -> Optional[str]:
        """The line to log when one is due at `now`, else None."""
        waited = now - self.since
        if waited < self._due_at():
            return None
        while waited >= self._due_at():  # a long sleep (a suspended laptop) reports once
            self._reports += 1
        hint = "is it running? do the keys match?" if self.keys else "is it running?"
        return f"no answer from {self.address} for {duration(waited)}; still trying ({hint})"
