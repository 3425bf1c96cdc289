"""Which workers' gradients to believe: the outlier rule, offences and bans. Pure: the server
passes in each result's gradient norm, its slot's size and the time.

A gradient is refused when it is not finite, or when its norm is far outside the recent
distribution: more than `norm_factor` times the running median of recent accepted norms, or less
than the median over it; a zero gradient always is (whatever the median, and even with the
factor 0), and so the screen cannot be switched off by feeding it zeros. Norms are compared per
unit of the slot's `scale` (sum over its parts of |coefficient| x samples), since a slot of twice
the samples has about twice the gradient; a slot much smaller than the typical one gets
sqrt(typical / scale) more room above, a much larger one as much below, which is how far its
per-sample norm moves when sampling noise dominates. The median is robust: up to half the recent
results may be poisoned before it moves, and one identity holds at most `PER_IDENTITY` of the
window (its next norm replaces its own oldest), so a flood from one key cannot move it; only
norms above zero enter it. It starts from a reference the coordinator computes itself, so the
very first results are judged too.

A non-finite gradient is an offence of the sender's identity (its CURVE key, or its worker id
without keys) at once. An outlier norm is only a suspicion: late in training a batch holding a few
badly fit samples honestly has a gradient many times the median. The server settles it with a third
computation (it computes the slot itself): a match is accepted (`accept`, and the median learns
from it), a mismatch is an offence (`offence`). `ban_after` offences within `offence_window_s`
seconds ban the identity for the rest of the run.

The screen adapts to the run's spread: a converged run's honest gradients spread far wider around
their median than an early one's, and a fixed factor then suspects honest results by the hundred
(each a computation here). A suspect computed again and found honest is proof of how far honest
results reach, so the limit grows to `HONEST_HEADROOM` times the largest recent honest outlier
(never below `norm_factor`, never above `MAX_ADAPTED` times it). Only results the coordinator
verified itself move it: a worker's own word never does.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Optional

from ..common.errors import ConfigError

# Copies of one slot, and a copy against the coordinator's own computation, agree when their L2
# distance is within this fraction of their size: workers on other hardware (or with other
# micro-batches) round differently, so not bitwise; a sign flip is 2, a wrong sample far over.
MATCH_TOLERANCE = 1e-3


def matches(distance: float, size: float) -> bool:
    return distance <= MATCH_TOLERANCE * max(size, 1e-12)


def check_verify_replicas(result_dtype: str) -> None:
    """Refuse, with one line, results that verified replicas could not compare (the code and
    sync rules are the scheduler's: SchedulerConfig)."""
    if result_dtype != "float32":
        raise ConfigError(f"--verify-replicas needs --result-dtype float32: {result_dtype} "
                          "results carry each worker's own rounding error (fed back from its "
                          "earlier results), so honest copies would not agree")


@dataclass(frozen=True)
class TrustConfig:
    norm_factor: float = 10.0  # refuse norms over this many times the running median; 0: no check
    window: int = 256  # recent accepted norms the median is taken over
    ban_after: int = 3  # offences that ban an identity; 0: never ban
    offence_window_s: float = 600.0  # offences older than this are forgiven

    def __post_init__(self):
        if not self.norm_factor >= 0 or math.isinf(self.norm_factor):
            raise ValueError(f"norm factor must be >= 0, got {self.norm_factor}")
        if self.norm_factor and self.norm_factor <= 1:
            raise ValueError(f"norm factor must be above 1 (or 0: off), got {self.norm_factor}")
        if self.window < 1 or self.ban_after < 0 or not self.offence_window_s > 0:
            raise ValueError("window >= 1, ban_after >= 0 and offence_window_s > 0")


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""  # why it was refused: "non-finite", or "norm" (a suspicion to settle)
    detail: str = ""  # one line for the event log
    banned: bool = False  # this refusal banned the sender


@dataclass
class Offender:
    offences: deque = field(default_factory=deque)  # times of recent offences
    total: int = 0
    reasons: dict = field(default_factory=dict)  # reason -> count
    banned_at: Optional[float] = None


class TrustPolicy:
    def __init__(self, config: TrustConfig = TrustConfig(), reference: Optional[float] = None):
        """`reference`: a per-unit norm the coordinator computed itself; it seeds the median."""
        self.config = config
        per_key = max(1, int(config.window * self.PER_IDENTITY))
        self._norms = RollingMedian(config.window, per_key)  # accepted norm per unit of scale
        self._scales = RollingMedian(config.window, per_key)
        if reference is not None and math.isfinite(reference) and reference > 0:
            self._norms.add(reference, REFERENCE)
        self._honest_outliers: deque[float] = deque(maxlen=16)  # their ratio to the median
        self.offenders: dict[str, Offender] = {}
        self.accepted = 0
        self.refused = 0
        self.suspected = 0

    def median(self) -> Optional[float]:
        return self._norms.median()

    PER_IDENTITY = 1 / 8  # of the median's window one identity's norms may hold
    HONEST_HEADROOM = 1.5  # the limit: this many times the largest recent honest outlier
    MAX_ADAPTED = 100.0  # ... but at most this many times `norm_factor`

    def factor(self) -> float:
        """How many times the median a norm may be before it is suspected, now."""
        factor = self.config.norm_factor
        if self._honest_outliers:
            factor = max(factor, min(self.HONEST_HEADROOM * max(self._honest_outliers),
                                     self.MAX_ADAPTED * factor))
        return factor

    def is_banned(self, identity: str) -> bool:
        offender = self.offenders.get(identity)
        return offender is not None and offender.banned_at is not None

    def banned(self) -> list[str]:
        return sorted(i for i, o in self.offenders.items() if o.banned_at is not None)

    def judge(self, identity: str, norm: float, scale: float, now: float) -> Verdict:
        """A result's gradient: `norm` its L2 norm, `scale` its slot's size (> 0)."""
        if not math.isfinite(norm):
            return self._refuse(identity, "non-finite", "non-finite gradient", now)
        if not norm > 0 and scale > 0:  # computed again, an honest zero is used after all
            self.suspected += 1
            return Verdict(False, "norm", "gradient norm 0 (a zero gradient)")
        if not scale > 0 or self.config.norm_factor == 0:
            self.accepted += 1
            return Verdict(True)
        per_unit = norm / scale
        median = self.median()
        if median is not None and median > 0:
            typical = self._scales.median() or scale
            factor = self.factor()
            limit = factor * median * math.sqrt(max(1.0, typical / scale))
            floor = median / (factor * math.sqrt(max(1.0, scale / typical)))
            if per_unit > limit or per_unit < floor:
                self.suspected += 1
                bound = f"limit {limit / median:.3g}x" if per_unit > limit \
                    else f"floor {floor / median:.3g}x"
                return Verdict(False, "norm", f"gradient norm {per_unit:.3g} per sample is "
                                              f"{per_unit / median:.3g}x the recent median "
                                              f"{median:.3g} ({bound})")
        self.accept(norm, scale, identity=identity)
        return Verdict(True)

    def accept(self, norm: float, scale: float, verified: bool = False,
               identity: Optional[str] = None) -> None:
        """A gradient of `identity` found honest: by the median, or (`verified`) a suspect that
        the coordinator's own computation matched, which widens the screen to the spread it
        shows (above or below). A zero norm says nothing of the spread: the median skips it."""
        if math.isfinite(norm) and norm > 0 and scale > 0:
            median = self.median()
            if verified and median:
                ratio = norm / scale / median
                self._honest_outliers.append(max(ratio, 1 / ratio))
            self._norms.add(norm / scale, identity)
            self._scales.add(scale, identity)
        self.accepted += 1

    def confirmed(self, identity: str, now: float, reason: str = "norm") -> bool:
        """A result proved wrong by the coordinator's own computation (a suspected outlier norm,
        or a replica that disagreed with its copy: `reason` "replica"): an offence. True if it
        bans."""
        self.refused += 1
        return self.offence(identity, reason, now)

    # Identities with offences on record but no ban: without keys a peer can say hello under
    # any number of ids, and the record of each must not grow the coordinator for ever.
    MAX_UNBANNED = 10_000

    def offence(self, identity: str, reason: str, now: float) -> bool:
        """Record an offence that is not a gradient's (a malformed result, say); True if it bans."""
        if identity not in self.offenders and len(self.offenders) >= self.MAX_UNBANNED:
            self._forget_unbanned(now)
        offender = self.offenders.setdefault(identity, Offender())
        offender.total += 1
        offender.reasons[reason] = offender.reasons.get(reason, 0) + 1
        offender.offences.append(now)
        while offender.offences and now - offender.offences[0] > self.config.offence_window_s:
            offender.offences.popleft()
        if (offender.banned_at is None and self.config.ban_after
                and len(offender.offences) >= self.config.ban_after):
            offender.banned_at = now
            return True
        return False

    def _forget_unbanned(self, now: float) -> None:
        """Drop the records no ban can come from any more (every offence forgiven); if that is
        not enough, the unbanned half whose last offence is oldest. Bans are kept: they hold."""
        unbanned = [(o.offences[-1] if o.offences else -math.inf, i)
                    for i, o in self.offenders.items() if o.banned_at is None]
        forgiven = {i for last, i in unbanned if now - last > self.config.offence_window_s}
        if len(unbanned) - len(forgiven) >= self.MAX_UNBANNED // 2:
            forgiven |= {i for _, i in sorted(unbanned)[:len(unbanned) // 2]}
        for identity in forgiven:
            del self.offenders[identity]

    def _refuse(self, identity: str, reason: str, detail: str, now: float) -> Verdict:
        self.refused += 1
        return Verdict(False, reason, detail, banned=self.offence(identity, reason, now))

    def summary(self) -> dict:
        """For the status snapshot."""
        median = self.median()
        banned = self.banned()
        return {
            "norm_factor": self.config.norm_factor, "ban_after": self.config.ban_after,
            "norm_factor_now": float(f"{self.factor():.4g}"),
            "median_norm": None if median is None else float(f"{median:.4g}"),
            "accepted": self.accepted, "refused": self.refused, "suspected": self.suspected,
            # bans are for good: a snapshot names a hundred of them and counts them all
            "banned": banned[:100], "banned_count": len(banned),
            "offenders": {i: {"offences": o.total, "reasons": dict(o.reasons),
                              "banned": o.banned_at is not None}
                          for i, o in sorted(self.offenders.items())[:100]},
        }


REFERENCE = "(the coordinator's reference)"  # the key of the median's seed


class RollingMedian:
    """The median of the last `window` values, kept sorted as they come and go: judging every
    result must not sort the window each time. Each value comes from a key (an identity), which
    holds at most `per_key` of the window: past that, its own oldest value makes room."""

    def __init__(self, window: int, per_key: Optional[int] = None):
        self._recent: deque[tuple[Optional[str], float]] = deque()
        self._sorted: list[float] = []
        self._held: Counter[Optional[str]] = Counter()
        self.window = max(1, window)
        self.per_key = self.window if per_key is None else max(1, per_key)

    def add(self, value: float, key: Optional[str] = None) -> None:
        if self._held[key] >= self.per_key:
            index = next(i for i, (k, _) in enumerate(self._recent) if k == key)
            self._drop(index)
        elif len(self._recent) == self.window:
            self._drop(0)
        self._recent.append((key, value))
        self._held[key] += 1
        bisect.insort(self._sorted, value)

    def _drop(self, index: int) -> None:
        key, old = self._recent[index]
        del self._recent[index]
        del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._held[key] -= 1
        if not self._held[key]:
            del self._held[key]

    def median(self) -> Optional[float]:
        n = len(self._sorted)
        if not n:
            return None
        if n % 2:
            return self._sorted[n // 2]
        return (self._sorted[n // 2 - 1] + self._sorted[n // 2]) / 2

    def __len__(self) -> int:
        return len(self._recent)
