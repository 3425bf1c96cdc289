"""The simulator's model backends (simulator.py), what the round core steps decoded rounds with:
costless (no tensors: the staleness rule alone decides whether a round is applied; synthetic
evaluations) or real (a small job's gradients and evaluation sums computed in this process with
the workers' kernels, rounds applied through the real `Aggregator`). torch is imported only by
the real one.
"""

from __future__ import annotations

from typing import Optional

from .effects import Compute
from .staleness import NO_COMPENSATION, DelayCompensation, StalenessRule


class CostlessGradients:
    """No tensors: a decoded round is applied (version + 1) or replanned by the staleness rule,
    and every result is honest (copies always agree, norms are the slot's size). Its evaluation is synthetic: the one
    metric, `version`, is the evaluated model's version, as sums (each test sample counts it),
    so the ranges an evaluation is cut into add up to it exactly when they come back whole."""

    sums_evaluable = True

    def __init__(self, train_samples: int, batch_size: int, rule: StalenessRule,
                 test_samples: int = 10_000):
        self.train_samples = train_samples
        self.test_samples = test_samples
        self.batch_size = batch_size
        self.rule = rule
        self.version = 0

    def result(self, task) -> tuple[None, float]:
        """No gradient, and a norm of 1 per unit of the slot's size (its samples, weighted by
        the code's coefficients): every result is as honest to the norm screen as the rest."""
        return None, float(sum(abs(c) * p[2] for p, c in zip(task.parts, task.coefficients)))

    def compute(self, request: Compute) -> None:
        return None

    def apply(self, terms, norms, samples: int, round_version: int, in_use) -> Optional[float]:
        weight = self.rule.weight(self.version - round_version)
        if weight is not None:
            self.version += 1
        return weight

    def distance(self, a, b) -> float:
        return 0.0

    def size(self, a) -> float:
        return 0.0

    def eval_sums(self, task) -> dict[str, tuple[float, float]]:
        """An evaluation slot's answer: `task` has the fields of an `Assign` of kind "eval"."""
        (_, _, count), = task.parts
        return {"version": (float(task.version) * count, float(count))}

    def evaluate(self) -> dict:
        """The model as it is now, evaluated whole (on the coordinator)."""
        return {"version": float(self.version)}


class RealGradients:
    """A small job trained for real: every result's coded gradient is computed here at its
    slot's model version, with the workers' kernel, and decoded rounds go through the real
    `Aggregator`."""

    def __init__(self, job_spec: str, job_args: dict, seed: int, rule: StalenessRule,
                 local: bool = False, outer_config=None,
                 compensation: DelayCompensation = NO_COMPENSATION):
        """`local`: slots are local tasks, and the coordinator's optimizer is the outer one;
        `compensation`: the delay compensation of stale rounds (gradient tasks only), with
        the snapshot of each round's version as the server's model state has it."""
        import torch

        from ..common.job import (FlatModel, build, build_schedule, eval_size, load_job,
                                  make_optimizer, sums_evaluable)
        from . import outer
        from .aggregator import Aggregator

        self._torch = torch
        job = load_job(job_spec, job_args)
        self.built = build(job, seed=seed)
        self.seed = seed
        model = self.built.model
        if local:
            optimizer = outer.build(model.module.parameters(), outer_config or outer.OuterConfig())
            self.aggregator = Aggregator(model, optimizer, rule)
        else:
            optimizer = make_optimizer(job, model.module)
            self.aggregator = Aggregator(model, optimizer, rule, schedule=build_schedule(
                job, optimizer), clip_norm=job.clip_norm, compensation=compensation)
        self.worker = FlatModel(job.build_model())
        self.train_samples = len(self.built.train)
        self.test_samples = eval_size(job, self.built.test)
        self.sums_evaluable = sums_evaluable(job)  # else it is evaluated here, whole
        self.batch_size = job.batch_size
        self.snapshots = {0: model.params.detach().clone()}

    @property
    def version(self) -> int:
        return self.aggregator.version

    def result(self, task) -> tuple[list, float]:
        """A slot's result as a worker computes it, with the workers' kernels: `task` has the
        fields of an `Assign` (or a `Compute`)."""
        from ..common.job import coded_gradient, local_change
        from ..common.tensors import finite_norm

        job, params = self.built.job, self.snapshots[task.version]
        version, block = task.version, self.built.random_block  # the slot's randomness, as a worker's
        if task.kind == "local":
            (part,), (coefficient,) = task.parts, task.coefficients
            result = local_change(job, self.worker, params, self.built.train, self.seed, part,
                                  coefficient, task.steps, version=version, block=block).change
        else:
            result = coded_gradient(job, self.worker, params, self.built.train, self.seed,
                                    task.parts, task.coefficients, version=version, block=block)
        return [result], finite_norm([result])

    def compute(self, request: Compute) -> list:
        return self.result(request)[0]

    @property
    def mean_square(self) -> Optional[float]:
        return self.aggregator.mean_square

    @property
    def lr_factor(self) -> float:
        return self.aggregator.lr_factor

    @lr_factor.setter
    def lr_factor(self, factor: float) -> None:
        self.aggregator.lr_factor = factor

    @property
    def optimizer_name(self) -> str:
        return type(self.aggregator.optimizer).__name__

    def apply(self, terms, norms, samples: int, round_version: int, in_use) -> Optional[float]:
        weight = self.aggregator.apply_terms(terms, samples, round_version, norms,
                                             self.snapshots.get(round_version))
        if weight is not None:
            self.snapshots[self.aggregator.version] = self.aggregator.model.params.detach().clone()
            for v in [v for v in self.snapshots if v != self.aggregator.version and not in_use(v)]:
                del self.snapshots[v]
        return weight

    def distance(self, a, b) -> float:
        from ..common.tensors import distance

        return distance(a, b)

    def size(self, a) -> float:
        from ..common.tensors import finite_norm

        return finite_norm(a)

    def eval_sums(self, task) -> dict[str, tuple[float, float]]:
        """An evaluation slot's answer as a worker computes it (the worker's kernel), on the
        model of its version: `task` has the fields of an `Assign` of kind "eval"."""
        from ..common.job import evaluation_sums

        (_, offset, count), = task.parts
        self.worker.load(self.snapshots[task.version])
        return evaluation_sums(self.built.job, self.worker.module, self.built.test, offset, count)

    def evaluate(self) -> dict:
        """The model as it is now, evaluated whole (the coordinator's own evaluation)."""
        from ..common.job import evaluate

        return evaluate(self.built.job, self.aggregator.model.module, self.built.test)
