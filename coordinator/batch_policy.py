"""A batch that follows the noise (`--batch adaptive[:MAX]`, `--batch-lr RULE`). Pure: numbers
in, numbers out (no clock, no sockets, no torch).

The gradient noise scale B_simple = tr(Sigma) / |G|^2 (noise.py) is the batch past which a larger
one buys mostly less noise rather than more progress per sample. It is small early in training
and grows as the gradient shrinks, so a batch fixed at the start is too small later on: more
steps, each of them noisier than it needs to be, and, on a fleet, more rounds (each with its
fixed costs: a model sent, a decode, a step). The policy here lets the round batch grow towards
B_simple as it is measured:

- never below the job's batch B0 (the base); it grows no further than MAX (`adaptive:MAX`, and
  `--max-batch`) nor than what the fleet computes in `ROUND_S` seconds at its measured
  samples/s (a fleet that shrinks brings it down, halving per change);
- smoothly: a change at most doubles or halves the batch, and lands on a multiple of the
  round's partitions (or of the workers of a synchronous round);
- with hysteresis: the target must stand more than `BAND` away from the batch for `PATIENCE`
  measured rounds in a row before the batch moves, so one noisy estimate does not flap it.

The learning rate of a step of B samples is the job's (as its schedule sets it) times a factor
(`lr_factor`), by the rule `--batch-lr` names, with S = B / B0 (at least 1):

- `linear`: S (Goyal et al. 2017: plain SGD, the noise-dominated regime);
- `sqrt`: sqrt(S) (the cautious rule for adaptive optimizers, Adam's family: Malladi et al.
  2022's square-root scaling);
- `adascale`: AdaScale's gain (Johnson et al. 2020), r = (T / B0 + |G|^2) / (T / B + |G|^2),
  T = tr(Sigma) and |G|^2 the smoothed estimates of noise.py, bounded to [1, S]: S where the
  noise dominates, 1 where the gradient does (a larger batch then buys no larger step);
- `none`: 1;
- `auto` (the default): adascale for SGD, the optimizer AdaScale was made for, sqrt for any
  other (Adam, AdamW and their family, and any optimizer this does not know: sqrt is the rule
  that overshoots least).

The job's learning-rate schedule counts progress in base-batch steps, samples / B0, not in
optimizer steps (the aggregator's `progress_base`), so a schedule written for the fixed batch
reaches the same point after the same samples whatever the batch did meanwhile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..common.errors import ConfigError

ROUND_S = 10.0  # a round's batch is at most what the fleet computes in this many seconds
BAND = 0.25  # the target must be over 1 + BAND times the batch (or under it divided by that)
PATIENCE = 3  # ... for this many measured rounds in a row
STEP = 2.0  # a change at most doubles or halves the batch

LR_RULES = ("auto", "sqrt", "adascale", "linear", "none")
SGD_FAMILY = ("SGD",)  # auto: adascale for these, sqrt for any other optimizer


@dataclass(frozen=True)
class BatchSetting:
    """`--batch`: the job's fixed batch (the default), or adaptive up to `cap` samples."""

    adaptive: bool = False
    cap: Optional[int] = None

    def __str__(self) -> str:
        if not self.adaptive:
            return "fixed"
        return "adaptive" if self.cap is None else f"adaptive:{self.cap}"


def parse_batch(text: str) -> BatchSetting:
    """`fixed`, `adaptive` or `adaptive:MAX`; ConfigError (one line) otherwise."""
    text = str(text).strip()
    if text == "fixed":
        return BatchSetting()
    kind, _, cap = text.partition(":")
    if kind != "adaptive":
        raise ConfigError(f"--batch must be fixed, adaptive or adaptive:MAX, not {text[:40]!r}")
    if not _:
        return BatchSetting(True)
    try:
        value = int(cap)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"--batch adaptive:MAX: MAX must be a whole number of samples >= 1, "
                          f"not {cap[:40]!r}")
    return BatchSetting(True, value)


