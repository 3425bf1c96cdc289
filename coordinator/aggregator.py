"""Decoded gradients -> optimizer steps, weighted by staleness.

The staleness rule is a pure policy (`StalenessRule`, coordinator/staleness.py); `Aggregator` owns the model's flat
parameters and the optimizer, and is the only place the model changes.

A weight w means influence: over all the steps that follow, a gradient weighted w moves the
parameters w times as far as it would have fresh, and the history it joins (momentum, moments)
moves as it would have with the gradient fresh. How that is done depends on the optimizer:

- SGD, with or without (Nesterov) momentum, dampening or weight decay, is linear in the gradient:
  the gradient is scaled by w before it enters the optimizer.
- Adam and AdamW: the update is linear in the first moment for a given second moment, so the first
  moment takes w * g and the second takes the square the gradient would have added fresh (the
  larger of the two squares when Adam's L2 weight decay is on, so it can never turn negative). A
  stale gradient is still an honest sample of the gradient's scale; weighting its square would
  shrink the normalisation and amplify every other gradient's share.
- Any other optimizer: the gradient is scaled by w, exact only for optimizers linear in it; a
  warning at construction says so.

The job's recipe acts here too: the round's mean gradient is clipped to the job's global norm
before it is weighted (so the same whatever the code that decoded it: every code decodes the
same mean), and the job's learning-rate schedule is stepped once per step taken, or, with
`progress_base` B0 set (`--batch adaptive`), once per B0 samples applied: a step of B samples
advances it B / B0 steps (fractions carried), so the schedule counts base-batch steps. The
step's learning rate is the schedule's times `lr_factor` (set before each step by the round
core, from the batch rule: batch_policy.py), restored after the step so the schedule never
sees it.

With `--delay-compensation` the round's mean gradient is corrected towards the gradient at the
current model (coordinator/compensation.py) before clipping and weighting; `mean_square` (the
noise scale's figure) stays the uncorrected gradient's, the one the workers' samples measured.

Buffers (BatchNorm statistics, counters) are not gradients: `merge_buffers` combines the states
the results of an applied round ended with (module docstring of `merge_buffers`).
"""

from __future__ import annotations

import logging
import math
from typing import Optional, Sequence

import torch

from ..common.errors import ConfigError, GradientRejected
from ..common.job import FlatModel, clip_
from ..common.tensors import sum_of_squares
from .compensation import DelayCompensator
from .staleness import NO_COMPENSATION, DelayCompensation, StalenessRule

log = logging.getLogger(__name__)


