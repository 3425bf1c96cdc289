"""The enrolment endpoint's bounds, decided: which refused attempt is answered, told to wait or
dropped (`RefusalBudget`), and which open connection is cut (`Connections`). Pure: time is an
argument, connections are opaque ids; enrolment.py holds the sockets.

A stranger with no token may reach the enrolment endpoint, so what a flood of them costs is
bounded here, and the bounds never fall on the holder of a valid token:
- A valid token is never charged. Its secret is checked first (one small file read and a hash,
  cheaper than the CURVE handshake the sender already made us do), so only refusals spend a
  budget.
- A refusal is charged to its source address first: past a few a window the source is told to
  wait, and that costs the window's overall bound nothing. Only what a source may still say
  spends the overall bound, past which refusals are dropped unanswered (no reply, no log line).
- Connections are counted: each has a deadline, and past the cap the oldest connection of the
  source holding the most is cut, so a flood of idle connections sheds its own, not a joiner's.
- Each connection may receive a few KiB (an enrolment is one small message); past that it is cut.
"""

from __future__ import annotations

import resource
from collections import OrderedDict
from typing import Hashable, Optional

from .invitations import REFUSALS_PER_SOURCE, REFUSALS_PER_WINDOW, WINDOW_S, Refusals, SourceLimit

CONNECTION_DEADLINE_S = 10.0  # handshake (5 s at most), enrol, answer: a joiner needs well under
MAX_CONNECTIONS = 256
CONNECTION_BYTES = 64 * 1024  # a handshake and an enrol message are well under 1 KiB
ANSWER, WAIT, DROP = "answer", "wait", "drop"


def connection_cap(nofile: Optional[int] = None) -> int:
    """Open enrolment connections allowed: min(MAX_CONNECTIONS, a quarter of RLIMIT_NOFILE),
    so that the training socket, checkpoints and records always find a file descriptor."""
    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if nofile == resource.RLIM_INFINITY:
            nofile = 1 << 20
    return max(1, min(MAX_CONNECTIONS, nofile // 4))


class RefusalBudget:
    """What becomes of a refused enrolment: ANSWER (with the reason), WAIT (the source has had
    its share: told how long, in seconds) or DROP (the window's overall bound is spent)."""

    def __init__(self, per_source: int = REFUSALS_PER_SOURCE,
                 per_window: int = REFUSALS_PER_WINDOW, window_s: float = WINDOW_S):
        self.sources = SourceLimit(per_source, window_s)
        self.overall = Refusals(per_window, window_s)

    def charge(self, source: str, now: float) -> tuple[str, float]:
        """Charge one refusal from `source` at `now`: (verdict, seconds to wait for WAIT)."""
        wait_s = self.sources.wait(source, now)
        if wait_s > 0:
            return WAIT, wait_s  # the source's own budget: the overall one is left to others
        self.sources.refused(source, now)
        if not self.overall.open(now):
            return DROP, 0.0
        self.overall.refused(now)
        return ANSWER, 0.0


class Connections:
    """The open enrolment connections: when each opened, from which source, and how many bytes
    it has received. `opened`, `received` and `due` name the connections to cut."""

    def __init__(self, cap: int, deadline_s: float = CONNECTION_DEADLINE_S,
                 max_bytes: int = CONNECTION_BYTES):
        self.cap, self.deadline_s, self.max_bytes = cap, deadline_s, max_bytes
        self.open: OrderedDict[Hashable, tuple[str, float]] = OrderedDict()  # oldest first
        self.per_source: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.open)

    def opened(self, conn: Hashable, source: str, now: float) -> list:
        """`conn` from `source` opened at `now`; the connections to cut to stay within the cap
        (the oldest of the source holding the most: a flood pays, a lone joiner does not)."""
        self.closed(conn)
        self.open[conn] = (source, now)
        self.per_source[source] = self.per_source.get(source, 0) + 1
        cut = []
        while len(self.open) > self.cap:
            biggest = max(self.per_source, key=self.per_source.__getitem__)
            victim = next(c for c, (s, _) in self.open.items() if s == biggest)
            self.closed(victim)
            cut.append(victim)
        return cut

    def closed(self, conn: Hashable) -> None:
        entry = self.open.pop(conn, None)
        if entry is not None:
            left = self.per_source[entry[0]] - 1
            if left:
                self.per_source[entry[0]] = left
            else:
                del self.per_source[entry[0]]

    def due(self, now: float) -> list:
        """The connections past their deadline at `now` (forgotten here: cut them)."""
        cut = []
        for conn, (_, since) in self.open.items():
            if now - since < self.deadline_s:
                break  # oldest first: the rest are younger
            cut.append(conn)
        for conn in cut:
            self.closed(conn)
        return cut

    def received(self, conn: Hashable, nbytes: int) -> bool:
        """Whether `conn`, having received `nbytes` in all, must be cut (then forgotten)."""
        if conn in self.open and nbytes > self.max_bytes:
            self.closed(conn)
            return True
        return False
