"""Invitations: who may enrol a key, decided. Pure: the wall clock (`now`, seconds since the
epoch: an invitation outlives the coordinator's process) is an argument.

An invitation is a record the coordinator keeps (enrolment.py stores it): its id, the hash of
its one-time secret, how many keys it may still enrol and until when. The secret itself is only
in the token handed to the volunteer; it is compared by hash, in constant time.
"""

from __future__ import annotations

import hmac
import math
import re
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from typing import Optional

from ..common.errors import ConfigError
from ..common.invitation import ID_RE, NAME_RE, digest

# How many refused enrolments the endpoint answers per window; past that, attempts are dropped
# unread until the window moves on (guessing a 256-bit secret is hopeless anyway: this keeps a
# flood from costing disk reads and log lines).
REFUSALS_PER_WINDOW = 20
WINDOW_S = 60.0
# Refused enrolments one source address may have in a window before its attempts are answered
# "wait" unread: a volunteer who mistyped a token gets a few tries; one host's flood of bad
# secrets does not spend the whole window's budget above, which honest joiners elsewhere share.
REFUSALS_PER_SOURCE = 5
SOURCES_KEPT = 10_000

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw]?)$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


@dataclass(frozen=True)
class Invitation:
    id: str
    digest: str  # sha256 of the secret, hex
    uses: int  # keys it may enrol in all
    expires: float  # seconds since the epoch
    name: str  # the prefix of the enrolled keys' (and workers') names
    created: float

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data) -> "Invitation":
        """ValueError when `data` is no invitation record."""
        if not isinstance(data, dict) or set(data) != set(cls.__dataclass_fields__):
            raise ValueError("not an invitation record")
        inv = cls(id=data["id"], digest=data["digest"], uses=data["uses"],
                  expires=data["expires"], name=data["name"], created=data["created"])
        if not (isinstance(inv.id, str) and ID_RE.match(inv.id) and isinstance(inv.digest, str)
                and len(inv.digest) == 64 and isinstance(inv.uses, int) and inv.uses >= 1
                and isinstance(inv.expires, (int, float)) and isinstance(inv.name, str)
                and NAME_RE.match(inv.name) and isinstance(inv.created, (int, float))):
            raise ValueError("not an invitation record")
        return inv


def judge(inv: Optional[Invitation], used: int, secret: str, now: float,
          revoked: bool = False) -> Optional[str]:
    """Why an enrolment with `secret` under `inv` (None: no such invitation), which has enrolled
    `used` keys so far, is refused; None: it may enrol one more. Only the secret's holder learns
    that an invitation was revoked, expired or used up."""
    if inv is None:
        return "unknown or revoked invitation"
    if not hmac.compare_digest(digest(secret), inv.digest):
        return "wrong secret for this invitation (a forged token)"
    if revoked:
        return "invitation revoked by the coordinator's operator"
    if now >= inv.expires:
        return "invitation expired"
    if used >= inv.uses:
        return f"invitation used up ({inv.uses} use{'' if inv.uses == 1 else 's'})"
    return None


def key_name(inv: Invitation, used: int) -> str:
    """The name of the key (and worker) the invitation's next use enrols."""
    return f"{inv.name}-{inv.id[:6]}-{used + 1}"


def parse_duration(text: str) -> float:
    """'7d', '12h', '30m', '90s' or seconds; ConfigError with one line."""
    match = _DURATION.match(str(text).strip())
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"--expires {text!r}: give a duration like 7d, 12h, 30m or 90s")
    return float(match.group(1)) * _UNITS[match.group(2)]


class Refusals:
    """Refused enrolments in the last window, to bound what a flood costs."""

    def __init__(self, limit: int = REFUSALS_PER_WINDOW, window_s: float = WINDOW_S):
        self.limit, self.window_s = limit, window_s
        self.times: deque[float] = deque()

    def open(self, now: float) -> bool:
        """Whether an attempt is heard now."""
        while self.times and self.times[0] <= now - self.window_s:
            self.times.popleft()
        return len(self.times) < self.limit

    def refused(self, now: float) -> None:
        self.times.append(now)


class SourceLimit:
    """Refused enrolments per source address in the last window: past `limit`, that source is
    told to wait (how long, in whole seconds) until its oldest refusal leaves the window, and
    its attempts are not read. At most `max_sources` are remembered, the least recently refused
    forgotten first."""

    def __init__(self, limit: int = REFUSALS_PER_SOURCE, window_s: float = WINDOW_S,
                 max_sources: int = SOURCES_KEPT):
        self.limit, self.window_s, self.max_sources = limit, window_s, max_sources
        self.sources: OrderedDict[str, deque[float]] = OrderedDict()

    def wait(self, source: str, now: float) -> float:
        """Seconds until an attempt from `source` is heard; 0: now."""
        times = self.sources.get(source)
        if times is None:
            return 0.0
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if not times:
            del self.sources[source]
            return 0.0
        return max(0.0, times[0] + self.window_s - now) if len(times) >= self.limit else 0.0

    def refused(self, source: str, now: float) -> None:
        times = self.sources.pop(source, None)
        if times is None:
            times = deque(maxlen=self.limit)
            while len(self.sources) >= self.max_sources:
                self.sources.popitem(last=False)
        times.append(now)
        self.sources[source] = times  # the most recently refused last

    @staticmethod
    def told(source: str, wait_s: float) -> str:
        return (f"too many refused enrolments from {source}: try again in "
                f"{math.ceil(wait_s)}s")
