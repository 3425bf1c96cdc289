"""Resource shares between projects: which project's task the one compute thread runs next.

A worker may serve several coordinators ("projects"), each with a share (BOINC's resource share).
Each project's compute-seconds are counted and decayed exponentially (BOINC's recent average
credit), and the next task goes to the ready project that has had least per unit of share. Over
time each ready project then gets compute in proportion to its share.

A project that is away (its coordinator is down, or it has had no work for a while) builds no
claim meanwhile: its count is lifted to the level of the least-served present project. So when it
comes back it is served at once (not starved) but has no backlog to catch up on (no flood). A
project that is up and owed most but whose next task is still on its way is waited for, briefly
(the caller bounds the wait): else a coordinator that deals one task per result would only ever
get every other task, whatever its share.

Pure: time is an argument; no clock, threads or sockets.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional


class ShareScheduler:
    def __init__(self, shares: Mapping[str, float], half_life_s: float = 600.0):
        if not shares:
            raise ValueError("at least one project")
        bad = {name: share for name, share in shares.items()
               if not (isinstance(share, (int, float)) and math.isfinite(share) and share > 0)}
        if bad:
            raise ValueError(f"shares must be positive numbers, got {bad}")
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s!r}")
        self.shares = dict(shares)
        self.half_life_s = half_life_s
        self.used = {name: 0.0 for name in shares}  # decayed compute-seconds
        self._decayed_at: Optional[float] = None

    def _decay(self, now: float) -> None:
        if self._decayed_at is not None and now > self._decayed_at:
            factor = 0.5 ** ((now - self._decayed_at) / self.half_life_s)
            for name in self.used:
                self.used[name] *= factor
        if self._decayed_at is None or now > self._decayed_at:
            self._decayed_at = now

    def _per_share(self, name: str) -> float:
        return self.used[name] / self.shares[name]

    def charge(self, project: str, seconds: float, now: float) -> None:
        """`project` computed for `seconds` (ending about `now`)."""
        self._decay(now)
        self.used[project] += max(0.0, seconds)

    def pick(self, asking: Iterable[str], now: float,
             expected: Iterable[str] = ()) -> Optional[str]:
        """The project whose task runs next, among those `asking` (a task queued). `expected`:
        projects that are up and have a task coming (a coordinator that deals one task per result
        is never seen asking while its last result is on the wire). None: wait for the expected
        project that is owed most (the caller bounds the wait), or none is asking."""
        self._decay(now)
        asking = set(asking)
        candidates = [name for name in self.shares if name in asking or name in set(expected)]
        if not asking or not candidates:
            return None
        floor = min(self._per_share(name) for name in candidates)
        for name in self.shares:
            if name not in candidates and self._per_share(name) < floor:
                self.used[name] = floor * self.shares[name]
        # Ties (at the start): the larger share first, then the order the projects were listed.
        order = {name: i for i, name in enumerate(self.shares)}
        best = min(candidates, key=lambda n: (self._per_share(n), -self.shares[n], order[n]))
        return best if best in asking else None

    def fractions(self) -> dict[str, float]:
        """Each project's part of the (decayed) compute so far."""
        total = sum(self.used.values())
        return {name: (used / total if total else 0.0) for name, used in self.used.items()}
