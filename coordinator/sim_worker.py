"""The simulator's workers (simulator.py): each one the daemon's own session (worker/session.py),
driven in virtual time as worker/daemon.py drives it on a socket.

A simulated worker's process is a real `Session`. The simulator tells it what happened (a
connection is open, a message or a task came, a computation ended, the time) and performs the
effects it returns, in order, as the daemon does: `Send` and `SendResult` go to the coordinator
after the worker's latency (a gradient also after its size over the worker's bandwidth),
`Compute` is a simulated computation that ends after the worker's simulated seconds for the slot
(fetching first the shards it lacks, over its own link), `CancelCompute` stops it (the session
is told `NotComputed`, as the compute thread would), `Join` is the job built at once, `Rehello`
is hello again on the same connection, `Reconnect` a new connection, `Leave` the process gone.
Tasks reach the session as the daemon hands them over after decoding one (the slot, its work and
the acknowledgements it carries); the work is the coordinator's `Assign`, which the session never
looks inside. Heartbeats are ticked on the session's own cadence (`wake_at`); one in `liveness -
1` of them is delivered (or one that tells new shards), the others counted as coordinator time
only (see simulator.py).

A machine that goes away takes its process with it, silently, or (`bye_fraction`) after the
session's stop, which says bye as on a signal. The next availability session is a new process:
a fresh session, hello without an instance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..common import protocol as proto
from ..worker.session import (Compute, CancelCompute, EvalAnswer, Join, Leave, NotComputed,
                              Outcome, Reconnect, Rehello, ResultReady, Send, SendResult, Session)
from .sim_fleet import SimWorker

# events, in order of kind at equal times (simulator.py's own follow)
_ONLINE, _OFFLINE, _CONNECT, _TO_WORKER, _DONE, _TO_COORDINATOR, _BEAT = range(7)
# an evaluation slot's seconds per test sample, over a training slot's per sample: forward
# passes only (as eval_slots.py sizes its slots)
EVAL_COST = 1 / 3
FINGERPRINT = "simulated"


@dataclass(frozen=True)
class SimTask:
    """A task as the daemon hands it to its session once decoded: the work (the coordinator's
    `Assign`) and the results its message acknowledges."""
    assign: Any
    acks: list


@dataclass(frozen=True)
class SimResult:
    """A gradient result as the worker keeps it until acknowledged (the daemon's `Kept`): its
    slot, its compute seconds and what was computed (for the backend, on arrival)."""
    slot: int
    compute_s: float
    assign: Any


class WorkerSide:
    """The simulation's worker side (mixed into `Simulation`): sessions driven in virtual time."""

    # from the simulation: config, data, gradients, core, now, online, workers, counters, _at

    def _hello_of(self, w: SimWorker) -> proto.Hello:
        return proto.Hello(worker_id=w.spec.id, host=w.spec.id, cores=1, threads=1, device="cpu",
                           memory_mb=0, versions={})

    def _next_session(self, w: SimWorker) -> None:
        while w.sessions:
            start, stop = w.sessions.popleft()
            if stop > self.now:
                self._at(max(start, self.now), _ONLINE, w, stop)
                return

    def _online(self, w: SimWorker, stop: float) -> None:
        """The machine is there: a new process (a fresh session), hello after start-up."""
        w.online = True
        self.online += 1
        w.available += 1
        held = (lambda: w.held(self.now)) if self.data.sharded else (lambda: [])
        w.process = Session(w.spec.credits, self._hello_of(w), held_shards=held)
        w.conn += 1
        w.beat_at = math.inf
        self._at(self.now + self.config.startup_s, _CONNECT, w, w.conn)
        if stop < math.inf:
            self._at(stop, _OFFLINE, w, w.available)

    def _connect(self, w: SimWorker, conn: int) -> None:
        if conn == w.conn and w.process is not None:
            self._drive(w, w.process.connect(self.now))

    def _offline(self, w: SimWorker, available: int) -> None:
        """The machine goes away with its process: silently, or saying bye first."""
        if available != w.available or not w.online:
            return
        says_bye = w.rng.random() < self.config.bye_fraction
        if says_bye and w.process is not None:  # as on a signal: stop, then the tick's bye
            self._drive(w, w.process.stop("the machine went away"), pump=False)
            self._drive(w, w.process.tick(self.now), pump=False)
        self._end_process(w)
        w.online = False
        self.online -= 1
        self._next_session(w)

    def _end_process(self, w: SimWorker) -> None:
        self._lost(w)  # what it computed of its running slot
        w.current = None
        w.process = None
        w.conn += 1  # nothing more reaches it, nothing more comes from it

    def _deliver(self, w: SimWorker, conn: int, msg) -> None:
        """A message from the coordinator reaches the worker (on the connection it was sent to)."""
        session = w.process
        if conn != w.conn or session is None:
            return  # that connection is gone
        if isinstance(msg, SimTask):
            assign = msg.assign
            if self.data.sharded:
                self._fetch(w, assign.prefetch)
            self._drive(w, session.task(self.now, assign.slot, assign, acks=msg.acks))
        else:
            self._drive(w, session.received(self.now, msg))

    def _beat(self, w: SimWorker, conn: int) -> None:
        """The session's tick, when it said it has something to do (heartbeats, silence)."""
        if conn != w.conn or w.process is None or self.now != w.beat_at:
            return  # superseded by an earlier one
        w.beat_at = math.inf
        self._drive(w, w.process.tick(self.now))

    def _done(self, w: SimWorker, run: int, slot: int) -> None:
        """A simulated computation ends (unless it was cancelled or its process is gone)."""
        if w.current is None or w.current[3] != run:
            return
        assign, compute = w.current[1], self.now - w.current[2]
        self._lost(w)
        w.current = None
        if assign.kind == "eval":
            evaluation = self.core.evaluation  # its sums are computed only if still wanted
            wanted = evaluation is not None and slot in evaluation.ranges \
                and slot not in evaluation.sums
            sums = self.gradients.eval_sums(assign) if wanted else {}
            outcome: Outcome = EvalAnswer(proto.EvalResult(
                slot=slot, version=assign.version, compute_s=compute,
                sums={k: [s, n] for k, (s, n) in sums.items()}))
        else:
            outcome = ResultReady(SimResult(slot, compute, assign))
        self._drive(w, w.process.finished(self.now, slot, outcome))

    # performing the session's effects -------------------------------------------------------

    def _drive(self, w: SimWorker, effects: list, pump: bool = True) -> None:
        """Perform `effects` (the session's, in order) as the daemon would; then (`pump`) start
        the next computation if the session has one, and queue its next tick."""
        for effect in effects:
            session = w.process
            if session is None:
                return
            if isinstance(effect, Send):
                self._send(w, effect.message)
            elif isinstance(effect, SendResult):
                size = self.config.model_bytes  # a gradient is as large as the model
                self._at(self.now + w.spec.latency_s + size / w.spec.bandwidth, _TO_COORDINATOR,
                         w, w.conn, effect.result, 1)
            elif isinstance(effect, Compute):
                self._compute(w, effect.slot, effect.work)
            elif isinstance(effect, CancelCompute):
                if w.current is not None and w.current[0] == effect.slot:
                    self._lost(w)
                    w.current = None
                    self._drive(w, session.finished(self.now, effect.slot, NotComputed()),
                                pump=False)
            elif isinstance(effect, Join):  # the job is built at once
                self._drive(w, session.welcomed(self.now, effect.welcome, FINGERPRINT),
                            pump=False)
            elif isinstance(effect, Rehello):  # hello again, on the same connection
                self._drive(w, session.connect(self.now), pump=False)
            elif isinstance(effect, Reconnect):  # a new connection
                w.conn += 1
                self._drive(w, session.connect(self.now), pump=False)
            elif isinstance(effect, Leave):
                self._end_process(w)
                return
            # DropResult: nothing to free here
        session = w.process
        if not pump or session is None:
            return
        if w.current is None and session.wants_compute():
            self._drive(w, session.start(self.now), pump=False)
        # (a deadline the session judges strictly after it: the next tick comes once the clock
        # has moved, as the daemon's clock does)
        wake = max(session.wake_at(), math.nextafter(self.now, math.inf))
        if wake < w.beat_at:
            w.beat_at = wake
            self._at(wake, _BEAT, w, w.conn)

    def _send(self, w: SimWorker, msg: proto.Message) -> None:
        beats = 1
        if isinstance(msg, proto.Heartbeat):  # one in `beats_per_delivery` goes (or new shards)
            w.beats += 1
            if msg.shards is None and w.beats < self.beats_per_delivery:
                return
            beats, w.beats = w.beats, 0
        self._at(self.now + w.spec.latency_s, _TO_COORDINATOR, w, w.conn, msg, beats)

    def _compute(self, w: SimWorker, slot: int, assign) -> None:
        """The session's `Compute`: the shards it lacks fetched first, then the worker's seconds
        for the slot's samples (fault injection and jitter as the engine's)."""
        spec, evaluation = w.spec, assign.kind == "eval"
        ready = (self._fetch(w, self.data.read(assign.parts))
                 if self.data.sharded and not evaluation else 0.0)
        # an evaluation slot's test samples take forward passes only
        cost = EVAL_COST if evaluation else 1.0
        samples = sum(p[2] for p in assign.parts)
        seconds = spec.s_per_sample * cost * samples * spec.slowdown + max(0.0, ready - self.now)
        if spec.jitter:
            seconds *= math.exp(spec.jitter * w.rng.standard_normal())
        if spec.stall_p and w.rng.random() < spec.stall_p:
            seconds += spec.stall_s
        w.runs += 1
        w.current = (slot, assign, self.now, w.runs)
        self._at(self.now + seconds, _DONE, w, w.runs, slot)

    def _lost(self, w: SimWorker) -> None:
        """The compute its running slot has taken so far, counted (training or evaluation)."""
        if w.current is None:
            return
        if w.current[1].kind == "eval":
            self.eval_compute += self.now - w.current[2]
        else:
            self.compute_total += self.now - w.current[2]

    def _fetch(self, w: SimWorker, shards) -> float:
        return w.fetch(shards, self.now, self.config.shard_bytes, self.config.cache_shards)
