"""The coordinator's I/O shell: one ROUTER socket, one asyncio loop.

It decodes messages, hands them to the scheduler (pure), performs the actions the scheduler
returns, applies decoded rounds through the aggregator, and around that evaluates, checkpoints and
logs metrics. Every inbound message is untrusted: a bad one is counted, logged with its sender and
dropped, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import os
import signal
import socket as pysocket
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import zmq
import zmq.asyncio

from .. import __version__
from ..common import coding
from ..common import protocol as proto
from ..common import security
from ..common.aio import on_reload_signal, on_stop_signals
from ..common.errors import (CheckpointError, ConfigError, GradientRejected, JobError,
                             ProtocolError)
from ..common.job import (BuiltJob, FlatModel, build, coded_gradient, evaluate, load_job,
                          local_change, reference_gradient_norm)
from ..common.tensors import (TORCH_DTYPES, BufferPool, blob_chunks, distance, finite_norm,
                              to_blob)
from ..common.throttle import Throttle
from . import checkpoint
from . import local, outer
from .aggregator import Aggregator, StalenessRule
from .ledger import LedgerWriter
from .outer import OuterConfig
from .sampler import Sampler
from .scheduler import (Assign, CancelSlots, CompareCopies, Decoded, Drained, Evicted, Scheduler,
                        SchedulerConfig)
from .status import CURVE_POINTS, build_snapshot
from .target import Target
from .trust import TrustConfig, TrustPolicy, check_verify_replicas, matches

log = logging.getLogger("idlegrad.coordinator")


_send_frame = zmq.backend.Socket.send  # (socket, data, flags, copy, track): one frame, no checks
_recv_frame = zmq.backend.Socket.recv  # (socket, flags, copy): one frame, no checks
_MORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)


def _recv_waiting(sock) -> list:
    """The next whole message already queued on `sock` (zmq.Again if none), frame by frame:
    pyzmq's recv_multipart asks the socket for RCVMORE through its option machinery, more than
    half the cost of a small message. The parts of a message arrive together, so only the first
    receive can find nothing."""
    frame = _recv_frame(sock, _NOBLOCK, False)
    frames = [frame]
    while frame.more:
        frame = _recv_frame(sock, _NOBLOCK, False)
        frames.append(frame)
    return frames


def tune_gc() -> None:
    """A long-running coordinator's collector: what start-up built (torch, the job, the model)
    is frozen out of collections, and full passes over the fleet's records come less often.
    Python's default (a young collection every 700 allocations, whose older passes walk every
    live object) costs the scheduler about a third of its time per slot at 10,000 workers; the
    coordinator's records hold few reference cycles."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 10, 10)


@dataclass
class CoordinatorConfig:
    job: str
    job_args: dict[str, Any] = field(default_factory=dict)
    bind: str = "tcp://127.0.0.1:5555"
    checkpoint_dir: Optional[str] = None
    checkpoint_every: float = 60.0
    metrics_path: Optional[str] = None
    epochs: Optional[int] = None
    target: Optional[Target] = None
    seed: int = 0
    heartbeat_s: float = 1.0
    liveness: int = 3
    partitions: int = 1
    open_rounds: int = 0
    staleness: StalenessRule = field(default_factory=StalenessRule)
    eval_every: Optional[float] = None  # None: adaptive, at most ~10% of the time
    min_deadline_s: float = 30.0
    threads: Optional[int] = None
    pause_grace_s: float = 5.0  # a worker paused by its owner keeps its slots this long
    redundancy: str = "none"  # none | replicate:R | cyclic:S | adaptive (coding.parse_redundancy)
    sync: bool = False  # synchronous SGD: one round, code none, a partition per ready worker
    max_batch: Optional[int] = None  # cap on a round's batch
    speculate: bool = True  # duplicate late slots to free workers (never with sync)
    secret_key: Optional[str] = None  # CURVE: this coordinator's NAME.key_secret file
    allow_keys: Optional[str] = None  # CURVE: directory of the workers' and monitors' NAME.key files
    insecure: bool = False  # without keys, listen beyond loopback anyway
    trust: TrustConfig = field(default_factory=TrustConfig)  # outlier gradients, offences, bans
    ledger_path: Optional[str] = None  # JSON lines: slots sent, results acknowledged, rounds applied
    task: str = "gradient"  # gradient | local:H | local:auto (local.parse_task)
    outer: OuterConfig = field(default_factory=OuterConfig)  # local tasks' outer optimizer
    local_slot_s: float = 5.0  # local:auto: the least compute seconds of a slot
    local_max_steps: int = 500  # local:auto: at most this many inner steps per slot
    local_link_factor: float = local.TaskMode.link_factor  # local:auto: compute / link seconds
    result_dtype: str = "float32"  # results on the wire: float32 or bfloat16 (workers round)
    verify_replicas: bool = False  # a replicated row counts once two copies of it agree


