"""The worker's I/O shell: one DEALER socket, one asyncio loop, compute in a thread.

Every protocol decision is the session's (`session.py`, sans-IO): this loop feeds it what happened
(messages, computations finished, the guest's pauses, the time) and performs the effects it
returns. Handshake: HELLO -> WELCOME (job name, arguments, fingerprint; never code) -> the worker
builds the job locally (`building.py`) -> READY (credits, fingerprint). Then it computes the
TASKs it is given, one at a time, keeping `credits` slots outstanding so it never waits between
tasks; heart-beats while it computes; and reconnects with exponential backoff when the
coordinator goes silent (the ZeroMQ guide's Paranoid Pirate). SHUTDOWN or a signal ends it
cleanly, handing unfinished slots back.

Being a good guest (`guest.py`): the probes are read every `sample_every` seconds in a thread and
the idle policy decides; a pause clears the engine's gate and the session tells the coordinator at
once (HEARTBEAT "paused", READY 0). Blobs (model snapshots, the shards of a job's data) come through
the data plane (`dataplane.py`): fetched in the compute thread, under the pause gate, before the
job's code runs; while the owner's daily transfer cap is spent, a slot whose data is not cached
goes back (HANDBACK) before it starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import platform
import random
import signal
import socket as pysocket
import threading
import time
from dataclasses import dataclass
from typing import Optional

import psutil
import torch
import zmq
import zmq.asyncio

from .. import __version__
from ..common import protocol as proto
from ..common.aio import on_stop_signals
from ..common.blobs import BlobError
from ..common.errors import ConfigError, PeerGone, ProtocolError, Refused
from ..common.security import KEYS_HINT, ClientKeys
from ..common.tensors import blob_chunks, buffer_vector, to_blob
from ..common.throttle import Throttle
from . import session as S
from .building import build_engine, job_key, load_welcomed, pick_device
from .cache import CacheError, CacheTooSmall, DiskFull, TransferCapReached
from .compress import ErrorFeedback
from .config import usable_cores
from .dataplane import DataPlane
from .engine import Cancelled, Outcome, SnapshotRef, Work
from .guest import Guest
from .idle import PolicyConfig, Readings
from .link import ShapedSocket

log = logging.getLogger("idlegrad.worker")


@dataclass
class WorkerConfig:
    coordinator: str = "tcp://127.0.0.1:5555"
    job: Optional[str] = None  # None: only the built-in jobs, chosen by the coordinator's name
    threads: Optional[int] = None
    device: str = "auto"
    credits: int = 2
    connect_timeout: float = 60.0  # 0: keep trying forever
    worker_id: Optional[str] = None
    max_backoff: float = 8.0
    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
    sample_every: float = 0.5  # seconds between probe readings
    cpu_ignore_niced: bool = True
    state_log: Optional[str] = None  # JSON lines: every change of state, with its readings
    slowdown: float = 1.0  # fault injection (tests, benchmarks): tasks take this many times as long
    stall: Optional[tuple[float, float]] = None  # fault injection: (probability, seconds)
    poison: Optional[tuple[str, float]] = None  # fault injection: (kind, factor), engine.parse_poison
    keys: Optional[ClientKeys] = None  # CURVE: the coordinator's pinned key and this worker's pair
    link_mbps: Optional[float] = None  # link emulation (link.py): Mbit/s each way; None: off
    # the blob cache, for jobs that declare their data by manifest (cache.py; worker.toml [cache])
    cache_dir: Optional[str] = None  # None: $XDG_CACHE_HOME/idlegrad/blobs
    cache_max_gb: float = 10.0
    download_max_mbps: Optional[float] = None
    daily_transfer_max_gb: Optional[float] = None
    blob_mirrors: tuple[str, ...] = ()  # the owner's mirrors, tried before the coordinator's


@dataclass
class _Kept:
    """A result until acknowledged: its message, its gradient buffer, trackers of its sends."""
    message: proto.Result
    gradient: torch.Tensor
    trackers: list = dataclasses.field(default_factory=list)


@dataclass
class _Computing:
    slot: int
    work: Work
    cancel: threading.Event
    began: float
    future: asyncio.Future


class _Rehello(Exception):
    """The coordinator does not know this session: hand-shake again on the same socket."""


class _Ended(Exception):
    """This connection is over: the coordinator is silent, or we said bye."""


def _wire_sum(value: float) -> float:
    """The wire takes finite sums only: a diverged model's (inf, nan) reads as a huge one."""
    value = float(value)
    return value if math.isfinite(value) else (-1e300 if value == -math.inf else 1e300)


