"""A fleet in virtual time: the real scheduler, codes and staleness rule, driven by a simulator.

Nobody can run ten thousand volunteers on one machine; but the scheduler (`scheduler.py`), the
codes (`common/coding.py`), adaptive redundancy and the staleness rule (`aggregator.py`) are pure
logic that takes `now`, so the same code can be driven by a discrete-event simulation: a heap of
virtual events (a worker comes online, a task arrives, a computation ends, a result reaches the
coordinator, a heartbeat, a tick) processed in time order. Nothing of the socket loops is used.

The model, and what it leaves out:

- Workers (`WorkerSpec`): seconds per sample (from a distribution, a CSV or a preset), credits,
  one-way latency and bandwidth, fault injection as the real engine does it (a slowdown factor, a
  stall of S seconds with probability P per task), a per-task jitter, and sessions of
  availability (from a churn model or a trace). A worker computes its tasks one after another in
  arrival order, as the daemon does; a cancel drops a queued task or stops the running one. When
  a session ends the worker vanishes silently (or says bye, for a fraction of departures): the
  scheduler notices it by its silence. A new session is a new process: hello, ready, no cache.
- Heartbeats are delivered every `liveness - 1` beats rather than every beat (a worker that is
  online is never evicted by mistake, since that is still within the silence the scheduler
  allows); an offline worker is therefore noticed up to one beat early. Results and readies
  refresh liveness as in the server.
- The coordinator is one queue: each message it takes (result, hello, ready, heartbeat) costs CPU
  time (`CoordinatorCosts`), plus bytes over its throughput (gradients in, models out, the sum and
  the step of a round); a message waits while the coordinator is busy. Its load is the fraction
  of time it is busy; past 1 it is the bottleneck.
- Gradients are costless by default (throughput and scheduling only: a round's step is counted,
  the staleness rule decides whether it is applied or replanned) or real (`RealGradients`: a
  small job's gradient is computed in this process for every used result, at the model version
  its slot was planned at, and applied through the real `Aggregator`, so staleness shows in the
  test metric).

- Data (`shards` > 0): the training set is cut into equal shards of `shard_bytes`. A worker
  fetches the shards a task reads that it does not hold before computing it, one download after
  another over its own link (its bandwidth), and the shards a prefetch hint names as soon as the
  hint arrives; its cache keeps at most `cache_shards` (least recently used out). It reports its
  shards in heartbeats, as the daemon does. With `locality` the epoch order is shard-aware and the
  scheduler prefers a worker's shards (coordinator/locality.py); without, a full shuffle, and any
  slot reads nearly every shard. The bytes each worker downloaded are in the result.

`simulate()` runs one mode; `compare()` runs several on the same fleet, sessions and seed.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Optional, Sequence

import numpy as np

from ..common import coding
from ..common.errors import ConfigError
from ..common.permutation import ShardOrder, epoch_blocks, part_indices
from .effects import Applied, Compute, Replanned, Used
from .local import parse_task
from .locality import Locality, group_for
from .rounds import RoundCore
from .sampler import Sampler
from .scheduler import Assign, CancelSlots, Evicted, Scheduler, SchedulerConfig
from .sim_backends import CostlessGradients, RealGradients
from .sim_fleet import (FLEET_MIX, Churn, SimWorker, WorkerSpec, fleet_from_csv,
                        lognormal_fleet, mixed_fleet, parse_churn, sessions_from_trace)
from .staleness import StalenessRule
from .trust import TrustConfig, TrustPolicy

__all__ = ["Churn", "CoordinatorCosts", "CostlessGradients", "FLEET_MIX", "ModeResult",
           "RealGradients", "SimConfig", "Simulation", "WorkerSpec", "check_mode", "compare",
           "fleet_from_csv", "lognormal_fleet", "mixed_fleet", "parse_churn",
           "sessions_from_trace", "simulate"]

# coordinator ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CoordinatorCosts:
    """What the coordinator's own work costs: CPU seconds per message taken in (decode,
    schema checks, the scheduler, the reply), and its throughput in bytes/s for tensors (a
    gradient taken in and checked, a model sent, a round's weighted sum and optimizer step).
    Defaults from `benchmarks/scheduler_scale.py --costs` on this machine (see docs/scaling.md)."""

    per_message_s: float = 60e-6
    bytes_per_s: float = 1.5e9


@dataclass
class SimConfig:
    duration_s: float = 3600.0
    batch_size: int = 1024
    partitions: int = 8
    open_rounds: int = 0
    redundancy: str = "none"  # none | replicate:R | cyclic:S | adaptive | sync
    speculate: bool = True
    heartbeat_s: float = 1.0
    liveness: int = 3
    task_timeout_s: float = 30.0
    staleness: str = "inverse"
    max_staleness: int = 32
    model_bytes: int = 4_000_000  # parameters x 4 (float32): a gradient is as large
    train_samples: int = 60_000  # for costless gradients: the data set the sampler plans over
    costs: CoordinatorCosts = CoordinatorCosts()
    target_samples: Optional[int] = None  # stop once this many samples are applied
    eval_every_s: float = 0.5  # real gradients: evaluate this often (virtual seconds)
    sample_every_s: Optional[float] = None  # the time series' step (default: duration / 200)
    bye_fraction: float = 0.0  # departures that say bye (the rest vanish silently)
    startup_s: float = 0.0  # from a session's start to its hello (process start-up)
    warmup_s: float = 0.0  # the scheduler's cost per slot and per heartbeat is counted after this
    verify_replicas: bool = False  # with replicate:R, a row counts once two copies agree
    task: str = "gradient"  # what a slot computes: gradient | local:H | local:auto
    seed: int = 0
    shards: int = 0  # the training set in this many equal shards that workers fetch; 0: local data
    shard_bytes: int = 64 * 2**20
    locality: bool = True  # sharded data: the shard-aware order and the scheduler's preference
    shuffle_window: int = 4  # shards whose samples are shuffled together
    cache_shards: Optional[int] = None  # shards a worker's cache keeps; None: no limit


# events, in order of kind at equal times
_ONLINE, _OFFLINE, _HELLO, _READY, _TASK, _CANCEL, _DONE, _RESULT, _BYE, _BEAT, _TICK, _SAMPLE, \
    _EVAL, _REJOIN, _NEXT_MESSAGE = range(15)
_TO_COORDINATOR = (_HELLO, _READY, _RESULT, _BYE, _BEAT)


@dataclass
class ModeResult:
    mode: str
    duration_s: float  # virtual seconds simulated (less when the target was reached)
    samples_applied: int
    samples_per_s: float
    rounds_decoded: int
    rounds_applied: int
    rounds_replanned: int
    slots_assigned: int
    slots_measured: int  # assigned after the warm-up
    slots_cancelled: int
    wasted_fraction: float  # worker compute not in an applied gradient, over all of it (less
    # the results still waiting in open rounds at the end)
    mean_staleness: float
    staleness: dict[int, int]  # tau -> rounds applied
    coordinator_load: float  # busy fraction of the coordinator
    coordinator_by: dict  # its busy fraction by cause (results, models out, sums and steps, ...)
    time_to_target_s: Optional[float]
    scheduler_us_per_slot: float  # time inside scheduler calls per slot assigned (CPU share)
    decision_us_per_slot: float  # the same without ticks: result, ready, applied, join, leave
    tick_us: float  # time per tick (liveness, deadlines, speculation)
    heartbeat_us: float  # time inside scheduler.seen per heartbeat delivered (CPU share)
    wall_s: float
    series: list[dict] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)  # real gradients: the last evaluation
    codes: dict = field(default_factory=dict)
    downloaded: dict = field(default_factory=dict)  # sharded data: worker -> bytes of shards
    data_bytes: int = 0  # sharded data: the training set's bytes

    @property
    def download_ratio(self) -> Optional[float]:
        """The most any worker downloaded over its share of the data (data / workers)."""
        if not self.downloaded or not self.data_bytes:
            return None
        return max(self.downloaded.values()) / (self.data_bytes / len(self.downloaded))

    def summary(self) -> dict:
        out = {"samples_per_s": round(self.samples_per_s, 3),
               "wasted_fraction": round(self.wasted_fraction, 4),
               "mean_staleness": round(self.mean_staleness, 3)}
        if self.downloaded:
            out["download_ratio"] = round(self.download_ratio, 3)
            out["downloaded_mb"] = round(sum(self.downloaded.values()) / 2**20, 1)
        return out



def _mode_settings(mode: str) -> tuple[bool, str]:
    if mode == "sync":
        return True, "none"
    return False, str(coding.parse_redundancy(mode))


class Simulation:
    def __init__(self, fleet: Sequence[WorkerSpec], config: SimConfig, mode: str,
                 gradients=None, target: Optional[Callable[[dict], bool]] = None,
                 scheduler_class=Scheduler):
        self.config = config
        self.mode = mode
        sync, redundancy = _mode_settings(mode)
        rule = StalenessRule(config.staleness, config.max_staleness)
        self.gradients = gradients or CostlessGradients(config.train_samples, config.batch_size,
                                                        rule)
        self.target = target
        per_shard = self._shard_samples(config)
        self.shard_of: Optional[np.ndarray] = None  # sample -> its shard (sharded data)
        self.order = config.seed  # a full shuffle, or the shard-aware order
        if per_shard:
            self.shard_of = np.repeat(np.arange(len(per_shard)), per_shard)
            if config.locality:
                self.order = ShardOrder(config.seed, per_shard, config.shuffle_window)
        sharded = isinstance(self.order, ShardOrder)
        if sharded and hasattr(self.gradients, "seed"):
            self.gradients.seed = self.order  # real gradients read the order the plan names
        self.sampler = Sampler(self.gradients.train_samples, blocks=(
            partial(epoch_blocks, self.order) if sharded else None))
        redundancy_policy = coding.parse_redundancy(redundancy)
        self.scheduler = scheduler_class(SchedulerConfig(
            batch_size=self.gradients.batch_size, partitions=config.partitions,
            open_rounds=config.open_rounds, heartbeat_s=config.heartbeat_s,
            liveness=config.liveness, min_deadline_s=config.task_timeout_s,
            redundancy=redundancy_policy, sync=sync,
            speculate=config.speculate, verify_replicas=config.verify_replicas), self.sampler,
            task_mode=parse_task(config.task),
            locality=Locality(self.order, group_for(redundancy_policy)) if sharded else None)
        # the server's own round core: the same decode, step, replan, compare and settle
        self.core = RoundCore(self.scheduler, self.gradients, TrustPolicy(TrustConfig()))
        self.rng = np.random.default_rng(config.seed)
        self.workers = {}
        for i, spec in enumerate(fleet):
            sessions = spec.sessions if spec.sessions is not None else [(0.0, math.inf)]
            self.workers[spec.id] = SimWorker(spec, deque(sessions),
                                            np.random.default_rng([config.seed, i]))
        self.events: list = []
        self._seq = 0
        self.now = 0.0
        self.coord_free = 0.0
        self.coord_busy = 0.0
        self.coord_by: dict[str, float] = {}  # busy seconds by what it was doing
        self.online = 0
        self.inbox: deque = deque()  # messages waiting for the busy coordinator
        self._waking = False
        self.beat_every = config.heartbeat_s * max(1, config.liveness - 1)
        # accounting
        self.samples_applied = 0
        self.rounds_decoded = self.rounds_applied = self.rounds_replanned = 0
        self.slots_assigned = self.slots_cancelled = self.slots_measured = 0
        self.compute_total = self.compute_useful = 0.0
        self.used_compute: dict[int, float] = {}  # slot -> compute seconds of its used result
        self.staleness: dict[int, int] = {}
        self.sched_s = 0.0
        self.beat_s = 0.0
        self.beats = 0
        self.tick_s = 0.0
        self.ticks = 0
        self.time_to_target: Optional[float] = None
        self.series: list[dict] = []
        self.metrics: dict = {}
        self._last_sample = (0.0, 0, 0.0)

    def _shard_samples(self, config: SimConfig) -> tuple[int, ...]:
        """Samples per shard of the emulated sharded data (nearly equal); () for local data."""
        if not config.shards:
            return ()
        n = self.gradients.train_samples
        if not 1 <= config.shards <= n:
            raise ConfigError(f"--shards must be from 1 to the {n} training samples")
        if config.shuffle_window < 1:
            raise ConfigError("--shuffle-window must be at least 1")
        bounds = np.linspace(0, n, config.shards + 1).round().astype(np.int64)
        return tuple(int(x) for x in np.diff(bounds))

    # the event queue -------------------------------------------------------------------------

    def _at(self, t: float, kind: int, *data) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, kind, self._seq, data))

    def run(self) -> ModeResult:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        end = self.config.duration_s
        for w in self.workers.values():
            self._next_session(w)
        self._at(0.0, _TICK)
        step = self.config.sample_every_s or max(end / 200, 1e-3)
        self._at(step, _SAMPLE, step)
        if isinstance(self.gradients, RealGradients):
            self._at(self.config.eval_every_s, _EVAL)
        events, handlers = self.events, self._handlers()
        self._handlers_by_kind = handlers
        while events and self.time_to_target is None:
            t, kind, _, data = heapq.heappop(events)
            if t > end:
                break
            self.now = t
            if kind in _TO_COORDINATOR and (self.coord_free > t or self.inbox):
                self.inbox.append((kind, data))  # it waits its turn
                self._wake()
                continue
            handlers[kind](*data)
        duration = self.time_to_target if self.time_to_target is not None else end
        wall = time.perf_counter() - wall0
        # Scheduler calls are timed with the wall clock (a CPU clock costs a microsecond a
        # read); on a shared machine the process is off the CPU part of that time, so the
        # figures are scaled by the share of the run it was on it.
        self.cpu_share = min(1.0, (time.process_time() - cpu0) / wall) if wall > 0 else 1.0
        return self._result(duration, wall)

    def _wake(self) -> None:
        if self.inbox and not self._waking:
            self._waking = True
            self._at(max(self.coord_free, self.now), _NEXT_MESSAGE)

    def _next_message(self) -> None:
        """The coordinator is free: it takes the oldest waiting message."""
        self._waking = False
        kind, data = self.inbox.popleft()
        self._handlers_by_kind[kind](*data)
        self._wake()

    def _handlers(self):
        return {_ONLINE: self._online, _OFFLINE: self._offline, _HELLO: self._hello,
                _READY: self._ready, _TASK: self._task, _CANCEL: self._cancel, _DONE: self._done,
                _RESULT: self._result_in, _BYE: self._bye, _BEAT: self._beat, _TICK: self._tick,
                _SAMPLE: self._sample, _EVAL: self._eval, _REJOIN: self._rejoin,
                _NEXT_MESSAGE: self._next_message}

    # worker side -----------------------------------------------------------------------------

    def _next_session(self, w: SimWorker) -> None:
        while w.sessions:
            start, stop = w.sessions.popleft()
            if stop > self.now:
                self._at(max(start, self.now), _ONLINE, w, stop)
                return

    def _online(self, w: SimWorker, stop: float) -> None:
        w.online = True
        self.online += 1
        w.session += 1
        w.available += 1
        self._at(self.now + self.config.startup_s + w.spec.latency_s, _HELLO, w, w.session)
        if stop < math.inf:
            self._at(stop, _OFFLINE, w, w.available)

    def _offline(self, w: SimWorker, available: int) -> None:
        if available != w.available or not w.online:
            return
        if w.current is not None:
            self.compute_total += self.now - w.started  # lost with the machine
        w.online, w.current = False, None
        self.online -= 1
        w.queue.clear()
        w.session += 1
        if w.rng.random() < self.config.bye_fraction:
            self._at(self.now + w.spec.latency_s, _BYE, w)
        self._next_session(w)

    def _rejoin(self, w: SimWorker, session: int) -> None:
        if session != w.session:
            return
        if w.current is not None:
            self.compute_total += self.now - w.started
        w.current = None
        w.queue.clear()
        w.session += 1
        self._at(self.now + w.spec.latency_s, _HELLO, w, w.session)

    def _task(self, w: SimWorker, session: int, task: tuple) -> None:
        if session != w.session or not w.online:
            return  # the worker it was sent to has gone (sent before the scheduler noticed)
        if self.shard_of is not None:
            self._fetch(w, task[2].prefetch)
        w.queue.append(task)
        if w.current is None:
            self._start(w)

    def _start(self, w: SimWorker) -> None:
        if not w.queue:
            return
        task = w.queue.popleft()
        spec = w.spec
        ready = self._fetch(w, self._shards_read(task[2])) if self.shard_of is not None else 0.0
        seconds = spec.s_per_sample * task[1] * spec.slowdown + max(0.0, ready - self.now)
        if spec.jitter:
            seconds *= math.exp(spec.jitter * w.rng.standard_normal())
        if spec.stall_p and w.rng.random() < spec.stall_p:
            seconds += spec.stall_s
        w.current, w.started = task, self.now
        self._at(self.now + seconds, _DONE, w, w.session, task[0])

    def _fetch(self, w: SimWorker, shards) -> float:
        return w.fetch(shards, self.now, self.config.shard_bytes, self.config.cache_shards)

    def _shards_read(self, assign: Assign) -> list[int]:
        shards: set[int] = set()
        for epoch, offset, count in assign.parts:
            indices = part_indices(self.order, self.gradients.train_samples, epoch, offset, count)
            shards.update(np.unique(self.shard_of[indices]).tolist())
        return sorted(shards)

    def _done(self, w: SimWorker, session: int, slot: int) -> None:
        if session != w.session or w.current is None or w.current[0] != slot:
            return  # cancelled while it ran, or the session ended
        task, compute = w.current, self.now - w.started
        self.compute_total += compute
        w.current = None
        transfer = w.spec.latency_s + self.config.model_bytes / w.spec.bandwidth
        self._at(self.now + transfer, _RESULT, w, w.session, task, compute)
        self._start(w)

    def _cancel(self, w: SimWorker, session: int, slots: list[int]) -> None:
        if session != w.session or not w.online:
            return
        gone = set(slots)
        w.queue = deque(t for t in w.queue if t[0] not in gone)
        if w.current is not None and w.current[0] in gone:
            self.compute_total += self.now - w.started
            w.current = None
            self._start(w)

    def _beat(self, w: SimWorker, session: int) -> None:
        if session != w.session:
            return
        self._charge(self.config.costs.per_message_s * self.beat_every / self.config.heartbeat_s,
                     "heartbeats")
        if self.shard_of is not None:  # the shards whole in its cache, when they changed
            held = sorted(k for k, when in w.shards.items() if when <= self.now)
            if held != w.shards_said:
                w.shards_said = held
                self.scheduler.holdings(w.spec.id, held)
        t0 = time.perf_counter()
        self.scheduler.seen(w.spec.id, self.now)
        if self.now >= self.config.warmup_s:
            self.beat_s += time.perf_counter() - t0
            self.beats += 1
        self._at(self.now + self.beat_every, _BEAT, w, session)

    # coordinator side ------------------------------------------------------------------------

    def _charge(self, seconds: float, what: str) -> None:
        self.coord_free = max(self.coord_free, self.now) + seconds
        self.coord_busy += seconds
        self.coord_by[what] = self.coord_by.get(what, 0.0) + seconds

    def _hello(self, w: SimWorker, session: int) -> None:
        if session != w.session:
            return
        self._charge(self.config.costs.per_message_s, "hellos")
        self._perform(self._timed(self.core.join, w.spec.id, {"host": w.spec.id}, w.spec.id,
                                  self.now))
        # welcome out, ready back: a round trip later
        self._at(self.now + 2 * w.spec.latency_s, _READY, w, session)
        self._at(self.now + self.beat_every, _BEAT, w, session)

    def _ready(self, w: SimWorker, session: int) -> None:
        if session != w.session or w.spec.id not in self.scheduler.workers:
            return
        self._charge(self.config.costs.per_message_s, "hellos")
        self._perform(self._timed(self.core.ready, w.spec.id, w.spec.credits, self.now))

    def _bye(self, w: SimWorker) -> None:
        self._charge(self.config.costs.per_message_s, "hellos")
        self._perform(self._timed(self.core.leave, w.spec.id, "said bye", self.now))

    def _result_in(self, w: SimWorker, session: int, task: tuple, compute: float) -> None:
        # Sent before its worker left, it still counts if the scheduler still expects it.
        costs = self.config.costs
        self._charge(costs.per_message_s + self.config.model_bytes / costs.bytes_per_s, "results")
        slot, _, assign = task
        gradient, norm = None, 0.0
        if self.scheduler.slot_scale(w.spec.id, slot) is not None:  # else it is dropped anyway
            gradient, norm = self.gradients.result(assign)
        t0 = time.perf_counter()
        effects = self.core.result(w.spec.id, slot, gradient, norm, compute, self.now)
        if self.now >= self.config.warmup_s:
            self.sched_s += time.perf_counter() - t0
        self._perform(effects, {slot: compute})

    def _tick(self) -> None:
        t0 = time.perf_counter()
        actions = self.core.tick(self.now)
        if self.now >= self.config.warmup_s:
            self.tick_s += time.perf_counter() - t0
            self.ticks += 1
        self._perform(actions)
        self._at(self.now + self.config.heartbeat_s / 2, _TICK)

    def _timed(self, call, *args):
        t0 = time.perf_counter()
        out = call(*args)
        if self.now >= self.config.warmup_s:
            self.sched_s += time.perf_counter() - t0
        return out

    def _perform(self, effects: list, computed: Optional[dict] = None) -> None:
        """What the round core asks for, in virtual time. `computed`: the compute seconds of
        the results these effects answer."""
        costs = self.config.costs
        for effect in effects:
            if isinstance(effect, Assign):
                w = self.workers[effect.worker]
                self.slots_assigned += 1
                if self.now >= self.config.warmup_s:
                    self.slots_measured += 1
                size = self.config.model_bytes if effect.send_model else 0
                if size:
                    self._charge(size / costs.bytes_per_s, "models out")
                samples = sum(p[2] for p in effect.parts)
                task = (effect.slot, samples, effect)
                arrive = max(self.now, self.coord_free) + w.spec.latency_s + size / w.spec.bandwidth
                self._at(arrive, _TASK, w, w.session, task)
            elif isinstance(effect, CancelSlots):
                w = self.workers[effect.worker]
                self.slots_cancelled += len(effect.slots)
                self._at(self.now + w.spec.latency_s, _CANCEL, w, w.session, effect.slots)
            elif isinstance(effect, Used):
                self.used_compute[effect.slot] = (computed or {}).get(effect.slot, 0.0)
            elif isinstance(effect, (Applied, Replanned)):
                self._account(effect)
            elif isinstance(effect, Compute):
                # the coordinator's own computation, as the server makes it in a thread
                self._perform(self.core.computed(self.gradients.compute(effect), None, self.now))
            elif isinstance(effect, Evicted):
                w = self.workers[effect.worker]
                if w.online and effect.reason != "rejoined":
                    # Evicted while alive (an overloaded coordinator heard nothing in time): its
                    # next message is refused and it handshakes again, as a new session.
                    self._at(self.now + w.spec.latency_s, _REJOIN, w, w.session)

    def _account(self, step) -> None:
        """A decoded round, applied or replanned."""
        self.rounds_decoded += 1
        costs = self.config.costs
        # the weighted sum of its slots' gradients and the optimizer step
        self._charge((step.terms + 1) * self.config.model_bytes / costs.bytes_per_s,
                     "sums and steps")
        useful = sum(self.used_compute.pop(s, 0.0) for s in step.slots)
        if isinstance(step, Replanned):
            self.rounds_replanned += 1
            return
        self.rounds_applied += 1
        self.compute_useful += useful
        self.samples_applied += step.samples
        self.staleness[step.staleness] = self.staleness.get(step.staleness, 0) + 1
        target = self.config.target_samples
        if target is not None and self.samples_applied >= target:
            self.time_to_target = self.now

    def _sample(self, step: float) -> None:
        t0, n0, busy0 = self._last_sample
        dt = max(1e-9, self.now - t0)
        online = self.online
        self.series.append({
            "t": round(self.now, 3), "samples_per_s": (self.samples_applied - n0) / dt,
            "samples": self.samples_applied, "online": online,
            "workers": len(self.scheduler.workers), "open_rounds": len(self.scheduler.rounds),
            "version": self.gradients.version,
            "coordinator_load": min(1.0, (self.coord_busy - busy0) / dt)})
        self._last_sample = (self.now, self.samples_applied, self.coord_busy)
        self._at(self.now + step, _SAMPLE, step)

    def _eval(self) -> None:
        self.metrics = self.gradients.evaluate()
        self.series.append({"t": round(self.now, 3), "samples": self.samples_applied,
                            "metrics": dict(self.metrics)})
        if self.target is not None and self.target(self.metrics):
            self.time_to_target = self.now
        self._at(self.now + self.config.eval_every_s, _EVAL)

    def _result(self, duration: float, wall: float) -> ModeResult:
        applied = sum(self.staleness.values())
        # Results waiting in rounds still open at the end are neither used nor wasted yet.
        total = self.compute_total - sum(self.used_compute.values())
        stats = self.scheduler.stats
        return ModeResult(
            mode=self.mode, duration_s=duration, samples_applied=self.samples_applied,
            samples_per_s=self.samples_applied / duration if duration > 0 else 0.0,
            rounds_decoded=self.rounds_decoded, rounds_applied=self.rounds_applied,
            rounds_replanned=self.rounds_replanned, slots_assigned=self.slots_assigned,
            slots_measured=self.slots_measured,
            slots_cancelled=self.slots_cancelled,
            wasted_fraction=max(0.0, (total - self.compute_useful) / total) if total > 0 else 0.0,
            mean_staleness=(sum(t * n for t, n in self.staleness.items()) / applied
                            if applied else 0.0),
            staleness=dict(sorted(self.staleness.items())),
            coordinator_load=self.coord_busy / duration if duration > 0 else 0.0,
            coordinator_by={k: v / duration for k, v in self.coord_by.items()} if duration > 0
            else {},
            time_to_target_s=self.time_to_target,
            scheduler_us_per_slot=(1e6 * (self.sched_s + self.tick_s) * self.cpu_share
                                   / max(1, self.slots_measured)),
            decision_us_per_slot=1e6 * self.sched_s * self.cpu_share / max(1, self.slots_measured),
            tick_us=1e6 * self.tick_s * self.cpu_share / max(1, self.ticks),
            heartbeat_us=1e6 * self.beat_s * self.cpu_share / max(1, self.beats), wall_s=wall,
            series=self.series, metrics=self.metrics,
            codes={k: stats["rounds_" + k] for k in ("none", "replicate", "cyclic")
                   if stats["rounds_" + k]},
            downloaded=({w.spec.id: w.downloaded for w in self.workers.values()}
                        if self.shard_of is not None else {}),
            data_bytes=self.config.shards * self.config.shard_bytes)


def simulate(fleet: Sequence[WorkerSpec], config: SimConfig, mode: str = "none",
             gradients=None, target=None, scheduler_class=Scheduler) -> ModeResult:
    return Simulation(fleet, config, mode, gradients, target, scheduler_class).run()


def compare(fleet: Sequence[WorkerSpec], config: SimConfig, modes: Sequence[str],
            make_gradients: Optional[Callable[[], object]] = None, target=None,
            progress: Optional[Callable[[ModeResult], None]] = None) -> dict[str, ModeResult]:
    """Every mode on the same fleet, sessions and seed (fresh gradients for each)."""
    out = {}
    for mode in modes:
        fresh = [replace(w, sessions=list(w.sessions) if w.sessions is not None else None)
                 for w in fleet]
        out[mode] = simulate(fresh, config, mode, make_gradients() if make_gradients else None,
                             target)
        if progress is not None:
            progress(out[mode])
    return out


def check_mode(mode: str) -> str:
    if mode == "sync":
        return mode
    return str(coding.parse_redundancy(mode))
