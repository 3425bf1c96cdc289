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
from ..common.tensors import sum_of_squares


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
                    round_version: int, norms: Optional[Sequence[float]] = None) -> Optional[float]:
        """`apply` for a gradient sum given as weighted terms, each a flat gradient cut into
        consecutive chunks (the frames it arrived in): the sum is written straight into the
        model's gradient, with no intermediate tensor the size of the model.

        `norms`, the terms' L2 norms when the caller has measured them (on arrival), bound the
        sum's: when that bound is safely finite the sum is not read again to check it."""
        weight = self.weight_for(round_version)
        if weight is None:
            return None
        if samples <= 0:
            raise GradientRejected("a round of no samples")
        if not terms:
            raise GradientRejected("a round of no gradients")
        grads = self.model.grads
        for chunks, _ in terms:
            numel = 0
            for chunk in chunks:
                if chunk.dim() != 1:
                    raise GradientRejected("a gradient must be flat")
                numel += chunk.numel()
            if numel != grads.numel():
                raise GradientRejected(f"gradient of {numel} values, model has {grads.numel()}")
        bound = math.inf
        if norms is not None and len(norms) == len(terms):
            bound = sum(abs(c) / samples * n for (_, c), n in zip(terms, norms))
        # the check below sums squares in the gradient's own precision: the bound must too
        checked = not (bound * bound < torch.finfo(grads.dtype).max)
        if not math.isfinite(_write_sum(grads, terms, samples, measure=checked)):
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


BLOCK = 1 << 18  # values per block of `_write_sum`: a block (1 MiB of float32) stays in cache


def _write_sum(out: torch.Tensor, terms: Sequence[tuple[Sequence[torch.Tensor], float]],
               samples: int, measure: bool = True) -> float:
    """Write sum_k coefficient_k / samples * term_k into `out` and return the squared norm of
    the result (inf or nan when a value is not; 0 without `measure`). Block by block, so the
    norm reads what was just written from cache: one pass over memory instead of two."""
    if out.numel() <= BLOCK and all(len(chunks) == 1 for chunks, _ in terms):
        # one block, one chunk a term (a small model's gradients): nothing to cut
        for i, ((chunk,), coefficient) in enumerate(terms):
            if i == 0:
                torch.mul(chunk, coefficient / samples, out=out)
            else:
                out.add_(chunk, alpha=coefficient / samples)
        return sum_of_squares(out) if measure else 0.0
    cuts = {0, out.numel(), *(range(BLOCK, out.numel(), BLOCK) if measure else ())}
    pieces = []  # per term: (start offset, chunk) of its consecutive chunks
    for chunks, _ in terms:
        offset, starts = 0, []
        for chunk in chunks:
            starts.append((offset, chunk))
            offset += chunk.numel()
            cuts.add(offset)
        pieces.append(starts)
    bounds = sorted(cuts)
    where = [0] * len(terms)  # per term: index of the chunk holding the current interval
    total = 0.0
    for a, b in zip(bounds, bounds[1:]):
        target = out[a:b]
        for i, (_, coefficient) in enumerate(terms):
            starts = pieces[i]
            while starts[where[i]][0] + starts[where[i]][1].numel() <= a:
                where[i] += 1
            start, chunk = starts[where[i]]
            source = chunk[a - start:b - start]
            if i == 0:
                torch.mul(source, coefficient / samples, out=target)
            else:
                target.add_(source, alpha=coefficient / samples)
        if measure:
            total += sum_of_squares(target)
    return total
