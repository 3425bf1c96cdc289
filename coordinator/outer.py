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
plain (asynchronous) local SGD, the staleness rule damping late rounds. Its settings
(`OuterConfig`) are pure, in coordinator/local.py.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .local import OuterConfig


def build(params: Iterable[torch.nn.Parameter], config: OuterConfig) -> torch.optim.Optimizer:
    nesterov = config.nesterov and config.momentum > 0  # torch refuses Nesterov without momentum
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, nesterov=nesterov)
