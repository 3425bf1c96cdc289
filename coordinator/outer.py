"""The outer optimizer of local-SGD tasks (DiLoCo, Douillard et al. 2023). Torch only.

A local round returns the summed "outer gradient" of its slots: for each slot, its samples times
(model at the round's version - model after its inner steps). The aggregator divides by the
round's samples, which makes the outer gradient a sample-weighted mean of the slots' changes, and
steps this optimizer with it, weighted by the round's staleness (the outer gradient scaled, which
for SGD weights its influence through the momentum too), exactly as it steps a job's optimizer
with a gradient in gradient mode. So checkpoints, staleness and the
validation of results are shared with gradient mode.

The outer optimizer is SGD with Nesterov momentum (DiLoCo's choice); by default lr 1 and no
momentum, with which applying a fresh round of one slot sets the model to that slot's result:
plain (asynchronous) local SGD, the staleness rule damping late rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

from ..common.errors import ConfigError


@dataclass(frozen=True)
class OuterConfig:
    # Defaults for asynchronous rounds of one slot each (the default --partitions 1): every
    # round is one worker's change, applied as it lands, so momentum adds up the changes of
    # workers that ran concurrently from nearly the same model and overshoots (momentum 0.9 and
    # even 0.3 diverged on `synthetic`, see docs/architecture.md). DiLoCo's lr 0.7, momentum 0.9
    # suit synchronous rounds that average several workers (--partitions K).
    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = True

    def __post_init__(self):
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"outer learning rate must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"outer momentum must be in [0, 1), got {self.momentum}")


def build(params: Iterable[torch.nn.Parameter], config: OuterConfig) -> torch.optim.Optimizer:
    nesterov = config.nesterov and config.momentum > 0  # torch refuses Nesterov without momentum
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, nesterov=nesterov)
