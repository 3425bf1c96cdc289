"""A gradient problem of known noise scale, and a digits coordinator's round core fed with it
(the model's own gradients have an unknown one): what the noise-scale and adaptive-batch tests
share."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from idlegrad.coordinator.effects import Applied
from idlegrad.coordinator.scheduler import Assign

DIM = 100


class KnownNoise:
    """Per-sample gradients G + sqrt(variance) z, z standard normal in `dim` dimensions: |G|^2 = 1,
    tr(Sigma) = dim * variance, so B_simple = dim * variance."""

    def __init__(self, b_simple: float, seed: int = 0, dim: int = DIM):
        self.rng = np.random.default_rng(seed)
        self.dim = dim
        self.mean = np.ones(dim) / np.sqrt(dim)
        self.variance = b_simple / dim
        self.b_simple = b_simple

    def partition_sum(self, samples: int) -> np.ndarray:
        """The summed gradient of `samples` fresh samples."""
        return (samples * self.mean
                + np.sqrt(self.variance * samples) * self.rng.standard_normal(self.dim))


@dataclass
class Driven:
    now: float
    slot_sizes: set = field(default_factory=set)  # samples of the slots answered
    batches: set = field(default_factory=set)  # samples of the rounds applied
    kinds: set = field(default_factory=set)  # the slots' kinds


def drive(training, problem: KnownNoise, rounds_wanted: int, now: float = 100.0,
          workers=("a", "b", "c", "d")) -> Driven:
    """`workers` join `training`'s round core with a credit each and answer every slot with
    `problem`'s gradient of its parts, a tenth of a second apart, until the noise estimate has
    `rounds_wanted` more rounds (bounded: a core that never measures stops after 4x as many)."""
    core = training.core
    held: dict[str, Assign] = {}
    out = Driven(now)

    def perform(effects):
        for e in effects:
            if isinstance(e, Assign):
                held[e.worker] = e
            elif isinstance(e, Applied):
                out.batches.add(e.samples)
                training.applied(e, out.now)

    for worker in workers:
        perform(core.join(worker, {}, worker, out.now) + core.ready(worker, 1, out.now))
    start = core.noise.rounds
    for _ in range(4 * rounds_wanted):
        if core.noise.rounds - start >= rounds_wanted:
            break
        out.now += 0.1
        for worker in workers:
            task = held.pop(worker)
            out.kinds.add(task.kind)
            out.slot_sizes.add(task.work.samples)
            gradient = sum(c * problem.partition_sum(part[2])
                           for part, c in zip(task.parts, task.coefficients))
            flat = torch.from_numpy(gradient).to(training.model.model.dtype)
            perform(core.result(worker, task.slot, [flat], float(flat.norm()), 0.001, out.now,
                                samples=task.work.samples, loss=1.0))
    return out
