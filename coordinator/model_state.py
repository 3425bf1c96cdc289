"""The coordinator's model: parameters, optimizer, the snapshots tasks are sent from, and the
computations the coordinator makes itself. The server's backend for the round core (torch; no
sockets, no clock).

Snapshots: a task at version v carries the model at v, sent zero-copy and asynchronously, so the
live parameters (which the next step changes) must not be what its frames point at. A snapshot
is made when a model is first sent at the current version, or just before a step while an open
round still needs the current version; it goes back to a pool of buffers once no open round
needs it and ZeroMQ is done sending it. A snapshot holds the model's persistent buffers at v too
(BatchNorm statistics: small, copied each time), sent with the parameters and loaded wherever
the model at v is computed or evaluated.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from ..common import protocol as proto
from ..common.errors import ProtocolError
from ..common.job import BuiltJob, EpochOrder, FlatModel, coded_gradient, evaluate, local_change
from ..common.tensors import (TORCH_DTYPES, BufferPool, blob_chunks, buffer_vector, distance,
                              finite_norm, to_blob)
from .aggregator import Aggregator, merge_buffers
from .staleness import NO_COMPENSATION, DelayCompensation, StalenessRule
from .effects import Compute

log = logging.getLogger("idlegrad.coordinator")


class ModelState:
    def __init__(self, built: BuiltJob, optimizer: torch.optim.Optimizer, rule: StalenessRule,
                 seed: EpochOrder, result_dtype: str = "float32", version: int = 0,
                 copy_threshold_bytes: int = 0, schedule=None, clip_norm: Optional[float] = None,
                 compensation: DelayCompensation = NO_COMPENSATION):
        self.built = built
        self.model: FlatModel = built.model
        self.optimizer = optimizer
        self.schedule = schedule
        self.seed = seed  # the order parts index: a seed (full shuffle) or a ShardOrder
        self.aggregator = Aggregator(self.model, optimizer, rule, version, schedule, clip_norm,
                                     compensation)
        self.result_dtype = (self.model.dtype if result_dtype == "float32"
                             else TORCH_DTYPES[result_dtype])
        # version -> (model, its blob, trackers of the zero-copy sends of it)
        self._snapshots: dict[int, tuple[torch.Tensor, proto.Blob, list]] = {}
        # version -> (buffers, their blob), beside each snapshot of a model that has buffers
        self._buffer_snapshots: dict[int, tuple[torch.Tensor, proto.Blob]] = {}
        self._buffers = BufferPool(self.model.numel, self.model.dtype)
        # below ZeroMQ's copy threshold a model is copied at send: cheaper than tracking it
        self.copy_numel = copy_threshold_bytes // self.model.params.element_size()
        self._scratch: Optional[FlatModel] = None  # for the coordinator's own computations
        self._eval_model: Optional[FlatModel] = None

    @property
    def version(self) -> int:
        return self.aggregator.version

    # the round core's backend -------------------------------------------------------------------

    def apply(self, terms, norms: Sequence[float], samples: int, round_version: int,
              in_use: Callable[[int], bool]) -> Optional[float]:
        current = self.version
        if in_use(current):
            self.blob(current)  # rounds still open at this version need it kept
        # the model the round was computed on, for delay compensation (kept while the round was
        # open: the snapshot it was sent from)
        sent = self._snapshots.get(round_version)
        weight = self.aggregator.apply_terms(terms, samples, round_version, norms,
                                             None if sent is None else sent[0])
        if weight is not None:
            for version in [v for v in self._snapshots if not in_use(v)]:
                tensor, _, trackers = self._snapshots.pop(version)
                self._buffers.give(tensor, trackers)
                # (a send of it in flight holds its memory: nothing to give back)
                self._buffer_snapshots.pop(version, None)
        return weight

    @property
    def mean_square(self) -> Optional[float]:
        return self.aggregator.mean_square

    @property
    def lr_factor(self) -> float:
        """The next step's learning-rate factor (--batch adaptive: the round core sets it)."""
        return self.aggregator.lr_factor

    @lr_factor.setter
    def lr_factor(self, factor: float) -> None:
        self.aggregator.lr_factor = factor

    def merge_buffers(self, states: Sequence[tuple[torch.Tensor, int]], weight: float) -> None:
        model = self.model
        if model.buffers:
            model.load_buffers(merge_buffers(model.buffers_flat(), states, weight,
                                             model.counter_mask))

    def distance(self, a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return distance(a, b)

    def size(self, a: list[torch.Tensor]) -> float:
        return finite_norm(a)

    # the wire ---------------------------------------------------------------------------------

    def gradient_of(self, blob: proto.Blob) -> list[torch.Tensor]:
        """A result's frames as chunks of a flat gradient in the model's dtype (ProtocolError
        when they are not one)."""
        grad = blob_chunks(blob, self.model.numel, self.result_dtype)
        if self.result_dtype != self.model.dtype:  # bfloat16 on the wire: widen, once
            grad = [chunk.to(self.model.dtype) for chunk in grad]
        return grad

    def buffers_of(self, blob: Optional[proto.Blob]) -> Optional[torch.Tensor]:
        """A result's buffer frame, checked (ProtocolError when it is not the model's buffers:
        missing, of another dtype or length, not finite, a counter not a whole number)."""
        model = self.model
        if not model.buffers:
            if blob is not None:
                raise ProtocolError("tensor", "buffers for a model that has none")
            return None
        if blob is None:
            raise ProtocolError("tensor", "no buffers for a model that has some")
        # a copy: small, and the frames it arrived in need not be held while its round is open
        return buffer_vector(blob, model.buffer_numel, model.counter_mask).clone()

    def blob(self, version: int) -> proto.Blob:
        """The model at `version`, as an immutable copy in a reused buffer (its buffers are
        snapshotted with it: `buffers_blob`)."""
        snap = self._snapshots.get(version)
        if snap is None:
            if version != self.version:
                raise RuntimeError(f"no snapshot of version {version}")  # a scheduler bug
            tensor = self._buffers.take()
            tensor.copy_(self.model.params.detach())
            snap = (tensor, to_blob(tensor), [])
            self._snapshots[version] = snap
            if self.model.buffers:
                buffers = self.model.buffers_flat()
                self._buffer_snapshots[version] = (buffers, to_blob(buffers))
        return snap[1]

    def buffers_blob(self, version: int) -> Optional[proto.Blob]:
        """The buffers of the snapshot `blob(version)` made, or None for a model without."""
        snap = self._buffer_snapshots.get(version)
        return None if snap is None else snap[1]

    def tracked(self, version: int, tracker) -> None:
        """A zero-copy send of the snapshot at `version` is under way."""
        self._snapshots[version][2].append(tracker)

    # the coordinator's own computations ---------------------------------------------------------

    def computation(self, request: Compute) -> Optional[Callable[[], list[torch.Tensor]]]:
        """A callable computing `request` exactly as a worker does (run it in a thread), or None
        when its model version is no longer kept."""
        snap = self._snapshots.get(request.version)
        if snap is not None:
            params = snap[0]
            buffers = self._buffer_snapshots.get(request.version, (None,))[0]
        elif request.version == self.version:
            params = self.model.params.detach().clone()
            buffers = self.model.buffers_flat()
        else:
            return None
        if self._scratch is None:
            self._scratch = FlatModel(self.built.job.build_model())
        if buffers is not None and self._scratch.buffers:
            self._scratch.load_buffers(buffers)  # where a forward reads them, as a worker's does
        job, train, seed, model = self.built.job, self.built.train, self.seed, self._scratch
        # the slot's randomness is keyed by its version, and cut in the job's blocks, as on the
        # worker (common/slot_random.py)
        version, block = request.version, self.built.random_block
        if request.kind == "local":
            (part,), (coefficient,) = request.parts, request.coefficients
            return lambda: [local_change(job, model, params, train, seed, part, coefficient,
                                         request.steps, version=version, block=block).change]
        return lambda: [coded_gradient(job, model, params, train, seed, request.parts,
                                       request.coefficients, version=version, block=block)]

    def evaluation(self) -> Callable[[], dict]:
        """A callable evaluating the model as it is now on the test set (run it in a thread:
        it works on a copy, so training goes on meanwhile)."""
        if self._eval_model is None:
            self._eval_model = FlatModel(self.built.job.build_model())
        self._eval_model.load(self.model.params)
        self._eval_model.load_buffers(self.model.buffers_flat())  # eval mode reads them
        model, job, test = self._eval_model, self.built.job, self.built.test
        return lambda: evaluate(job, model.module, test)

    # checkpoints ------------------------------------------------------------------------------

    def state(self) -> dict:
        state = {"params": self.model.params.detach().clone(),
                 "buffers": self.model.buffer_state(),
                 "optimizer": self.optimizer.state_dict()}
        if self.schedule is not None:
            state["schedule"] = self.schedule.state_dict()
            # base-batch steps counted (--batch adaptive), so a resumed schedule is where it was
            state["schedule_progress"] = self.aggregator.progress_state()
        return state

    def load(self, state: dict, with_optimizer: bool) -> None:
        self.model.load(state["params"])
        buffers = state.get("buffers")
        if self.model.buffers:
            missing = self.model.load_buffer_state(buffers if isinstance(buffers, dict) else {})
            if missing:
                log.warning("the checkpoint holds no values for the buffers %s: they keep the "
                            "values the model was built with", ", ".join(missing[:8]))
        if with_optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
            if self.schedule is not None:
                if "schedule" in state:
                    self.schedule.load_state_dict(state["schedule"])
                    if isinstance(state.get("schedule_progress"), dict):
                        self.aggregator.load_progress_state(state["schedule_progress"])
                else:
                    log.warning("the checkpoint holds no learning-rate schedule: the job's "
                                "schedule starts from its beginning")
