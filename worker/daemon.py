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

Blobs (model snapshots a task names, the shards of a job's data) are fetched through the blob cache
in the compute thread, under the engine's pause gate: a download stops when the owner wants the
machine back. When the owner's daily transfer cap is spent the worker says "capped" in its
heartbeats and asks for no slots (READY 0); a slot that needs data it does not hold goes back to
the coordinator at once (HANDBACK), the ones it can compute from its cache are computed, and every
CAPPED_RETRY_S it asks again, until the allowance returns at 00:00 UTC.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import platform
import random
import signal
import socket as pysocket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import psutil
import torch
import zmq
import zmq.asyncio

from .. import __version__
from ..common import protocol as proto
from ..common.aio import on_stop_signals
from ..common.errors import ConfigError, PeerGone, ProtocolError, Refused
from ..common.job import BuiltJob, Job, build, epoch_order, job_differences, model_bytes
from ..common.job_loading import builtin_job_names, load_job
from ..common.security import KEYS_HINT, ClientKeys
from ..common.tensors import blob_chunks, buffer_vector, to_blob
from ..common.throttle import Throttle
from ..common.blobs import BlobError, Manifest, MAX_MANIFEST_BYTES
from .cache import (BlobCache, CacheError, CacheTooSmall, CoordinatorSource, DiskFull, HttpSource,
                    TransferCapReached, cache_from_settings)
from .engine import Cancelled, Engine, Outcome, SnapshotRef, Work
from .idle import (Decision, IdlePolicy, PolicyConfig, Readings, describe_policy,
                   memory_left_mb)
from .compress import ErrorFeedback
from .link import ShapedSocket
from .probes import Probes
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


class Guest:
    """Being a good guest, for the whole process: the idle policy, the probes, and the gate that
    lets the engines compute. One per process however many projects it serves, so that one
    reading of the machine pauses them all and the owner's limits count once."""

    def __init__(self, config: WorkerConfig, uses_gpu: bool, gpu_index: Optional[int] = None):
        self.policy = IdlePolicy(dataclasses.replace(config.policy, uses_gpu=uses_gpu))
        self.probes = Probes(ignore_niced=config.cpu_ignore_niced, gpu_index=gpu_index)
        self.running = threading.Event()  # the engines' gate: set while computing is allowed
        self.running.set()
        self.pauses = 0
        self._state_log = open(config.state_log, "a", buffering=1) if config.state_log else None
        self.log_state("start", Decision(True, (), False), None)

    def apply(self, readings: Readings, now: float) -> Optional[Decision]:
        """Decide on `readings`; open or close the gate. The decision when it changed, else None."""
        decision = self.policy.decide(readings, now)
        if not decision.changed:
            return None
        if decision.run:
            self.running.set()
            log.info("resuming: the machine has been idle for %gs", self.policy.config.resume_after)
        else:
            self.running.clear()  # the engines stop at their next micro-batch boundary
            self.pauses += 1
            log.info("pausing: %s", "; ".join(decision.reasons))
        self.log_state("running" if decision.run else "paused", decision, readings)
        return decision

    def log_state(self, state: str, decision: Decision, readings: Optional[Readings]) -> None:
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

    def close(self) -> None:
        if self._state_log is not None:
            self._state_log.close()


class _PrefetchGate:
    """A prefetch yields to the owner too: it stops at the next block of a pause and is given
    up (its partial file kept); the slot that needs the shard fetches it under its own gate."""

    def __init__(self, running: threading.Event):
        self._running = running

    def stopping(self) -> bool:
        return not self._running.is_set()

    def wait(self) -> None:
        raise CacheError("the owner needs the machine: prefetch given up until a slot needs it")


def _wire_sum(value: float) -> float:
    """The wire takes finite sums only: a diverged model's (inf, nan) reads as a huge one."""
    value = float(value)
    return value if math.isfinite(value) else (-1e300 if value == -math.inf else 1e300)


class _OtherJob(Refused):
    """The job built here is not the coordinator's (another fingerprint)."""


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
    MAX_UNACKED = 16  # results kept for resending; acknowledgements come within milliseconds
    # Copies of the model a worker holds at once: flat parameters and gradients, a model received
    # from the wire, a local task's optimizer moments (Adam's two); one gradient buffer per credit.
    MODEL_COPIES = 5
    # While the transfer cap is spent: how long the worker asks for no slots after it handed one
    # back, before it asks again (a locality-aware coordinator may then give it slots it holds)
    CAPPED_RETRY_S = 60.0

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
        self.built: Optional[BuiltJob] = None
        self._built_for: Optional[tuple] = None
        self.engine: Optional[Engine] = None
        self.heartbeat_s = 1.0
        self.liveness = 3
        self._queue: deque[Work] = deque()
        # (version, model as views of the frames it came in, its buffers or None, or the
        # snapshot that names it instead)
        self._cache: Optional[tuple[int, Optional[list[torch.Tensor]], Optional[torch.Tensor],
                                    Optional[SnapshotRef]]] = None
        self._current: Optional[tuple[Work, threading.Event]] = None
        self._refused_logged = Throttle()  # a flood of tasks past our credits
        self._began = 0.0  # when the current compute began (time.monotonic())
        self._stop: Optional[str] = None
        self.results_sent = 0
        self.results_resent = 0
        # The coordinator process this worker's slots and results belong to (welcome.instance),
        # and the results it has not yet seen acknowledged: resent after a reconnect to it.
        self._instance: Optional[str] = None
        self._unacked: dict[int, proto.Result] = {}
        # slot -> (its gradient buffer, trackers of its sends): back to the engine once dropped
        self._held: dict[int, tuple[torch.Tensor, list]] = {}
        self._wire = ErrorFeedback()  # results as the coordinator wants them (welcome)
        self._samples = guest is None  # alone: this worker reads the probes and decides
        if guest is None:
            uses_gpu = self.device.type == "cuda"
            guest = Guest(config, uses_gpu, (self.device.index or 0) if uses_gpu else None)
        self.guest = guest
        self._running = guest.running
        self.project = project or config.coordinator
        self.compute_slot = compute_slot
        self._nudged: Optional[asyncio.Event] = None  # set by MultiWorker when the guest changed
        # The data plane: the cache, made when a job first declares its data by manifest, and
        # the coordinator as its source of last resort, attached to each session's socket.
        self.cache: Optional[BlobCache] = None
        self.coordinator_source = CoordinatorSource()
        self.manifest: Optional[Manifest] = None  # of the job built, when it declares its data
        self._cache_logged = Throttle()
        self._mirrors: list[str] = []  # the owner's and the coordinator's, in that order
        # the daily transfer cap: when its allowance returns (time.time()), while it is spent
        self._capped_until: Optional[float] = None
        self._ask_again_at = 0.0  # capped: no slots asked for until then (time.monotonic())
        self._handback: list[int] = []  # slots to give back: their data is not here, nor can be
        self._announced: Optional[int] = None  # the credits last said in a READY
        self._shards_said: Optional[list[int]] = None  # as this session's coordinator last heard
        self._prefetch_told: list[int] = []
        self._prefetching: Optional[asyncio.Future] = None

    @property
    def policy(self) -> IdlePolicy:
        return self.guest.policy

    @property
    def probes(self) -> Probes:
        return self.guest.probes

    @property
    def pauses(self) -> int:
        return self.guest.pauses

    def nudge(self) -> None:
        """The shared guest paused or resumed: tell this session's coordinator."""
        if self._nudged is not None:
            self._nudged.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def _credits(self) -> int:
        if self.paused or (self.capped and time.monotonic() < self._ask_again_at):
            return 0
        return self.config.credits

    @property
    def capped(self) -> bool:
        """The daily transfer cap is spent (until the allowance returns)."""
        if self._capped_until is not None and time.time() >= self._capped_until:
            self._capped_until = None
            log.info("the daily transfer allowance is back: fetching again")
        return self._capped_until is not None

    # lifecycle ------------------------------------------------------------------------------

    def run(self) -> str:
        return asyncio.run(self._main())

    async def _main(self) -> str:
        on_stop_signals(self._on_signal)
        log.info("idle policy: %s (readings: %s)", describe_policy(self.guest.policy.config),
                 self.probes.describe())
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
        give_up_at = self._deadline()
        waiting = Waiting(self.config.coordinator, self.config.keys is not None, time.monotonic())
        timeout = self.config.connect_timeout
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
                            f"{self.config.connect_timeout:g}s (is it running? see "
                            f"--connect-timeout{KEYS_HINT if self.config.keys else ''})")
                    if (line := waiting.report(time.monotonic())) is not None:
                        log.warning("%s", line)
                    backoff = min(self.config.max_backoff, backoff * 2) * random.uniform(0.8, 1.2)
                    continue
                backoff = 0.25
                await self._session(sock, welcome)
                give_up_at = self._deadline()
                waiting = Waiting(self.config.coordinator, self.config.keys is not None,
                                  time.monotonic())
                if self._stop is None:
                    log.warning("lost the coordinator at %s; reconnecting", self.config.coordinator)
            finally:
                sock.close(linger=0 if self._stop is None else 1000)

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
        if self.config.keys is not None:
            self.config.keys.apply(sock)
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
                      "python": platform.python_version(), "protocol": str(proto.PROTOCOL_VERSION),
                      "job_identity": proto.JOB_IDENTITY_FORMAT},
            job=self.config.job, instance=self._instance)

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

    def _job_spec(self, welcome: proto.Welcome) -> str:
        if self.config.job is None and welcome.job not in builtin_job_names():
            raise Refused(f"the coordinator trains job {welcome.job!r}, which is not built in; "
                          "start this worker with --job SPEC naming that job's code on this machine")
        return self.config.job or welcome.job

    async def _data_store(self, sock, welcome: proto.Welcome) -> Optional[BlobCache]:
        """For a job that declares its data by manifest: the cache, its sources set (the owner's
        mirrors, the coordinator's, the coordinator) and the manifest in it, fetched while the
        session stays alive. None for a job that builds its own data."""
        key = (welcome.job, tuple(sorted(welcome.job_args.items())), welcome.seed,
               welcome.shuffle_window)
        if self._built_for == key and self.built is not None and self.built.job.data is None:
            return None
        job = load_job(self._job_spec(welcome), welcome.job_args)
        if job.data is None:
            return None
        self._ensure_cache()
        self.heartbeat_s, self.liveness = welcome.heartbeat_s, welcome.liveness
        try:
            path = await self._while_fetching(sock, asyncio.to_thread(self.cache.path_of, job.data))
            with open(path, "rb") as fh:
                manifest = Manifest.from_bytes(fh.read(MAX_MANIFEST_BYTES + 1), job.data)
        except (CacheError, BlobError, OSError) as exc:
            raise Refused(f"cannot fetch the manifest of job {job.name!r}'s data: {exc}") from None
        biggest = max((s.size for s in manifest.shards), default=0)
        if biggest > self.cache.max_bytes:
            raise CacheTooSmall(
                f"the cache cap of {self.cache.max_bytes / 2**30:.3g} GB (cache_max_gb) is below "
                f"one shard of job {job.name!r}'s data ({biggest / 2**30:.3g} GB): raise "
                "cache_max_gb in worker.toml (or --cache-max-gb)")
        self.manifest = manifest
        return self.cache

    def _ensure_cache(self) -> BlobCache:
        """The blob cache, made on first need (a job's data, a model snapshot), with the
        session's sources: the owner's mirrors, the coordinator's, the coordinator."""
        if self.cache is None:
            self.cache = cache_from_settings(self.config)
        self.cache.sources = ([HttpSource(url) for url in self._mirrors]
                              + [self.coordinator_source])
        if self.engine is not None:
            self.engine.store = self.cache
        return self.cache

    async def _while_fetching(self, sock, work):
        """Await `work` (a fetch in a thread) while the session lives: heartbeats go out, and the
        chunks it asked the coordinator for are delivered."""
        task = asyncio.ensure_future(work)
        recv = asyncio.ensure_future(sock.recv_multipart(copy=False))
        next_beat = time.monotonic()
        try:
            while not task.done():
                if time.monotonic() >= next_beat:
                    await self._send(sock, self._heartbeat(self._beat_state(None)))
                    next_beat = time.monotonic() + self.heartbeat_s
                await asyncio.wait({task, recv}, timeout=max(0.0, next_beat - time.monotonic()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if recv.done():
                    frames = recv.result()
                    recv = asyncio.ensure_future(sock.recv_multipart(copy=False))
                    try:
                        msg = proto.decode(frames)
                    except ProtocolError as exc:
                        log.warning("dropped a bad message from the coordinator: %s", exc)
                        continue
                    if isinstance(msg, proto.Chunk):
                        self.coordinator_source.deliver(msg)
                    elif isinstance(msg, proto.Reject):
                        self._on_reject(msg)
                    elif isinstance(msg, proto.Shutdown):
                        self._stop = f"shutdown: {msg.reason}"
                        self.coordinator_source.detach()
            return task.result()
        finally:
            recv.cancel()

    def _cache_counters(self) -> Optional[dict]:
        return self.cache.counters() if self.cache is not None else None

    def held_shards(self) -> list[int]:
        """The indices of the current manifest's shards that this worker's cache holds whole
        (a look at the folder, no hashing): what a worker can tell the coordinator for locality."""
        if self.cache is None or self.manifest is None:
            return []
        held = set(self.cache.held(s.sha256 for s in self.manifest.shards))
        return [k for k, s in enumerate(self.manifest.shards) if s.sha256 in held]

    def _prepare(self, welcome: proto.Welcome, store: Optional[BlobCache] = None) -> None:
        """Build the job the coordinator names, from this machine's own code (its data from
        `store` when it declares its data by manifest)."""
        key = (welcome.job, tuple(sorted(welcome.job_args.items())), welcome.seed,
               welcome.shuffle_window)
        if self._built_for != key:
            spec = self._job_spec(welcome)
            # The previous job is of no use now, and its memory is the next one's.
            self.built = self.engine = self._built_for = None
            job = load_job(spec, welcome.job_args)
            self._check_memory(job)
            self.built = build(job, device=self.device, store=store)
            self._check_memory(job, self.built)
            order = epoch_order(self.built.train, welcome.seed, welcome.shuffle_window)
            self.engine = Engine(self.built, order, self.device)
            self.engine.slowdown, self.engine.stall = self.config.slowdown, self.config.stall
            self.engine.poison = self.config.poison
            self.engine.store = self.cache
            self._built_for = key
        self.heartbeat_s = welcome.heartbeat_s
        self.liveness = welcome.liveness
        self._wire = ErrorFeedback(welcome.result_dtype)
        if self.built.fingerprint != welcome.fingerprint:
            # Another model under the job's name (another version of its code, or of idlegrad):
            # its gradients would be of no use, so say what differs and leave instead of joining.
            if welcome.job_identity is None:  # a coordinator that does not say
                raise _OtherJob(f"job fingerprint {self.built.fingerprint} here, "
                                f"{welcome.fingerprint} at the coordinator: refused to compute "
                                "for another version of the job")
            differs = job_differences(self.built.identity, welcome.job_identity,
                                      "here", "at the coordinator")
            raise _OtherJob(f"job {self.built.job.name!r} here is not the coordinator's "
                            f"({'; '.join(differs) or 'fingerprints differ'}): start this worker "
                            "with the coordinator's job and version")

    def _check_memory(self, job: Job, built: Optional[BuiltJob] = None) -> None:
        """Refuse a job the owner's memory limits have no room for. The coordinator chooses the
        job's arguments, so it chooses its size: before building, the model is measured on the
        meta device (nothing allocated) and counted as every copy the worker will hold; after,
        what building took (data sets too) is in the worker's resident memory, and the copies
        still to come are added. A factory that allocates by itself is seen only after."""
        copies = self.MODEL_COPIES + self.config.credits
        if built is None:
            per_copy = model_bytes(job)
            if per_copy is None:
                return  # not measurable without building it: measured after
        else:
            model = built.model
            per_copy = model.params.nbytes + sum(b.nbytes for b in model.module.buffers())
            copies -= 2  # its parameters and gradients are built
        need_mb = per_copy * copies / 2**20
        left_mb = memory_left_mb(self.config.policy, psutil.Process().memory_info().rss / 2**20,
                                 psutil.virtual_memory().available / 2**20)
        if need_mb > left_mb:
            self.built = None
            needs = "needs" if built is None else "once built, needs"
            raise Refused(
                f"job {job.name!r} with the coordinator's arguments {needs} {need_mb:,.0f} MiB "
                f"more ({copies} copies of a {per_copy / 2**20:,.1f} MiB model), and this worker "
                f"may take {max(0.0, left_mb):,.0f} MiB more (the owner's --memory-max and the "
                "memory the machine has free): refused")

    async def _session(self, sock, welcome: proto.Welcome) -> None:
        self._attach(sock)
        try:
            await self._session_on(sock, welcome)
        finally:
            self.coordinator_source.detach()  # fetches under way fail, and resume later

    def _attach(self, sock) -> None:
        """Let the cache's thread ask the coordinator for chunks on this session's socket."""
        loop = asyncio.get_running_loop()

        def send(msg: proto.Message) -> None:  # from the cache's thread
            try:
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._send(sock, msg)))
            except RuntimeError:  # the loop is closing
                raise ConnectionError("the worker is stopping") from None

        self.coordinator_source.attach(send)

    async def _session_on(self, sock, welcome: proto.Welcome) -> None:
        while True:
            self._mirrors = list(dict.fromkeys([*self.config.blob_mirrors, *welcome.blob_mirrors]))
            if self.cache is not None:
                self._ensure_cache()  # this session's sources
            try:
                try:
                    store = await self._data_store(sock, welcome)
                    self._prepare(welcome, store)
                except (Refused, ConfigError) as exc:  # this worker cannot run that job
                    if isinstance(exc, _OtherJob) and welcome.job_identity is not None:
                        # the coordinator says what differs; its answer shows the ready arrived
                        await self._send(sock, proto.Ready(
                            credits=0, fingerprint=self.built.fingerprint,
                            job_identity=proto.job_identity_or_none(self.built.identity)))
                        await self._recv(sock, 2.0)
                    else:
                        await self._send(sock, proto.Bye(reason=str(exc)[:500]))
                    raise
                await self._resume(sock, welcome)
                self._shards_said, self._prefetch_told = None, []  # a new session hears anew
                if self.paused or self.capped:
                    await self._send(sock, self._heartbeat(self._beat_state(None)))
                await self._send_ready(sock)
                log.info("joined %s: job %s, %d credits, %s with %d threads%s",
                         self.config.coordinator, welcome.job, self.config.credits, self.device,
                         self.threads, " (paused)" if self.paused else "")
                await self._serve(sock)
                return
            except _Rehello:
                log.info("the coordinator does not know this session (restarted?); saying hello again")
                welcome = await self._handshake(sock, timeout=self.heartbeat_s * self.liveness)
                if welcome is None:
                    return

    def _abort_work(self) -> None:
        self._queue.clear()
        self._cache = None
        if self._current is not None:
            self._current[1].set()

    def _forget_session(self) -> None:
        """Nothing held is any use: the next hello starts afresh."""
        self._abort_work()
        self._drop_results(list(self._unacked))
        self._instance = None

    async def _resume(self, sock, welcome: proto.Welcome) -> None:
        """After a welcome: keep what this coordinator still expects of us, resend the results it
        has not acknowledged, drop the rest (a restarted coordinator knows none of our slots)."""
        if welcome.instance != self._instance:
            if self._instance is not None:
                log.info("a new coordinator process: dropping %d queued slots and %d unacknowledged "
                         "results of the old one", len(self._queue), len(self._unacked))
            self._queue.clear()
            self._drop_results(list(self._unacked))
            self._instance = welcome.instance
            return
        holding = set(welcome.holding)
        self._queue = deque(w for w in self._queue if w.slot in holding)
        self._drop_results([s for s in self._unacked if s not in holding])
        for slot, result in list(self._unacked.items()):
            await self._send_tracked(sock, slot, result)
            self.results_resent += 1
        if self._unacked:
            log.info("resent %d unacknowledged results", len(self._unacked))

    async def _serve(self, sock) -> None:
        last_heard = time.monotonic()
        next_beat = time.monotonic()
        next_sample = time.monotonic() + self.config.sample_every
        if self._samples:  # (shared probes are MultiWorker's, read by its own task)
            self.probes.restart()  # the first reading covers one sample, not the start-up
        recv = asyncio.ensure_future(sock.recv_multipart(copy=False))
        computing: Optional[asyncio.Future] = None
        sampling: Optional[asyncio.Future] = None
        # The process's one compute slot, when shared with other projects: asked for, then lent.
        granted: Optional[asyncio.Future] = None
        nudge: Optional[asyncio.Future] = None
        if not self._samples:  # another reads the probes, and nudges this session on a change
            self._nudged = asyncio.Event()
            nudge = asyncio.ensure_future(self._nudged.wait())
        try:
            if self.compute_slot is not None:
                self.compute_slot.up(self.project)
            while True:
                if self._stop is not None:
                    await self._send(sock, proto.Bye(reason=self._stop))
                    return
                now = time.monotonic()
                if now >= next_beat:
                    await self._send(sock, self._heartbeat(self._beat_state(computing)))
                    next_beat = now + self.heartbeat_s
                    if self._credits() != self._announced:  # capped: time to ask again, or back
                        await self._announce(sock, computing)
                if now - last_heard > self.heartbeat_s * self.liveness:
                    return  # the coordinator is gone: the caller reconnects
                if self._samples and sampling is None and now >= next_sample:
                    sampling = asyncio.ensure_future(asyncio.to_thread(self.probes.read))
                    next_sample = now + self.config.sample_every
                waiting = {recv}
                waiting |= {f for f in (computing, sampling, granted, nudge) if f is not None}
                wake = (next_beat if sampling is not None or not self._samples
                        else min(next_beat, next_sample))
                await asyncio.wait(waiting, timeout=max(0.0, wake - time.monotonic()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if sampling is not None and sampling.done():
                    readings = sampling.result() if sampling.exception() is None else Readings()
                    sampling = None
                    if self.guest.apply(readings, time.monotonic()) is not None:
                        await self._announce(sock, computing)
                if nudge is not None and nudge.done():
                    self._nudged.clear()
                    nudge = asyncio.ensure_future(self._nudged.wait())
                    await self._announce(sock, computing)
                if recv.done():
                    frames = recv.result()
                    recv = asyncio.ensure_future(sock.recv_multipart(copy=False))
                    last_heard = time.monotonic()
                    self._dispatch(frames)
                if computing is not None and computing.done():
                    outcome = self._finish(computing)
                    computing = None
                    if self._handback:
                        await self._hand_back(sock, computing)
                    if granted is not None:  # the next task may be another project's
                        self.compute_slot.leave(self.project, outcome.compute_s if outcome else 0.0)
                        granted = None
                    if outcome is not None:
                        await self._send_result(sock, outcome)
                if (granted is not None and granted.done() and computing is None
                        and not self._queue):  # lent, but its task was cancelled meanwhile
                    self.compute_slot.leave(self.project, 0.0)
                    granted = None
                if computing is None and self._queue and self._stop is None and not self.paused:
                    if self.compute_slot is not None and granted is None:
                        granted = self.compute_slot.request(self.project)
                    if granted is not None and not granted.done():
                        continue  # another project's task runs first
                    work = self._queue.popleft()
                    cancel = threading.Event()
                    self._current = (work, cancel)
                    self._began = time.monotonic()
                    computing = asyncio.ensure_future(
                        asyncio.to_thread(self.engine.compute, work, cancel, self._running))
        finally:
            recv.cancel()
            if nudge is not None:
                nudge.cancel()
                self._nudged = None
            if sampling is not None:
                await asyncio.wait({sampling})
            if computing is not None:
                work = self._current[0] if self._current is not None else None
                if self._current is not None:
                    self._current[1].set()
                await asyncio.wait({computing})
                outcome = self._finish(computing)
                if self._stop is None:
                    if outcome is not None and outcome.sums is None:  # sent after the reconnect
                        self._keep_result(outcome)
                    elif work is not None:  # interrupted by the lost session: compute it again
                        self._queue.appendleft(work)
                if granted is not None:
                    self.compute_slot.leave(self.project, outcome.compute_s if outcome else 0.0)
                    granted = None
            if self.compute_slot is not None:  # asked for, or lent and not used: the others' now
                self.compute_slot.down(self.project)

    def _keep_result(self, outcome: Outcome) -> proto.Result:
        result = proto.Result(
            slot=outcome.slot, version=outcome.version, samples=outcome.samples,
            loss=outcome.loss, compute_s=outcome.compute_s,
            gradient=to_blob(self._wire.encode(outcome.gradient)), waited_s=outcome.waited_s,
            buffers=None if outcome.buffers is None else to_blob(outcome.buffers))
        self._drop_results([outcome.slot])  # a recomputed slot replaces its older result
        self._unacked[outcome.slot] = result
        self._held[outcome.slot] = (outcome.gradient, [])
        while len(self._unacked) > self.MAX_UNACKED:  # a coordinator that never acknowledges
            self._drop_results([next(iter(self._unacked))])
        return result

    async def _send_result(self, sock, outcome: Outcome) -> None:
        if outcome.sums is not None:
            # Not kept for a resend: a lost evaluation answer is a slot the coordinator hands
            # out again at its deadline.
            await self._send(sock, proto.EvalResult(
                slot=outcome.slot, version=outcome.version, compute_s=outcome.compute_s,
                sums={name[:proto.MAX_METRIC_NAME]: [_wire_sum(s), _wire_sum(c)]
                      for name, (s, c) in list(outcome.sums.items())[:proto.MAX_EVAL_METRICS]}))
            self.results_sent += 1
            return
        await self._send_tracked(sock, outcome.slot, self._keep_result(outcome))
        self.results_sent += 1

    async def _send_tracked(self, sock, slot: int, result: proto.Result) -> None:
        """Send a result zero-copy, noting the send's tracker: its gradient buffer is reused only
        once every send of it is done and the result is acknowledged or dropped."""
        tracker = await sock.send_multipart(proto.encode(result), copy=False, track=True)
        if slot in self._held:
            self._held[slot][1].append(tracker)

    def _drop_results(self, slots) -> None:
        for slot in slots:
            self._unacked.pop(slot, None)
            held = self._held.pop(slot, None)
            if held is not None:
                self.engine.release(held[0], held[1])

    def _heartbeat(self, state: str) -> proto.Heartbeat:
        """A heartbeat: the cache's counters, and the shards this worker holds when they changed
        since it last said (a bounded, sorted list, for the coordinator's locality)."""
        try:
            shards = sorted({int(k) for k in self.held_shards() if int(k) >= 0})
        except Exception as exc:  # the cache's hook: locality is a preference, work goes on
            if self._refused_logged.ready(time.monotonic()):
                log.warning("could not list the shards held: %s", exc)
            shards = self._shards_said or []
        shards = shards[:proto.MAX_HELD_SHARDS]
        cache = self._cache_counters()
        if shards == self._shards_said:
            return proto.Heartbeat(state=state, cache=cache)
        self._shards_said = shards
        return proto.Heartbeat(state=state, shards=shards, cache=cache)

    def _prefetch(self, shards: list[int]) -> None:
        """The coordinator's hint of the shards this worker will need next: fetch the missing
        ones ahead, one fetch at a time, in a thread (as the compute thread fetches on first
        use; the cache downloads each blob once, whoever asks first)."""
        if not shards or shards == self._prefetch_told or self.cache is None or self.manifest is None:
            return
        self._prefetch_told = list(shards)
        if self._prefetching is not None and not self._prefetching.done():
            return  # a hint lost costs a later fetch on first use, no more
        wanted = [self.manifest.shards[k] for k in shards if 0 <= k < len(self.manifest.shards)]
        held = set(self.cache.held(s.sha256 for s in wanted))
        missing = [s for s in wanted if s.sha256 not in held]
        if missing:
            self._prefetching = asyncio.ensure_future(asyncio.to_thread(self._fetch_ahead, missing))

    def _fetch_ahead(self, shards) -> None:
        with self.cache.gated(_PrefetchGate(self._running)):
            for shard in shards:
                try:
                    self.cache.path_of(shard.sha256, shard.size)
                except Exception as exc:  # a guess: the slot that needs it fetches again
                    log.info("prefetch of shard %s stopped: %s", shard.sha256[:12], exc)
                    return

    def _beat_state(self, computing) -> str:
        if self.paused:
            return "paused"
        if self.capped:
            return "capped"
        return "working" if computing is not None else "idle"

    async def _announce(self, sock, computing) -> None:
        """Tell the coordinator at once that the guest paused or resumed (no slots while
        paused), or that the transfer cap was reached or its allowance returned."""
        await self._send(sock, self._heartbeat(self._beat_state(computing)))
        await self._send_ready(sock)

    async def _send_ready(self, sock) -> None:
        self._announced = self._credits()
        await self._send(sock, proto.Ready(credits=self._announced,
                                           fingerprint=self.built.fingerprint))

    async def _hand_back(self, sock, computing) -> None:
        """Slots whose data is not here and cannot be fetched today go back at once, after a
        READY 0: the coordinator gives them to others, not to us again."""
        slots, self._handback = self._handback, []
        self._ask_again_at = time.monotonic() + self.CAPPED_RETRY_S
        await self._announce(sock, computing)
        await self._send(sock, proto.Handback(
            slots=slots, reason="the daily transfer cap is spent and the data is not cached"))

    def _finish(self, computing: asyncio.Future) -> Optional[Outcome]:
        work, cancel = self._current
        self._current = None
        try:
            outcome = computing.result()
            if work.arrived is not None:
                outcome = dataclasses.replace(outcome, waited_s=max(0.0, self._began - work.arrived))
            return outcome
        except Cancelled:
            return None
        except TransferCapReached as exc:
            if not self.capped:
                log.warning("%s: asking for no slots that need data not cached here, until the "
                            "allowance returns", exc)
            self._capped_until = self.cache.capped_until(time.time()) or time.time() + 60
            self._handback.append(work.slot)
            return None
        except (CacheTooSmall, DiskFull) as exc:  # no slot can be computed here until fixed
            log.error("%s; leaving", exc)
            self._stop = str(exc)
            return None
        except (CacheError, BlobError) as exc:  # no source has the blob now: the slot goes on
            if self._cache_logged.ready(time.monotonic()):
                log.warning("slot %d: %s", work.slot, exc)
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
        if isinstance(msg, proto.Chunk):
            self.coordinator_source.deliver(msg)
        elif isinstance(msg, proto.Task):
            if msg.acks:
                self._drop_results(msg.acks)
            self._on_task(msg)
            self._prefetch(msg.prefetch)
        elif isinstance(msg, proto.Cancel):
            cancelled = set(msg.slots)
            self._queue = deque(w for w in self._queue if w.slot not in cancelled)
            if self._current is not None and self._current[0].slot in cancelled:
                self._current[1].set()
        elif isinstance(msg, proto.Ack):
            self._drop_results(msg.slots)
        elif isinstance(msg, proto.Shutdown):
            log.info("the coordinator says: %s", msg.reason)
            self._stop = f"shutdown: {msg.reason}"
            self._abort_work()
        elif isinstance(msg, proto.Reject):
            self._on_reject(msg)
        # Heartbeats need nothing beyond having been heard.

    def _holds(self, slot: int) -> bool:
        """Whether `slot` is queued or computing. (A slot whose result is unacknowledged is not
        held: the coordinator may have refused that result and handed the slot back to us.)"""
        return (any(w.slot == slot for w in self._queue)
                or (self._current is not None and self._current[0].slot == slot))

    def _on_task(self, task: proto.Task) -> None:
        if task.snapshot is not None:  # the model by name: fetched when the slot is computed
            self._ensure_cache()
            self._cache = (task.version, None, None,
                           SnapshotRef(task.snapshot, task.snapshot_bytes))
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
                log.warning("task %d: bad model: %s", task.slot, exc)
                return
            self._cache = (task.version, params, buffers, None)
        elif self._cache is None or self._cache[0] != task.version:
            # The coordinator thinks we hold a model we do not: start the session afresh.
            self._forget_session()
            raise _Rehello()
        if self._holds(task.slot):  # sent again after a resumed session: we have it
            return
        held = len(self._queue) + (self._current is not None)
        if held >= 2 * self.config.credits + 2:
            # The coordinator deals at most our credits (a pause or a resume can cross a task in
            # flight, hence the margin); past that its tasks would only pile up here. It hands
            # the slot to someone else when its deadline passes.
            if self._refused_logged.ready(time.monotonic()):
                log.warning("task %d refused: %d slots held already, for %d credits", task.slot,
                            held, self.config.credits)
            return
        work = Work(task.slot, task.version, self._cache[1], task.parts, task.coefficients,
                    task.kind, task.steps, arrived=time.monotonic(), buffers=self._cache[2],
                    snapshot=self._cache[3])
        try:
            self.engine.check(work)
        except ValueError as exc:
            log.warning("task %d refused: %s", task.slot, exc)
            return
        self._queue.append(work)
