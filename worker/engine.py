"""Computes a slot's coded gradient, in micro-batches, honouring pause and cancel between them.

The engine runs in a worker thread (the daemon's event loop keeps heart-beating meanwhile). It
checks the cancel flag and the pause gate between micro-batches, and sizes micro-batches from its
measured speed so that a cancel or pause takes effect well within a second. While paused it sleeps
on the gate (no CPU), and the paused time is not counted as compute time.

What a slot fetches (the model snapshot a task names, the shards its samples are in) comes through
the blob cache in this thread too, under the same gate: a download stops between two blocks when
the owner wants the machine back, waits, and resumes from its partial file (cache.py's `gated`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..common import snapshot
from ..common.blobs import BlobError
from ..common.errors import ProtocolError
from ..common.job import (BuiltJob, EpochOrder, FlatModel, accumulate_coded_gradient,
                          evaluation_sums, local_change)
from ..common.sharded import ShardedDataset
from ..common.tensors import BufferPool, buffer_vector, from_blob

log = logging.getLogger("idlegrad.worker.engine")


class Cancelled(Exception):
    """The slot was cancelled (or the worker is stopping) between two micro-batches."""


@dataclass(frozen=True)
class SnapshotRef:
    """A model by name: the snapshot blob (common/snapshot.py) a task named, of `size` bytes."""

    sha256: str
    size: int


@dataclass(frozen=True)
class Work:
    slot: int
    version: int
    # The model at `version`: flat, or consecutive chunks (the frames it arrived in). It must not
    # change once handed over: the engine skips loading a params object it loaded last.
    params: torch.Tensor | Sequence[torch.Tensor]
    parts: Sequence[Sequence[int]]  # [epoch, offset, count] each
    coefficients: Sequence[float]
    # "local": `steps` inner steps of the job's optimizer (compute_local); "eval": the sums of the
    # evaluation of the one part's range of the test set (compute_eval)
    kind: str = "gradient"
    steps: int = 0
    arrived: Optional[float] = None  # time.monotonic() when the task reached the worker
    # the model's persistent buffers at `version` (float64, FlatModel.buffers_flat's order);
    # None when it has none
    buffers: Optional[torch.Tensor] = None
    # the model at `version` by name instead (params and buffers are then unused): fetched
    # through the engine's store when the slot is computed
    snapshot: Optional[SnapshotRef] = None


@dataclass(frozen=True)
class Outcome:
    slot: int
    version: int
    # flat, CPU; the caller owns it, and may hand it back (`release`). None for an evaluation.
    gradient: Optional[torch.Tensor]
    samples: int
    loss: float
    compute_s: float
    waited_s: float = 0.0  # from the task's arrival to the start of its compute (the daemon's)
    # the persistent buffers the computation left (float64, CPU); None when the model has none
    buffers: Optional[torch.Tensor] = None
    sums: Optional[dict[str, tuple[float, float]]] = None  # an evaluation's answer


class Engine:
    MICRO_BATCH_TARGET_S = 0.2  # far under the one-second promise to the machine's owner

    def __init__(self, built: BuiltJob, seed: EpochOrder, device: torch.device):
        """`seed`: the order parts index (the welcome's seed, or its shard-aware order)."""
        self.built = built
        self.seed = seed
        self.device = device
        self.micro_batch = 16  # grows after the first measurement
        # Gradients go out zero-copy: each slot computes into a buffer of this pool, and a sent
        # one is reused only when ZeroMQ is done with it (`release`).
        self._gradients = BufferPool(built.model.numel, built.model.dtype)
        self._loaded: object = None  # the params object the model holds
        self._s_per_sample: Optional[float] = None
        # fault injection for tests and benchmarks (the worker's --slowdown and --stall)
        self.slowdown = 1.0
        # this thread's CPU time and the wall clock when the slot began (--slowdown)
        self._cpu_start = self._wall_start = 0.0
        self.poison: Optional[tuple[str, float]] = None  # fault injection: a hostile worker
        self.stall: Optional[tuple[float, float]] = None  # (probability, seconds)
        self._random = random.Random()
        # the blob cache (worker/cache.py): where snapshots come from, and whose downloads the
        # pause gate interrupts; None until the worker makes one
        self.store = None
        # what a slot reads, fetched before the job's code runs (the daemon's data plane), or None
        self.fetch = None
        self._snapshot: Optional[tuple[str, torch.Tensor, Optional[torch.Tensor]]] = None
        # the snapshots used lately, least recent first: one pushed out of these goes from the
        # cache. By use, not by first load: an evaluation's slots at one version interleave
        # with training at newer ones, and its snapshot must outlive them to be fetched once.
        self._recent_snapshots: deque[str] = deque()

    def check(self, work: Work) -> None:
        """Raise ValueError for a task this worker cannot compute (parts outside its data).
        Bounds only: it runs on the event loop, and building each part's epoch permutation here
        let one task of 65,536 parts hold the loop (and its heartbeats) for 20 s."""
        if work.snapshot is not None:
            if self.store is None:
                raise ValueError("a model snapshot, and no blob cache to fetch it")
        elif self.built.model.buffers and work.buffers is None:
            raise ValueError("no buffers with the model, which has some")
        n = len(self.built.test if work.kind == "eval" else self.built.train)
        for epoch, offset, count in work.parts:
            if offset < 0 or count < 0 or offset + count > n:
                raise ValueError(f"part [{epoch}, {offset}, {count}] outside a data set of "
                                 f"{n} samples")

    WARM_UP_SAMPLES = 48  # three micro-batches of the first size

    def warm_up(self) -> None:
        """Compute one small gradient at the model as built and throw it away, before the
        first task: torch's first forward and backward pay for lazy set-up (allocations,
        kernel choices; a GPU's context), and a first task paying it made the machine look
        several times slower than it is (its first result sizes its next parts, and a slowed
        machine paid the set-up times its slowdown). Its micro-batches measure the engine's
        speed, so the first task's micro-batches are sized too. No injected delay: it is no
        task. Only for a job whose data is built here: one whose data comes by manifest reads
        its samples through fetches the session drives (worker/building.py)."""
        count = min(self.WARM_UP_SAMPLES, len(self.built.train))
        if count == 0:
            return
        model = self.built.model
        gate = _MicroBatchGate(self, threading.Event(), None)
        on_cpu = model.grads.device.type == "cpu"
        if on_cpu:
            model.use_grads(self._gradients.take())
        model.grads.zero_()
        accumulate_coded_gradient(
            self.built.job, model, self.built.train, self.seed, [(0, 0, count)], [1.0],
            micro_batch=lambda: self.micro_batch, device=self.device, between=gate.between,
            observe=gate.observe, block=self.built.random_block)
        model.grads.zero_()
        if on_cpu:
            self._gradients.give(model.grads)

    SNAPSHOTS_KEPT = 3
    PAUSE_POLL_S = 0.25  # while paused, how often the cancel flag is looked at

    def compute(self, work: Work, cancel: threading.Event,
                running: Optional[threading.Event] = None) -> Outcome:
        """The slot's coded gradient. `running`: a gate, set while computing is allowed; when it
        is clear the engine waits at the next micro-batch boundary (until set, or cancelled)."""
        start = self._wall_start = time.perf_counter()
        self._cpu_start = time.thread_time()
        gate = _MicroBatchGate(self, cancel, running)
        gated = self.store.gated(gate) if self.store is not None else contextlib.nullcontext()
        with gated:
            work = self._with_model(work)
            if self.fetch is not None:
                self.fetch(work)
            for _ in range(2):
                if work.kind == "eval":
                    outcome = self.compute_eval(work, cancel, running)
                elif work.kind == "local":
                    outcome = self._compute_local(work, gate, start)
                else:
                    outcome = self._compute_gradient(work, gate, start)
                corrupt = self._corrupt_shards()
                if not corrupt:
                    return outcome
                # what it computed is thrown away (its buffer too: a rare case); the shards
                # are dropped from the cache, and fetched again by the computation done again
                log.warning("shard%s %s corrupted on disk since checked: dropped, fetched again, "
                            "slot %d computed again", "s" if len(corrupt) > 1 else "",
                            ", ".join(sha[:12] for sha in corrupt), work.slot)
            raise BlobError(f"shards corrupted on disk again after a fetch ({corrupt[0][:12]}): "
                            "the disk under the cache is failing")

    def _corrupt_shards(self) -> list[str]:
        """The data's shards that no longer hash to their names (common/sharded.py)."""
        out: list[str] = []
        for data in (self.built.train, self.built.test):
            data = getattr(data, "dataset", data)  # a Subset of one
            if isinstance(data, ShardedDataset):
                out += [sha for sha in data.corrupt_shards() if sha not in out]
        return out

    @property
    def loaded_snapshot(self) -> Optional[str]:
        """The sha256 of the snapshot whose model is loaded, if any."""
        return self._snapshot[0] if self._snapshot is not None else None

    def _with_model(self, work: Work) -> Work:
        """`work` with the model it names by snapshot loaded (fetched, checked by hash; the
        last one loaded is kept, so the slots of one version share one tensor)."""
        ref = work.snapshot
        if ref is None:
            return work
        if self._snapshot is None or self._snapshot[0] != ref.sha256:
            self._snapshot = None  # the last version's memory is the next one's
            path = self.store.path_of(ref.sha256, ref.size or None)
            params, buffers = read_snapshot(path, self.built.model, work.version)
            self._snapshot = (ref.sha256, params, buffers)
            if ref.sha256 in self._recent_snapshots:
                self._recent_snapshots.remove(ref.sha256)
            self._recent_snapshots.append(ref.sha256)
            while len(self._recent_snapshots) > self.SNAPSHOTS_KEPT:
                self.store.discard(self._recent_snapshots.popleft())
        _, params, buffers = self._snapshot
        return dataclasses.replace(work, params=params, buffers=buffers, snapshot=None)

    def _compute_gradient(self, work: Work, gate: "_MicroBatchGate", start: float) -> Outcome:
        cancel, running = gate._cancel, gate._running
        model = self.built.model
        if work.params is not self._loaded:  # a new version (a slot at the same one: no copy)
            self._loaded = None
            model.load(work.params if isinstance(work.params, torch.Tensor) else list(work.params))
            self._loaded = work.params
        self._load_buffers(work)
        on_cpu = model.grads.device.type == "cpu"
        if on_cpu:
            model.use_grads(self._gradients.take())
        model.grads.zero_()
        tally = accumulate_coded_gradient(
            self.built.job, model, self.built.train, self.seed, work.parts, work.coefficients,
            micro_batch=lambda: self.micro_batch, device=self.device, between=gate.between,
            observe=gate.observe, version=work.version, block=self.built.random_block)
        paused_s = self._slowed(gate.paused_s, cancel, running)
        if on_cpu:
            gradient = model.grads  # the next slot computes into another buffer
        else:
            gradient = self._gradients.take()
            gradient.copy_(model.grads)
        if self.poison is not None:
            gradient = poisoned(gradient, *self.poison)
        return Outcome(work.slot, work.version, gradient, tally.samples,
                       tally.loss_sum / tally.samples if tally.samples else 0.0,
                       max(0.0, time.perf_counter() - start - paused_s), buffers=self._buffers())

    def compute_eval(self, work: Work, cancel: threading.Event,
                     running: Optional[threading.Event] = None) -> Outcome:
        """The evaluation sums of the model at `work.version` over its range of the test set, in
        micro-batches (forward only: sized from the training speed, they take less time)."""
        start = self._wall_start = time.perf_counter()
        self._cpu_start = time.thread_time()
        gate = _MicroBatchGate(self, cancel, running)
        model = self.built.model
        if work.params is not self._loaded:
            self._loaded = None
            model.load(work.params if isinstance(work.params, torch.Tensor) else list(work.params))
            self._loaded = work.params
        self._load_buffers(work)  # eval mode reads the running statistics
        ((_, offset, count),) = work.parts
        sums = evaluation_sums(self.built.job, model.module, self.built.test, offset, count,
                               chunk=lambda: self.micro_batch, between=gate.between)
        paused_s = self._slowed(gate.paused_s, cancel, running)
        return Outcome(work.slot, work.version, None, count, 0.0,
                       max(0.0, time.perf_counter() - start - paused_s), sums=sums)

    def _load_buffers(self, work: Work) -> None:
        """Every slot starts from its version's buffers: the forward passes of the last slot
        moved them (BatchNorm's running statistics), even at the same version."""
        if self.built.model.buffers:
            if work.buffers is None:
                raise ValueError("a task without the buffers of a model that has some")
            self.built.model.load_buffers(work.buffers)

    def _buffers(self) -> Optional[torch.Tensor]:
        return self.built.model.buffers_flat() if self.built.model.buffers else None

    def release(self, gradient: torch.Tensor, trackers: Sequence = ()) -> None:
        """Hand back an outcome's gradient, to be reused once every tracker (of its zero-copy
        sends) is done."""
        self._gradients.give(gradient, trackers)
    def _compute_local(self, work: Work, gate: "_MicroBatchGate", start: float) -> Outcome:
        """`work.steps` inner steps of the job's optimizer over the slot's one part, from the
        model at `work.version`; the outcome's `gradient` is coefficient * samples * (start -
        end), the slot's summed outer gradient (coordinator/outer.py).

        The optimizer is built afresh for every slot: a slot is then a pure function of (model,
        samples), so replicas agree, any worker can take any slot, and a worker that leaves loses
        nothing the next one needs. Carried inner state (Adam's moments) would have been computed
        on an older model, and would be lost whenever the fleet changes."""
        cancel, running = gate._cancel, gate._running  # cancel and pause within an inner step too
        initial = work.params if isinstance(work.params, torch.Tensor) else torch.cat(list(work.params))
        self._loaded = None  # the inner steps move the model away from any params object
        (part,) = work.parts
        (coefficient,) = work.coefficients
        self._load_buffers(work)
        result = local_change(self.built.job, self.built.model, initial, self.built.train,
                              self.seed, part, coefficient, work.steps, self.device,
                              micro_batch=lambda: self.micro_batch, between=gate.between,
                              observe=gate.observe, version=work.version,
                              block=self.built.random_block)
        paused_s = self._slowed(gate.paused_s, cancel, running)
        change = result.change.to("cpu")
        if self.poison is not None:
            change = poisoned(change, *self.poison)
        return Outcome(work.slot, work.version, change, result.samples,
                       result.loss_sum / result.samples if result.samples else 0.0,
                       max(0.0, time.perf_counter() - start - paused_s), buffers=self._buffers())

    INJECT_STEP_S = 0.05  # injected delays sleep in steps this small: cancel and pause stay prompt

    def _slot_cpu_s(self) -> float:
        """This thread's CPU seconds since the slot began (the engine computes a slot in one
        thread): what --slowdown multiplies. By the wall clock, workers sharing a machine's
        cores (a fleet emulated on one machine) had their waits for the cores multiplied too,
        and X-slowed workers on too few cores ran as machines several times slower still."""
        return time.thread_time() - self._cpu_start

    def _slowed(self, paused_s: float, cancel: threading.Event,
                running: Optional[threading.Event]) -> float:
        """The slot's computation done, the sleep --slowdown and --stall add to it; `paused_s`
        (the owner's pauses so far, no part of the slot's time) plus those during the sleep."""
        wall_s = time.perf_counter() - self._wall_start - paused_s
        injected = self._injected_delay(self._slot_cpu_s(), wall_s)
        if injected > 0:
            paused_s += self._sleep(injected, cancel, running)
        return paused_s

    def _injected_delay(self, compute_s: float, wall_s: float = 0.0) -> float:
        """The sleep that --slowdown X and --stall add to a slot of `compute_s` CPU seconds that
        has lasted `wall_s` so far: with X, the slot lasts X times its CPU time in all. A machine
        X times slower computes on a core of its own; waits here for a core that this machine's
        other processes share are part of that time, not added to it (workers computing at
        once at a round's start queued for the cores, and their slots ended by who got one
        first)."""
        delay = max(0.0, self.slowdown * compute_s - wall_s) if self.slowdown > 1 else 0.0
        if self.stall is not None and self._random.random() < self.stall[0]:
            delay += self.stall[1]
        return delay

    def _sleep(self, seconds: float, cancel: threading.Event,
               running: Optional[threading.Event]) -> float:
        """Sleep `seconds` of (simulated) compute in small steps, honouring cancel and pause;
        returns the paused time (not counted as compute)."""
        paused = 0.0
        end = time.perf_counter() + seconds
        while True:
            if running is not None and not running.is_set():
                t0 = time.perf_counter()
                paused += self._wait(running, cancel)
                end += time.perf_counter() - t0
            left = end - time.perf_counter()
            if left <= 0:
                return paused
            if cancel.wait(min(self.INJECT_STEP_S, left)):
                raise Cancelled()

    def _gate(self, cancel: threading.Event, running: Optional[threading.Event]) -> float:
        """Where computing may stop: Cancelled if cancelled; while paused, wait. Seconds paused."""
        if cancel.is_set():
            raise Cancelled()
        if running is not None and not running.is_set():
            return self._wait(running, cancel)
        return 0.0

    def _wait(self, running: threading.Event, cancel: threading.Event) -> float:
        """Sleep until the gate opens (or cancel); the seconds slept."""
        t0 = time.perf_counter()
        while not running.wait(self.PAUSE_POLL_S):
            if cancel.is_set():
                raise Cancelled()
        if cancel.is_set():
            raise Cancelled()
        return time.perf_counter() - t0

    def _observe(self, samples: int, seconds: float) -> None:
        if samples <= 0 or seconds <= 0:
            return
        rate = seconds / samples
        self._s_per_sample = rate if self._s_per_sample is None else 0.7 * self._s_per_sample + 0.3 * rate
        self.micro_batch = int(min(4096, max(1, self.MICRO_BATCH_TARGET_S / self._s_per_sample)))


class _MicroBatchGate:
    """The hooks the shared kernels (common/job.py) call around each micro-batch: the engine's
    cancel and pause check before it, its speed measurement after it. The seconds spent paused
    add up in `paused_s`, and are not compute time. The clock is read here: the kernels read none."""

    def __init__(self, engine: Engine, cancel: threading.Event,
                 running: Optional[threading.Event]):
        self._engine, self._cancel, self._running = engine, cancel, running
        self.paused_s = 0.0
        self._started = time.perf_counter()

    def between(self) -> None:
        self.paused_s += self._engine._gate(self._cancel, self._running)
        self._started = time.perf_counter()

    def observe(self, samples: int) -> None:
        self._engine._observe(samples, time.perf_counter() - self._started)

    # what a download in this thread asks between two blocks (cache.py's DownloadGate)

    def stopping(self) -> bool:
        """The owner wants the machine back, or the slot is cancelled: stop reading now."""
        return self._cancel.is_set() or (self._running is not None and not self._running.is_set())

    def wait(self) -> None:
        """Sleep until computing may go on (the paused time is no compute time); Cancelled
        gives the download up, its partial file kept for the next time."""
        self.between()


def read_snapshot(path: str, model: FlatModel,
                  version: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(parameters, buffers or None) of the snapshot blob at `path` (its hash already checked
    by the cache), checked as the wire checks a model frame; BlobError when it is not the
    model at `version`."""
    with open(path, "rb") as fh:
        data = bytearray(fh.read())  # a copy of its own: the cache may evict the file
    found, parts = snapshot.parse(memoryview(data))
    if found != version:
        raise BlobError(f"the snapshot is of version {found}, the task of {version}")
    try:
        if "params" not in parts:
            raise ProtocolError("tensor", "no parameters in the snapshot")
        params = from_blob(parts["params"], model.numel, model.dtype)
        buffers = None
        if model.buffers:
            if "buffers" not in parts:
                raise ProtocolError("tensor", "no buffers in the snapshot of a model with some")
            buffers = buffer_vector(parts["buffers"], model.buffer_numel, model.counter_mask)
    except ProtocolError as exc:
        raise BlobError(f"a snapshot that is not this job's model: {exc}") from None
    return params, buffers


def poisoned(gradient: torch.Tensor, kind: str, factor: float) -> torch.Tensor:
    """What a hostile or broken worker sends instead of `gradient` (fault injection)."""
    if kind == "nan":
        return torch.full_like(gradient, math.nan)
    return gradient * factor
