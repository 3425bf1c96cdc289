"""The coordinator's I/O shell: one ROUTER socket, one asyncio loop.

It decodes messages, asks the gate (gate.py) whether their sender may say them, hands them to
the round core (rounds.py), the run core (run.py), the data plane or the operators, and performs
what they return: tasks and replies on the socket, the coordinator's own computations and
evaluations in threads (offloop.py), events, the ledger and the metrics log. Decisions live in
those rooms, not here. Every inbound message is untrusted: a bad one is counted, logged with its
sender and dropped, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
from typing import Optional

import zmq

from .. import __version__
from ..common import protocol as proto
from ..common.aio import on_reload_signal, on_stop_signals
from ..common.errors import ProtocolError
from ..common.throttle import Throttle
from . import enrolment
from .config import CoordinatorConfig, check
from .effects import Applied, Ban, Compute, Evaluated, Event, Used
from .offloop import OffLoop
from .operators import Operators
from .budgets import DECODE, OVER_RATE, KeyBudgets
from .gate import BANNED, REVOKED, Gate, NeedHello
from .records import RunRecords
from .run import EvaluateHere
from .scheduler import Assign, CancelSlots, Drained, Evicted
from .status import EVENTS_PER_STATUS, coordinator_snapshot
from .training import Training, tune_gc
from .transport import ZmqTransport, short, user_id

__all__ = ["Coordinator", "CoordinatorConfig"]

log = logging.getLogger("idlegrad.coordinator")


class Coordinator:
    def __init__(self, config: CoordinatorConfig):
        checked = check(config)
        self.config = config
        self.keypair = checked.keypair
        self.training = Training(config, checked, zmq.COPY_THRESHOLD)
        self.core = self.training.core
        self.gate = Gate(checked.keys, self.core.trust.is_banned)
        self.budgets = KeyBudgets.serving(config.budgets, self.gate, self.core)
        self.operators = Operators(config, self.gate, self.core, self.training.credits,
                                   self.keypair[0] if self.keypair else None, self._event)
        self.operators.load_bans()
        self.enrolment: Optional[enrolment.Endpoint] = None  # with --enrolled, while serving
        self._acks_due: dict[str, int] = {}  # worker id -> the slot of the result being taken
        self.offloop = OffLoop(self.training, self.core)  # computations and evaluations in threads
        self._bad_logged = Throttle()  # bad messages, however hostile the peer
        self._refused_logged = Throttle()  # handshakes from keys not allowed
        self._over_rate_logged = Throttle(60.0)  # results over their key's rate
        self.transport = None  # ZmqTransport while serving; anything with its `send` in tests
        self.clock = time.monotonic  # the loop's one clock (tests/unit/pair.py sets a virtual one)
        self.stop_reason: Optional[str] = None
        self._stopping: Optional[asyncio.Future] = None  # done once a signal asks to stop
        self.records = RunRecords(config.metrics_path, config.ledger_path,
                                  self.training.instance, report=self.training.event)

    # what the command line and tests read
    scheduler = property(lambda self: self.core.scheduler)
    counters = property(lambda self: self.core.counters)
    samples_applied = property(lambda self: self.core.samples_applied)
    metrics = property(lambda self: self.training.metrics)
    version = property(lambda self: self.training.version)

    def snapshot(self, cursor: int = 0) -> dict:
        return coordinator_snapshot(self.training, self.clock(), cursor,
                                    stopping=self.stop_reason is not None,
                                    events_limit=EVENTS_PER_STATUS)

    # the loop -------------------------------------------------------------------------------

    def run(self) -> str:
        """Serve until training ends or a signal arrives. Returns why it stopped."""
        return asyncio.run(self._serve())

    async def _serve(self) -> str:
        tune_gc()
        self.transport = transport = ZmqTransport(self.config.bind, self.keypair, self._allow)
        self.enrolment = enrolling = enrolment.start(self)  # None without --enrolled
        self.operators.store = enrolling.store if enrolling is not None else None
        on_stop_signals(self._on_signal)
        if self.gate.secure:
            on_reload_signal(lambda: asyncio.ensure_future(self.reload_keys()))
        self.open_logs()
        self._event("start", self.training.start_text(
            f"CURVE, {self.gate.describe()}" if self.gate.secure else "no keys: unencrypted"))
        try:
            await self._loop(transport)
            await self.finish()
        finally:
            self.records.close()
            transport.close()
            self.training.close()
            if enrolling is not None:
                enrolling.close()
        return self.stop_reason or "stopped"

    def open_logs(self) -> None:
        self.records.open(version=self.version, samples=self.samples_applied, time=time.time())
        self.training.started = self.clock()

    def _allow(self, key: bytes) -> bool:
        """The CURVE handshake's question, asked of the gate."""
        allowed = self.gate.handshake(key)
        if not allowed:
            self.counters["handshakes_refused"] += 1
            if self._refused_logged.ready(self.clock()):
                self._event("refused", f"a handshake from key {short(key)}, which is in no key "
                                       "folder (copy its NAME.key into --allow-keys, "
                                       "--monitor-keys or --operator-keys and send SIGHUP)",
                            level=logging.WARNING)
        return allowed

    def _on_signal(self, sig) -> None:
        if self.stop_reason is None:
            self.stop_reason = "interrupted"
            self._event("stop", f"{signal.Signals(sig).name} received")
        if self._stopping is not None and not self._stopping.done():
            self._stopping.set_result(None)  # the loop may be waiting for its next tick

    async def _loop(self, transport: ZmqTransport) -> None:
        tick_every = self.config.heartbeat_s / 2
        next_tick = self.clock() + tick_every
        next_checkpoint = self.clock() + self.config.checkpoint_every
        recv = asyncio.ensure_future(transport.receive())
        self._stopping = asyncio.get_running_loop().create_future()
        run = self.training.run
        # A slot's lateness is looked at when its prediction says, not only at the ticks: in
        # sync rounds of tens of ms a tick (half a heartbeat) is many rounds. At most this often.
        spec_every = min(tick_every, 0.01)
        spec_seen = -math.inf
        try:
            while self.stop_reason is None:
                now = self.clock()
                spec_at = max(self.core.next_speculation_at(), spec_seen + spec_every)
                due = min(next_tick, next_checkpoint, run.next_at(), spec_at)
                # chunks waiting to be served: look at the socket, and come straight back
                wait = 0.0 if self.training.data.pending else max(0.0, due - now)
                waiting = {recv, self._stopping} | self.offloop.futures()
                await asyncio.wait(waiting, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                overslept = self.clock() - now - wait
                if overslept > self.config.heartbeat_s:  # stopped, suspended, or starved of CPU
                    self._absent(overslept)
                awake = self.clock()
                if recv.done():
                    await self._handle_batch(recv.result())
                    recv = asyncio.ensure_future(transport.receive())
                    if self.stop_reason is not None:
                        break
                await self.perform(self.offloop.computed(self.clock()))
                if self.training.data.pending:  # one pass, at most its byte budget
                    await self.training.data.serve(self.gate.routes, self._send_counted,
                                                   self._event)
                now = self.clock()
                if now >= next_tick:
                    # What arrived while the loop was not looking (a frozen or busy coordinator)
                    # is handled before silence is judged: workers knocking at the door are not
                    # evicted for the coordinator's own absence.
                    if recv.done():
                        await self._handle_batch(recv.result())
                    else:
                        recv.cancel()  # a pending receive holds no message: nothing is lost
                        await self._handle_batch(None)
                    recv = asyncio.ensure_future(transport.receive())
                    now = self.clock()
                    # Stopped (or starved) while handling what came in rather than in the wait
                    # above: that time is no worker's silence either (a SIGSTOP landing there
                    # had both workers of test_exactly_once evicted on waking)
                    if now - awake > self.config.heartbeat_s:
                        self._absent(now - awake)
                    await self.perform(self.core.tick(now))
                    next_tick = now + tick_every
                elif now >= spec_at:
                    spec_seen = now
                    await self.perform(self.core.speculate(now))
                evaluation = self.offloop.evaluated()
                if evaluation is not None:
                    await self.evaluated(evaluation, "coordinator")
                if self.stop_reason is None:  # the evaluation due, if one is (run.py)
                    await self.perform(run.tick(self.clock()))
                if self.config.checkpoint_dir and now >= next_checkpoint:
                    self.save_checkpoint()
                    next_checkpoint = self.clock() + self.config.checkpoint_every
                if self.scheduler.finished and self.stop_reason is None:
                    self.stop_reason = "epochs"
        finally:
            recv.cancel()
            await self.offloop.settle()

    def _absent(self, seconds: float) -> None:
        """The loop did not run for `seconds`: that time is no worker's silence."""
        self.scheduler.absent(seconds)
        self._event("absent", f"the coordinator did not run for {seconds:.1f}s: that time "
                              "counts as no worker's silence", level=logging.WARNING)

    async def _handle_batch(self, first: Optional[list]) -> None:
        """Handle `first` (if any) and what else is queued, up to a bound, through the plain
        view of the socket: no receive is pending meanwhile."""
        transport = self.transport
        transport.handling = True
        try:
            if first is not None:
                await self.handle(first)
            for i in range(256):  # the periodic work must not wait behind a flood
                # stopped (a target confirmed): no more results, so the model the run stops
                # with is the one that met the target, not a round or two past it
                if self.stop_reason is not None:
                    break
                try:
                    frames = transport.waiting()
                except zmq.Again:
                    break
                await self.handle(frames)
                if i % 32 == 31:  # let a settle's thread start and report (a flood never yields)
                    await asyncio.sleep(0)
                    await self.perform(self.offloop.computed(self.clock()))
        finally:
            transport.handling = False

    async def finish(self) -> None:
        if self.stop_reason != "interrupted":
            # Training is over: withdraw the work and send everyone home.
            await self.perform(self.core.stop(self.clock()))
            for route in list(self.gate.routes.values()):
                await self._send(route, proto.Shutdown(
                    reason=f"training finished ({self.stop_reason})"))
        if self.training.run.stale():
            # The last word of a run is the coordinator's: workers may all be gone by now.
            await self.evaluated(self.training.evaluation()(), "coordinator")
        self.save_checkpoint()
        self.records.metrics(self.training.final_record(self.clock(), self.stop_reason))
        self._event("stop", f"stopped: {self.stop_reason}")

    def save_checkpoint(self) -> Optional[str]:
        self.records.sync()
        path = self.training.save_checkpoint(self.clock())
        if path is not None:
            self.records.write("checkpoint", version=self.version)
        return path

    async def evaluated(self, result: tuple, source: str) -> None:
        """An evaluation is done: made here (in a thread, on a copy of the model), or by
        workers (`source`). What the run core makes of it may stop the run, or start the
        evaluation that confirms a target."""
        start, record = self.training.evaluated(result, source, self.clock(),
                                                judge=self.stop_reason is None)
        self.records.metrics(record)
        if self.stop_reason is None:
            self.stop_reason = self.training.run.stopped
        await self.perform(start)

    # messages -------------------------------------------------------------------------------

    async def handle(self, frames: list, key: Optional[bytes] = None) -> None:
        """One received message: routing id, header, tensor frames. `key`: the sender's CURVE
        key (read from the frames when the coordinator has keys)."""
        if len(frames) < 2:
            self._bad(b"?", ProtocolError("frames", "no routing id or no header"))
            return
        route = bytes(frames[0].buffer) if hasattr(frames[0], "buffer") else bytes(frames[0])
        self.counters["bytes_received"] += sum(len(f) for f in frames[1:])
        if self.gate.secure and key is None:
            key = user_id(frames[1])
        if not self.gate.listed(key):
            # Admitted before a SIGHUP revoked it (or, were the authenticator to fail, never
            # admitted at all): nothing it says is used.
            self.counters["messages_unlisted_key"] += 1
            worker_id = self.gate.peers.get(route)
            if worker_id is not None:
                await self._revoke_worker(worker_id)
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
        refusal = self.gate.admit(key, msg, route) or self.budgets.admit(key, msg)
        if refusal is not None:
            if refusal.bad_message:
                self._bad(route, ProtocolError(refusal.counter, refusal.reason))
                return
            self.counters[refusal.counter] += 1
            if refusal.code is not None:
                await self._send(route, refusal.reply(msg))
            return
        if isinstance(msg, proto.Hello):  # its source address: its kin (gate.py)
            self.gate.heard_from(route, enrolment.peer_address(frames[1]))
        try:
            await handler(self, route, msg, key)
        except NeedHello:
            # A worker of an earlier coordinator process (or one we evicted): it re-handshakes.
            self.counters["hello_first"] += 1
            await self._send(route, proto.Reject(code="hello_first", reason="say hello first"))
        except ProtocolError as exc:
            self._bad(route, exc)

    def _bad(self, route: bytes, exc: ProtocolError) -> None:
        bad = self.training.bad_messages
        bad[exc.reason] += 1
        who = self.gate.peers.get(route, route.hex()[:16])
        if self._bad_logged.ready(self.clock()):
            self._event("rejected", f"bad message from {who}: {exc} ({sum(bad.values())} so far)",
                        level=logging.WARNING)

    async def _on_hello(self, route: bytes, msg: proto.Hello, key: Optional[bytes]) -> None:
        now = self.clock()
        resumed = self.training.resumes(msg, self.gate.same_key(msg.worker_id, key))
        if resumed:
            self.counters["sessions_resumed"] += 1
            self.scheduler.seen(msg.worker_id, now)
        else:
            await self.perform(self.core.join(msg.worker_id, {
                "host": msg.host, "cores": msg.cores, "threads": msg.threads, "device": msg.device,
                "memory_mb": msg.memory_mb, "versions": msg.versions, "job": msg.job},
                self.gate.identity(msg.worker_id, key), now,
                self.gate.kin(msg.worker_id, key, route)))
        self.gate.connect(msg.worker_id, route, key)
        self._event("join", f"{msg.worker_id} {'came back' if resumed else 'joined'} from "
                            f"{msg.host} ({msg.device}, {msg.threads} threads)", msg.worker_id)
        holding = sorted(self.scheduler.workers[msg.worker_id].assigned) if resumed else []
        await self._send(route, self.training.welcome(
            holding, msg.versions.get("job_identity") == proto.JOB_IDENTITY_FORMAT))
        if resumed:  # tasks sent down its old connection may be lost: it ignores the ones it has
            await self.perform(self.core.resend(msg.worker_id, now))

    async def _on_ready(self, route: bytes, msg: proto.Ready, key) -> None:
        worker_id = self.gate.worker_of(route)
        reject = self.training.refusal(worker_id, msg.fingerprint, msg.job_identity)
        if reject is not None:
            await self._send(route, reject)
            await self.perform(self.core.leave(worker_id, "wrong job", self.clock()))
            return
        credits = self.budgets.credits(self.gate.identity(worker_id, key), worker_id, msg.credits)
        await self.perform(self.core.ready(worker_id, credits, self.clock()))

    async def _on_result(self, route: bytes, msg: proto.Result, key) -> None:
        worker_id = self.gate.worker_of(route)
        # Taken (used, refused or dropped) once the core has judged it: the worker forgets it;
        # unacknowledged, it would be resent after a reconnect. A task sent to the worker
        # meanwhile carries the acknowledgement (`_send_task`).
        self._acks_due[worker_id] = msg.slot
        effects = []
        try:
            model, now = self.training.model, self.clock()
            identity = self.gate.identity(worker_id, key)
            verdict = self.budgets.result(identity, worker_id, msg.slot, now)
            if verdict != DECODE:  # not read (a slot it does not hold, or over its rate): acked
                if verdict == OVER_RATE:  # the slot is not lost: the next worker that asks takes it
                    await self.perform(self.core.handback(worker_id, [msg.slot], now))
                    if self._over_rate_logged.ready(now):
                        self._event("over_budget", f"results of {worker_id} over its key's budget "
                                    f"({self.config.budgets.results_per_s:g} a second, "
                                    "--key-results-per-s): not read, their slots dealt again",
                                    level=logging.WARNING)
                return
            try:
                grad = model.gradient_of(msg.gradient)
                buffers = model.buffers_of(msg.buffers)
            except ProtocolError:
                await self.perform(self.core.malformed(worker_id, msg.slot, now))
                raise
            effects = self.core.result(worker_id, msg.slot, grad, model.size(grad), msg.compute_s,
                                       now, msg.waited_s, msg.samples, msg.loss, buffers)
            await self.perform(effects)
        finally:
            self.records.write("ack", slot=msg.slot, worker=worker_id,
                               used=any(isinstance(e, Used) and e.slot == msg.slot for e in effects))
            slot = self._acks_due.pop(worker_id, None)
            if slot is not None:
                await self._tell(worker_id, proto.Ack(slots=[slot]))

    async def _on_eval_result(self, route: bytes, msg: proto.EvalResult, key) -> None:
        worker_id = self.gate.worker_of(route)
        sums = {name: (float(pair[0]), float(pair[1])) for name, pair in msg.sums.items()}
        await self.perform(self.core.evaluated(worker_id, msg.slot, msg.version, sums,
                                               msg.compute_s, self.clock()))

    async def _on_heartbeat(self, route: bytes, msg: proto.Heartbeat, key) -> None:
        worker_id = self.gate.worker_of(route)
        await self.perform(self.core.seen(worker_id, msg.state, self.clock(), msg.shards))
        self.training.data.report(worker_id, msg.cache)
        await self._send(route, proto.Heartbeat(state="coordinator"))

    async def _on_fetch(self, route: bytes, msg: proto.Fetch, key) -> None:
        refusal = self.training.data.fetch(self.gate.worker_of(route), msg, key)
        if refusal is not None:
            await self._send(route, refusal)

    async def _on_handback(self, route: bytes, msg: proto.Handback, key) -> None:
        worker_id, now = self.gate.worker_of(route), self.clock()
        await self.perform(self.core.handback(worker_id, msg.slots, now) if msg.error is None
                           else self.core.job_failed(worker_id, msg.slots, msg.error, now))

    async def _on_bye(self, route: bytes, msg: proto.Bye, key) -> None:
        worker_id = self.gate.peers.get(route)
        if worker_id is not None:
            await self.perform(self.core.leave(worker_id, f"said bye: {msg.reason}"[:200],
                                               self.clock()))

    async def _on_status(self, route: bytes, msg: proto.StatusRequest, key) -> None:
        await self._send(route, proto.Status(snapshot=self.snapshot(msg.cursor)))

    async def _on_control(self, route: bytes, msg: proto.Control, key) -> None:
        ok, detail = await self.control(msg.action, msg.worker, msg.invitation)
        await self._send(route, proto.ControlReply(action=msg.action, ok=ok, detail=detail))

    async def control(self, action: str, worker: Optional[str] = None,
                      invitation: Optional[str] = None) -> tuple[bool, str]:
        """An operator's command (operators.py): pause, resume, drain, ban or unban a worker,
        revoke an invitation."""
        ok, detail, effects = self.operators.command(action, worker, invitation,
                                                     self.clock())
        await self.perform(effects)
        return ok, detail

    async def _on_invite(self, route: bytes, msg: proto.Invite, key) -> None:
        await self._send(route, self.operators.invite(msg))

    async def _on_credit(self, route: bytes, msg: proto.CreditRequest, key) -> None:
        await self._send(route, self.operators.credit(key, msg))

    _HANDLERS = {proto.Hello: _on_hello, proto.Ready: _on_ready, proto.Result: _on_result,
                 proto.EvalResult: _on_eval_result,
                 proto.Heartbeat: _on_heartbeat, proto.Bye: _on_bye, proto.Fetch: _on_fetch,
                 proto.Handback: _on_handback, proto.StatusRequest: _on_status,
                 proto.Control: _on_control, proto.Invite: _on_invite,
                 proto.CreditRequest: _on_credit}

    async def reload_keys(self) -> None:
        """Re-read the key folders (SIGHUP); a key no longer in --allow-keys has its worker
        evicted."""
        for worker_id in self.operators.reload_keys():
            self._event("revoked", f"{worker_id}: key revoked", worker_id, logging.WARNING)
            await self._revoke_worker(worker_id)

    async def _revoke_worker(self, worker_id: str) -> None:
        """Its key lost the worker role: told why (else it would take the silence for an
        outage, and retry for ever), then evicted."""
        self.counters["workers_revoked"] += 1
        await self._tell(worker_id, proto.Reject(code="revoked", reason=REVOKED))
        # evicted now: its slots go back to the pool, and nothing more from its connection is used
        await self.perform(self.core.leave(worker_id, "key revoked", self.clock()))
        self.gate.forget(worker_id)

    # what the core asks for -------------------------------------------------------------------

    async def perform(self, effects: list) -> None:
        self.training.credits.take(effects, time.time())
        for effect in effects:
            if isinstance(effect, Assign):
                await self._send_task(effect)
            elif isinstance(effect, CancelSlots):
                await self._tell(effect.worker, proto.Cancel(slots=effect.slots))
            elif isinstance(effect, Event):
                self.training.record(effect)
            elif isinstance(effect, Applied):
                self.training.applied(effect, self.clock())
                self.records.write("applied", round=effect.round, version=effect.version,
                                   parts=[list(p) for p in effect.parts], t=time.time())
                self.training.data.stepped(self.scheduler.version_in_use, self.version)
            elif isinstance(effect, Compute):
                self.offloop.compute(effect)
            elif isinstance(effect, Evaluated):
                await self.evaluated((effect.version, effect.samples, effect.metrics,
                                       effect.seconds), "workers")
            elif isinstance(effect, EvaluateHere) and effect.confirming:
                await self.evaluated(await self.offloop.confirm(), "coordinator")
            elif isinstance(effect, EvaluateHere):
                self.offloop.evaluate()
            elif isinstance(effect, Ban):
                await self._tell(effect.worker, proto.Reject(code="banned",
                                                             reason=effect.reason or BANNED))
                self.gate.forget(effect.worker)
            elif isinstance(effect, Drained):
                await self._tell(effect.worker, proto.Shutdown(reason="drained by the operator"))
            elif isinstance(effect, Evicted):
                self.gate.forget(effect.worker)
                self.training.data.forget(effect.worker)

    async def _send_task(self, action: Assign) -> None:
        self.records.write("sent", slot=action.slot, worker=action.worker)
        ack = self._acks_due.pop(action.worker, None)
        task, track = self.training.task(action, [] if ack is None else [ack])
        tracker = await self._send(self.gate.routes[action.worker], task, track=track)
        if track:
            self.training.model.tracked(action.version, tracker)

    async def _tell(self, worker_id: str, msg: proto.Message) -> None:
        route = self.gate.routes.get(worker_id)
        if route is not None:  # (it may have gone meanwhile)
            await self._send(route, msg)

    async def _send(self, route: bytes, msg: proto.Message, track: bool = False):
        """Send `msg`; with `track`, return the MessageTracker of its zero-copy frames."""
        return await self._send_counted(route, msg, True, track)

    async def _send_counted(self, route: bytes, msg: proto.Message, counted: bool,
                            track: bool = False):
        """`counted`: in the wire bytes per sample (the data plane's chunks are not)."""
        frames = proto.encode(msg)
        if counted:
            self.counters["bytes_sent"] += sum(memoryview(f).nbytes for f in frames)
        return await self.transport.send(route, frames, track)

    def _event(self, kind: str, text: str, worker: Optional[str] = None,
               level: int = logging.INFO) -> None:
        self.training.event(kind, text, worker, level)
