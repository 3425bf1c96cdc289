"""The worker's I/O shell: one DEALER socket, one asyncio loop, compute in a thread.

Handshake: HELLO -> WELCOME (job name, arguments, fingerprint; never code) -> the worker builds
the job locally -> READY (credits, fingerprint). Then it computes the TASKs it is given, one at a
time, keeping `credits` slots outstanding so it never waits between tasks; heart-beats while it
computes; and reconnects with exponential backoff when the coordinator goes silent (the ZeroMQ
guide's Paranoid Pirate). SHUTDOWN or a signal ends it cleanly, handing unfinished slots back.

Being a good guest: while serving, the probes (`probes.py`) are read every `sample_every` seconds
in a thread and the idle policy (`idle.py`) decides. A pause clears the engine's gate (it stops at
the next micro-batch boundary, well within a second, and sleeps), and tells the coordinator at once:
HEARTBEAT "paused" and READY with 0 credits, so it gets no new slots; the coordinator withdraws the
slots it holds after its pause grace. While paused nothing computes and the loop only wakes for
heartbeats and samples. On resume the worker announces its credits again; tasks at a newer version
carry the model, so it computes on the current one. Every change of state is logged, and written
as a JSON line to `state_log` when one is configured.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import platform
import random
import signal
import socket as pysocket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import psutil
import torch
import zmq
import zmq.asyncio

from .. import __version__
from ..common import protocol as proto
from ..common.aio import on_stop_signals
from ..common.errors import ConfigError, PeerGone, ProtocolError, Refused
from ..common.job import BuiltJob, build, builtin_job_names, load_job
from ..common.tensors import from_blob, to_blob
from .engine import Cancelled, Engine, Outcome, Work
from .idle import Decision, IdlePolicy, PolicyConfig, Readings
from .compress import ErrorFeedback
from .link import ShapedSocket
from .probes import Probes

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
    link_mbps: Optional[float] = None  # link emulation (link.py): Mbit/s each way; None: off


class _Rehello(Exception):
    """The coordinator does not know this session: hand-shake again on the same socket."""


def pick_device(wanted: str) -> torch.device:
    if wanted == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(wanted)
    except RuntimeError:
        raise ConfigError(f"device {wanted!r} unknown: use auto, cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {wanted!r} asked for, but torch sees no CUDA device here")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {wanted!r} is not supported: use cpu or cuda[:N]")
    return device


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class Worker:
    def __init__(self, config: WorkerConfig):
        if config.credits < 1:
            raise ConfigError("credits must be at least 1")
        self.config = config
        self.device = pick_device(config.device)
        self.threads = config.threads or usable_cores()
        if self.threads < 1:
            raise ConfigError("threads must be at least 1")
        torch.set_num_threads(self.threads)
        self.worker_id = config.worker_id or f"{pysocket.gethostname()}-{os.getpid()}"
        self.built: Optional[BuiltJob] = None
        self._built_for: Optional[tuple] = None
        self.engine: Optional[Engine] = None
        self.heartbeat_s = 1.0
        self.liveness = 3
        self._queue: deque[Work] = deque()
        self._cache: Optional[tuple[int, torch.Tensor]] = None  # (version, model)
        self._current: Optional[tuple[Work, threading.Event]] = None
        self._stop: Optional[str] = None
        self.results_sent = 0
        self._wire = ErrorFeedback()  # results as the coordinator wants them (welcome)
        uses_gpu = self.device.type == "cuda"
        self.policy = IdlePolicy(dataclasses.replace(config.policy, uses_gpu=uses_gpu))
        self.probes = Probes(ignore_niced=config.cpu_ignore_niced,
                             gpu_index=(self.device.index or 0) if uses_gpu else None)
        self._running = threading.Event()  # the engine's gate: set while computing is allowed
        self._running.set()
        self.pauses = 0
        self._state_log = open(config.state_log, "a", buffering=1) if config.state_log else None
        self._log_state("start", Decision(True, (), False), None)

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def _credits(self) -> int:
        return 0 if self.paused else self.config.credits

    # lifecycle ------------------------------------------------------------------------------

    def run(self) -> str:
        return asyncio.run(self._main())

    async def _main(self) -> str:
        on_stop_signals(self._on_signal)
        log.info("idle policy: %s", self.probes.describe())
        ctx = zmq.asyncio.Context()
        try:
            backoff = 0.25
            give_up_at = self._deadline()
            while self._stop is None:
                sock = self._socket(ctx)
                try:
                    welcome = await self._handshake(sock, timeout=backoff)
                    if welcome is None:
                        if time.monotonic() > give_up_at:
                            raise PeerGone(
                                f"cannot reach the coordinator at {self.config.coordinator} within "
                                f"{self.config.connect_timeout:g}s (is it running? see --connect-timeout)")
                        backoff = min(self.config.max_backoff, backoff * 2) * random.uniform(0.8, 1.2)
                        continue
                    backoff = 0.25
                    await self._session(sock, welcome)
                    give_up_at = self._deadline()
                    if self._stop is None:
                        log.warning("lost the coordinator at %s; reconnecting", self.config.coordinator)
                finally:
                    sock.close(linger=0 if self._stop is None else 1000)
        finally:
            ctx.term()
            if self._state_log is not None:
                self._state_log.close()
        return self._stop or "stopped"

    def _deadline(self) -> float:
        t = self.config.connect_timeout
        return time.monotonic() + t if t > 0 else float("inf")

    def _on_signal(self, sig) -> None:
        if self._stop is None:
            self._stop = "interrupted"
            log.info("%s received; returning unfinished slots and leaving", signal.Signals(sig).name)
            self._abort_work()

    def _socket(self, ctx) -> zmq.asyncio.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, proto.SOCKET_MAX_MSG_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.config.coordinator)
        if self.config.link_mbps:
            return ShapedSocket(sock, self.config.link_mbps)
        return sock

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

    async def _recv(self, sock, timeout: float) -> Optional[proto.Message]:
        if not await sock.poll(timeout * 1000, zmq.POLLIN):
            return None
        frames = await sock.recv_multipart(copy=False)
        try:
            return proto.decode(frames)
        except ProtocolError as exc:
            log.warning("dropped a bad message from the coordinator: %s", exc)
            return None

    async def _handshake(self, sock, timeout: float) -> Optional[proto.Welcome]:
        await self._send(sock, self._hello())
        end = time.monotonic() + timeout
        while self._stop is None and (left := end - time.monotonic()) > 0:
            msg = await self._recv(sock, min(left, 0.2))
            if isinstance(msg, proto.Welcome):
                return msg
            if isinstance(msg, proto.Reject) and msg.code != "hello_first":  # we just said it
                self._on_reject(msg)
            elif isinstance(msg, proto.Shutdown):
                self._stop = f"coordinator said: {msg.reason}"
        return None

    def _on_reject(self, msg: proto.Reject) -> None:
        if msg.code == "hello_first":
            raise _Rehello()
        raise Refused(f"the coordinator refused this worker ({msg.code}): {msg.reason}")

    # a session ------------------------------------------------------------------------------

    def _prepare(self, welcome: proto.Welcome) -> None:
        """Build the job the coordinator names, from this machine's own code."""
        key = (welcome.job, tuple(sorted(welcome.job_args.items())), welcome.seed)
        if self._built_for != key:
            spec = self.config.job or welcome.job
            if self.config.job is None and welcome.job not in builtin_job_names():
                raise Refused(f"the coordinator trains job {welcome.job!r}, which is not built in; "
                            "start this worker with --job SPEC naming that job's code on this machine")
            job = load_job(spec, welcome.job_args)
            self.built = build(job, device=self.device)
            self.engine = Engine(self.built, welcome.seed, self.device)
            self.engine.slowdown, self.engine.stall = self.config.slowdown, self.config.stall
            self._built_for = key
        self.heartbeat_s = welcome.heartbeat_s
        self.liveness = welcome.liveness
        self._wire = ErrorFeedback(welcome.result_dtype)
        if self.built.fingerprint != welcome.fingerprint:
            log.error("job fingerprint %s differs from the coordinator's %s",
                      self.built.fingerprint, welcome.fingerprint)

    async def _session(self, sock, welcome: proto.Welcome) -> None:
        while True:
            try:
                try:
                    self._prepare(welcome)
                except (Refused, ConfigError) as exc:  # this worker cannot run that job
                    await self._send(sock, proto.Bye(reason=str(exc)[:500]))
                    raise
                if self.paused:
                    await self._send(sock, proto.Heartbeat(state="paused"))
                await self._send(sock, proto.Ready(credits=self._credits(),
                                                   fingerprint=self.built.fingerprint))
                log.info("joined %s: job %s, %d credits, %s with %d threads%s",
                         self.config.coordinator, welcome.job, self.config.credits, self.device,
                         self.threads, " (paused)" if self.paused else "")
                await self._serve(sock)
                return
            except _Rehello:
                log.info("the coordinator does not know this session (restarted?); saying hello again")
                self._abort_work()
                welcome = await self._handshake(sock, timeout=self.heartbeat_s * self.liveness)
                if welcome is None:
                    return

    def _abort_work(self) -> None:
        self._queue.clear()
        self._cache = None
        if self._current is not None:
            self._current[1].set()

    async def _serve(self, sock) -> None:
        last_heard = time.monotonic()
        next_beat = time.monotonic()
        next_sample = time.monotonic() + self.config.sample_every
        self.probes.restart()  # the first reading covers one sample, not the start-up
        recv = asyncio.ensure_future(sock.recv_multipart(copy=False))
        computing: Optional[asyncio.Future] = None
        sampling: Optional[asyncio.Future] = None
        try:
            while True:
                if self._stop is not None:
                    await self._send(sock, proto.Bye(reason=self._stop))
                    return
                now = time.monotonic()
                if now >= next_beat:
                    await self._send(sock, proto.Heartbeat(state=self._beat_state(computing)))
                    next_beat = now + self.heartbeat_s
                if now - last_heard > self.heartbeat_s * self.liveness:
                    return  # the coordinator is gone: the caller reconnects
                if sampling is None and now >= next_sample:
                    sampling = asyncio.ensure_future(asyncio.to_thread(self.probes.read))
                    next_sample = now + self.config.sample_every
                waiting = {recv}
                waiting |= {f for f in (computing, sampling) if f is not None}
                wake = next_beat if sampling is not None else min(next_beat, next_sample)
                await asyncio.wait(waiting, timeout=max(0.0, wake - time.monotonic()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if sampling is not None and sampling.done():
                    readings = sampling.result() if sampling.exception() is None else Readings()
                    sampling = None
                    await self._apply_policy(sock, readings, computing)
                if recv.done():
                    frames = recv.result()
                    recv = asyncio.ensure_future(sock.recv_multipart(copy=False))
                    last_heard = time.monotonic()
                    self._dispatch(frames)
                if computing is not None and computing.done():
                    outcome = self._finish(computing)
                    computing = None
                    if outcome is not None:
                        await self._send(sock, proto.Result(
                            slot=outcome.slot, version=outcome.version, samples=outcome.samples,
                            loss=outcome.loss, compute_s=outcome.compute_s,
                            gradient=to_blob(self._wire.encode(outcome.gradient))))
                        self.results_sent += 1
                if computing is None and self._queue and self._stop is None and not self.paused:
                    work = self._queue.popleft()
                    cancel = threading.Event()
                    self._current = (work, cancel)
                    computing = asyncio.ensure_future(
                        asyncio.to_thread(self.engine.compute, work, cancel, self._running))
        finally:
            recv.cancel()
            if sampling is not None:
                await asyncio.wait({sampling})
            if computing is not None:
                if self._current is not None:
                    self._current[1].set()
                await asyncio.wait({computing})
                self._finish(computing)

    def _beat_state(self, computing) -> str:
        if self.paused:
            return "paused"
        return "working" if computing is not None else "idle"

    async def _apply_policy(self, sock, readings: Readings, computing) -> None:
        decision = self.policy.decide(readings, time.monotonic())
        if not decision.changed:
            return
        if decision.run:
            self._running.set()
            log.info("resuming: the machine has been idle for %gs", self.policy.config.resume_after)
        else:
            self._running.clear()  # the engine stops at its next micro-batch boundary
            self.pauses += 1
            log.info("pausing: %s", "; ".join(decision.reasons))
        self._log_state("running" if decision.run else "paused", decision, readings)
        await self._send(sock, proto.Heartbeat(state=self._beat_state(computing)))
        await self._send(sock, proto.Ready(credits=self._credits(),
                                           fingerprint=self.built.fingerprint))

    def _log_state(self, state: str, decision: Decision, readings: Optional[Readings]) -> None:
        if self._state_log is None:
            return
        record = {"time": time.time(), "monotonic": time.monotonic(), "state": state,
                  "reasons": list(decision.reasons), "unknown": list(decision.unknown),
                  "readings": dataclasses.asdict(readings) if readings is not None else None,
                  "pid": os.getpid()}
        try:
            self._state_log.write(json.dumps(record) + "\n")
        except OSError as exc:
            log.warning("cannot write the state log: %s", exc)

    def _finish(self, computing: asyncio.Future) -> Optional[Outcome]:
        work, cancel = self._current
        self._current = None
        try:
            return computing.result()
        except Cancelled:
            return None
        except Exception as exc:  # the job's own code failed on this slot
            log.exception("slot %d failed: %s", work.slot, exc)
            return None

    def _dispatch(self, frames) -> None:
        try:
            msg = proto.decode(frames)
        except ProtocolError as exc:
            log.warning("dropped a bad message from the coordinator: %s", exc)
            return
        if isinstance(msg, proto.Task):
            self._on_task(msg)
        elif isinstance(msg, proto.Cancel):
            cancelled = set(msg.slots)
            self._queue = deque(w for w in self._queue if w.slot not in cancelled)
            if self._current is not None and self._current[0].slot in cancelled:
                self._current[1].set()
        elif isinstance(msg, proto.Shutdown):
            log.info("the coordinator says: %s", msg.reason)
            self._stop = f"shutdown: {msg.reason}"
            self._abort_work()
        elif isinstance(msg, proto.Reject):
            self._on_reject(msg)
        # Heartbeats need nothing beyond having been heard.

    def _on_task(self, task: proto.Task) -> None:
        if task.model is not None:
            try:
                params = from_blob(task.model, self.built.model.numel, self.built.model.dtype)
            except ProtocolError as exc:
                log.warning("task %d: bad model: %s", task.slot, exc)
                return
            self._cache = (task.version, params)
        elif self._cache is None or self._cache[0] != task.version:
            # The coordinator thinks we hold a model we do not: start the session afresh.
            raise _Rehello()
        work = Work(task.slot, task.version, self._cache[1], task.parts, task.coefficients,
                    task.kind, task.steps)
        try:
            self.engine.check(work)
        except ValueError as exc:
            log.warning("task %d refused: %s", task.slot, exc)
            return
        self._queue.append(work)
