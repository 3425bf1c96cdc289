"""The staleness rule: how much a gradient computed some versions ago still counts, and the
delay compensation setting (how a stale gradient is corrected: coordinator/compensation.py).
Pure (no torch): the configuration check and the costless simulator use it without the model's
room (coordinator/aggregator.py, which applies the weight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..common.errors import ConfigError


@dataclass(frozen=True)
class StalenessRule:
    """How much a gradient computed `tau` versions ago still counts.

    `inverse`: 1/(1+tau); `sqrt`: 1/sqrt(1+tau); `constant`: 1. Past `max_staleness` the
    gradient is not applied at all (its samples are replanned).
    """

    kind: str = "inverse"
    max_staleness: int = 32

    KINDS = ("inverse", "sqrt", "constant")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ConfigError(f"staleness rule {self.kind!r} unknown: use one of {', '.join(self.KINDS)}")
        if self.max_staleness < 0:
            raise ConfigError("max staleness must be >= 0")

    def weight(self, tau: int) -> Optional[float]:
        if tau < 0:
            raise ValueError("a gradient from the future")
        if tau > self.max_staleness:
            return None
        if self.kind == "inverse":
            return 1.0 / (1 + tau)
        if self.kind == "sqrt":
            return 1.0 / math.sqrt(1 + tau)
        return 1.0


COMPENSATIONS = ("off", "dc", "dc-a")
DEFAULT_LAMBDA = {"dc": 0.04, "dc-a": 2.0}  # the paper's choices for its CIFAR-10 runs


@dataclass(frozen=True)
class DelayCompensation:
    """The parsed `--delay-compensation`: `kind` off, dc or dc-a, and its lambda."""

    kind: str = "off"
    lam: float = 0.0

    @property
    def on(self) -> bool:
        return self.kind != "off"

    def __str__(self) -> str:
        return "off" if not self.on else f"{self.kind}:{self.lam:g}"


NO_COMPENSATION = DelayCompensation()


def parse_delay_compensation(text: str) -> DelayCompensation:
    """`off`, `dc`, `dc:LAMBDA`, `dc-a` or `dc-a:LAMBDA` (ConfigError with one line)."""
    kind, colon, value = str(text).strip().partition(":")
    if kind not in COMPENSATIONS or (kind == "off" and colon):
        raise ConfigError(f"--delay-compensation must be off, dc[:LAMBDA] or dc-a[:LAMBDA], "
                          f"not {str(text)[:40]!r}")
    if kind == "off":
        return NO_COMPENSATION
    if not colon:
        return DelayCompensation(kind, DEFAULT_LAMBDA[kind])
    try:
        lam = float(value)
    except ValueError:
        lam = float("nan")
    if not 0 < lam < float("inf"):
        raise ConfigError(f"--delay-compensation {kind}: LAMBDA must be a number > 0, not "
                          f"{value[:40]!r}")
    return DelayCompensation(kind, lam)
