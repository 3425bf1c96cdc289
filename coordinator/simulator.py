"""A fleet in virtual time: the real scheduler, codes and staleness rule, driven by a simulator.

Nobody can run ten thousand volunteers on one machine; but the scheduler (`scheduler.py`), the
codes (`common/coding.py`), adaptive redundancy and the staleness rule (`aggregator.py`) are pure
logic that takes `now`, so the same code can be driven by a discrete-event simulation: a heap of
virtual events (a worker comes online, a message reaches a worker or the coordinator, a
computation ends, a session's tick, the coordinator's tick, the moment a held slot may turn
late by its prediction, which the server's loop wakes for too) processed in time order. Nothing
of the socket loops is used.

The model, and what it leaves out:

- Workers (`WorkerSpec`): seconds per sample (from a distribution, a CSV or a preset), credits,
  one-way latency and bandwidth, fault injection as the real engine does it (a slowdown factor, a
  stall of S seconds with probability P per task), a per-task jitter, and sessions of
  availability (from a churn model or a trace). Each worker's process is the daemon's own
  session (`worker/session.py`, driven by `sim_worker.py` as `worker/daemon.py` drives it): its
  handshake and resume rules, its queue of slots computed one after another in arrival order,
  its credits, its unacknowledged results, its heartbeats and its judgement of a silent
  coordinator; a cancel drops a queued slot or stops the running one. When a session of
  availability ends the worker vanishes silently (or says bye, for a fraction of departures):
  the scheduler notices it by its silence. A new one is a new process: a fresh session, hello.
- The coordinator takes the sessions' messages as the server does (`server.py`'s handlers, the
  same round core and run core entry points): a hello joins (or resumes the same process, its
  slots kept, with a welcome naming them), a result is acknowledged (on the next task, or
  alone), a heartbeat is answered, and a message on a connection it does not know (its worker
  evicted, by an overloaded coordinator say) is refused with `hello_first`, so that worker says
  hello again. Tasks and results travel as the decoded messages the daemon and the core see
  (`SimTask`, `SimResult`: no tensors, no wire encoding).
- A session heartbeats every `heartbeat_s`; one beat in `liveness - 1` (or one that tells new
  shards) is delivered, the others are counted as coordinator time only (a worker that is online
  is never evicted by mistake, since that is still within the silence the scheduler allows); an
  offline worker is therefore noticed up to one beat early. Results and readies refresh
  liveness as in the server.
- The coordinator is one queue: each message it takes (result, hello, ready, heartbeat) costs CPU
  time (`CoordinatorCosts`), plus bytes over its throughput (gradients in, models out, the sum and
  the step of a round); a message waits while the coordinator is busy. Its load is the fraction
  of time it is busy; past 1 it is the bottleneck.
- Gradients are costless by default (throughput and scheduling only: a round's step is counted,
  the staleness rule decides whether it is applied or replanned) or real (`RealGradients`: a
  small job's gradient is computed in this process for every used result, at the model version
  its slot was planned at, and applied through the real `Aggregator`, so staleness shows in the
  test metric).
- Evaluations go through the run core (`run.py`), driven as the server drives it: its `tick` at
  the time it says the next may start, each evaluation handed to workers through the round
  core's `evaluate` as evaluation slots (`Assign` of kind "eval"), which a worker computes like
  any task but for a third of the seconds per sample (forward passes only) and answers with
  sums (`evaluated`); the last answer completes it and the run core judges it. A target met
  stops the run (a result of an older version is confirmed first, on the coordinator, at once:
  no round is applied meanwhile, as in the server). With costless gradients the one metric is
  synthetic (the evaluated version); with real ones the sums are the workers' kernel over the
  slot's range of the test set (`common.job.evaluation_sums`). A job whose evaluation returns
  means is evaluated on the coordinator, at once. Evaluation slots' compute is counted apart
  from training's (it is not waste). The layout: the fleet and its data in `sim_fleet.py`, the
  backends in `sim_backends.py`, the settings and figures in `sim_config.py`, the workers'
  sessions driven in `sim_worker.py`.

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
from dataclasses import replace
from functools import partial
from typing import Callable, Optional, Sequence

import numpy as np

from ..common import coding
from ..common import protocol as proto
from ..common.permutation import epoch_blocks
from .effects import Applied, Compute, Evaluated, Replanned, Used
from .eval_slots import EVAL_SLOT_BATCHES, plan_ranges
from .evaluation import TARGET
from .local import parse_task
from .locality import Locality, group_for
from .rounds import RoundCore
from .run import COORDINATOR, WORKERS, EvaluateHere, RunCore
from .sampler import Sampler
from .effects import Ban
from .scheduler import Assign, CancelSlots, Drained, Evicted, Scheduler, SchedulerConfig
from .sim_backends import CostlessGradients, RealGradients
from .batch_policy import Batching, parse_batch, resolve_lr_rule
from .sim_config import CoordinatorCosts, ModeResult, SimConfig
from .sim_fleet import (FLEET_MIX, Churn, SimData, SimWorker, WorkerSpec, fleet_from_csv,
                        lognormal_fleet, mixed_fleet, parse_churn, sessions_from_trace)
from .sim_worker import (_BEAT, _CONNECT, _DONE, _OFFLINE, _ONLINE, _TO_COORDINATOR, _TO_WORKER,
                         FINGERPRINT, SimResult, SimTask, WorkerSide)
from .staleness import StalenessRule
from .target import Target
from .trust import TrustConfig, TrustPolicy

__all__ = ["Churn", "CoordinatorCosts", "CostlessGradients", "FLEET_MIX", "ModeResult",
           "RealGradients", "SimConfig", "Simulation", "WorkerSpec", "check_mode", "compare",
           "fleet_from_csv", "lognormal_fleet", "mixed_fleet", "parse_churn",
           "sessions_from_trace", "simulate"]

# the coordinator's events, after the workers' (sim_worker.py), in order of kind at equal times
_TICK, _SAMPLE, _EVAL, _NEXT_MESSAGE, _SPECULATE = range(_BEAT + 1, _BEAT + 6)
SPECULATE_EVERY_S = 0.01  # as the server: lateness looked at when predicted, at most this often
INSTANCE = "simulated"  # the coordinator process (one per simulation)
COORDINATOR_BEAT = proto.Heartbeat(state="coordinator")


class Simulation(WorkerSide):
    """One mode in virtual time: the round core and the run core driven by a fleet's events, the
    workers' sessions (sim_worker.py) by the coordinator's messages."""

    def __init__(self, fleet: Sequence[WorkerSpec], config: SimConfig, mode: str,
                 gradients=None, target: Optional[Target] = None,
                 scheduler_class=Scheduler):
        self.config = config
        self.mode = mode
        sync, redundancy = _mode_settings(mode)
        rule = StalenessRule(config.staleness, config.max_staleness)
        self.gradients = gradients or CostlessGradients(config.train_samples, config.batch_size,
                                                        rule, config.test_samples)
        self.data = data = SimData(self.gradients.train_samples, config.shards, config.seed,
                                   config.locality, config.shuffle_window)
        sharded = data.shard_aware
        if sharded and hasattr(self.gradients, "seed"):
            self.gradients.seed = data.order  # real gradients read the order the plan names
        self.sampler = Sampler(self.gradients.train_samples, blocks=(
            partial(epoch_blocks, data.order) if sharded else None))
        redundancy_policy = coding.parse_redundancy(redundancy)
        self.scheduler = scheduler_class(SchedulerConfig(
            batch_size=self.gradients.batch_size, partitions=config.partitions,
            open_rounds=config.open_rounds, heartbeat_s=config.heartbeat_s,
            liveness=config.liveness, min_deadline_s=config.task_timeout_s,
            redundancy=redundancy_policy, sync=sync,
            speculate=config.speculate, verify_replicas=config.verify_replicas), self.sampler,
            task_mode=parse_task(config.task),
            locality=Locality(data.order, group_for(redundancy_policy)) if sharded else None)
        # the server's own round core: the same decode, step, replan, compare and settle
        setting = parse_batch(config.batch)
        batching = Batching(setting, resolve_lr_rule(
            config.batch_lr, getattr(self.gradients, "optimizer_name", "SGD")),
            self.gradients.batch_size)
        aggregator = getattr(self.gradients, "aggregator", None)
        if setting.adaptive and aggregator is not None:
            aggregator.progress_base = self.gradients.batch_size  # the schedule counts samples
        self.core = RoundCore(self.scheduler, self.gradients, TrustPolicy(TrustConfig()),
                              batching=batching)
        # ... and its run core: evaluations (on the workers' evaluation slots), target and stop
        self.run_core = RunCore(
            self.core, WORKERS if self.gradients.sums_evaluable else COORDINATOR,
            plan_ranges(self.gradients.test_samples, EVAL_SLOT_BATCHES * self.gradients.batch_size),
            config.eval_every_s, target)
        self.evaluates = config.eval_every_s is not None or target is not None
        self._eval_at = math.inf  # when the run core's next tick is queued
        self._spec_at = math.inf  # when the next look at late slots is queued ...
        self._spec_seen = -math.inf  # ... and when the last was
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
        # one heartbeat in this many is delivered (see the module's doc)
        self.beats_per_delivery = max(1, config.liveness - 1)
        self.welcome = proto.Welcome(
            job="simulated", job_args={}, fingerprint=FINGERPRINT, seed=config.seed,
            heartbeat_s=config.heartbeat_s, liveness=config.liveness, instance=INSTANCE)
        self.routes: dict[str, int] = {}  # worker id -> the connection the coordinator knows
        self.acks_due: dict[str, int] = {}  # worker id -> the slot of the result being taken
        costs = config.costs
        self._cost_of = {SimResult: (costs.per_message_s + config.model_bytes / costs.bytes_per_s,
                                     "results"), proto.Heartbeat: (costs.per_message_s, "heartbeats"),
                         proto.EvalResult: (costs.per_message_s, "evaluations")}
        # accounting
        self.samples_applied = 0
        self.rounds_decoded = self.rounds_applied = self.rounds_replanned = 0
        self.slots_assigned = self.slots_cancelled = self.slots_measured = 0
        self.compute_total = self.compute_useful = 0.0  # training slots
        self.eval_compute = 0.0  # evaluation slots
        self.evaluations = self.evaluations_here = self.eval_slots = 0
        self.stopped: Optional[str] = None
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
        self._next_evaluation()
        events, handlers = self.events, self._handlers()
        self._handlers_by_kind = handlers
        while events and self.stopped is None:
            t, kind, _, data = heapq.heappop(events)
            if t > end:
                break
            self.now = t
            if kind == _TO_COORDINATOR and (self.coord_free > t or self.inbox):
                self.inbox.append((kind, data))  # it waits its turn
                self._wake()
                continue
            handlers[kind](*data)
        duration = self.now if self.stopped is not None else end
        wall = time.perf_counter() - wall0
        # Scheduler calls are timed with the wall clock (a CPU clock costs a microsecond a
        # read); on a shared machine the process is off the CPU part of that time, so the
        # figures are scaled by the share of the run it was on it.
        self.cpu_share = min(1.0, (time.process_time() - cpu0) / wall) if wall > 0 else 1.0
        return ModeResult.of(self, duration, wall)

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
        return {_ONLINE: self._online, _OFFLINE: self._offline, _CONNECT: self._connect,
                _TO_WORKER: self._deliver, _DONE: self._done, _TO_COORDINATOR: self._from_worker,
                _BEAT: self._beat, _TICK: self._tick, _SAMPLE: self._sample, _EVAL: self._run_tick,
                _NEXT_MESSAGE: self._next_message, _SPECULATE: self._speculate}

    # coordinator side ------------------------------------------------------------------------

    def _charge(self, seconds: float, what: str) -> None:
        self.coord_free = max(self.coord_free, self.now) + seconds
        self.coord_busy += seconds
        self.coord_by[what] = self.coord_by.get(what, 0.0) + seconds

    # the workers' messages, taken as the server takes them (server.py's handlers) ------------

    def _from_worker(self, w: SimWorker, conn: int, msg, beats: int = 1) -> None:
        """A message of a worker's session (on connection `conn`): what it costs the
        coordinator, then the round core's or the run core's entry point the server calls."""
        wid = w.spec.id
        seconds, what = self._cost_of.get(type(msg), (self.config.costs.per_message_s, "hellos"))
        self._charge(seconds * beats, what)
        if isinstance(msg, proto.Hello):
            self._hello(w, conn, msg)
        elif isinstance(msg, proto.Bye):
            if self.routes.get(wid) == conn:
                self._perform(self._timed(self.core.leave, wid, f"said bye: {msg.reason}"[:200],
                                          self.now))
        elif self.routes.get(wid) != conn:  # a connection it does not know (evicted, replaced)
            self._tell(w, conn, proto.Reject(code="hello_first", reason="say hello first"))
        elif isinstance(msg, SimResult):
            self._result(w, conn, msg)
        elif isinstance(msg, proto.Heartbeat):
            t0 = time.perf_counter()
            effects = self.core.seen(wid, msg.state, self.now, msg.shards)
            if self.now >= self.config.warmup_s:
                self.beat_s += time.perf_counter() - t0
                self.beats += 1
            self._perform(effects)
            self._tell(w, conn, COORDINATOR_BEAT)
        elif isinstance(msg, proto.Ready):
            self._perform(self._timed(self.core.ready, wid, msg.credits, self.now))
        elif isinstance(msg, proto.EvalResult):
            sums = {name: (float(pair[0]), float(pair[1])) for name, pair in msg.sums.items()}
            self._perform(self._timed(self.core.evaluated, wid, msg.slot, msg.version, sums,
                                      msg.compute_s, self.now))
        elif isinstance(msg, proto.Handback):
            self._perform(self._timed(self.core.handback, wid, msg.slots, self.now))

    def _hello(self, w: SimWorker, conn: int, msg: proto.Hello) -> None:
        """The same process back (its instance is ours, before its eviction) keeps its slots;
        else it joins, evicting its old session."""
        wid = w.spec.id
        resumed = wid in self.scheduler.workers and msg.instance == INSTANCE
        if resumed:
            self.scheduler.seen(wid, self.now)
        else:
            self._perform(self._timed(self.core.join, wid, {"host": msg.host}, wid, self.now))
        self.routes[wid] = conn
        holding = sorted(self.scheduler.workers[wid].assigned) if resumed else []
        self._tell(w, conn, replace(self.welcome, holding=holding) if holding else self.welcome)
        if resumed:  # tasks sent down its old connection may be lost
            self._perform(self._timed(self.core.resend, wid, self.now))

    def _result(self, w: SimWorker, conn: int, msg: SimResult) -> None:
        # Sent before its worker left, it still counts if the scheduler still expects it.
        wid, slot = w.spec.id, msg.slot
        self.acks_due[wid] = slot  # a task sent meanwhile carries the acknowledgement
        gradient, norm = None, 0.0
        if self.scheduler.slot_scale(wid, slot) is not None:  # else it is dropped anyway
            gradient, norm = self.gradients.result(msg.assign)
        t0 = time.perf_counter()
        effects = self.core.result(wid, slot, gradient, norm, msg.compute_s, self.now)
        if self.now >= self.config.warmup_s:
            self.sched_s += time.perf_counter() - t0
        self._perform(effects, {slot: msg.compute_s})
        if self.acks_due.pop(wid, None) is not None:
            self._tell(w, conn, proto.Ack(slots=[slot]))

    def _tell(self, w: SimWorker, conn: Optional[int], msg, size: int = 0) -> None:
        """Send `msg` down connection `conn` once the coordinator is done with what it does."""
        if conn is not None:
            self._at(max(self.now, self.coord_free) + w.spec.latency_s + size / w.spec.bandwidth,
                     _TO_WORKER, w, conn, msg)

    def _tick(self) -> None:
        t0 = time.perf_counter()
        actions = self.core.tick(self.now)
        if self.now >= self.config.warmup_s:
            self.tick_s += time.perf_counter() - t0
            self.ticks += 1
        self._perform(actions)
        self._next_evaluation()
        self._at(self.now + self.config.heartbeat_s / 2, _TICK)

    def _timed(self, call, *args):
        t0 = time.perf_counter()
        out = call(*args)
        if self.now >= self.config.warmup_s:
            self.sched_s += time.perf_counter() - t0
        return out

    def _speculate(self) -> None:
        """A slot may have turned late by its prediction, between ticks (as the server looks)."""
        self._spec_at, self._spec_seen = math.inf, self.now
        self._perform(self.core.speculate(self.now))

    def _next_speculation(self) -> None:
        at = max(self.core.next_speculation_at(), self._spec_seen + SPECULATE_EVERY_S)
        if at < self._spec_at:
            self._spec_at = at
            self._at(max(at, self.now), _SPECULATE)

    def _perform(self, effects: list, computed: Optional[dict] = None) -> None:
        """What the round core asks for, in virtual time. `computed`: the compute seconds of
        the results these effects answer."""
        self._next_speculation()  # what led to these may have changed when a slot turns late
        costs = self.config.costs
        for effect in effects:
            if isinstance(effect, Assign):
                w = self.workers[effect.worker]
                self.slots_assigned += 1
                self.eval_slots += effect.kind == "eval"
                if self.now >= self.config.warmup_s:
                    self.slots_measured += 1
                size = self.config.model_bytes if effect.send_model else 0
                if size:
                    self._charge(size / costs.bytes_per_s, "models out")
                ack = self.acks_due.pop(effect.worker, None)
                self._tell(w, self.routes.get(effect.worker),
                           SimTask(effect, [] if ack is None else [ack]), size)
            elif isinstance(effect, CancelSlots):
                self.slots_cancelled += len(effect.slots)
                self._tell(self.workers[effect.worker], self.routes.get(effect.worker),
                           proto.Cancel(slots=effect.slots))
            elif isinstance(effect, Used):
                self.used_compute[effect.slot] = (computed or {}).get(effect.slot, 0.0)
            elif isinstance(effect, (Applied, Replanned)):
                self._account(effect)
            elif isinstance(effect, Compute):
                # the coordinator's own computation, as the server makes it in a thread
                self._perform(self.core.computed(self.gradients.compute(effect), None, self.now))
            elif isinstance(effect, Evaluated):
                self._evaluated(effect.version, effect.samples, effect.metrics, effect.seconds)
            elif isinstance(effect, EvaluateHere):
                self._evaluate_here()
            elif isinstance(effect, Evicted):
                # forgotten: its next message is refused (hello first), and it says hello again
                self.routes.pop(effect.worker, None)
            elif isinstance(effect, Ban):
                self._tell(self.workers[effect.worker], self.routes.pop(effect.worker, None),
                           proto.Reject(code="banned", reason="banned"))
            elif isinstance(effect, Drained):
                self._tell(self.workers[effect.worker], self.routes.get(effect.worker),
                           proto.Shutdown(reason="drained"))

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
            self.stopped = "samples"

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

    # evaluations: the run core, driven as the server drives it -------------------------------

    def _run_tick(self) -> None:
        self._eval_at = math.inf
        self._perform(self.run_core.tick(self.now))
        self._next_evaluation()

    def _next_evaluation(self) -> None:
        """Queue the run core's next tick, at the time it says one may start."""
        at = self.run_core.next_at() if self.evaluates and self.stopped is None else math.inf
        if at < self._eval_at:
            self._eval_at = at
            self._at(max(at, self.now), _EVAL)

    def _evaluated(self, version: int, samples: int, metrics: dict, seconds: float,
                   here: bool = False) -> None:
        """An evaluation is answered: the run core judges it (the target met: the run stops)."""
        self.evaluations += 1
        self.evaluations_here += here
        self.metrics = dict(metrics)
        self.series.append({"t": round(self.now, 3), "samples": samples, "version": version,
                            "metrics": dict(metrics)})
        outcome, start = self.run_core.evaluated(version, metrics, seconds, self.now)
        if outcome == TARGET:
            self.time_to_target = self.now
        if self.run_core.stopped is not None:
            self.stopped = self.run_core.stopped
        self._perform(start)
        self._next_evaluation()

    def _evaluate_here(self) -> None:
        """`EvaluateHere`: the model as it is now, on the coordinator, at once (the server
        awaits a confirming one: no round is applied meanwhile)."""
        self._evaluated(self.gradients.version, self.samples_applied,
                        self.gradients.evaluate(), 0.0, here=True)


def _mode_settings(mode: str) -> tuple[bool, str]:
    if mode == "sync":
        return True, "none"
    return False, str(coding.parse_redundancy(mode))


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