class Coordinator:
    HANDSHAKE_S = 5.0  # a connection that has not finished its handshake by then is dropped
    EVENTS_KEPT = 1000
    EVENTS_PER_STATUS = 200
    DISPUTES_QUEUED = 8

    def __init__(self, config: CoordinatorConfig):
        self.config = config
        self.keypair, self.allowed_keys = self._check_security(config)
        self._check_paths(config)
        low, high = proto.HEARTBEAT_S_RANGE
        if not low <= config.heartbeat_s <= high:
            raise ConfigError(f"--heartbeat must be from {low:g} to {high:g} seconds (workers "
                              f"refuse a welcome outside that), not {config.heartbeat_s:g}")
        if config.threads:
            torch.set_num_threads(config.threads)
        try:
            job = load_job(config.job, config.job_args)
        except JobError as exc:
            raise _naming_job_args(exc, config.job_args) from None
        self.task_mode = local.parse_task(config.task, config.local_slot_s,
                                          max_steps=config.local_max_steps,
                                          link_factor=config.local_link_factor)
        redundancy = coding.parse_redundancy(config.redundancy)
        local.check_redundancy(self.task_mode, redundancy, config.sync)
        if config.verify_replicas:
            check_verify_replicas(redundancy, config.sync, config.result_dtype)
        try:
            self.built: BuiltJob = build(job, seed=config.seed)
        except JobError as exc:
            raise _naming_job_args(exc, config.job_args) from None
        if config.target is not None:
            self._check_target(config.target)
        self.model: FlatModel = self.built.model
        if self.task_mode.local:  # the job's optimizer runs on the workers, the outer one here
            self.optimizer = outer.build(self.model.module.parameters(), config.outer)
        else:
            self.optimizer = job.build_optimizer(self.model.module.parameters())
        self._eval_model = FlatModel(job.build_model())
        self.sampler = Sampler(len(self.built.train), config.epochs)
        self.samples_applied = 0
        self.elapsed_before = 0.0  # training time of earlier runs resumed from a checkpoint
        version, next_id = 0, 1
        resumed = self._resume() if config.checkpoint_dir else None
        if resumed:
            version, next_id = resumed
        self.aggregator = Aggregator(self.model, self.optimizer, config.staleness, version)
        self.scheduler = Scheduler(
            SchedulerConfig(batch_size=job.batch_size, partitions=config.partitions,
                            open_rounds=config.open_rounds, heartbeat_s=config.heartbeat_s,
                            liveness=config.liveness, min_deadline_s=config.min_deadline_s,
                            pause_grace_s=config.pause_grace_s,
                            redundancy=redundancy,
                            sync=config.sync, max_batch=config.max_batch,
                            speculate=config.speculate and not config.sync,
                            verify_replicas=config.verify_replicas),
            self.sampler, version=version, next_id=next_id)
        self._result_dtype = (self.model.dtype if config.result_dtype == "float32"
                              else TORCH_DTYPES[config.result_dtype])
        if self.task_mode.local:
            self.scheduler.slot_samples = lambda s_per_sample, link_s: (
                self.task_mode.slot_samples(s_per_sample, job.batch_size, link_s))

        self._eval_model.load(self.model.params)
        try:
            reference = reference_gradient_norm(job, self._eval_model, self.built.train, config.seed)
        except Exception as exc:  # the job's own code: one line, not a traceback
            raise JobError(f"job {job.name!r}: its loss failed on the first training samples: "
                           f"{type(exc).__name__}: {exc}"[:500]) from None
        self.trust = TrustPolicy(config.trust, reference=reference)
        self.identity_names: dict[str, str] = {}  # trust identity -> the worker id it last used
        self._check_model: Optional[FlatModel] = None  # scratch model for third computations
        # The coordinator's own computation of a slot, settling a suspected result or two
        # copies that disagree (one at a time), and what to do with it once done.
        self._verifying: Optional[asyncio.Future] = None
        self._then = None  # async (future) -> None
        # Disagreements waiting for the settle in progress: a received batch is handled before
        # the loop sees a settle finish, so most disagreements meet a busy one. Bounded, so that
        # hostile workers cannot make the coordinator compute more than one slot at a time.
        self._disputes: deque[CompareCopies] = deque()
        self.routes: dict[str, bytes] = {}  # worker id -> routing id
        self.key_of: dict[str, bytes] = {}  # worker id -> the CURVE public key that holds it
        self.peers: dict[bytes, str] = {}  # routing id -> worker id
        # arrived slot gradients of open rounds, as views of the frames they came in
        # (and their norms, measured on arrival: they bound the round's sum; and their senders'
        # worker ids and trust identities, which a disagreement between copies needs)
        self._grads: dict[int, tuple[list[torch.Tensor], float, tuple[str, str]]] = {}
        self._acks_due: dict[str, int] = {}  # worker id -> the slot of the result being taken
        # version -> (model, its blob, trackers of the zero-copy sends of it)
        self._snapshots: dict[int, tuple[torch.Tensor, proto.Blob, list]] = {}
        self._snapshot_buffers = BufferPool(self.model.numel, self.model.dtype)
        # below ZeroMQ's copy threshold a model is copied at send: cheaper than tracking it
        self._copy_numel = zmq.COPY_THRESHOLD // self.model.params.element_size()
        self.bad_messages: Counter[str] = Counter()
        self.counters: Counter[str] = Counter()
        self.events: deque[dict] = deque(maxlen=self.EVENTS_KEPT)
        self._event_id = 0
        self.metrics: dict[str, float] = {}
        self.curve: deque[dict] = deque(maxlen=CURVE_POINTS)  # recent evaluations, for monitors
        self.instance = f"{pysocket.gethostname()}-{os.getpid()}-{time.time():.3f}"
        self.train_loss: Optional[float] = None
        self._rate: deque[tuple[float, int]] = deque(maxlen=512)
        self._bad_logged = Throttle()  # bad messages, however hostile the peer
        self._refused_logged = Throttle()  # handshakes from keys not allowed
        self.stop_reason: Optional[str] = None
        self.started = time.monotonic()
        self._metrics_file = None
        self.ledger: Optional[LedgerWriter] = None

    # setup ----------------------------------------------------------------------------------

    def _check_target(self, target: Target) -> None:
        """A target on a metric the job does not report is one line now, not an error after the
        first evaluation. The names come from evaluating a few test samples."""
        few = torch.utils.data.Subset(self.built.test, range(min(8, len(self.built.test))))
        try:
            names = evaluate(self.built.job, self.built.model.module, few).keys()
        except Exception:  # noqa: BLE001 - the job's own code: the first real evaluation will say
            return
        if target.metric not in names:
            raise ConfigError(f"--target {target}: the job reports no metric {target.metric!r}; "
                              f"its metrics are {', '.join(sorted(names))}")

    @staticmethod
    def _check_paths(config: CoordinatorConfig) -> None:
        """Where the coordinator writes, made ready before anything starts: a path it cannot
        write is one line now, not a traceback after binding (or checkpoints that never save)."""
        flag, path = "", ""
        try:
            if config.checkpoint_dir:
                flag, path = "--checkpoint-dir", config.checkpoint_dir
                os.makedirs(path, exist_ok=True)
                if not os.access(path, os.W_OK | os.X_OK):
                    raise PermissionError(13, "Permission denied")
            for flag, path in (("--metrics", config.metrics_path), ("--ledger", config.ledger_path)):
                if path:
                    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                    open(path, "a").close()
        except OSError as exc:
            raise ConfigError(f"{flag} {path}: cannot write there: {exc.strerror or exc}") from None

    @staticmethod
    def _check_security(config: CoordinatorConfig) -> tuple[Optional[tuple[bytes, bytes]],
                                                              frozenset[bytes]]:
        """The CURVE key pair and allow-list, or (None, empty) for a plain loopback coordinator."""
        security.check_address(config.bind, "--bind", bind=True)
        if (config.secret_key is None) != (config.allow_keys is None):
            raise ConfigError("--secret-key and --allow-keys go together: give both or neither")
        if config.secret_key is not None:
            return security.load_keypair(config.secret_key), security.load_allowed(config.allow_keys)
        if not security.is_loopback(config.bind):
            if not config.insecure:
                raise ConfigError(
                    f"refusing to listen on {config.bind} without keys: anyone who reaches it could "
                    "train your model; give --secret-key and --allow-keys (see `idlegrad keys "
                    "generate`), bind to 127.0.0.1, or say --insecure")
            log.warning("listening on %s WITHOUT encryption or authentication (--insecure): "
                        "anyone who can reach it may join and send gradients", config.bind)
        return None, frozenset()

    @property
    def secure(self) -> bool:
        return self.keypair is not None

    async def reload_keys(self) -> None:
        """Re-read --allow-keys (SIGHUP): new keys may connect; a removed key's connections
        are cut off from the next message on, and its worker is evicted."""
        if not self.secure:
            self._event("keys", "SIGHUP ignored: this coordinator runs without keys")
            return
        try:
            allowed = security.load_allowed(self.config.allow_keys)
        except ConfigError as exc:
            # Fail closed: an unreadable list admits nobody until it is fixed and re-read.
            allowed = frozenset()
            self._event("keys", f"{exc}; admitting nobody", level=logging.ERROR)
        revoked = self.allowed_keys - allowed
        self.allowed_keys = allowed
        self._event("keys", f"--allow-keys re-read: {len(allowed)} keys, {len(revoked)} revoked")
        for worker_id, key in list(self.key_of.items()):
            if key not in allowed:
                self.counters["workers_revoked"] += 1
                self._event("revoked", f"{worker_id}: key {_short(key)} revoked",
                            worker=worker_id, level=logging.WARNING)
                await self._forget(worker_id, "key revoked")

    async def _forget(self, worker_id: str, reason: str) -> None:
        """Evict a worker now (revoked, banned): its slots go back to the pool, and nothing
        more from its connection is used."""
        if worker_id in self.scheduler.workers:
            await self._perform(self.scheduler.leave(worker_id, time.monotonic(), reason))
        route = self.routes.pop(worker_id, None)
        if route is not None:
            self.peers.pop(route, None)
        self.key_of.pop(worker_id, None)

    def _resume(self) -> Optional[tuple[int, int]]:
        state = checkpoint.load(self.config.checkpoint_dir)
        if state is None:
            return None
        if state["fingerprint"] != self.built.fingerprint:
            raise CheckpointError(
                f"the checkpoint in {self.config.checkpoint_dir} is for job {state['job']!r} "
                f"(fingerprint {state['fingerprint']}), not this one ({self.built.fingerprint})")
        self.model.load(state["params"])
        kind = state.get("task_kind", "gradient")
        if kind == self.task_mode.kind:
            self.optimizer.load_state_dict(state["optimizer"])
        else:  # the job's optimizer and the outer one share no state
            log.warning("the checkpoint was trained with %s tasks: its optimizer state is not "
                        "carried over to %s tasks", kind, self.task_mode.kind)
        self.sampler.load_state_dict(state["sampler"])
        if state["seed"] != self.config.seed:
            log.warning("using the checkpoint's data seed %d, not %d", state["seed"], self.config.seed)
            self.config.seed = int(state["seed"])
        self.samples_applied = int(state["samples"])
        self.elapsed_before = float(state["elapsed"])
        self.metrics = {str(k): float(v) for k, v in state.get("metrics", {}).items()}
        log.info("resumed from %s at version %d (%d samples applied)",
                 checkpoint.path_in(self.config.checkpoint_dir), state["version"], self.samples_applied)
        return int(state["version"]), int(state["next_id"])

    def save_checkpoint(self) -> Optional[str]:
        if not self.config.checkpoint_dir:
            return None
        sampler_state = self.sampler.state_dict()
        # Rounds still open are replanned on resume: their samples are not lost.
        sampler_state["replan"] = ([[list(p) for p in parts] for parts in self.scheduler.open_parts()]
                                   + sampler_state["replan"])
        path = checkpoint.save(self.config.checkpoint_dir, {
            "job": self.built.job.name,
            "fingerprint": self.built.fingerprint,
            "version": self.aggregator.version,
            "params": self.model.params.detach().clone(),
            "optimizer": self.optimizer.state_dict(),
            "task_kind": self.task_mode.kind,  # whose state "optimizer" is: the job's or the outer
            "sampler": sampler_state,
            "seed": self.config.seed,
            "samples": self.samples_applied,
            "next_id": self.scheduler.next_id(),
            "elapsed": self.elapsed(),
            "metrics": dict(self.metrics),
        })
        self.counters["checkpoints"] += 1
        if self.ledger is not None:
            self.ledger.write("checkpoint", version=self.aggregator.version)
        self._event("checkpoint", f"version {self.aggregator.version} saved")
        return path

    def elapsed(self) -> float:
        return self.elapsed_before + time.monotonic() - self.started

    # the loop -------------------------------------------------------------------------------

    def run(self) -> str:
        """Serve until training ends or a signal arrives. Returns why it stopped."""
        return asyncio.run(self._serve())

    async def _serve(self) -> str:
        tune_gc()
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, proto.SOCKET_MAX_MSG_BYTES)
        sock.setsockopt(zmq.LINGER, 500)  # let SHUTDOWNs flush, but never hold the exit long
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # Half-open connections are shed: a peer that has not finished the ZMTP (and CURVE)
        # handshake within this long is dropped, and TCP keepalives find peers that vanished.
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(self.HANDSHAKE_S * 1000))
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 60)
        auth = None
        if self.secure:
            auth = self._start_authenticator(ctx, sock)
        try:
            sock.bind(self.config.bind)
        except zmq.ZMQError as exc:
            sock.close(0)
            if auth is not None:
                auth.stop()
            ctx.term()
            raise ConfigError(f"cannot bind {self.config.bind}: {exc}") from None
        self.sock = sock
        # A plain (blocking-API) view of the same socket, for the hot path: while a received
        # batch is handled no receive is pending, so sending and draining through it cannot
        # swallow the wake-up that asyncio waits for; it skips a Future per message. A ROUTER's
        # send never blocks (it drops at the high-water mark), so it never stalls the loop.
        self._direct = zmq.Socket.shadow(sock.underlying)
        on_stop_signals(self._on_signal)
        if self.secure:
            on_reload_signal(lambda: asyncio.ensure_future(self.reload_keys()))
        if self.config.metrics_path:
            self._metrics_file = open(self.config.metrics_path, "a", buffering=1)
        if self.config.ledger_path:
            self.ledger = LedgerWriter(self.config.ledger_path, self.instance)
            self.ledger.write("start", version=self.aggregator.version, samples=self.samples_applied,
                              time=time.time())
        self.started = time.monotonic()
        security_note = (f"CURVE, {len(self.allowed_keys)} keys allowed" if self.secure
                         else "no keys: unencrypted")
        self._event("start", f"job {self.built.job.name} at version {self.aggregator.version}, "
                             f"listening on {self.config.bind} ({security_note})")
        try:
            await self._loop()
            await self._finish()
        finally:
            if self._metrics_file:
                self._metrics_file.close()
            if self.ledger is not None:
                self.ledger.close()
            sock.close()
            if auth is not None:
                auth.stop()
            ctx.term()
        return self.stop_reason or "stopped"

    def _start_authenticator(self, ctx, sock):
        """ZAP through pyzmq's asyncio authenticator, asking our allow-list for every handshake.

        Fails closed twice over: a handshake nobody answers never completes, and every message's
        User-Id is checked against the allow-list again in `_handle`."""
        from zmq.auth.asyncio import AsyncioAuthenticator

        coordinator = self

        class AllowList:
            def callback(self, domain, key: bytes) -> bool:
                allowed = key in coordinator.allowed_keys
                if not allowed:
                    coordinator.counters["handshakes_refused"] += 1
                    if coordinator._refused_logged.ready(time.monotonic()):
                        coordinator._event("refused", f"a handshake from key {_short(key)}, which "
                                           "is not in --allow-keys (copy its NAME.key there and "
                                           "send SIGHUP)", level=logging.WARNING)
                return allowed

        auth = AsyncioAuthenticator(ctx, log=logging.getLogger("idlegrad.coordinator.auth"))
        try:
            auth.start()
            auth.configure_curve_callback("*", credentials_provider=AllowList())
        except Exception as exc:
            auth.stop()
            raise ConfigError(f"cannot start the CURVE authenticator: {exc}") from None
        public, secret = self.keypair
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        return auth

    def _on_signal(self, sig) -> None:
        if self.stop_reason is None:
            self.stop_reason = "interrupted"
            self._event("stop", f"{signal.Signals(sig).name} received")
        if self._stopping is not None and not self._stopping.done():
            self._stopping.set_result(None)  # the loop may be waiting for its next tick

    _stopping: Optional[asyncio.Future] = None  # done once a signal asks the loop to stop

    async def _loop(self) -> None:
        sock = self.sock
        tick_every = self.config.heartbeat_s / 2
        next_tick = time.monotonic() + tick_every
        next_checkpoint = time.monotonic() + self.config.checkpoint_every
        next_eval = time.monotonic()
        eval_task: Optional[asyncio.Task] = None
        recv = asyncio.ensure_future(sock.recv_multipart(copy=False))
        self._stopping = asyncio.get_running_loop().create_future()
        try:
            while self.stop_reason is None:
                now = time.monotonic()
                due = min(next_tick, next_checkpoint, next_eval if eval_task is None else math.inf)
                wait = max(0.0, due - now)
                waiting = {recv, self._stopping} if eval_task is None else {
                    recv, self._stopping, eval_task}
                if self._verifying is not None:
                    waiting.add(self._verifying)
                await asyncio.wait(waiting, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                overslept = time.monotonic() - now - wait
                if overslept > self.config.heartbeat_s:  # stopped, suspended, or starved of CPU
                    self.scheduler.absent(overslept)
                    self._event("absent", f"the coordinator did not run for {overslept:.1f}s: "
                                          "that time counts as no worker's silence",
                                level=logging.WARNING)
                if recv.done():
                    await self._handle_batch(recv.result())
                    recv = asyncio.ensure_future(sock.recv_multipart(copy=False))
                if self._verifying is not None and self._verifying.done():
                    await self._settle()
                now = time.monotonic()
                if now >= next_tick:
                    # What arrived while the loop was not looking (a frozen or busy coordinator)
                    # is handled before silence is judged: workers knocking at the door are not
                    # evicted for the coordinator's own absence.
                    if recv.done():
                        await self._handle_batch(recv.result())
                    else:
                        recv.cancel()  # a pending receive holds no message: nothing is lost
                        await self._handle_batch(None)
                    recv = asyncio.ensure_future(sock.recv_multipart(copy=False))
                    now = time.monotonic()
                    await self._perform(self.scheduler.tick(now))
                    next_tick = now + tick_every
                if eval_task is not None and eval_task.done():
                    self._record_eval(*eval_task.result())
                    eval_task = None
                    next_eval = time.monotonic() + self._eval_interval()
                if eval_task is None and now >= next_eval and self.stop_reason is None:
                    if self._last_eval_version != self.aggregator.version:
                        eval_task = self._start_eval()
                    else:  # nothing new to evaluate
                        next_eval = now + self._eval_interval()
                if self.config.checkpoint_dir and now >= next_checkpoint:
                    self.save_checkpoint()
                    next_checkpoint = time.monotonic() + self.config.checkpoint_every
                if self.scheduler.finished and self.stop_reason is None:
                    self.stop_reason = "epochs"
        finally:
            recv.cancel()
            if eval_task is not None:
                await asyncio.wait({eval_task})
            if self._verifying is not None:
                await asyncio.wait({self._verifying})

    async def _handle_batch(self, first: Optional[list]) -> None:
        """Handle `first` (if any) and what else is queued, up to a bound, through the plain
        view of the socket: no receive is pending meanwhile."""
        self._handling = True
        try:
            if first is not None:
                await self._handle(first)
            for _ in range(256):  # the periodic work must not wait behind a flood
                try:
                    frames = _recv_waiting(self._direct)
                except zmq.Again:
                    break
                await self._handle(frames)
        finally:
            self._handling = False

    async def _finish(self) -> None:
        if self.stop_reason != "interrupted":
            # Training is over: withdraw the work and send everyone home.
            await self._perform(self.scheduler.stop())
            for worker_id, route in list(self.routes.items()):
                await self._send(route, proto.Shutdown(reason=f"training finished ({self.stop_reason})"))
        if self._last_eval_version != self.aggregator.version:
            self._record_eval(*self._evaluate_now())
        self.save_checkpoint()
        self._write_metrics(final=True)
        self._event("stop", f"stopped: {self.stop_reason}")

    # evaluation -----------------------------------------------------------------------------

    _last_eval_version: Optional[int] = None
    _last_eval_s: float = 0.0

    def _eval_interval(self) -> float:
        if self.config.eval_every is not None:
            return self.config.eval_every
        return max(0.2, 10 * self._last_eval_s)  # evaluation takes at most ~10% of the time

    def _start_eval(self) -> asyncio.Task:
        self._eval_model.load(self.model.params)
        version, samples = self.aggregator.version, self.samples_applied
        return asyncio.ensure_future(asyncio.to_thread(self._evaluate_copy, version, samples))

    def _evaluate_copy(self, version: int, samples: int) -> tuple[int, int, dict, float]:
        t0 = time.perf_counter()
        metrics = evaluate(self.built.job, self._eval_model.module, self.built.test)
        return version, samples, metrics, time.perf_counter() - t0

    def _evaluate_now(self) -> tuple[int, int, dict, float]:
        self._eval_model.load(self.model.params)
        return self._evaluate_copy(self.aggregator.version, self.samples_applied)

    def _record_eval(self, version: int, samples: int, metrics: dict, seconds: float) -> None:
        self._last_eval_s = seconds
        self._last_eval_version = version
        self.metrics = metrics
        self.curve.append({"t": round(self.elapsed(), 3), "version": version, "samples": samples,
                           "loss": self.train_loss, "metrics": dict(metrics)})
        self._write_metrics(version=version, samples=samples)
        target = self.config.target
        if target is not None and target.metric not in metrics and self.stop_reason is None:
            self.stop_reason = "bad target"
            log.error("target metric %r is not among the job's metrics %s",
                      target.metric, sorted(metrics))
        elif target is not None and target.reached(metrics) and self.stop_reason is None:
            if version != self.aggregator.version:
                # The model moved on while it was evaluated: the model we stop with must meet
                # the target itself, so confirm on it (training is paused for one evaluation).
                self._record_eval(*self._evaluate_now())
                return
            self.stop_reason = "target"
            self._event("target", f"{target} reached at version {version}: "
                                  f"{target.metric}={metrics[target.metric]:.4f}")

    def _write_metrics(self, version: Optional[int] = None, samples: Optional[int] = None,
                       final: bool = False) -> None:
        if self._metrics_file is None:
            return
        record = {
            "time": time.time(), "elapsed": round(self.elapsed(), 4),
            "version": self.aggregator.version if version is None else version,
            "samples": self.samples_applied if samples is None else samples,
            "epoch": round(self.sampler.progress, 4), "loss": self.train_loss,
            "metrics": self.metrics, "workers": len(self.scheduler.workers),
            "samples_per_s": round(self.samples_per_s(), 2),
            "bytes_per_sample": self.bytes_per_sample(), "task": str(self.task_mode),
        }
        if final:
            record["final"] = True
            record["reason"] = self.stop_reason
            # the run's tallies, for after the status endpoint is gone
            record["counters"] = dict(self.counters)
            record["scheduler"] = dict(self.scheduler.stats)
        self._metrics_file.write(json.dumps(record) + "\n")

    # messages -------------------------------------------------------------------------------

    async def _handle(self, frames: list) -> None:
        if len(frames) < 2:
            self._bad(b"?", ProtocolError("frames", "no routing id or no header"))
            return
        route = bytes(frames[0].buffer)
        self.counters["bytes_received"] += sum(len(f) for f in frames[1:])
        key = None
        if self.secure:
            key = _user_id(frames[1])
            if key not in self.allowed_keys:
                # Admitted before a SIGHUP revoked it (or, were the authenticator to fail, never
                # admitted at all): nothing it says is used.
                self.counters["messages_unlisted_key"] += 1
                worker_id = self.peers.get(route)
                if worker_id is not None:
                    await self._forget(worker_id, "key revoked")
                return
        try:
            msg = proto.decode(frames[1:])
        except ProtocolError as exc:
            self._bad(route, exc)
            if exc.reason == "version":
                await self._send(route, proto.Reject(
                    code="version", reason=f"coordinator speaks protocol {proto.PROTOCOL_VERSION} "
                                           f"(idlegrad {__version__}): {exc.detail}"))
            return
        handler = self._HANDLERS.get(type(msg))
        if handler is None:
            self._bad(route, ProtocolError("unexpected", f"{msg.TYPE} is not for the coordinator"))
            return
        if isinstance(msg, proto.Hello) and self.trust.is_banned(self._identity(msg.worker_id, key)):
            self.counters["hello_banned"] += 1
            await self._send(route, proto.Reject(
                code="banned", reason="banned by this coordinator for repeated bad gradients"))
            return
        if key is not None and self.trust.is_banned(self._identity("", key)):
            # A banned key still in --allow-keys: a monitor's commands (pause, drain) need no
            # hello, and a ban is of the key, whatever it says next.
            self.counters["messages_banned_key"] += 1
            return
        if key is not None and isinstance(msg, proto.Hello):
            owner = self.key_of.get(msg.worker_id)
            if owner is not None and owner != key:
                self.counters["hello_identity"] += 1
                await self._send(route, proto.Reject(
                    code="identity", reason=f"worker id {msg.worker_id!r} belongs to another key"))
                return
        elif key is not None and route in self.peers and self.key_of.get(self.peers[route]) != key:
            self._bad(route, ProtocolError("identity", "message under another key than its hello"))
            return
        try:
            if isinstance(msg, proto.Hello):
                await self._on_hello(route, msg, key)
            else:
                await handler(self, route, msg)
        except _NeedHello:
            # A worker of an earlier coordinator process (or one we evicted): it re-handshakes.
            self.counters["hello_first"] += 1
            await self._send(route, proto.Reject(code="hello_first", reason="say hello first"))
        except ProtocolError as exc:
            self._bad(route, exc)

    def _bad(self, route: bytes, exc: ProtocolError) -> None:
        self.bad_messages[exc.reason] += 1
        who = self.peers.get(route, route.hex()[:16])
        if self._bad_logged.ready(time.monotonic()):
            self._event("rejected", f"bad message from {who}: {exc} "
                                    f"({sum(self.bad_messages.values())} so far)", level=logging.WARNING)

    def _identity(self, worker_id: str, key: Optional[bytes] = None) -> str:
        """Who is judged and banned: the CURVE key when there are keys, else the worker id."""
        key = key if key is not None else self.key_of.get(worker_id)
        return "key:" + key.decode("ascii") if key is not None else worker_id

    def _slot_scale(self, worker_id: str, slot_id: int) -> Optional[float]:
        """sum |coefficient| x samples over the slot's parts, if the slot is this worker's."""
        record = self.scheduler.workers.get(worker_id)
        slot = self.scheduler.slots.get(slot_id)
        if record is None or slot is None or slot_id not in record.assigned:
            return None
        round_ = self.scheduler.rounds.get(slot.round)
        if round_ is None:
            return None
        return sum(abs(c) * round_.parts[j][2] for j, c in slot.row)

    async def _suspect_result(self, worker_id: str, msg: proto.Result, grad: list[torch.Tensor],
                              norm: float, scale: float, identity: str, verdict) -> bool:
        """An outlier norm: settle it with a third computation, the coordinator's own, in a
        thread. One at a time; a suspect arriving meanwhile goes back to the pool (no offence)."""
        self.counters["gradients_suspected"] += 1
        if self._verifying is not None:
            self.counters["suspects_requeued"] += 1
            await self._perform(self.scheduler.failed(worker_id, msg.slot, time.monotonic()))
            return False
        computing = self._compute_here(msg.slot)
        if computing is None:  # no copy of that model is left: cannot settle it; back to the pool
            await self._perform(self.scheduler.failed(worker_id, msg.slot, time.monotonic()))
            return False
        self._event("suspected", f"{verdict.detail} from {worker_id} for slot {msg.slot}: "
                                 "computing it here to settle it", worker=worker_id)

        async def then(task: asyncio.Future) -> None:
            await self._settle_suspect(task, worker_id, msg, grad, norm, scale, identity)

        self._verifying, self._then = computing, then
        return False  # not yet: `_settle_suspect` uses it once it is found honest

    def _compute_here(self, slot_id: int) -> Optional[asyncio.Future]:
        """Start computing slot `slot_id` here, in a thread, exactly as a worker does (a coded
        gradient, or a local slot's change), on the model version its round was planned at.
        None when that model is no longer kept."""
        slot = self.scheduler.slots[slot_id]
        round_ = self.scheduler.rounds[slot.round]
        parts = [round_.parts[j] for j, _ in slot.row]
        coefficients = [c for _, c in slot.row]
        snap = self._snapshots.get(round_.version)
        if snap is not None:
            params = snap[0]
        elif round_.version == self.aggregator.version:
            params = self.model.params.detach().clone()
        else:
            return None
        if self._check_model is None:
            self._check_model = FlatModel(self.built.job.build_model())
        job, train, seed = self.built.job, self.built.train, self.config.seed
        if self.task_mode.local:
            (part,), (coefficient,) = parts, coefficients
            steps = local.inner_steps(part[2], job.batch_size)  # as `_task_kind` sends it
            return asyncio.ensure_future(asyncio.to_thread(
                lambda: local_change(job, self._check_model, params, train, seed, part,
                                     coefficient, steps).change))
        return asyncio.ensure_future(asyncio.to_thread(
            coded_gradient, job, self._check_model, params, train, seed, parts, coefficients))

    async def _settle(self) -> None:
        task, then = self._verifying, self._then
        self._verifying = self._then = None
        await then(task)
        while self._disputes and self._verifying is None:
            await self._start_settle(self._disputes.popleft())

    async def _settle_suspect(self, task: asyncio.Future, worker_id: str, msg: proto.Result,
                              grad: list[torch.Tensor], norm: float, scale: float,
                              identity: str) -> None:
        now = time.monotonic()
        try:
            reference = task.result()
        except Exception as exc:  # the job's code failed here: give the slot to someone else
            log.warning("could not compute slot %d to settle it: %s", msg.slot, exc)
            await self._perform(self.scheduler.failed(worker_id, msg.slot, now))
            return
        off = distance(grad, [reference])
        size = finite_norm(reference)
        if matches(off, size):
            self.counters["suspects_honest"] += 1
            self.trust.accept(float(size), scale)
            self._event("verified", f"slot {msg.slot} from {worker_id}: computed here, it matches "
                                    "(an honest outlier); used", worker=worker_id)
            await self._use_result(worker_id, msg, grad, norm, now)
            return
        self.counters["suspects_wrong"] += 1
        banned = self.trust.confirmed(identity, now)
        await self._offence(worker_id, msg.slot, "norm",
                            f"gradient {off / max(size, 1e-12):.3g}x off the slot's true one "
                            f"(computed here)", banned)

    # verified replicas ------------------------------------------------------------------------

    async def _compare_copies(self, action: CompareCopies) -> None:
        """Two copies of a row, from two workers: used if they agree; if not, the coordinator
        computes the slot itself (one settle at a time), and each copy that does not match it is
        an offence of its sender."""
        first, second = action.slots
        if first not in self._grads or second not in self._grads:  # defensive: never seen
            self.counters["replicas_unsettled"] += 1
            await self._drop_copies(first, second, [])
            return
        (grad_a, norm_a, (worker_a, identity_a)) = self._grads[first]
        (grad_b, norm_b, (worker_b, identity_b)) = self._grads[second]
        off = distance(grad_a, grad_b)
        size = max(norm_a, norm_b)
        # One identity under two worker ids would agree with itself: a third opinion decides.
        if matches(off, size) and identity_a != identity_b:
            await self._perform(self.scheduler.copies_agreed(first, second, time.monotonic()))
            self._grads.pop(second, None)  # not used: the first copy is
            return
        await self._perform(self.scheduler.copies_disagreed(first, second, time.monotonic()))
        detail = (f"copies of slots {first} ({worker_a}) and {second} ({worker_b}) in round "
                  f"{action.round} differ by {off / max(size, 1e-12):.3g} of their size")
        if await self._refuse_banned(first, second, detail):
            return
        if self._verifying is None:
            self._event("replicas_disagreed", f"{detail}: computing it here to settle it")
        elif len(self._disputes) < self.DISPUTES_QUEUED:
            self._event("replicas_disagreed", f"{detail}: to be computed here")
            self._disputes.append(action)
            return
        else:
            self._event("replicas_disagreed", f"{detail}: too many waiting to be computed here")
        await self._start_settle(action)

    async def _start_settle(self, action: CompareCopies) -> None:
        first, second = action.slots
        if await self._refuse_banned(first, second, f"copies of slots {first} and {second} in "
                                                    f"round {action.round} disagree"):
            return  # (banned while it waited)
        computing = None
        if self._verifying is None:
            computing = self._compute_here(first)
        if computing is None:  # too many waiting, or the model is gone: both computed again
            self.counters["replicas_unsettled"] += 1
            self._event("replicas_unsettled", f"copies of slots {first} and {second} in round "
                                              f"{action.round} disagree: both computed again")
            await self._drop_copies(first, second, [])
            return

        async def then(task: asyncio.Future) -> None:
            await self._settle_copies(task, first, second)

        self._verifying, self._then = computing, then

    async def _refuse_banned(self, first: int, second: int, detail: str) -> bool:
        """A disagreement where a sender has been banned meanwhile: its copy is refused without
        computing the slot here; the other copy stays held for the next one to agree with."""
        banned = [s for s in (first, second)
                  if s in self._grads and self.trust.is_banned(self._grads[s][2][1])]
        if not banned:
            return False
        self.counters["replicas_of_banned"] += len(banned)
        kept = [s for s in (first, second) if s not in banned]
        names = " and ".join(self._grads[s][2][0] for s in banned)
        self._event("replicas_disagreed", f"{detail}: {names} is banned: its copy refused, not "
                                          "computed here")
        for slot in banned:
            self._grads.pop(slot, None)
        await self._perform(self.scheduler.copies_settled(
            first, second, [], time.monotonic(), kept=kept[0] if kept else None))
        return True

    async def _settle_copies(self, task: asyncio.Future, first: int, second: int) -> None:
        now = time.monotonic()
        try:
            reference = task.result()
        except Exception as exc:  # the job's code failed here: nobody is blamed
            log.warning("could not compute slot %d to settle its copies: %s", first, exc)
            self.counters["replicas_unsettled"] += 1
            await self._drop_copies(first, second, [])
            return
        if first not in self._grads or second not in self._grads:  # (not while its row waits)
            await self._drop_copies(first, second, [])
            return
        size = finite_norm(reference)
        correct = [s for s in (first, second) if matches(distance(self._grads[s][0], [reference]),
                                                         size)]
        wrong = [s for s in (first, second) if s not in correct]
        senders = [self._grads[s][2] for s in wrong]
        for slot in correct:
            worker_id = self._grads[slot][2][0]
            self._event("verified", f"slot {slot} from {worker_id}: computed here, it matches; "
                                    f"{'used' if slot == correct[0] else 'agrees'}",
                        worker=worker_id)
        banned = []
        for slot, (worker_id, identity) in zip(wrong, senders):
            self.counters["gradients_rejected"] += 1
            self.counters["rejected_replica"] += 1
            if self.trust.confirmed(identity, now, "replica"):
                banned.append((worker_id, identity))
            self._event("rejected", f"result for slot {slot} from {worker_id}: differs from the "
                                    "slot computed here (its copy disagreed)", worker=worker_id,
                        level=logging.WARNING)
        await self._drop_copies(first, second, correct)
        for worker_id, identity in banned:
            await self._ban(worker_id, identity)

    async def _drop_copies(self, first: int, second: int, correct: list[int]) -> None:
        """Hand a settled disagreement to the scheduler; results not used are let go."""
        for slot in (first, second):
            if slot not in correct[:1]:
                self._grads.pop(slot, None)
        await self._perform(self.scheduler.copies_settled(first, second, correct,
                                                          time.monotonic()))

    async def _offence(self, worker_id: str, slot: int, reason: str, detail: str,
                       banned: bool) -> None:
        self.counters["gradients_rejected"] += 1
        self.counters["rejected_" + reason.replace("-", "_")] += 1
        self._event("rejected", f"{detail} from {worker_id} for slot {slot}", worker=worker_id,
                    level=logging.WARNING)
        await self._perform(self.scheduler.failed(worker_id, slot, time.monotonic()))
        if banned:
            await self._ban(worker_id)

    async def _ban(self, worker_id: str, identity: Optional[str] = None) -> None:
        """`identity`: the banned one, where the worker may have left (its key forgotten)."""
        identity = identity if identity is not None else self._identity(worker_id)
        offender = self.trust.offenders[identity]
        self.counters["workers_banned"] += 1
        self._event("banned", f"{worker_id} banned after {offender.total} offences "
                              f"({', '.join(f'{k} x{v}' for k, v in offender.reasons.items())})",
                    worker=worker_id, level=logging.WARNING)
        if self._identity(worker_id) != identity:
            return  # the id is someone else's now (the banned one left; another key took it)
        route = self.routes.get(worker_id)
        if route is not None:
            await self._send(route, proto.Reject(
                code="banned", reason="banned by this coordinator for repeated bad gradients"))
        await self._forget(worker_id, "banned")

    def _worker_of(self, route: bytes) -> str:
        worker_id = self.peers.get(route)
        if worker_id is None:
            raise _NeedHello()
        return worker_id

    async def _on_hello(self, route: bytes, msg: proto.Hello, key: Optional[bytes] = None) -> None:
        old_route = self.routes.get(msg.worker_id)
        record = self.scheduler.workers.get(msg.worker_id)
        now = time.monotonic()
        resumed = (record is not None and msg.instance == self.instance
                   and (key is None or self.key_of.get(msg.worker_id) == key))
        if resumed:
            # The same worker process back on a new connection, before its eviction: it keeps
            # its slots, and resends the results it has not seen acknowledged.
            self.counters["sessions_resumed"] += 1
            self.scheduler.seen(msg.worker_id, now)
        else:
            await self._perform(self.scheduler.join(msg.worker_id, {
                "host": msg.host, "cores": msg.cores, "threads": msg.threads, "device": msg.device,
                "memory_mb": msg.memory_mb, "versions": msg.versions, "job": msg.job}, now))
        if old_route is not None:
            self.peers.pop(old_route, None)
        self.peers.pop(route, None)
        self.routes[msg.worker_id] = route
        self.peers[route] = msg.worker_id
        if key is not None:
            self.key_of[msg.worker_id] = key
        self._event("join", f"{msg.worker_id} {'came back' if resumed else 'joined'} from "
                            f"{msg.host} ({msg.device}, {msg.threads} threads)", worker=msg.worker_id)
        holding = sorted(self.scheduler.workers[msg.worker_id].assigned) if resumed else []
        await self._send(route, proto.Welcome(
            # the job's name, not the spec: no local paths to strangers
            job=self.built.job.name, job_args=self.config.job_args, fingerprint=self.built.fingerprint,
            seed=self.config.seed, heartbeat_s=self.config.heartbeat_s,
            liveness=self.config.liveness, instance=self.instance, holding=holding,
            result_dtype=self.config.result_dtype))
        if resumed:  # tasks sent down its old connection may be lost: it ignores the ones it has
            await self._perform(self.scheduler.resend(msg.worker_id, now))

    async def _on_ready(self, route: bytes, msg: proto.Ready) -> None:
        worker_id = self._worker_of(route)
        if msg.fingerprint != self.built.fingerprint:
            reason = (f"this coordinator trains job {self.built.job.name!r} with fingerprint "
                      f"{self.built.fingerprint}; the worker built fingerprint {msg.fingerprint}: "
                      "start it with the same job and version")
            await self._send(route, proto.Reject(code="job", reason=reason))
            await self._perform(self.scheduler.leave(worker_id, time.monotonic(), "wrong job"))
            return
        await self._perform(self.scheduler.ready(worker_id, msg.credits, time.monotonic()))

    async def _on_result(self, route: bytes, msg: proto.Result) -> None:
        worker_id = self._worker_of(route)
        used = False
        # Taken (used, refused or dropped) once the scheduler has judged it: the worker forgets
        # it; unacknowledged, it would be resent after a reconnect. A task sent to the worker
        # meanwhile carries the acknowledgement (`_perform`).
        self._acks_due[worker_id] = msg.slot
        try:
            used = await self._take_result(worker_id, msg)
        finally:
            if self.ledger is not None:
                self.ledger.write("ack", slot=msg.slot, worker=worker_id, used=used)
            slot = self._acks_due.pop(worker_id, None)
            if slot is not None and worker_id in self.routes:
                await self._send(self.routes[worker_id], proto.Ack(slots=[slot]))

    async def _take_result(self, worker_id: str, msg: proto.Result) -> bool:
        """Judge and hand a result to the scheduler; whether its gradient is used."""
        now = time.monotonic()
        identity = self._identity(worker_id)
        if identity != worker_id:  # keys (a bounded set) are shown by the name they last used
            self.identity_names[identity] = worker_id
        try:
            grad = blob_chunks(msg.gradient, self.model.numel, self._result_dtype)
            if self._result_dtype != self.model.dtype:  # bfloat16 on the wire: widen, once
                grad = [chunk.to(self.model.dtype) for chunk in grad]
        except ProtocolError:
            await self._perform(self.scheduler.failed(worker_id, msg.slot, now))
            if self.trust.offence(identity, "malformed", now):
                await self._ban(worker_id)
            raise
        scale = self._slot_scale(worker_id, msg.slot)
        norm = finite_norm(grad)  # inf or nan: a non-finite value (or an absurd norm)
        if not math.isfinite(norm):
            verdict = self.trust.judge(identity, math.nan, 1.0, now)
        elif scale is not None:  # a result for a slot it does not hold is refused below anyway
            verdict = self.trust.judge(identity, norm, scale, now)
        else:
            verdict = None
        if verdict is not None and verdict.reason == "norm":
            return await self._suspect_result(worker_id, msg, grad, norm, scale, identity, verdict)
        if verdict is not None and not verdict.ok:
            await self._offence(worker_id, msg.slot, verdict.reason, verdict.detail, verdict.banned)
            return False
        return await self._use_result(worker_id, msg, grad, norm, now)

    async def _use_result(self, worker_id: str, msg: proto.Result, grad: list[torch.Tensor],
                          norm: float, now: float) -> bool:
        accepted, actions = self.scheduler.result(worker_id, msg.slot, msg.compute_s, now,
                                                  msg.waited_s)
        if accepted:
            self._grads[msg.slot] = (grad, norm, (worker_id, self._identity(worker_id)))
            if msg.samples and math.isfinite(msg.loss):
                self.train_loss = msg.loss if self.train_loss is None else (
                    0.9 * self.train_loss + 0.1 * msg.loss)
        else:
            self.counters["results_dropped"] += 1
        await self._perform(actions)
        return accepted

    async def _on_heartbeat(self, route: bytes, msg: proto.Heartbeat) -> None:
        worker_id = self._worker_of(route)
        record = self.scheduler.workers.get(worker_id)
        was_paused = record is not None and record.paused_since is not None
        self.scheduler.seen(worker_id, time.monotonic(), msg.state)
        if record is not None and was_paused != (msg.state == "paused"):
            if was_paused:
                self._event("worker_resumed", f"{worker_id} resumed", worker=worker_id)
            else:
                self._event("worker_paused", f"{worker_id} paused: its owner needs the machine; "
                                             f"its {len(record.assigned)} slots are withdrawn after "
                                             f"{self.config.pause_grace_s:g}s", worker=worker_id)
        await self._send(route, proto.Heartbeat(state="coordinator"))

    async def _on_bye(self, route: bytes, msg: proto.Bye) -> None:
        worker_id = self.peers.get(route)
        if worker_id is not None:
            await self._perform(self.scheduler.leave(worker_id, time.monotonic(),
                                                     f"said bye: {msg.reason}"[:200]))

    async def _on_status(self, route: bytes, msg: proto.StatusRequest) -> None:
        await self._send(route, proto.Status(snapshot=self.snapshot(msg.cursor)))

    async def _on_control(self, route: bytes, msg: proto.Control) -> None:
        ok, detail = await self.control(msg.action, msg.worker)
        await self._send(route, proto.ControlReply(action=msg.action, ok=ok, detail=detail))

    async def control(self, action: str, worker: Optional[str] = None) -> tuple[bool, str]:
        """An operator's command (from a monitor): pause, resume, or drain a worker."""
        now = time.monotonic()
        if action == "pause":
            if self.scheduler.paused:
                return True, "training was already paused"
            self.scheduler.pause()
            self._event("pause", "training paused by the operator: no new slots")
            return True, "training paused"
        if action == "resume":
            if not self.scheduler.paused:
                return True, "training was not paused"
            self._event("resume", "training resumed by the operator")
            await self._perform(self.scheduler.resume(now))
            return True, "training resumed"
        if action == "drain":
            if worker not in self.scheduler.workers:
                return False, f"no worker {str(worker)[:80]!r}"
            self._event("drain", f"{worker} draining: it finishes its slots, then leaves",
                        worker=worker)
            await self._perform(self.scheduler.drain(worker, now))
            return True, f"{worker} draining"
        return False, f"unknown action {action[:20]!r}"

    _HANDLERS = {proto.Hello: _on_hello, proto.Ready: _on_ready, proto.Result: _on_result,
                 proto.Heartbeat: _on_heartbeat, proto.Bye: _on_bye,
                 proto.StatusRequest: _on_status, proto.Control: _on_control}

    # actions --------------------------------------------------------------------------------

    _handling = False  # a received batch is being handled: no receive is pending

    async def _send(self, route: bytes, msg: proto.Message, track: bool = False):
        """Send `msg`; with `track`, return the MessageTracker of its zero-copy frames."""
        frames = proto.encode(msg)
        self.counters["bytes_sent"] += sum(memoryview(f).nbytes for f in frames)
        if self._handling:
            # pyzmq's send_multipart adds per-frame checks and enum arithmetic: a third of the
            # cost of a small message
            sock = self._direct
            _send_frame(sock, route, _MORE)
            for frame in frames[:-1]:
                _send_frame(sock, frame, _MORE, not track, track)
            return _send_frame(sock, frames[-1], 0, not track, track)
        return await self.sock.send_multipart([route, *frames], copy=not track, track=track)

    def bytes_per_sample(self) -> Optional[float]:
        """Wire bytes, both ways, per sample applied."""
        if not self.samples_applied:
            return None
        total = self.counters["bytes_sent"] + self.counters["bytes_received"]
        return round(total / self.samples_applied, 1)

    async def _perform(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, Assign):
                route = self.routes[action.worker]
                model = self._model_blob(action.version) if action.send_model else None
                if self.ledger is not None:
                    self.ledger.write("sent", slot=action.slot, worker=action.worker)
                # A small model is copied into ZeroMQ at once: a tracker costs more than the copy
                track = model is not None and model.numel > self._copy_numel
                ack = self._acks_due.pop(action.worker, None)
                tracker = await self._send(route, proto.Task(
                    slot=action.slot, round=action.round, version=action.version,
                    parts=action.parts, coefficients=action.coefficients,
                    deadline_s=min(action.deadline_s, 1e9), model=model,
                    acks=[] if ack is None else [ack], **self._task_kind(action)), track=track)
                if track:
                    self._snapshots[action.version][2].append(tracker)
            elif isinstance(action, CancelSlots):
                route = self.routes.get(action.worker)
                if route is not None:
                    await self._send(route, proto.Cancel(slots=action.slots))
            elif isinstance(action, Decoded):
                await self._perform(self._apply(action))
            elif isinstance(action, CompareCopies):
                await self._compare_copies(action)
            elif isinstance(action, Drained):
                route = self.routes.get(action.worker)
                self._event("drained", f"{action.worker} drained; sending it home",
                            worker=action.worker)
                if route is not None:
                    await self._send(route, proto.Shutdown(reason="drained by the operator"))
            elif isinstance(action, Evicted):
                route = self.routes.pop(action.worker, None)
                if route is not None:
                    self.peers.pop(route, None)
                self.key_of.pop(action.worker, None)
                self._event("leave", f"{action.worker} left ({action.reason}); "
                                     f"{action.requeued} slots requeued", worker=action.worker)

    def _task_kind(self, action: Assign) -> dict:
        if not self.task_mode.local:
            return {}
        samples = sum(part[2] for part in action.parts)
        steps = local.inner_steps(samples, self.built.job.batch_size)
        if log.isEnabledFor(logging.DEBUG):
            record = self.scheduler.workers.get(action.worker)
            if record is not None:
                log.debug("slot %d to %s: %d inner steps (%s s per sample, %s link s per slot)",
                          action.slot, action.worker, steps, record.s_per_sample, record.link_s)
        return {"kind": "local", "steps": steps}

    def _model_blob(self, version: int) -> proto.Blob:
        """The model at `version`, as an immutable copy: frames go out zero-copy, asynchronously,
        so the live parameters must not be what they point at. Copies live in reused buffers."""
        snap = self._snapshots.get(version)
        if snap is None:
            if version != self.aggregator.version:
                raise RuntimeError(f"no snapshot of version {version}")  # a scheduler bug
            tensor = self._snapshot_buffers.take()
            tensor.copy_(self.model.params.detach())
            snap = (tensor, to_blob(tensor), [])
            self._snapshots[version] = snap
        return snap[1]

    def _release_snapshots(self) -> None:
        """Snapshots no open round needs go back to the pool (reused once sent)."""
        for version in [v for v in self._snapshots if not self.scheduler.version_in_use(v)]:
            tensor, _, trackers = self._snapshots.pop(version)
            self._snapshot_buffers.give(tensor, trackers)

    def _apply(self, decoded: Decoded) -> list:
        """Step with a decoded round (or replan it); returns the scheduler's follow-up actions."""
        terms = [(self._grads[s][0], w) for s, w in decoded.weights.items()]
        norms = [self._grads[s][1] for s in decoded.weights]
        for slot in decoded.slots:
            self._grads.pop(slot, None)
        current = self.aggregator.version
        if self.scheduler.version_in_use(current):
            self._model_blob(current)  # rounds still open at this version need it kept
        try:
            weight = self.aggregator.apply_terms(terms, decoded.samples, decoded.version, norms)
        except GradientRejected as exc:
            self.counters["rounds_rejected"] += 1
            self._event("rejected", f"round {decoded.round}: {exc}", level=logging.WARNING)
            weight = None
        else:
            if weight is None:
                self.counters["rounds_too_stale"] += 1
        if weight is None:
            self.scheduler.replan(decoded)
        else:
            self.samples_applied += decoded.samples
            if self.ledger is not None:
                self.ledger.write("applied", round=decoded.round, version=self.aggregator.version,
                                  parts=[list(p) for p in decoded.parts], t=time.time())
            self._rate.append((time.monotonic(), self.samples_applied))
            self._release_snapshots()
        return self.scheduler.applied(self.aggregator.version, time.monotonic())

    # status ---------------------------------------------------------------------------------

    def _event(self, kind: str, text: str, worker: Optional[str] = None,
               level: int = logging.INFO) -> None:
        self._event_id += 1
        self.events.append({"id": self._event_id, "time": time.time(), "kind": kind,
                            "worker": worker, "text": text})
        log.log(level, "%s: %s", kind, text)

    def _trust_summary(self) -> dict:
        summary = self.trust.summary()
        name = lambda identity: self.identity_names.get(identity, identity)  # noqa: E731
        summary["banned"] = [name(i) for i in summary["banned"]]
        summary["offenders"] = {name(i): o for i, o in summary["offenders"].items()}
        return summary

    def samples_per_s(self, window: float = 5.0) -> float:
        if len(self._rate) < 2:
            return 0.0
        end_t, end_n = self._rate[-1]
        now = max(time.monotonic(), end_t)  # so the rate decays to 0 when nothing is applied
        for t, n in self._rate:
            if now - t <= window:
                break
        else:
            return 0.0
        return (end_n - n) / (now - t) if now > t else 0.0

    def snapshot(self, cursor: int = 0) -> dict:
        """The status endpoint's answer (coordinator/status.py builds it, purely)."""
        target = self.config.target
        base = {
            "job": self.built.job.name, "fingerprint": self.built.fingerprint,
            "instance": self.instance,
            "state": "stopping" if self.stop_reason else "training",
            "version": self.aggregator.version, "samples": self.samples_applied,
            "epoch": round(self.sampler.progress, 4), "epochs": self.config.epochs,
            "train_samples": len(self.built.train), "elapsed_s": round(self.elapsed(), 3),
            "samples_per_s": round(self.samples_per_s(), 2), "loss": self.train_loss,
            "metrics": self.metrics, "target": str(target) if target else None,
            "target_metric": target.metric if target else None,
            "target_value": target.value if target else None,
            "target_higher": target.higher_is_better if target else None,
            "counters": dict(self.counters), "bad_messages": dict(self.bad_messages),
            "trust": self._trust_summary(),
            "host": pysocket.gethostname(),
            "task": str(self.task_mode),
            "bytes_per_sample": self.bytes_per_sample(),
        }
        staleness = self.config.staleness
        stats = self.scheduler.stats
        redundancy = {
            "code": self.scheduler.last_code,
            "predicted_s_per_sample": {k: round(v, 9) for k, v in self.scheduler.last_costs.items()},
            "policy": "sync" if self.config.sync else str(self.scheduler.config.redundancy),
            "partitions": self.config.partitions, "max_batch": self.config.max_batch,
            "speculate": self.scheduler.config.speculate,
            "slots_speculated": stats["slots_speculated"],
            "slots_redundant": stats["slots_redundant"],
            "rounds_by_code": {k: stats["rounds_" + k] for k in ("none", "replicate", "cyclic")
                               if stats["rounds_" + k]},
            "open_rounds_limit": self.config.open_rounds,
            "staleness_rule": staleness.kind, "max_staleness": staleness.max_staleness,
            "rounds_too_stale": self.counters["rounds_too_stale"],
            "rounds_rejected": self.counters["rounds_rejected"],
            "verify_replicas": self.scheduler.config.verify_replicas,
            "replicas_agreed": stats["replicas_agreed"],
            "replicas_disagreed": stats["replicas_disagreed"],
        }
        return build_snapshot(self.scheduler, time.monotonic(), base, curve=self.curve,
                              events=self.events, cursor=cursor, last_event=self._event_id,
                              redundancy=redundancy, events_limit=self.EVENTS_PER_STATUS)


def _naming_job_args(exc: JobError, job_args: dict) -> JobError:
    """A job that failed to build says so in its own terms (a torch error about a tensor's size,
    say); the --job-arg values it was given are usually the cause, so the line names them."""
    if not job_args:
        return exc
    given = " ".join(f"--job-arg {k}={v!r}" for k, v in job_args.items())
    return JobError(f"{exc} (given {given})")


def _user_id(frame) -> Optional[bytes]:
    """The peer's CURVE public key (Z85), which the authenticator made the message's User-Id."""
    try:
        return frame.get("User-Id").encode("ascii")
    except (zmq.ZMQError, AttributeError, UnicodeError):
        return None


def _short(key: bytes) -> str:
    return key[:8].decode("ascii", errors="replace") + "..."


class _NeedHello(ProtocolError):
    def __init__(self):
        super().__init__("hello_first", "message from a peer that has not said hello")