class Aggregator:
    """Applies one decoded round at a time to the coordinator's model."""

    def __init__(self, model: FlatModel, optimizer: torch.optim.Optimizer, rule: StalenessRule,
                 version: int = 0, schedule=None, clip_norm: Optional[float] = None,
                 compensation: DelayCompensation = NO_COMPENSATION):
        """`schedule`: a torch LR scheduler over `optimizer`, stepped after each step;
        `clip_norm`: the global L2 norm a round's mean gradient is clipped to;
        `compensation`: the delay compensation of stale rounds (off by default)."""
        self.model = model
        self.optimizer = optimizer
        self.rule = rule
        self.version = version
        self.schedule = schedule
        self.clip_norm = clip_norm
        self.clipped = 0  # steps whose gradient was clipped
        # the last step's mean gradient's squared norm, before clipping and weighting (None when
        # the round was not applied): the gradient noise scale's big-batch figure (noise.py)
        self.mean_square: Optional[float] = None
        self._weigh = _weighing_for(optimizer)
        self.compensator = DelayCompensator(compensation)
        self.lr_factor = 1.0  # the next step's learning rate is the schedule's times this
        # the schedule counts base-batch steps of this many samples (None: optimizer steps)
        self.progress_base: Optional[int] = None
        self.progress = 0.0  # base-batch steps applied (with progress_base)
        self.schedule_steps = 0  # the schedule's steps taken for them

    def weight_for(self, round_version: int) -> Optional[float]:
        return self.rule.weight(self.version - round_version)

    def apply(self, gradient_sum: torch.Tensor, samples: int, round_version: int) -> Optional[float]:
        """Step with the mean gradient of a round planned at `round_version`.

        Returns the staleness weight used, or None when the round is too stale (nothing changes).
        Raises GradientRejected for a gradient that must never be applied.
        """
        return self.apply_terms([([gradient_sum], 1.0)], samples, round_version)

    def apply_terms(self, terms: Sequence[tuple[Sequence[torch.Tensor], float]], samples: int,
                    round_version: int, norms: Optional[Sequence[float]] = None,
                    sent: Optional[torch.Tensor] = None) -> Optional[float]:
        """`apply` for a gradient sum given as weighted terms, each a flat gradient cut into
        consecutive chunks (the frames it arrived in): the sum is written straight into the
        model's gradient, with no intermediate tensor the size of the model.

        `norms`: the terms' L2 norms when the caller has measured them (on arrival); unused
        now that the sum's norm is always measured (the noise scale needs it), kept for the
        callers. The sum's squared norm, before clipping and weighting, is left in
        `mean_square`.

        `sent`: the flat parameters of `round_version` (what the round was computed on), for
        delay compensation; None when they are no longer kept (the round is then applied with
        the staleness weight alone, and counted)."""
        self.mean_square = None
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
        # The sum's norm is measured as it is written (from cache, block by block): the check
        # of finiteness, clipping and the noise scale all read it. Its squares are summed in
        # the gradient's own precision: a sum that overflows there is refused.
        squares = _write_sum(grads, terms, samples)
        if not math.isfinite(squares):
            grads.zero_()
            raise GradientRejected("non-finite gradient")
        self.mean_square = squares
        compensator = self.compensator
        if compensator.setting.on:
            compensator.observe(grads)
            if compensator.correct_(grads, self.model.params.detach(), sent,
                                    self.version - round_version):
                squares = sum_of_squares(grads)  # the corrected gradient is what is clipped
                if not math.isfinite(squares):
                    grads.zero_()
                    raise GradientRejected("non-finite gradient after delay compensation")
        if clip_(grads, self.clip_norm, math.sqrt(squares)):
            self.clipped += 1
        if weight != 1.0:
            self._weigh(self.optimizer, self.model.grads, weight)
        self._step()
        self._advance_schedule(samples)
        self.version += 1
        return weight

    def _step(self) -> None:
        """The optimizer's step, at `lr_factor` times each group's learning rate."""
        factor = self.lr_factor
        if factor == 1.0:
            self.optimizer.step()
            return
        groups = self.optimizer.param_groups
        kept = [group["lr"] for group in groups]
        try:
            for group, lr in zip(groups, kept):
                group["lr"] = lr * factor
            self.optimizer.step()
        finally:
            for group, lr in zip(groups, kept):
                group["lr"] = lr

    def _advance_schedule(self, samples: int) -> None:
        if self.schedule is None:
            return
        if self.progress_base is None:
            self.schedule.step()
            return
        self.progress += samples / self.progress_base
        while self.schedule_steps < math.floor(self.progress + 1e-9):
            self.schedule.step()
            self.schedule_steps += 1

    def progress_state(self) -> dict:
        return {"progress": self.progress, "schedule_steps": self.schedule_steps}

    def load_progress_state(self, state: dict) -> None:
        self.progress = float(state.get("progress", 0.0))
        self.schedule_steps = int(state.get("schedule_steps", 0))


def merge_buffers(current: torch.Tensor, states: Sequence[tuple[torch.Tensor, float]],
                  weight: float, counters: torch.Tensor) -> torch.Tensor:
    """The buffers after a round is applied, from `current` (float64, FlatModel.buffers_flat's
    order) and the `states` the round's used results ended with, each with its slot's samples;
    `weight` is the round's staleness weight and `counters` marks the integer values.

    - Floating values (running mean and variance): the sample-weighted mean m of the states,
      taken with the round's staleness weight w: current + w (m - current). A fresh round
      (w = 1) replaces the buffers with the mean its workers ended with, as hivemind averages
      peers' buffers and as DDP, whose ranks run the same batch size, ends with rank 0's
      statistics; a stale round's statistics describe an older model, and count as much as its
      gradient does. A convex combination: a variance stays non-negative.
    - Counters (num_batches_tracked): the largest, never less than now. Each result counts the
      forward passes on its own path from the round's version, and parallel slots are not
      sequential passes; with every slot doing the same passes, as DDP's ranks, this is DDP's
      count. A counter never goes back.
    """
    if not states:
        return current
    stacked = torch.stack([state.to(torch.float64) for state, _ in states])
    samples = torch.tensor([max(0.0, float(n)) for _, n in states], dtype=torch.float64)
    if not samples.sum() > 0:
        samples = torch.ones_like(samples)
    mean = (samples / samples.sum()) @ stacked
    merged = current + weight * (mean - current)
    if counters.any():
        merged[counters] = torch.maximum(current[counters], stacked[:, counters].amax(dim=0))
    return merged


