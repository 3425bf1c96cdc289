"""Decoded gradients -> optimizer steps, weighted by staleness.

The staleness rule is a pure policy (`StalenessRule`); `Aggregator` owns the model's flat
parameters and the optimizer, and is the only place the model changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..common.errors import ConfigError, GradientRejected
from ..common.job import FlatModel
from ..common.tensors import finite_norm


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


class Aggregator:
    """Applies one decoded round at a time to the coordinator's model."""

    def __init__(self, model: FlatModel, optimizer: torch.optim.Optimizer, rule: StalenessRule,
                 version: int = 0):
        self.model = model
        self.optimizer = optimizer
        self.rule = rule
        self.version = version
        self._base_lrs = [group.get("lr") for group in optimizer.param_groups]

    def weight_for(self, round_version: int) -> Optional[float]:
        return self.rule.weight(self.version - round_version)

    def apply(self, gradient_sum: torch.Tensor, samples: int, round_version: int) -> Optional[float]:
        """Step with the mean gradient of a round planned at `round_version`.

        Returns the staleness weight used, or None when the round is too stale (nothing changes).
        Raises GradientRejected for a gradient that must never be applied.
        """
        return self.apply_terms([([gradient_sum], 1.0)], samples, round_version)

    def apply_terms(self, terms: Sequence[tuple[Sequence[torch.Tensor], float]], samples: int,
                    round_version: int) -> Optional[float]:
        """`apply` for a gradient sum given as weighted terms, each a flat gradient cut into
        consecutive chunks (the frames it arrived in): the sum is written straight into the
        model's gradient, with no intermediate tensor the size of the model."""
        weight = self.weight_for(round_version)
        if weight is None:
            return None
        if samples <= 0:
            raise GradientRejected("a round of no samples")
        if not terms:
            raise GradientRejected("a round of no gradients")
        grads = self.model.grads
        for i, (chunks, coefficient) in enumerate(terms):
            if any(c.dim() != 1 for c in chunks):
                raise GradientRejected("a gradient must be flat")
            numel = sum(c.numel() for c in chunks)
            if numel != grads.numel():
                raise GradientRejected(f"gradient of {numel} values, model has {grads.numel()}")
            scale = coefficient / samples
            offset = 0
            for chunk in chunks:
                target = grads[offset:offset + chunk.numel()]
                if i == 0:
                    torch.mul(chunk, scale, out=target)
                else:
                    target.add_(chunk, alpha=scale)
                offset += chunk.numel()
        if not math.isfinite(finite_norm(grads)):
            grads.zero_()
            raise GradientRejected("non-finite gradient")
        # The staleness weight scales the step, not the gradient: adaptive optimizers (Adam)
        # normalise a scaled gradient away, a scaled learning rate they honour.
        for group, lr in zip(self.optimizer.param_groups, self._base_lrs):
            if lr is not None:
                group["lr"] = lr * weight
        try:
            self.optimizer.step()
        finally:
            for group, lr in zip(self.optimizer.param_groups, self._base_lrs):
                if lr is not None:
                    group["lr"] = lr
        self.version += 1
        return weight
