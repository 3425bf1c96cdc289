"""An in-memory coordinator/worker pair, for the unit tests of what the protocol's rules decide.

The coordinator is the real one (server.py's `Coordinator`: its gate, round core, run core,
ledger, credits and records) with no socket: its transport hands each message it sends, encoded
and decoded as on the wire, to the worker it is for. Each worker is the real worker session
(worker/session.py) driven here as the daemon drives it, computing its slots with the job's real
engine (worker/engine.py, built as the daemon builds it), one after another and in this thread.
Time is a virtual clock that moves only when the pair says: nothing sleeps, and a run of a real
job takes what its gradients take to compute.

`Pair.run` is the loop: it delivers what is in flight, lets each worker compute one slot, moves
the clock, and does the coordinator's periodic work (the round core's tick at its cadence, the
computations and evaluations off its loop, awaited at once, the run core's tick), until the run
stops or the caller's condition holds. Between runs a test speaks for a raw peer (`frames`),
kills a worker (`Worker.kill`), adds one, and reads what travelled (`Pair.wire.sent`,
`Worker.said`) and what the coordinator shows (its snapshot, `final`, `events`, `metrics`).

Several projects per worker (worker/projects.py): pairs on one clock (`Pair(..., clock=)`), each
with a worker of the same machine, the workers sharing one `ComputeSlot` (`Pair.worker(...,
shared=)`); `run_together` drives them as one loop, the shared compute thread computing one
slot a turn, lent by share. `Pair.kill` is a coordinator gone silent (SIGKILL, or a SIGTERM that
sends nobody home).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections import deque
from typing import Callable, Optional

import torch

from idlegrad.common import protocol as proto
from idlegrad.coordinator.server import Coordinator, CoordinatorConfig
from idlegrad.worker import session as S
from idlegrad.worker.building import build_engine, hello_of, load_welcomed, task_model
from idlegrad.worker.compress import ErrorFeedback, eval_message, result_message
from idlegrad.worker.daemon import WorkerConfig
from idlegrad.worker.engine import Cancelled, Work
from idlegrad.worker.projects import ComputeSlot

from .fakes import RecordingTransport

CPU = torch.device("cpu")
STEP_S = 0.05  # virtual seconds per turn of the loop (each worker computes one slot in one)


class Clock:
    """Virtual seconds: the coordinator's clock and the workers' `now`."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now


class Timers:
    """Calls due at a virtual time (`later`, as a loop's `call_later`), made when it comes."""

    class Handle:
        def __init__(self, due: float, fn: Callable[[], None]):
            self.due, self.fn, self.cancelled = due, fn, False

        def cancel(self) -> None:
            self.cancelled = True

    def __init__(self, clock: Clock):
        self.clock = clock
        self.pending: list[Timers.Handle] = []

    def later(self, delay: float, fn: Callable[[], None]) -> "Timers.Handle":
        handle = Timers.Handle(self.clock.now + delay, fn)
        self.pending.append(handle)
        return handle

    def fire(self) -> None:
        due = [h for h in self.pending if h.due <= self.clock.now]
        self.pending = [h for h in self.pending if h.due > self.clock.now]
        for handle in due:
            if not handle.cancelled:
                handle.fn()


def compute_slot(shares: dict[str, float], clock: Clock, hold_s: float = 0.2) -> ComputeSlot:
    """The compute slot of one worker process serving projects of `shares` (name -> share),
    on the virtual `clock` (its hold timed there too)."""
    from idlegrad.worker.shares import ShareScheduler

    timers = Timers(clock)
    slot = ComputeSlot(ShareScheduler(shares), clock=clock, hold_s=hold_s, later=timers.later)
    slot.timers = timers  # type: ignore[attr-defined]  # fired by the loop, each turn
    return slot


class _Sent:
    """A zero-copy send's tracker: the wire below copied the frames, so it is done at once."""

    done = True