# Weighing a gradient: prepares the optimizer's gradient (and state) so that its next step takes
# the gradient with influence `weight` (module docstring). -------------------------------------


def _weighing_for(optimizer: torch.optim.Optimizer):
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        for group in optimizer.param_groups:
            if not float(group["betas"][1]) > 0:
                # with beta2 = 0 the second moment is the last gradient's square alone: no
                # adjustment before the step reaches it
                raise ConfigError("staleness weights need Adam's beta2 > 0")
        return _weigh_adam
    if not isinstance(optimizer, torch.optim.SGD):
        log.warning("staleness weights scale the gradient given to %s, which weights its "
                    "influence exactly only if the optimizer is linear in the gradient (SGD is; "
                    "Adam and AdamW are handled)", type(optimizer).__name__)
    return _weigh_linear


def _weigh_linear(optimizer: torch.optim.Optimizer, grads: torch.Tensor, weight: float) -> None:
    grads.mul_(weight)


def _weigh_adam(optimizer: torch.optim.Optimizer, grads: torch.Tensor, weight: float) -> None:
    """Scale the gradient by `weight` and top up each second moment beforehand, so that after
    the step (v <- beta2 v + (1 - beta2) g'^2, g' the scaled gradient) it holds what the
    unscaled gradient would have left there.

    The top-up is fresh^2 - stale^2 (clamped at 0), fresh = s g + l2 p what Adam adds to its
    moments unscaled, stale = s w g + l2 p scaled (s the sign of maximize, l2 the coupled weight
    decay), computed as (fresh - stale)(fresh + stale) = s g (1 - w) (s g (1 + w) + 2 l2 p) with
    one multi-tensor operation per factor: a step's worth of per-parameter Python is what made
    this cost more than the optimizer's own step."""
    _create_adam_state(optimizer)
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        beta2 = float(group["betas"][1])
        decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        l2 = 0.0 if decoupled else float(group["weight_decay"])
        gradients = [p.grad for p in params]
        moments = [optimizer.state[p]["exp_avg_sq"] for p in params]
        scale = (1 - beta2) / beta2
        if not l2:
            # s^2 = 1: the top-up is g^2 (1 - w^2), nothing when |w| >= 1
            if weight * weight < 1:
                torch._foreach_addcmul_(moments, gradients, gradients,
                                        value=(1 - weight * weight) * scale)
            continue
        sign = -1.0 if group["maximize"] else 1.0
        both = torch._foreach_mul(gradients, sign * (1 + weight))
        torch._foreach_add_(both, [p.detach() for p in params], alpha=2 * l2)
        torch._foreach_mul_(both, gradients)
        torch._foreach_mul_(both, sign * (1 - weight))
        torch._foreach_clamp_min_(both, 0.0)
        torch._foreach_add_(moments, both, alpha=scale)
    grads.mul_(weight)


def _create_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Have Adam create the state of parameters that have none (its first step does that lazily,
    which would be too late for the top-up), exactly as that first step would, by a step that
    moves nothing: learning rate and weight decay 0, zero gradients, and only those parameters
    given a gradient. Then the step counts are reset, so the real step is still their first."""
    fresh = [p for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None and not optimizer.state.get(p)]
    if not fresh:
        return
    kept_grads = {p: p.grad for group in optimizer.param_groups for p in group["params"]}
    kept_settings = [(group["lr"], group["weight_decay"]) for group in optimizer.param_groups]
    try:
        for p in kept_grads:
            p.grad = None
        for p in fresh:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"], group["weight_decay"] = 0.0, 0.0
        optimizer.step()
    finally:
        for group, (lr, decay) in zip(optimizer.param_groups, kept_settings):
            group["lr"], group["weight_decay"] = lr, decay
        for p, grad in kept_grads.items():
            p.grad = grad
    for p in fresh:
        step = optimizer.state[p]["step"]
        if torch.is_tensor(step):
            step.zero_()
        else:
            optimizer.state[p]["step"] = 0


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