class Worker:
    def __init__(self, config: WorkerConfig, guest: Optional[Guest] = None,
                 compute_slot: Optional["ComputeSlot"] = None, project: Optional[str] = None):
        """`guest` and `compute_slot`: shared with the other projects' sessions of this process
        (`MultiWorker`); without them this worker is the only one, and reads the probes itself."""
        if config.credits < 1:
            raise ConfigError("credits must be at least 1")
        self.config = config
        self.device = pick_device(config.device)
        self.threads = config.threads or usable_cores()
        if self.threads < 1:
            raise ConfigError("threads must be at least 1")
        torch.set_num_threads(self.threads)
        self.worker_id = config.worker_id or f"{pysocket.gethostname()}-{os.getpid()}"
        self.built = self.engine = self._built_for = None
        # the model of the last task that carried one: (version, its frames' views, buffers,
        # or the snapshot that names it instead)
        self._model: Optional[tuple] = None
        self._computing: Optional[_Computing] = None
        self._wire = ErrorFeedback()  # results as the coordinator wants them (welcome)
        self._samples = guest is None  # alone: this worker reads the probes and decides
        if guest is None:
            uses_gpu = self.device.type == "cuda"
            guest = Guest(config, uses_gpu, (self.device.index or 0) if uses_gpu else None)
        self.guest, self._running = guest, guest.running
        self.project = project or config.coordinator
        self.compute_slot = compute_slot
        self._nudged: Optional[asyncio.Event] = None  # set by MultiWorker when the guest changed
        self.data = DataPlane(config, self._running)
        self.session = S.Session(config.credits, self._hello(), held_shards=self.data.held_shards,
                                 cache_counters=self.data.counters)
        self._cache_logged = Throttle()

    policy = property(lambda self: self.guest.policy)
    probes = property(lambda self: self.guest.probes)
    pauses = property(lambda self: self.guest.pauses)
    paused = property(lambda self: not self._running.is_set())
    results_sent = property(lambda self: self.session.results_sent)
    results_resent = property(lambda self: self.session.results_resent)
    _stop = property(lambda self: self.session.stopped)

    def nudge(self) -> None:
        """The shared guest paused or resumed: tell this session's coordinator."""
        if self._nudged is not None:
            self._nudged.set()

    # lifecycle ------------------------------------------------------------------------------

    def run(self) -> str:
        return asyncio.run(self._main())

    async def _main(self) -> str:
        on_stop_signals(self._on_signal)
        log.info("idle policy: %s", self.probes.describe())
        ctx = zmq.asyncio.Context()
        try:
            await self.connect_loop(ctx)
        finally:
            ctx.term()
            self.guest.close()
        return self._stop or "stopped"

    async def connect_loop(self, ctx) -> None:
        """Connect, serve, reconnect with backoff, until stopped (or the coordinator cannot be
        reached within connect_timeout: PeerGone)."""
        backoff = 0.25
        timeout = self.config.connect_timeout
        give_up_at = time.monotonic() + timeout if timeout > 0 else math.inf
        # one line, so that a worker waiting for its coordinator is not taken for a hung one
        log.info("connecting to the coordinator at %s (%s)", self.config.coordinator,
                 f"giving up after {timeout:g}s without an answer" if timeout > 0
                 else "until it answers")
        while self._stop is None:
            sock = self._socket(ctx)
            try:
                welcome = await self._handshake(sock, timeout=backoff)
                if welcome is None:
                    if time.monotonic() > give_up_at:
                        raise PeerGone(
                            f"cannot reach the coordinator at {self.config.coordinator} within "
                            f"{timeout:g}s (is it running? see "
                            f"--connect-timeout{KEYS_HINT if self.config.keys else ''})")
                    backoff = min(self.config.max_backoff, backoff * 2) * random.uniform(0.8, 1.2)
                    continue
                backoff = 0.25
                await self._session(sock, welcome)
                give_up_at = time.monotonic() + timeout if timeout > 0 else math.inf
                if self._stop is None:
                    log.warning("lost the coordinator at %s; reconnecting", self.config.coordinator)
            finally:
                sock.close(linger=0 if self._stop is None else 1000)

    def _on_signal(self, sig) -> None:
        if self._stop is None:
            log.info("%s received; returning unfinished slots and leaving", signal.Signals(sig).name)
            self._cancel(self.session.stop("interrupted"))

    def _socket(self, ctx) -> zmq.asyncio.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, proto.SOCKET_MAX_MSG_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        if self.config.keys is not None:
            self.config.keys.apply(sock)
        sock.connect(self.config.coordinator)
        return ShapedSocket(sock, self.config.link_mbps) if self.config.link_mbps else sock

    def _hello(self) -> proto.Hello:
        return proto.Hello(
            worker_id=self.worker_id, host=pysocket.gethostname(), cores=usable_cores(),
            threads=self.threads, device=str(self.device),
            memory_mb=psutil.virtual_memory().total // 2**20,
            versions={"idlegrad": __version__, "torch": torch.__version__,
                      "python": platform.python_version(), "protocol": str(proto.PROTOCOL_VERSION)},
            job=self.config.job)

    async def _send(self, sock, msg: proto.Message) -> None:
        await sock.send_multipart(proto.encode(msg), copy=False)

    def _decode(self, frames) -> Optional[proto.Message]:
        try:
            return proto.decode(frames)
        except ProtocolError as exc:
            log.warning("dropped a bad message from the coordinator: %s", exc)
            return None

    async def _handshake(self, sock, timeout: float) -> Optional[proto.Welcome]:
        await self._perform(sock, self.session.connect(time.monotonic()))
        end = time.monotonic() + timeout
        while self._stop is None and (left := end - time.monotonic()) > 0:
            if not await sock.poll(min(left, 0.2) * 1000, zmq.POLLIN):
                continue
            msg = self._decode(await sock.recv_multipart(copy=False))
            for effect in self.session.received(time.monotonic(), msg) if msg else ():
                if isinstance(effect, S.Join):
                    return effect.welcome
                await self._perform(sock, [effect])
        return None

    # performing the session's effects -------------------------------------------------------

    async def _perform(self, sock, effects) -> None:
        for effect in effects:
            if isinstance(effect, S.Send):
                await self._send(sock, effect.message)
            elif isinstance(effect, S.SendResult):  # zero-copy: its buffer is reused once done
                tracker = await sock.send_multipart(proto.encode(effect.result.message),
                                                    copy=False, track=True)
                effect.result.trackers.append(tracker)
            elif isinstance(effect, S.DropResult):
                self.engine.release(effect.result.gradient, effect.result.trackers)
            elif isinstance(effect, S.Compute):
                cancel = threading.Event()
                self._computing = _Computing(effect.slot, effect.work, cancel, time.monotonic(),
                                             asyncio.ensure_future(asyncio.to_thread(
                                                 self.engine.compute, effect.work, cancel,
                                                 self._running)))
            elif isinstance(effect, S.Rehello):
                if effect.forget:
                    self._model = None
                raise _Rehello()
            elif isinstance(effect, S.Leave):
                if effect.refused:
                    raise Refused(effect.reason)
                raise _Ended()
            elif isinstance(effect, S.Reconnect):
                raise _Ended()
            else:
                self._cancel([effect])

    def _cancel(self, effects) -> None:
        for effect in effects:
            if (isinstance(effect, S.CancelCompute) and self._computing is not None
                    and self._computing.slot == effect.slot):
                self._computing.cancel.set()

    # a session ------------------------------------------------------------------------------

    async def _session(self, sock, welcome: proto.Welcome) -> None:
        loop = asyncio.get_running_loop()

        def send(msg: proto.Message) -> None:  # from the cache's thread
            try:
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._send(sock, msg)))
            except RuntimeError:  # the loop is closing
                raise ConnectionError("the worker is stopping") from None

        self.data.attach(send)
        try:
            while welcome is not None:
                try:
                    await self._join(sock, welcome)
                    await self._serve(sock)
                    return
                except _Rehello:
                    log.info("the coordinator does not know this session (restarted?); "
                             "saying hello again")
                    welcome = await self._handshake(
                        sock, timeout=self.session.heartbeat_s * self.session.liveness)
        finally:
            self.data.detach()
            self.session.lost(time.monotonic())

    async def _join(self, sock, welcome: proto.Welcome) -> None:
        self.data.welcomed(welcome.blob_mirrors)
        try:
            try:
                fresh = self._built_for != job_key(welcome) or self.built is None
                job = load_welcomed(self.config.job, welcome) if fresh else self.built.job
                store = None
                if job.data is not None:
                    if fresh or self.data.manifest is None:
                        await self._while_fetching(
                            sock, asyncio.to_thread(self.data.fetch_manifest, job))
                    store = self.data.cache
                self._prepare(welcome, store, job)
            except (Refused, ConfigError) as exc:  # this worker cannot run that job
                await self._send(sock, proto.Bye(reason=str(exc)[:500]))
                raise
        except BaseException:
            self.session.lost(time.monotonic())
            raise
        self.session.pause(time.monotonic(), self.paused)  # (the shared guest's, as it is now)
        await self._perform(sock, self.session.welcomed(time.monotonic(), welcome,
                                                         self.built.fingerprint))
        log.info("joined %s: job %s, %d credits, %s with %d threads%s",
                 self.config.coordinator, welcome.job, self.config.credits, self.device,
                 self.threads, " (paused)" if self.paused else "")

    async def _while_fetching(self, sock, work):
        """Await `work` (a fetch in a thread) while the session lives: heartbeats go out, and the
        chunks it asked the coordinator for are delivered."""
        task = asyncio.ensure_future(work)
        recv = asyncio.ensure_future(sock.recv_multipart(copy=False))
        try:
            while not task.done():
                await self._perform(sock, self.session.tick(time.monotonic()))
                await asyncio.wait({task, recv}, return_when=asyncio.FIRST_COMPLETED,
                                   timeout=max(0.0, self.session.wake_at() - time.monotonic()))
                if recv.done():
                    msg = self._decode(recv.result())
                    recv = asyncio.ensure_future(sock.recv_multipart(copy=False))
                    if isinstance(msg, proto.Chunk):
                        self.data.deliver(msg)
                    elif msg is not None:
                        await self._perform(sock, self.session.received(time.monotonic(), msg))
                        if self._stop is not None:
                            self.data.detach()
            return task.result()
        finally:
            recv.cancel()

    def _prepare(self, welcome: proto.Welcome, store=None, job=None) -> None:
        """Build the job the coordinator names, from this machine's own code (its data from
        `store` when it declares its data by manifest), unless it is built already."""
        if self._built_for != job_key(welcome):
            job = job or load_welcomed(self.config.job, welcome)
            # The previous job is of no use now, and its memory is the next one's.
            self.built = self.engine = self._built_for = None
            self.built, self.engine = build_engine(job, welcome, self.config, self.device, store)
            self.engine.fetch = lambda work: self.data.fetch_for(self.engine, work)
            self._built_for = job_key(welcome)
        self._wire = ErrorFeedback(welcome.result_dtype)
        if self.built.fingerprint != welcome.fingerprint:
            # Another model under the job's name (another version of its code, or of idlegrad):
            # its gradients would be of no use, so say so and leave instead of joining.
            raise Refused(f"job fingerprint {self.built.fingerprint} here, {welcome.fingerprint} "
                          "at the coordinator: refused to compute for another version of the job")

    async def _serve(self, sock) -> None:
        next_sample = time.monotonic() + self.config.sample_every
        if self._samples:  # (shared probes are MultiWorker's, read by its own task)
            self.probes.restart()  # the first reading covers one sample, not the start-up
        recv = asyncio.ensure_future(sock.recv_multipart(copy=False))
        # the probes' reading under way; the process's one compute slot, when shared with other
        # projects, asked for then lent; MultiWorker's nudge when the shared guest changed
        sampling = granted = nudge = None
        if not self._samples:
            self._nudged = asyncio.Event()
            nudge = asyncio.ensure_future(self._nudged.wait())
        try:
            if self.compute_slot is not None:
                self.compute_slot.up(self.project)
            while True:
                await self._perform(sock, self.session.tick(time.monotonic()))
                if self._samples and sampling is None and time.monotonic() >= next_sample:
                    sampling = asyncio.ensure_future(asyncio.to_thread(self.probes.read))
                    next_sample = time.monotonic() + self.config.sample_every
                computing = self._computing.future if self._computing is not None else None
                waiting = {f for f in (recv, computing, sampling, granted, nudge) if f is not None}
                wake = min(self.session.wake_at(),
                           next_sample if self._samples and sampling is None else math.inf)
                await asyncio.wait(waiting, timeout=max(0.0, wake - time.monotonic()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if sampling is not None and sampling.done():
                    readings = sampling.result() if sampling.exception() is None else Readings()
                    sampling = None
                    if self.guest.apply(readings, time.monotonic()) is not None:
                        await self._perform(sock, self.session.pause(time.monotonic(), self.paused))
                if nudge is not None and nudge.done():
                    self._nudged.clear()
                    nudge = asyncio.ensure_future(self._nudged.wait())
                    await self._perform(sock, self.session.pause(time.monotonic(), self.paused))
                if recv.done():
                    frames = recv.result()
                    recv = asyncio.ensure_future(sock.recv_multipart(copy=False))
                    await self._dispatch(sock, frames)
                if computing is not None and computing.done():
                    slot, (outcome, compute_s) = self._computing.slot, self._finish()
                    if granted is not None:  # the next task may be another project's
                        self.compute_slot.leave(self.project, compute_s)
                        granted = None
                    await self._perform(sock, self.session.finished(time.monotonic(), slot, outcome))
                if self._computing is None and self.session.wants_compute():
                    if self.compute_slot is not None and granted is None:
                        granted = self.compute_slot.request(self.project)
                    if granted is not None and not granted.done():
                        continue  # another project's task runs first
                    await self._start(sock)
                if granted is not None and granted.done() and self._computing is None:
                    self.compute_slot.leave(self.project, 0.0)  # lent, but nothing to run now
                    granted = None
        except _Ended:
            return
        finally:
            recv.cancel()
            if nudge is not None:
                nudge.cancel()
                self._nudged = None
            if sampling is not None:
                await asyncio.wait({sampling})
            self._cancel(self.session.lost(time.monotonic()))
            compute_s = 0.0
            if self._computing is not None:  # kept for the next session, or computed again
                await asyncio.wait({self._computing.future})
                slot, (outcome, compute_s) = self._computing.slot, self._finish()
                await self._perform(sock, self.session.finished(time.monotonic(), slot, outcome))
            if granted is not None:
                self.compute_slot.leave(self.project, compute_s)
            if self.compute_slot is not None:  # asked for, or lent and not used: the others' now
                self.compute_slot.down(self.project)

    async def _start(self, sock) -> None:
        """The next slot that can run here; while the transfer cap is spent, what the cache
        lacks goes back first."""
        now = time.monotonic()
        if self.data.cache is not None:
            until = self.data.cache.capped_until(time.time())
            self.session.cap(now, None if until is None else now + until - time.time())
        await self._perform(sock, self.session.start(
            now, lambda work: self.data.has_data(self.engine, work)))

    def _finish(self) -> tuple[S.Outcome, float]:
        """What the computation that ended came to, for the session; its compute seconds."""
        c, self._computing = self._computing, None
        try:
            outcome: Outcome = c.future.result()
        except Cancelled:
            return S.NotComputed(), 0.0
        except TransferCapReached as exc:
            log.warning("slot %d: %s", c.slot, exc)
            left = self.data.cache.capped_until(time.time())
            return S.Capped(time.monotonic() + (left - time.time() if left else 60.0)), 0.0
        except (CacheTooSmall, DiskFull) as exc:  # no slot can be computed here until fixed
            return S.Fatal(str(exc)), 0.0
        except (CacheError, BlobError) as exc:  # no source has the blob now: the slot goes on
            if self._cache_logged.ready(time.monotonic()):
                log.warning("slot %d: %s", c.slot, exc)
            return S.NotComputed(), 0.0
        except Exception as exc:  # noqa: BLE001 - the job's own code failed on this slot
            log.exception("slot %d failed: %s", c.slot, exc)
            return S.NotComputed(), 0.0
        waited = max(0.0, c.began - c.work.arrived) if c.work.arrived is not None else 0.0
        o = dataclasses.replace(outcome, waited_s=waited)
        if o.sums is not None:
            return S.EvalAnswer(proto.EvalResult(
                slot=o.slot, version=o.version, compute_s=o.compute_s,
                sums={name[:proto.MAX_METRIC_NAME]: [_wire_sum(total), _wire_sum(n)]
                      for name, (total, n) in list(o.sums.items())[:proto.MAX_EVAL_METRICS]})), o.compute_s
        message = proto.Result(
            slot=o.slot, version=o.version, samples=o.samples, loss=o.loss, compute_s=o.compute_s,
            gradient=to_blob(self._wire.encode(o.gradient)), waited_s=o.waited_s,
            buffers=None if o.buffers is None else to_blob(o.buffers))
        return S.ResultReady(_Kept(message, o.gradient)), o.compute_s

    async def _dispatch(self, sock, frames) -> None:
        now = time.monotonic()
        self.session.heard(now)
        msg = self._decode(frames)
        if isinstance(msg, proto.Chunk):
            self.data.deliver(msg)
        elif isinstance(msg, proto.Task):
            await self._perform(sock, self._on_task(now, msg))
            self.data.prefetch(msg.prefetch)
        elif msg is not None:
            await self._perform(sock, self.session.received(now, msg))

    def _on_task(self, now: float, task: proto.Task) -> list:
        """The task's model decoded and its work built, for the session to decide on."""
        if task.snapshot is not None:  # the model by name: fetched when the slot is computed
            self.engine.store = self.data.ensure_cache()
            self._model = (task.version, None, None, SnapshotRef(task.snapshot, task.snapshot_bytes))
        elif task.model is not None:
            model = self.built.model
            try:
                params = blob_chunks(task.model, model.numel, model.dtype)
                buffers = None
                if model.buffers or task.buffers is not None:
                    if task.buffers is None:
                        raise ProtocolError("tensor", "no buffers with the model")
                    buffers = buffer_vector(task.buffers, model.buffer_numel, model.counter_mask)
            except ProtocolError as exc:
                return self.session.task(now, task.slot, None, refused=f"bad model: {exc}",
                                         acks=task.acks)
            self._model = (task.version, params, buffers, None)
        if self._model is None or self._model[0] != task.version:
            return self.session.task(now, task.slot, None, model_held=False, acks=task.acks)
        _, params, buffers, snapshot = self._model
        work = Work(task.slot, task.version, params, task.parts, task.coefficients, task.kind,
                    task.steps, arrived=now, buffers=buffers, snapshot=snapshot)
        try:
            self.engine.check(work)
            refused = None
        except ValueError as exc:
            refused = str(exc)
        return self.session.task(now, task.slot, work, refused=refused, acks=task.acks)
