"""The worker's I/O shell: one DEALER socket, one asyncio loop, compute in a thread.

Every protocol decision is the session's (`session.py`, sans-IO): this loop feeds it what happened
(messages, computations ended, the guest's pauses, the time) and performs the effects it returns:
HELLO -> WELCOME -> the job built here (`building.py`) -> READY; TASKs computed one at a time with
`credits` slots outstanding; heartbeats; reconnects with backoff when the coordinator goes silent
(the ZeroMQ guide's Paranoid Pirate); SHUTDOWN or a signal ends it, handing unfinished slots back.
The guest (`guest.py`) pauses the engine's gate; blobs come through the data plane
(`dataplane.py`), in the compute thread under that gate, before the job's code runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import random
import signal
import socket as pysocket
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch
import zmq
import zmq.asyncio

from ..common import protocol as proto
from ..common.aio import on_stop_signals
from ..common.blobs import BlobError
from ..common.errors import ConfigError, PeerGone, ProtocolError, Refused
from ..common.security import KEYS_HINT, ClientKeys
from . import allocator
from . import session as S
from .building import (build_engine, check_same_job, held_model, hello_of, job_key, load_welcomed,
                       pick_device, refusal_message, session_outcome, task_work)
from .cache import CacheError, CacheTooSmall
from .compress import ErrorFeedback
from .config import usable_cores
from .dataplane import DataPlane
from .engine import Cancelled, Outcome, Work
from .guest import Guest, SharedCompute, watch
from .idle import PolicyConfig, describe_policy
from .link import ShapedSocket
from .waiting import Waiting

log = logging.getLogger("idlegrad.worker")


@dataclass
class WorkerConfig:
    coordinator: str = "tcp://127.0.0.1:5555"
    job: Optional[str] = None  # None: only the built-in jobs, chosen by the coordinator's name
    threads: Optional[int] = None
    device: str = "auto"
    credits: int = 2
    connect_timeout: float = 0.0  # 0: keep trying forever (saying so every so often)
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


class Worker:
    def __init__(self, config: WorkerConfig, guest: Optional[Guest] = None,
                 compute_slot: Optional[SharedCompute] = None, project: Optional[str] = None):
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
        allocator.keep_freed_memory()  # process-wide, as the threads are
        self.worker_id = config.worker_id or f"{pysocket.gethostname()}-{os.getpid()}"
        self.built = self.engine = self._built_for = None
        # the model of the last task that carried one: (version, its frames' views, buffers,
        # or the snapshot that names it instead)
        self._model: Optional[tuple] = None
        self._computing: Optional[_Computing] = None
        self._wire = ErrorFeedback()  # results as the coordinator wants them (welcome)
        if guest is None:
            uses_gpu = self.device.type == "cuda"
            guest = Guest(config, uses_gpu, (self.device.index or 0) if uses_gpu else None)
        self.guest, self._running = guest, guest.running
        self.project = project or config.coordinator
        self.compute_slot = compute_slot
        self._nudged = asyncio.Event()  # the guest paused or resumed
        self.data = DataPlane(config, self._running)
        self.session = S.Session(config.credits,
                                 hello_of(self.worker_id, self.threads, self.device, config.job),
                                 held_shards=self.data.held_shards, cache_counters=self.data.counters)

    pauses = property(lambda self: self.guest.pauses)
    paused = property(lambda self: not self._running.is_set())
    results_sent = property(lambda self: self.session.results_sent)
    results_resent = property(lambda self: self.session.results_resent)
    _stop = property(lambda self: self.session.stopped)

    def nudge(self) -> None:
        """The guest paused or resumed: tell this session's coordinator."""
        self._nudged.set()

    # lifecycle ------------------------------------------------------------------------------

    def run(self) -> str:
        return asyncio.run(self._main())

    async def _main(self) -> str:
        on_stop_signals(self._on_signal)
        log.info("idle policy: %s (readings: %s)", describe_policy(self.guest.policy.config),
                 self.guest.probes.describe())
        ctx = zmq.asyncio.Context()
        watching = asyncio.ensure_future(watch(self.guest, self.config.sample_every, self.nudge))
        try:
            await self.connect_loop(ctx)
        finally:
            watching.cancel()
            ctx.term()
            self.guest.close()
        return self._stop or "stopped"

    async def connect_loop(self, ctx) -> None:
        """Connect, serve, reconnect with backoff, until stopped (or the coordinator cannot be
        reached within connect_timeout: PeerGone)."""
        backoff = 0.25
        waiting = Waiting(self.config.coordinator, self.config.keys is not None, time.monotonic())
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
                    if (line := waiting.report(time.monotonic())) is not None:
                        log.warning("%s", line)
                    backoff = min(self.config.max_backoff, backoff * 2) * random.uniform(0.8, 1.2)
                    continue
                backoff = 0.25
                await self._session(sock, welcome)
                give_up_at = time.monotonic() + timeout if timeout > 0 else math.inf
                waiting = Waiting(self.config.coordinator, self.config.keys is not None,
                                  time.monotonic())
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
            elif isinstance(effect, (S.Leave, S.Reconnect)):
                if getattr(effect, "refused", False):
                    raise Refused(effect.reason)
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
        self.data.attach(asyncio.get_running_loop(), lambda msg: self._send(sock, msg))
        try:
            while welcome is not None:
                try:
                    await self._join(sock, welcome)
                    await self._serve(sock)
                    return
                except _Rehello:
                    log.info("the coordinator does not know this session: hello again")
                    welcome = await self._handshake(
                        sock, timeout=self.session.heartbeat_s * self.session.liveness)
        finally:
            self.data.detach()
            self.session.lost(time.monotonic())

    async def _join(self, sock, welcome: proto.Welcome) -> None:
        """Build the welcome's job (loaded once; its manifest fetched once), then resume."""
        self.data.welcomed(welcome.blob_mirrors)
        try:
            fresh = self._built_for != job_key(welcome) or self.built is None
            job = load_welcomed(self.config.job, welcome) if fresh else self.built.job
            if job.data is not None and (fresh or self.data.manifest is None):
                await self._while_fetching(sock, asyncio.to_thread(self.data.fetch_manifest, job))
            self._prepare(welcome, self.data.cache if job.data is not None else None, job)
        except (Refused, ConfigError) as exc:  # this worker cannot run that job
            message, answered = refusal_message(exc, self.built, welcome)
            await self._send(sock, message)
            if answered:  # its answer (the Reject that names the differences) shows it arrived
                try:
                    await asyncio.wait_for(sock.recv_multipart(copy=False), 2.0)
                except asyncio.TimeoutError:
                    pass
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
        check_same_job(self.built, welcome)

    async def _serve(self, sock) -> None:
        recv = asyncio.ensure_future(sock.recv_multipart(copy=False))
        nudge = asyncio.ensure_future(self._nudged.wait())  # the guest paused or resumed
        granted = None  # the process's one compute slot, shared with other projects: asked, lent
        try:
            if self.compute_slot is not None:
                self.compute_slot.up(self.project)
            while True:
                await self._perform(sock, self.session.tick(time.monotonic()))
                computing = self._computing.future if self._computing is not None else None
                waiting = {f for f in (recv, computing, granted, nudge) if f is not None}
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED,
                                   timeout=max(0.0, self.session.wake_at() - time.monotonic()))
                if nudge.done():
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
                    now = time.monotonic()  # (what the cache lacks goes back while capped)
                    self.session.cap(now, self.data.capped_until(now))
                    await self._perform(sock, self.session.start(
                        now, lambda work: self.data.has_data(self.engine, work)))
                if granted is not None and granted.done() and self._computing is None:
                    self.compute_slot.leave(self.project, 0.0)  # lent, but nothing to run now
                    granted = None
        except _Ended:
            return
        finally:
            recv.cancel()
            nudge.cancel()
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

    def _finish(self) -> tuple[S.Outcome, float]:
        """What the computation that ended came to, for the session; its compute seconds."""
        c, self._computing = self._computing, None
        try:
            outcome: Outcome = c.future.result()
        except Cancelled:
            return S.NotComputed(), 0.0
        except (CacheError, CacheTooSmall, BlobError) as exc:  # the data plane: cap, sources, disk
            return self.data.failed(c.slot, exc, time.monotonic()), 0.0
        except Exception as exc:  # noqa: BLE001 - the job's own code failed on this slot
            log.exception("slot %d failed: %s", c.slot, exc)
            return S.NotComputed(error=f"{type(exc).__name__}: {exc}"), 0.0
        return session_outcome(outcome, c.work, c.began, self._wire)

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
        try:
            self._model = held_model(task, self._model, self.built.model)
        except ProtocolError as exc:
            return self.session.task(now, task.slot, None, refused=f"bad model: {exc}",
                                     acks=task.acks)
        work = task_work(task, self._model, now)
        if work is None:  # it names a version whose model we do not hold
            return self.session.task(now, task.slot, None, model_held=False, acks=task.acks)
        try:
            self.engine.check(work)
            refused = None
        except ValueError as exc:
            refused = str(exc)
        return self.session.task(now, task.slot, work, refused=refused, acks=task.acks)
