"""The idle policy: readings in, `run` or `pause` (with the reasons) out. Pure logic.

No psutil, no clock, no threads: the probes (`worker/probes.py`) take the readings and the daemon
passes them in with `now` (a monotonic time in seconds), so the policy is tested with a fake clock.

Rules (each configurable; the defaults follow BOINC's and are on where they make sense):

| rule      | pauses when                                                            | default    |
| --------- | ---------------------------------------------------------------------- | ---------- |
| `cpu`     | processes outside the worker's own tree use more than `cpu_others_max_pct` percent of the machine (all cores = 100) | 25 |
| `user`    | the user gave input less than `user_idle_min_s` seconds ago           | 180 s      |
| `battery` | the machine runs on battery (`pause_on_battery`)                      | on         |
| `memory`  | available memory is below `memory_available_min_mb`                   | 256 MiB    |
| `gpu`     | other processes use more than `gpu_others_max_pct` of the GPU (only when the worker computes on a GPU) | 10 |
| `hours`   | the local time is outside every allowed range of `hours` (none: any time) | any time |
| `rss`     | the worker's own resident memory exceeds `worker_rss_max_mb` (the owner's memory ceiling) | none |

A limit set to None switches its rule off.

**Unknown readings.** A reading the platform cannot give is `None` ("unknown"). By default an
unknown reading never pauses: a desktop without a battery, a headless server without any notion of
user input, or a Wayland session that hides input times must still compute; the CPU rule (which
psutil measures everywhere) then stands in for user activity. An owner who would rather be safe
names the rules whose unknown readings must pause in `pause_when_unknown` (e.g. `["user"]`: no
computing unless user idleness can be proven). Decisions list the unknown rules, so the worker can
say why it decided what it did.

**Hysteresis.** Any rule that fires pauses at once. The worker resumes only after every rule has
been clear, continuously, for `resume_after` seconds: a user who pauses typing for ten seconds does
not get a burst of computing in the middle of their work.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

RULES = ("cpu", "user", "battery", "memory", "gpu", "hours", "rss")

MINUTES_PER_DAY = 24 * 60


@dataclass(frozen=True)
class Readings:
    """What the probes saw. None: unknown on this platform (or this time)."""

    cpu_others_pct: Optional[float] = None  # percent of the whole machine (all cores = 100)
    user_idle_s: Optional[float] = None  # seconds since the last user input
    on_battery: Optional[bool] = None
    memory_available_mb: Optional[float] = None
    gpu_others_pct: Optional[float] = None  # GPU utilisation by processes other than the worker
    worker_rss_mb: Optional[float] = None  # the worker's own tree
    local_minute: Optional[int] = None  # minutes since local midnight, 0..1439


@dataclass(frozen=True)
class PolicyConfig:
    resume_after: float = 60.0
    cpu_others_max_pct: Optional[float] = 25.0
    user_idle_min_s: Optional[float] = 180.0
    pause_on_battery: bool = True
    memory_available_min_mb: Optional[float] = 256.0
    gpu_others_max_pct: Optional[float] = 10.0
    uses_gpu: bool = False  # set by the worker from its device, not by the owner
    hours: tuple[tuple[int, int], ...] = ()  # allowed [start, end) minute ranges; () = always
    worker_rss_max_mb: Optional[float] = None
    pause_when_unknown: frozenset[str] = frozenset()

    def __post_init__(self):
        check_policy(self)


def describe_policy(config: PolicyConfig) -> str:
    """One line for the log: the rules in force, so that an owner sees what was asked (an idle
    policy switched off is said to be off, not left to be inferred)."""
    rules = []
    if config.cpu_others_max_pct is not None:
        rules.append(f"others use over {config.cpu_others_max_pct:g}% CPU")
    if config.user_idle_min_s is not None:
        rules.append(f"user input within {config.user_idle_min_s:g}s")
    if config.pause_on_battery:
        rules.append("on battery")
    if config.memory_available_min_mb is not None:
        rules.append(f"under {config.memory_available_min_mb:g} MB available")
    if config.gpu_others_max_pct is not None and config.uses_gpu:
        rules.append(f"others use over {config.gpu_others_max_pct:g}% GPU")
    limits = []
    if config.hours:
        limits.append("hours " + ", ".join(f"{a // 60:02d}:{a % 60:02d}-{b // 60:02d}:{b % 60:02d}"
                                            for a, b in config.hours))
    if config.worker_rss_max_mb is not None:
        limits.append(f"memory ceiling {config.worker_rss_max_mb:g} MB")
    owner = f"; the owner's limits still hold: {', '.join(limits)}" if limits else ""
    if not rules:
        return "off (--no-idle-policy): computing whatever the machine does" + owner
    return (f"pausing when {', '.join(rules)}; resuming {config.resume_after:g}s after all are "
            f"clear{owner}")


@dataclass(frozen=True)
class Decision:
    run: bool
    reasons: tuple[str, ...]  # why it pauses (empty while running)
    changed: bool  # the state flipped with this decision
    unknown: tuple[str, ...] = ()  # rules whose readings were unknown
    resume_in: Optional[float] = None  # paused, all rules clear: seconds until it resumes

    @property
    def state(self) -> str:
        return "running" if self.run else "paused"


# configuration helpers ---------------------------------------------------------------------------

_HOURS_RE = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")


def parse_hours(text: str) -> tuple[int, int]:
    """'22:00-07:00' -> (1320, 420): an allowed range of local time; it may wrap past midnight.
    '00:00-24:00' is the whole day. Raises ValueError with a readable message."""
    m = _HOURS_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"{text!r} is not a range like '22:00-07:00'")
    h1, m1, h2, m2 = map(int, m.groups())
    for h, mm in ((h1, m1), (h2, m2)):
        if mm > 59 or h > 24 or (h == 24 and mm != 0):
            raise ValueError(f"{text!r}: {h:02d}:{mm:02d} is not a time of day")
    start, end = h1 * 60 + m1, h2 * 60 + m2
    if start == MINUTES_PER_DAY:
        start = 0
    if start == end:
        raise ValueError(f"{text!r} is an empty range (use '00:00-24:00' for the whole day)")
    return start, end


def format_hours(span: tuple[int, int]) -> str:
    (start, end) = span
    return f"{start // 60:02d}:{start % 60:02d}-{end // 60:02d}:{end % 60:02d}"


def in_hours(minute: int, spans: tuple[tuple[int, int], ...]) -> bool:
    if not spans:
        return True
    for start, end in spans:
        if start < end:
            if start <= minute < end:
                return True
        elif minute >= start or minute < end:  # wraps past midnight
            return True
    return False


def memory_left_mb(config: PolicyConfig, worker_rss_mb: float, available_mb: float) -> float:
    """MiB the worker may still take: up to the owner's ceiling on its own memory, and never into
    the last `memory_available_min_mb` the machine has free (past it, other programs swap)."""
    left = available_mb - (config.memory_available_min_mb or 0.0)
    if config.worker_rss_max_mb is not None:
        left = min(left, config.worker_rss_max_mb - worker_rss_mb)
    return left


def check_policy(config: PolicyConfig) -> None:
    """Raise ValueError naming the field for an impossible setting."""
    def number(name: str, value, optional: bool = True, upper: Optional[float] = None):
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < 0 or (upper is not None and value > upper):
            bound = f" and at most {upper:g}" if upper is not None else ""
            raise ValueError(f"{name}: must be a number >= 0{bound}, got {value!r}")

    number("resume_after", config.resume_after, optional=False)
    number("cpu_others_max_pct", config.cpu_others_max_pct, upper=100)
    number("user_idle_min_s", config.user_idle_min_s)
    number("memory_available_min_mb", config.memory_available_min_mb)
    number("gpu_others_max_pct", config.gpu_others_max_pct, upper=100)
    number("worker_rss_max_mb", config.worker_rss_max_mb)
    for span in config.hours:
        if (not isinstance(span, tuple) or len(span) != 2
                or not all(isinstance(x, int) and 0 <= x <= MINUTES_PER_DAY for x in span)
                or span[0] == span[1] or span[0] == MINUTES_PER_DAY):
            raise ValueError(f"hours: bad range {span!r}")
    unknown = set(config.pause_when_unknown) - set(RULES)
    if unknown:
        raise ValueError(f"pause_when_unknown: unknown rules {sorted(unknown)}; "
                         f"the rules are {', '.join(RULES)}")


# the policy --------------------------------------------------------------------------------------


class IdlePolicy:
    """Holds the run/pause state and its hysteresis; `decide` is called with every sample."""

    def __init__(self, config: PolicyConfig = PolicyConfig(), running: bool = True):
        self.config = config
        self.running = running
        self.reasons: tuple[str, ...] = ()
        self._clear_since: Optional[float] = None  # while paused: when every rule became clear

    def evaluate(self, readings: Readings) -> tuple[list[str], list[str]]:
        """(reasons to pause, rules whose readings were unknown), without touching the state."""
        c, r = self.config, readings
        reasons: list[str] = []
        unknown: list[str] = []

        def rule(name: str, applies: bool, value, fires, text):
            if not applies:
                return
            if value is None:
                unknown.append(name)
                if name in c.pause_when_unknown:
                    reasons.append(f"{name}: unknown on this machine")
            elif fires(value):
                reasons.append(f"{name}: {text(value)}")

        rule("cpu", c.cpu_others_max_pct is not None, r.cpu_others_pct,
             lambda v: v > c.cpu_others_max_pct,
             lambda v: f"other processes use {v:.0f}% of the machine > {c.cpu_others_max_pct:g}%")
        rule("user", c.user_idle_min_s is not None, r.user_idle_s,
             lambda v: v < c.user_idle_min_s,
             lambda v: f"user input {v:.0f}s ago < {c.user_idle_min_s:g}s")
        rule("battery", c.pause_on_battery, r.on_battery, lambda v: v, lambda v: "on battery")
        rule("memory", c.memory_available_min_mb is not None, r.memory_available_mb,
             lambda v: v < c.memory_available_min_mb,
             lambda v: f"{v:.0f} MiB available < {c.memory_available_min_mb:g} MiB")
        rule("gpu", c.uses_gpu and c.gpu_others_max_pct is not None, r.gpu_others_pct,
             lambda v: v > c.gpu_others_max_pct,
             lambda v: f"other processes use {v:.0f}% of the GPU > {c.gpu_others_max_pct:g}%")
        rule("hours", bool(c.hours), r.local_minute,
             lambda v: not in_hours(int(v), c.hours),
             lambda v: f"{int(v) // 60:02d}:{int(v) % 60:02d} is outside the allowed hours "
                       f"{', '.join(format_hours(s) for s in c.hours)}")
        rule("rss", c.worker_rss_max_mb is not None, r.worker_rss_mb,
             lambda v: v > c.worker_rss_max_mb,
             lambda v: f"worker uses {v:.0f} MiB > the {c.worker_rss_max_mb:g} MiB ceiling")
        return reasons, unknown

    def decide(self, readings: Readings, now: float) -> Decision:
        reasons, unknown = self.evaluate(readings)
        was_running = self.running
        if reasons:  # pause at once
            self.running = False
            self.reasons = tuple(reasons)
            self._clear_since = None
            return Decision(False, self.reasons, was_running, tuple(unknown))
        if self.running:
            return Decision(True, (), False, tuple(unknown))
        if self._clear_since is None or now < self._clear_since:
            self._clear_since = now
        left = self.config.resume_after - (now - self._clear_since)
        if left <= 0:
            self.running = True
            self.reasons = ()
            self._clear_since = None
            return Decision(True, (), True, tuple(unknown))
        return Decision(False, self.reasons, False, tuple(unknown), resume_in=left)