class Wire(RecordingTransport):
    """The coordinator's transport: what it sends, recorded and queued for the worker it is for
    (a route with no worker, a raw peer's, is only recorded)."""

    def __init__(self, workers: dict[bytes, "Worker"]):
        super().__init__()
        self.workers = workers

    async def send(self, route: bytes, frames: list, track: bool):
        await super().send(route, frames, track)
        worker = self.workers.get(route)
        if worker is not None:
            worker.inbox.append(self.sent[-1][1])
        return _Sent() if track else None


class Worker:
    """A worker session and the engine of the job it was welcomed to, driven as the daemon
    drives them (worker/daemon.py), without a socket or a thread."""

    def __init__(self, pair: "Pair", name: str, credits: int = 2,
                 poison: Optional[tuple[str, float]] = None,
                 shared: Optional[tuple[ComputeSlot, str]] = None,
                 key: Optional[bytes] = None):
        self.pair, self.name, self.route = pair, name, name.encode()
        self.key = key  # its CURVE public key, as the socket would say it (None: no keys)
        # (the process's compute slot, this session's project in it), as MultiWorker's
        self.shared = shared
        self.granted: Optional[asyncio.Future] = None  # the shared slot: asked for, or lent
        self.config = WorkerConfig(worker_id=name, credits=credits, device="cpu", threads=1,
                                   poison=poison)
        self.session = S.Session(credits, hello_of(name, 1, CPU, None))
        self.inbox: deque[proto.Message] = deque()
        self.said: list[proto.Message] = []  # everything it sent, in order
        self.engine = self.built = self.feedback = None
        self.model: Optional[tuple] = None  # (version, params, buffers) of the last model sent
        self.computing: Optional[tuple[int, Work]] = None
        self.cancelled = False  # the slot computing was cancelled: it ends not computed
        self.left: Optional[S.Leave] = None
        self.dead = False  # killed: it hears, says and computes nothing more (`kill`)
        self.stopped = False  # SIGSTOP: what is sent to it waits, it says and computes nothing
        self.computed = 0  # slots computed here

    @property
    def now(self) -> float:
        return self.pair.clock.now

    def kill(self) -> None:
        """SIGKILL: gone without a word; what it held is the coordinator's to take back."""
        self.dead = True
        self.inbox.clear()
        self._down()

    def stop(self) -> None:
        """SIGSTOP: frozen; what the coordinator sends it waits in its socket's queue."""
        self.stopped = True

    def cont(self) -> None:
        """SIGCONT: it reads what waited, and goes on where it was."""
        self.stopped = False

    def _down(self) -> None:
        """This session's connection ended (daemon.py's `_serve` ends): the others' time now."""
        if self.shared is not None:
            self.shared[0].down(self.shared[1])
            self.granted = None

    @property
    def serving(self) -> bool:
        return self.left is None and not self.dead and not self.stopped

    async def connect(self) -> None:
        await self.perform(self.session.connect(self.now))

    async def say(self, msg: proto.Message) -> None:
        """Send `msg` to the coordinator, as this worker."""
        self.said.append(msg)
        if not self.pair.killed:
            await self.pair.coordinator.handle([self.route, *proto.encode(msg)], key=self.key)

    async def perform(self, effects: list) -> None:
        for effect in effects:
            if isinstance(effect, S.Send):
                await self.say(effect.message)
            elif isinstance(effect, S.SendResult):
                await self.say(effect.result)
            elif isinstance(effect, S.Compute):
                self.computing, self.cancelled = (effect.slot, effect.work), False
            elif isinstance(effect, S.CancelCompute):
                self.cancelled = True
            elif isinstance(effect, S.Join):
                await self._join(effect.welcome)
            elif isinstance(effect, (S.Rehello, S.Reconnect)):
                self._down()
                if isinstance(effect, S.Rehello) and effect.forget:
                    self.model = None
                await self.connect()
            elif isinstance(effect, S.Leave):
                self._down()
                self.left = effect

    async def _join(self, welcome: proto.Welcome) -> None:
        if self.built is None:
            self.built, self.engine = build_engine(load_welcomed(None, welcome), welcome,
                                                   self.config, CPU)
        self.feedback = ErrorFeedback(welcome.result_dtype)
        await self.perform(self.session.welcomed(self.now, welcome, self.built.fingerprint))
        if self.shared is not None:
            self.shared[0].up(self.shared[1])

    async def receive(self) -> None:
        """Everything the coordinator sent it so far, in order."""
        while self.inbox and not self.stopped:
            msg = self.inbox.popleft()
            if self.dead:
                continue
            self.session.heard(self.now)
            if isinstance(msg, proto.Task):
                await self.perform(self._task(msg))
            else:
                await self.perform(self.session.received(self.now, msg))

    def _task(self, task: proto.Task) -> list:
        """The daemon's `_on_task`: the task's model decoded and its work built."""
        if task.model is not None:
            params, buffers = task_model(task, self.built.model)
            self.model = (task.version, params.clone() if isinstance(params, torch.Tensor)
                          else [p.clone() for p in params], buffers)
        if self.model is None or self.model[0] != task.version:
            return self.session.task(self.now, task.slot, None, model_held=False, acks=task.acks)
        _, params, buffers = self.model
        work = Work(task.slot, task.version, params, task.parts, task.coefficients, task.kind,
                    task.steps, arrived=self.now, buffers=buffers)
        try:
            self.engine.check(work)
            refused = None
        except ValueError as exc:
            refused = str(exc)
        return self.session.task(self.now, task.slot, work, refused=refused, acks=task.acks)

    async def compute_one(self, busy: Optional[set] = None) -> bool:
        """Start the next slot and compute it, as the daemon's compute thread would; whether one
        was computed. With a shared compute slot, only once it is lent to this session (asked
        for as the daemon asks), and not in a turn `busy` (the ids of the slots that computed
        in it) names: the process's one thread computes one slot a turn."""
        slot_of = self.shared[0] if self.shared is not None else None
        if slot_of is not None and self.computing is None:
            if self.granted is None and self.session.wants_compute():
                self.granted = slot_of.request(self.shared[1])
            if self.granted is None or not self.granted.done() or id(slot_of) in (busy or ()):
                return False
        if self.computing is None:
            await self.perform(self.session.start(self.now))
        if self.computing is None:
            if slot_of is not None and self.granted is not None:
                slot_of.leave(self.shared[1], 0.0)  # lent, but nothing to run now
                self.granted = None
            return False
        (slot, work), self.computing = self.computing, None
        cancel = threading.Event()
        if self.cancelled:
            cancel.set()
        try:
            # In virtual time a slot takes one turn, whatever it took here: what the coordinator
            # makes of compute times (speeds, deadlines, late slots) is then the same on any
            # machine, under any load
            o = dataclasses.replace(self.engine.compute(work, cancel),
                                    compute_s=self.pair.step_s)
            spent = self.pair.step_s
            outcome: S.Outcome = (S.EvalAnswer(eval_message(o)) if o.sums is not None
                                  else S.ResultReady(result_message(o, self.feedback)))
            self.computed += 1
        except Cancelled:
            outcome, spent = S.NotComputed(), 0.0
        if slot_of is not None:
            if self.granted is not None:  # the next slot may be another project's
                slot_of.leave(self.shared[1], spent)
                self.granted = None
            if busy is not None:
                busy.add(id(slot_of))
        await self.perform(self.session.finished(self.now, slot, outcome))
        return True


