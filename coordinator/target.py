"""When to stop: a target test metric. Pure, and free of torch so front ends can parse it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..common.errors import ConfigError


@dataclass(frozen=True)
class Target:
    """Stop when `metric` reaches `value`: at least it, or at most it for losses and errors."""

    metric: str
    value: float
    higher_is_better: bool

    @classmethod
    def parse(cls, text: str) -> "Target":
        for op, higher in ((">=", True), ("<=", False), ("=", None)):
            name, sep, value = text.partition(op)
            if sep:
                break
        else:
            raise ConfigError(f"target {text!r} must look like METRIC=VALUE, e.g. accuracy=0.95")
        name = name.strip()
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"target {text!r}: {value!r} is not a number") from None
        if not name or not math.isfinite(number):
            raise ConfigError(f"target {text!r} must look like METRIC=VALUE, e.g. accuracy=0.95")
        if higher is None:
            higher = not any(w in name.lower() for w in ("loss", "error", "perplexity", "bits_per"))
        return cls(name, number, higher)

    def reached(self, metrics: dict[str, float]) -> bool:
        got = metrics.get(self.metric)
        if got is None:
            return False
        return got >= self.value if self.higher_is_better else got <= self.value

    def __str__(self) -> str:
        return f"{self.metric}{'>=' if self.higher_is_better else '<='}{self.value:g}"