def parse_lr_rule(text: str) -> str:
    if text not in LR_RULES:
        raise ConfigError(f"--batch-lr must be one of {', '.join(LR_RULES)}, not "
                          f"{str(text)[:40]!r}")
    return text


def resolve_lr_rule(rule: str, optimizer: str) -> str:
    """The rule `auto` comes to for an optimizer named `optimizer` (its class name)."""
    parse_lr_rule(rule)
    if rule != "auto":
        return rule
    return "adascale" if optimizer in SGD_FAMILY else "sqrt"


def adascale_gain(batch: int, base: int, gradient_sq: Optional[float],
                  trace: Optional[float]) -> float:
    """AdaScale's gain r of a batch `batch` over the base batch, from the smoothed |G|^2 and
    tr(Sigma), bounded to [1, batch / base]. 1 while nothing is measured; the bound where the
    measured |G|^2 is not positive (the noise swamps the gradient: r tends to S)."""
    scale = max(1.0, batch / base)
    if trace is None or gradient_sq is None or not (math.isfinite(trace)
                                                     and math.isfinite(gradient_sq)):
        return 1.0
    if not trace > 0:
        return 1.0  # no noise: a larger batch changes nothing of the step
    if not gradient_sq > 0:
        return scale
    gain = (trace / base + gradient_sq) / (trace / (scale * base) + gradient_sq)
    return min(scale, max(1.0, gain))


def lr_factor(rule: str, batch: int, base: int, gradient_sq: Optional[float] = None,
              trace: Optional[float] = None) -> float:
    """The factor on the job's learning rate of a step of `batch` samples (module docstring);
    `rule` resolved (not auto). A batch at or below the base takes the job's rate."""
    scale = max(1.0, batch / base)
    if rule == "linear":
        return scale
    if rule == "sqrt":
        return math.sqrt(scale)
    if rule == "adascale":
        return adascale_gain(batch, base, gradient_sq, trace)
    if rule == "none":
        return 1.0
    raise ValueError(f"not a resolved learning-rate rule: {rule!r}")