class Pair:
    """A coordinator of `config` (its bind unused) and the workers added to it; `clock` another
    pair's, for pairs run together (`run_together`)."""

    def __init__(self, config: CoordinatorConfig, step_s: float = STEP_S,
                 clock: Optional[Clock] = None):
        self.clock = clock or Clock()
        self.step_s = step_s
        self.workers: dict[bytes, Worker] = {}
        self._joining: list[Worker] = []  # added, not yet said hello
        self.wire = Wire(self.workers)
        # One torch thread, as every process of the integration suite has (--threads 1): on a
        # loaded machine the default's threads fight each other, ten times slower. And where
        # evaluations (and so settles) run is said, not measured: --eval-on auto times the job
        # on this machine, and a loaded one could choose the other way (the small jobs the pair
        # runs are evaluated on the coordinator under auto)
        self.coordinator = Coordinator(dataclasses.replace(
            config, threads=config.threads or 1,
            eval_on="coordinator" if config.eval_on == "auto" else config.eval_on))
        self.coordinator.transport = self.wire
        self.coordinator.clock = self.clock
        self.coordinator.open_logs()
        self._next_tick = self.clock.now
        self.finished = False
        self.killed = False  # `kill`: it hears nothing, says nothing, does nothing more

    # what the tests read
    core = property(lambda self: self.coordinator.core)
    counters = property(lambda self: self.coordinator.counters)

    def worker(self, name: str, credits: int = 2,
               poison: Optional[tuple[str, float]] = None,
               shared: Optional[tuple[ComputeSlot, str]] = None,
               key: Optional[bytes] = None) -> Worker:
        """A worker that says hello at the next `run` (it joins then); `shared`: (the compute
        slot of its process, its project there), one project's session of a MultiWorker; `key`:
        the public key it connects with, to a coordinator with keys."""
        worker = Worker(self, name, credits, poison, shared, key)
        self.workers[worker.route] = worker
        self._joining.append(worker)
        return worker

    def frames(self, frames: list, route: bytes = b"raw", key: Optional[bytes] = None) -> None:
        """Raw frames from a peer at `route` (a raw peer's, or a worker's), as the socket hands
        them to the coordinator: routing id first; `key`, the peer's CURVE key."""
        async def handled():
            await self.coordinator.handle([route, *frames], key=key)
            await self._offloop_done()

        asyncio.run(handled())

    def ask(self, msg: proto.Message, key: Optional[bytes] = None,
            route: bytes = b"raw") -> proto.Message:
        """What the coordinator answers `msg` from a raw peer (a monitor's, an operator's
        command) of `key`: its one reply."""
        sent = len(self.wire.sent)
        self.frames(proto.encode(msg), route, key)
        (reply,) = [m for r, m in self.wire.sent[sent:] if r == route]
        return reply

    def kill(self) -> None:
        """The coordinator's process gone without a word (SIGKILL; or SIGTERM, which sends
        nobody home): its workers hear nothing more, and what they say is lost."""
        self.killed = True
        for worker in self.workers.values():
            worker.inbox.clear()

    def run(self, until: Callable[[], bool] = lambda: False, steps: int = 100_000,
            finish: bool = True) -> None:
        """Turns of the loop until the run stops (then, with `finish`, the coordinator's end
        of a run: work withdrawn, every worker sent home) or `until()` holds, at most `steps`."""
        run_together([self], until, steps, finish)

    def turns(self, n: int) -> None:
        """`n` turns of the loop (n * step_s virtual seconds), unless the run stops first."""
        turns([self], n)

    @property
    def stopped(self) -> bool:
        return self.killed or self.coordinator.stop_reason is not None

    async def _deliver(self) -> None:
        """Hellos of new workers, then everything in flight, until nothing is."""
        while self._joining:
            await self._joining.pop(0).connect()
        while any(w.inbox and not w.stopped for w in self.workers.values()):
            for worker in list(self.workers.values()):
                await worker.receive()

    async def _offloop_done(self) -> None:
        """What the coordinator started computing off its loop, done before this loop (one
        `asyncio.run`) ends: the next turn, in another loop, takes it up."""
        c = self.coordinator
        for job in (c.offloop.computing, c.offloop.evaluating):
            if job is not None and not job.done():
                await asyncio.wait({job})

    async def _tick(self) -> None:
        """The coordinator's loop without its socket (server.py's `_loop`), then the workers'
        heartbeats."""
        c, now = self.coordinator, self.clock.now
        if self.killed:
            for worker in list(self.workers.values()):
                if worker.serving:
                    await worker.perform(worker.session.tick(now))
            return
        # a slot computed here: done within the turn (a done future may be another loop's: the
        # last `run`'s)
        if c.offloop.computing is not None and not c.offloop.computing.done():
            await asyncio.wait({c.offloop.computing})
        await c.perform(c.offloop.computed(now))
        if now >= self._next_tick:
            await c.perform(c.core.tick(now))
            self._next_tick = now + c.config.heartbeat_s / 2
        if c.offloop.evaluating is not None and not c.offloop.evaluating.done():
            await asyncio.wait({c.offloop.evaluating})
        evaluation = c.offloop.evaluated()
        if evaluation is not None:
            await c.evaluated(evaluation, "coordinator")
        if c.stop_reason is None:
            await c.perform(c.training.run.tick(now))
        if c.scheduler.finished and c.stop_reason is None:
            c.stop_reason = "epochs"
        for worker in list(self.workers.values()):
            if worker.serving:
                await worker.perform(worker.session.tick(now))
        await self._deliver()

    async def finish(self) -> None:
        """The end of a run, as the server's: its last word, and every worker sent home (each
        says bye and leaves)."""
        self.finished = True
        await self.coordinator.finish()
        await self._deliver()
        for worker in list(self.workers.values()):
            if worker.serving:
                await worker.perform(worker.session.tick(self.clock.now))
        await self._deliver()

    def final(self) -> dict:
        """The metrics log's last line (what `finish` wrote): the run's tallies."""
        return self.coordinator.training.final_record(self.clock.now,
                                                      self.coordinator.stop_reason)

    def metrics(self) -> list[dict]:
        """The metrics log (config.metrics_path), a record a line."""
        with open(self.coordinator.config.metrics_path) as fh:
            return [json.loads(line) for line in fh if line.strip()]

    def events(self, kind: str, worker: Optional[str] = None) -> list[dict]:
        """The coordinator's events of `kind` (of `worker`), as its status shows them."""
        return [e for e in self.coordinator.training.events
                if e["kind"] == kind and (worker is None or e.get("worker") == worker)]

    def close(self) -> None:
        self.coordinator.records.close()
        self.coordinator.training.close()


