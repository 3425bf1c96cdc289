"""The staleness rule: how much a gradient computed some versions ago still counts. Pure (no
torch): the configuration check and the costless simulator use it without the model's room
(coordinator/aggregator.py, which applies the weight).
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