class BatchPolicy:
    """The round batch, moved towards the measured noise scale (module docstring)."""

    def __init__(self, base: int, cap: Optional[int] = None, band: float = BAND,
                 patience: int = PATIENCE, step: float = STEP):
        if base < 1:
            raise ValueError("the base batch must be at least 1")
        self.base = base
        self.cap = cap  # None: no cap but the fleet's
        self.band, self.patience, self.step = band, patience, step
        self.batch = base
        self.streak = 0  # measured rounds in a row asking to grow (> 0) or to shrink (< 0)
        self.changes = 0
        self.target: Optional[float] = None  # the last target, for the status

    def upper(self, capacity: Optional[float] = None) -> float:
        """The most the batch may be now: MAX and the fleet's capacity (samples a round), never
        below the base."""
        upper = math.inf if self.cap is None else float(self.cap)
        if capacity is not None and math.isfinite(capacity) and capacity > 0:
            upper = min(upper, capacity)
        return max(float(self.base), upper)

    def observe(self, b_simple: Optional[float], capacity: Optional[float] = None,
                multiple: int = 1) -> int:
        """One measured round: `b_simple` the smoothed noise scale (None: not measurable now,
        which holds the batch), `capacity` the samples the fleet computes in a round (None: not
        known), `multiple` the round's partitions or workers. Returns the next rounds' batch."""
        if b_simple is None or not math.isfinite(b_simple):
            self.streak = 0
            return self.batch
        upper = self.upper(capacity)
        target = min(max(float(b_simple), float(self.base)), upper)
        self.target = target
        if target > self.batch * (1 + self.band):
            direction = 1
        elif target * (1 + self.band) < self.batch:
            direction = -1
        else:
            direction = 0
        if direction == 0 or (self.streak and (self.streak > 0) != (direction > 0)):
            self.streak = direction
        else:
            self.streak += direction
        if abs(self.streak) < self.patience:
            return self.batch
        new = self._next(target, upper, direction, max(1, int(multiple)))
        self.streak = 0
        if new != self.batch:
            self.batch = new
            self.changes += 1
        return self.batch

    def _next(self, target: float, upper: float, direction: int, m: int) -> int:
        """A step towards `target`: at most x STEP (or / STEP), on a multiple of `m` where one
        lies in that step, within [base, upper]."""
        batch = self.batch
        if direction > 0:
            goal = min(target, batch * self.step, upper)
            new = int(goal // m) * m
            if new <= batch:  # the multiple is too coarse for this step: the step itself
                new = int(goal)
            return max(self.base, new)
        # Down (the noise scale fell, or the fleet's capacity did): halving at most, even below
        # a capacity that dropped at once (its estimate moves with churn); to the base itself
        # rather than to a multiple above it.
        goal = max(target, batch / self.step)
        new = int(math.ceil(goal / m)) * m
        if new >= batch:
            new = int(math.ceil(goal))
        return self.base if goal <= self.base else max(self.base, new)

    def state_dict(self) -> dict:
        return {"base": self.base, "batch": self.batch, "streak": self.streak,
                "changes": self.changes, "target": self.target}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's state; its batch kept within this run's base and MAX."""
        batch = int(state.get("batch", self.base))
        self.batch = int(min(max(batch, self.base), self.upper()))
        self.streak = int(state.get("streak", 0))
        self.changes = int(state.get("changes", 0))
        target = state.get("target")
        self.target = None if target is None else float(target)


class Batching:
    """What the round core asks about the batch: the policy (None with a fixed batch) and the
    learning-rate rule, resolved."""

    def __init__(self, setting: BatchSetting, rule: str, base: int,
                 cap: Optional[int] = None, round_s: float = ROUND_S):
        """`cap`: `--max-batch`, if given, beside the setting's MAX (the smaller holds)."""
        self.setting = setting
        self.rule = rule if setting.adaptive else "none"
        self.base = base
        self.round_s = round_s
        caps = [c for c in (setting.cap, cap) if c is not None]
        self.policy = BatchPolicy(base, min(caps) if caps else None) if setting.adaptive else None
        self.last_factor = 1.0

    @property
    def adaptive(self) -> bool:
        return self.policy is not None

    @property
    def batch(self) -> int:
        return self.policy.batch if self.policy is not None else self.base

    def factor(self, samples: int, gradient_sq: Optional[float],
               trace: Optional[float]) -> float:
        """The learning-rate factor of a step of `samples` (1 with a fixed batch)."""
        if self.policy is None:
            return 1.0
        self.last_factor = lr_factor(self.rule, samples, self.base, gradient_sq, trace)
        return self.last_factor

    def observe(self, b_simple: Optional[float], fleet_rate: Optional[float],
                multiple: int) -> Optional[int]:
        """A measured round; the new batch when it changed, else None. `fleet_rate`: the
        fleet's samples per second as the speed model predicts them (None: not known yet)."""
        if self.policy is None:
            return None
        before = self.policy.batch
        capacity = fleet_rate * self.round_s if fleet_rate else None
        after = self.policy.observe(b_simple, capacity, multiple)
        return after if after != before else None

    def summary(self) -> dict:
        """For the status snapshot and the metrics log (plain numbers)."""
        policy = self.policy
        return {"batch": self.batch, "base": self.base, "setting": str(self.setting),
                "rule": self.rule, "adaptive": self.adaptive,
                "max": policy.cap if policy is not None else None,
                "lr_factor": round(self.last_factor, 4),
                "changes": policy.changes if policy is not None else 0}

    def state_dict(self) -> dict:
        return {"policy": self.policy.state_dict() if self.policy is not None else None,
                "last_factor": self.last_factor}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if not isinstance(state, dict):
            return
        if self.policy is not None and isinstance(state.get("policy"), dict):
            self.policy.load_state_dict(state["policy"])
        self.last_factor = float(state.get("last_factor", 1.0)) if self.policy else 1.0