def run_together(pairs: list[Pair], until: Callable[[], bool] = lambda: False,
                 steps: int = 100_000, finish: bool = True) -> None:
    """`Pair.run` for pairs on one clock: turns of one loop until every pair's run stopped (each
    then finished, with `finish`) or `until()` holds, at most `steps`. In a turn each worker
    computes a slot, except that workers sharing a compute slot compute one between them."""
    assert len({id(p.clock) for p in pairs}) == 1, "pairs run together share one clock"
    asyncio.run(_run(pairs, until, steps, finish))


def turns(pairs: list[Pair], n: int) -> None:
    """`n` turns of the pairs' loop (`run_together`), unless every run stops first."""
    left = [n]

    def done() -> bool:
        left[0] -= 1
        return left[0] < 0

    run_together(pairs, until=done, steps=n + 1)


async def _run(pairs: list[Pair], until, steps: int, finish: bool) -> None:
    clock, step_s = pairs[0].clock, pairs[0].step_s
    for _ in range(steps):
        for p in pairs:
            await p._deliver()
        if all(p.stopped for p in pairs) or until():
            break
        busy: set = set()  # the shared compute slots that computed in this turn
        for p in pairs:
            for worker in list(p.workers.values()):
                if worker.serving and await worker.compute_one(busy):
                    await p._deliver()
        clock.now += step_s
        for p in pairs:
            for worker in p.workers.values():
                if worker.shared is not None:
                    worker.shared[0].timers.fire()  # type: ignore[attr-defined]
            await p._tick()
    else:
        raise AssertionError(f"still running after {steps} turns: "
                             f"{[p.coordinator.core.samples_applied for p in pairs]} samples "
                             "applied")
    for p in pairs:
        if finish and p.coordinator.stop_reason is not None and not p.finished and not p.killed:
            await p.finish()
        await p._offloop_done()
