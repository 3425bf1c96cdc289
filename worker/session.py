"""The worker's session with one coordinator, sans-IO: every protocol decision a worker makes.

The session holds no socket, thread, clock or tensor. Its driver (the daemon, a test, a simulator
in virtual time) tells it what happened, `now` (seconds on one monotonic clock) always passed in,
and performs the effects it returns, in order:

- the connection: `connect` (a socket is open: say hello), `received` (a message without tensors
  came), `task` (a task came; the driver decoded its model and built its work), `welcomed` (the
  driver built the job a welcome named), `tick`, `lost` (the driver dropped the connection);
- the computation: `wants_compute`, `start` (the compute thread is free), `finished`;
- the machine: `pause` (the guest paused or resumed), `cap` (the owner's transfer cap is spent
  until then), `stop`.

What it decides: the handshake and the resume rules of docs/protocol.md ("Exactly once"), the
queue of slots and the credits announced, the results not yet acknowledged (resent once after a
resumed session, dropped when the coordinator says so or is another process), the transfer cap's
hand-backs (a slot whose data is neither here nor fetchable goes back before it starts), the
heartbeats and the shards they tell, and when the coordinator is gone. Work and results are the
driver's objects, referred to by slot and by the handle the driver gave (`work`, `result`); the
session never looks inside them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..common import protocol as proto
from ..common.text import shown
from ..common.throttle import Throttle

log = logging.getLogger("idlegrad.worker")

MAX_UNACKED = 16  # results kept for resending; acknowledgements come within milliseconds
# While the transfer cap is spent: how long the worker asks for no slots after it handed one back,
# before it asks again (a locality-aware coordinator may then give it slots whose data it holds)
CAPPED_RETRY_S = 60.0
HANDBACK_REASON = "the daily transfer cap is spent and the data is not cached"


def one_line(text: str) -> str:
    """`text` as the wire takes an error: one printable line, at most proto.MAX_NAME long."""
    line = "".join(c if c.isprintable() else " " for c in text)
    return line if len(line) <= proto.MAX_NAME else line[:proto.MAX_NAME - 3] + "..."


# effects: what the driver must do ---------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """Send `message` (built here, no tensors) to the coordinator."""
    message: proto.Message


@dataclass(frozen=True)
class SendResult:
    """Send the result the driver kept as `result` for `slot` (first time, or again on resume)."""
    slot: int
    result: Any


@dataclass(frozen=True)
class DropResult:
    """The result `result` of `slot` is acknowledged or given up: its buffers may be reused."""
    slot: int
    result: Any


@dataclass(frozen=True)
class Compute:
    """Compute `slot` (the driver's `work`), then call `finished`."""
    slot: int
    work: Any


@dataclass(frozen=True)
class CancelCompute:
    """Stop computing `slot` at its next boundary; `finished` follows all the same."""
    slot: int


@dataclass(frozen=True)
class Join:
    """The coordinator welcomed us: build the job it names, then call `welcomed` (or `lost`)."""
    welcome: proto.Welcome


@dataclass(frozen=True)
class Rehello:
    """The coordinator does not know this session: say hello again on the same socket (`connect`).
    `forget`: nothing held is of use (the driver drops its model too)."""
    forget: bool


@dataclass(frozen=True)
class Reconnect:
    """The coordinator has been silent too long: a new socket, then `connect`."""


@dataclass(frozen=True)
class Leave:
    """Stop serving. `refused`: the coordinator refused this worker; say `reason` and stop."""
    reason: str
    refused: bool = False


# outcomes: what a computation came to (`finished`'s argument) -----------------------------------


@dataclass(frozen=True)
class ResultReady:
    """A gradient or local result, kept by the driver as `result` until acknowledged."""
    result: Any


@dataclass(frozen=True)
class EvalAnswer:
    """An evaluation's answer: sent once, never kept (a lost one is handed out again)."""
    message: proto.EvalResult


@dataclass(frozen=True)
class NotComputed:
    """Cancelled, or failed (the driver said why). `error`: the job's own code failed on the
    slot (what it raised): the coordinator is told, so that the slot goes to others at once."""
    error: Optional[str] = None


@dataclass(frozen=True)
class Capped:
    """Its data is not here and the transfer cap is spent until `until` (the session's clock)."""
    until: float


@dataclass(frozen=True)
class Fatal:
    """Nothing can be computed here until the owner acts (cache too small, disk full): leave."""
    reason: str


Effect = Send | SendResult | DropResult | Compute | CancelCompute | Join | Rehello | Reconnect | Leave
Outcome = ResultReady | EvalAnswer | NotComputed | Capped | Fatal

# states
DISCONNECTED, HELLO, JOINING, SERVING = "disconnected", "hello", "joining", "serving"


class Session:
    def __init__(self, credits: int, hello: proto.Hello, *,
                 held_shards: Callable[[], Optional[list[int]]] = lambda: [],
                 cache_counters: Callable[[], Optional[dict]] = lambda: None,
                 max_unacked: int = MAX_UNACKED, capped_retry_s: float = CAPPED_RETRY_S):
        """`hello`: this worker's hello (its `instance` is the session's); `held_shards`,
        `cache_counters`: readings for heartbeats (held_shards None: cannot tell now)."""
        self.credits = credits
        self.hello = hello
        self._held_shards, self._cache_counters = held_shards, cache_counters
        self.max_unacked, self.capped_retry_s = max_unacked, capped_retry_s
        self.state = DISCONNECTED
        # The coordinator process this worker's slots and results belong to (welcome.instance)
        self.instance: Optional[str] = None
        self.fingerprint = ""
        self.heartbeat_s, self.liveness = 1.0, 3
        self.queue: deque[tuple[int, Any]] = deque()
        self.current: Optional[tuple[int, Any]] = None
        self.unacked: dict[int, Any] = {}  # slot -> the driver's result, in the order sent
        self.paused = False
        self.capped_until: Optional[float] = None
        self.ask_again_at = -float("inf")
        self.announced: Optional[int] = None  # the credits last said in a READY
        self.shards_said: Optional[list[int]] = None  # as this session's coordinator last heard
        self.last_heard = self.next_beat = 0.0
        self.stopped: Optional[str] = None
        self.results_sent = self.results_resent = 0
        self._refused_logged = Throttle()  # a flood of tasks past our credits

    # readings -----------------------------------------------------------------------------------

    def capped(self, now: float) -> bool:
        """The daily transfer cap is spent (until its allowance returns)."""
        if self.capped_until is not None and now >= self.capped_until:
            self.capped_until = None
            log.info("the daily transfer allowance is back: fetching again")
        return self.capped_until is not None

    def credits_now(self, now: float) -> int:
        if self.paused or (self.capped(now) and now < self.ask_again_at):
            return 0
        return self.credits

    def holds(self, slot: int) -> bool:
        """Whether `slot` is queued or computing. (A slot whose result is unacknowledged is not
        held: the coordinator may have refused that result and handed the slot back to us.)"""
        return ((self.current is not None and self.current[0] == slot)
                or any(s == slot for s, _ in self.queue))

    def wake_at(self) -> float:
        """When `tick` next has something to do (a heartbeat, the coordinator's silence)."""
        if self.state == SERVING:
            return min(self.next_beat, self.last_heard + self.heartbeat_s * self.liveness)
        return self.next_beat if self.state == JOINING else float("inf")

    def beat_state(self, now: float) -> str:
        if self.paused:
            return "paused"
        if self.capped(now):
            return "capped"
        return "working" if self.current is not None else "idle"

    # the connection -----------------------------------------------------------------------------

    def connect(self, now: float) -> list[Effect]:
        """A socket is open (or the same one, after `Rehello`): say hello, naming our instance."""
        self.state = HELLO
        self.last_heard = now
        return [Send(dataclasses.replace(self.hello, instance=self.instance))]

    def received(self, now: float, msg: proto.Message) -> list[Effect]:
        """A message from the coordinator other than a task or a chunk."""
        self.last_heard = now
        if isinstance(msg, proto.Welcome):
            if self.state != HELLO:
                return []  # not an answer to anything we said
            self.state = JOINING
            self.heartbeat_s, self.liveness = msg.heartbeat_s, msg.liveness
            self.next_beat = now
            return [Join(msg)]
        if isinstance(msg, proto.Reject):
            if msg.code != "hello_first":
                return [Leave(f"the coordinator refused this worker ({shown(msg.code)}): "
                              f"{shown(msg.reason)}",
                              refused=True)]
            if self.state in (HELLO, DISCONNECTED):  # we just said hello, or are about to
                return []
            return self._end(Rehello(forget=False))
        if isinstance(msg, proto.Shutdown):
            log.info("the coordinator says: %s", shown(msg.reason))
            prefix = "coordinator said" if self.state == HELLO else "shutdown"
            return self.stop(f"{prefix}: {shown(msg.reason)}")
        if self.state != SERVING:
            return []
        if isinstance(msg, proto.Cancel):
            cancelled = set(msg.slots)
            self.queue = deque((s, w) for s, w in self.queue if s not in cancelled)
            if self.current is not None and self.current[0] in cancelled:
                return [CancelCompute(self.current[0])]
        elif isinstance(msg, proto.Ack):
            return self._drop(msg.slots)
        return []  # heartbeats need nothing beyond having been heard

    def heard(self, now: float) -> None:
        """Anything arrived (a chunk too): the coordinator is alive."""
        self.last_heard = now

    def welcomed(self, now: float, welcome: proto.Welcome, fingerprint: str) -> list[Effect]:
        """The driver built the welcome's job (of `fingerprint`): keep what this coordinator still
        expects of us, resend the results it has not acknowledged, drop the rest (a restarted
        coordinator knows none of our slots), and announce our credits."""
        effects: list[Effect] = []
        if welcome.instance != self.instance:
            if self.instance is not None:
                log.info("a new coordinator process: dropping %d queued slots and %d "
                         "unacknowledged results of the old one", len(self.queue), len(self.unacked))
            self.queue.clear()
            effects += self._drop(list(self.unacked))
            self.instance = welcome.instance
        else:
            holding = set(welcome.holding)
            self.queue = deque((s, w) for s, w in self.queue if s in holding)
            effects += self._drop([s for s in self.unacked if s not in holding])
            effects += [SendResult(s, r) for s, r in self.unacked.items()]
            self.results_resent += len(self.unacked)
            if self.unacked:
                log.info("resent %d unacknowledged results", len(self.unacked))
        self.state = SERVING
        self.fingerprint = fingerprint
        self.heartbeat_s, self.liveness = welcome.heartbeat_s, welcome.liveness
        self.shards_said = None  # a new session hears anew
        self.last_heard = self.next_beat = now
        if self.paused or self.capped(now):
            effects.append(Send(self._heartbeat(now)))
        return effects + [self._ready(now)]

    def task(self, now: float, slot: int, work: Any, *, model_held: bool = True,
             refused: Optional[str] = None, acks=()) -> list[Effect]:
        """A task for `slot` (the driver's `work`). `model_held`: the task carries its model, or
        names a version whose model we hold; `refused`: why this worker cannot compute it (its
        parts outside our data); `acks`: the results it acknowledges."""
        self.last_heard = now
        effects = self._drop(acks)
        if self.state != SERVING:
            return effects
        if not model_held:  # the coordinator thinks we hold a model we do not: start afresh
            return effects + self._end(Rehello(forget=True))
        if self.holds(slot):  # sent again after a resumed session: we have it
            return effects
        held = len(self.queue) + (self.current is not None)
        if held >= 2 * self.credits + 2:
            # The coordinator deals at most our credits (a pause or a resume can cross a task in
            # flight, hence the margin); past that its tasks would only pile up here. It hands
            # the slot to someone else when its deadline passes.
            if self._refused_logged.ready(now):
                log.warning("task %d refused: %d slots held already, for %d credits", slot, held,
                            self.credits)
            return effects
        if refused is not None:
            log.warning("task %d refused: %s", slot, refused)
            return effects
        self.queue.append((slot, work))
        return effects

    def tick(self, now: float) -> list[Effect]:
        """Time passed: say goodbye if stopping, heartbeats when due, credits when they changed
        (the cap's retry came, the allowance returned), and give up on a silent coordinator."""
        if self.state == JOINING and now >= self.next_beat:
            self.next_beat = now + self.heartbeat_s
            return [Send(self._heartbeat(now))]
        if self.state != SERVING:
            return []
        if self.stopped is not None:
            self.state = DISCONNECTED
            return [Send(proto.Bye(reason=self.stopped)), Leave(self.stopped)]
        effects: list[Effect] = []
        if now >= self.next_beat:
            effects.append(Send(self._heartbeat(now)))
            self.next_beat = now + self.heartbeat_s
            if self.credits_now(now) != self.announced:
                effects += self._announce(now)
        if now - self.last_heard > self.heartbeat_s * self.liveness:
            effects += self._end(Reconnect())  # the coordinator is gone
        return effects

    def lost(self, now: float) -> list[Effect]:
        """The driver dropped the connection (or left the join): what computes stops; its
        outcome is kept for the next session (`finished`)."""
        return self._end(None) if self.state != DISCONNECTED else []

    # the computation ----------------------------------------------------------------------------

    def wants_compute(self) -> bool:
        return (self.state == SERVING and self.current is None and bool(self.queue)
                and self.stopped is None and not self.paused)

    def start(self, now: float, has_data: Optional[Callable[[Any], bool]] = None) -> list[Effect]:
        """The compute thread is free: the next slot that can run here. While the transfer cap is
        spent, a slot whose data is not here (`has_data(work)` false) is handed back before it
        starts, not failed by the data loader. At most one `Compute`."""
        if not self.wants_compute():
            return []
        capped = self.capped(now)
        back: list[int] = []
        effects: list[Effect] = []
        while self.queue:
            slot, work = self.queue.popleft()
            if capped and has_data is not None and not has_data(work):
                back.append(slot)
                continue
            self.current = (slot, work)
            effects.append(Compute(slot, work))
            break
        return (self._hand_back(now, back) if back else []) + effects

    def finished(self, now: float, slot: int, outcome: Outcome) -> list[Effect]:
        """The computation of `slot` ended with `outcome`."""
        work = None
        if self.current is not None and self.current[0] == slot:
            work = self.current[1]
            self.current = None
        if isinstance(outcome, Fatal):
            log.error("%s; leaving", outcome.reason)
            return self.stop(outcome.reason)
        if self.stopped is not None:
            return [DropResult(slot, outcome.result)] if isinstance(outcome, ResultReady) else []
        if isinstance(outcome, Capped):
            self.cap(now, outcome.until)
        if self.state != SERVING:  # lost meanwhile: a result is resent on resume, the rest redone
            if isinstance(outcome, ResultReady):
                return self._keep(slot, outcome.result)
            if work is not None:
                self.queue.appendleft((slot, work))
            return []
        if isinstance(outcome, ResultReady):
            self.results_sent += 1
            return self._keep(slot, outcome.result) + [SendResult(slot, outcome.result)]
        if isinstance(outcome, EvalAnswer):
            self.results_sent += 1
            return [Send(outcome.message)]
        if isinstance(outcome, Capped):
            return self._hand_back(now, [slot])
        if isinstance(outcome, NotComputed) and outcome.error is not None:
            return [Send(proto.Handback(slots=[slot], reason="the job failed",
                                        error=one_line(outcome.error)))]
        return []

    # the machine --------------------------------------------------------------------------------

    def pause(self, now: float, paused: bool) -> list[Effect]:
        """The guest paused or resumed: tell the coordinator at once (no slots while paused)."""
        self.paused = paused
        return self._announce(now) if self.state == SERVING else []

    def cap(self, now: float, until: Optional[float]) -> None:
        """The transfer cap is spent until `until` (None: not known to be spent)."""
        if until is None or until <= now:
            return
        if not self.capped(now):
            log.warning("today's transfer cap is spent: asking for no slots that need data not "
                        "cached here, until the allowance returns")
        self.capped_until = until

    def stop(self, reason: str) -> list[Effect]:
        """Leave: slots not computed go back to the coordinator (it hears `bye` at the next
        tick), what computes stops."""
        if self.stopped is None:
            self.stopped = reason
        self.queue.clear()
        return [CancelCompute(self.current[0])] if self.current is not None else []

    # inside -------------------------------------------------------------------------------------

    def _end(self, then: Optional[Effect]) -> list[Effect]:
        """The connection ends: what computes stops, then `then`."""
        if isinstance(then, Rehello) and then.forget:
            self.queue.clear()
        effects: list[Effect] = []
        if self.current is not None:
            effects.append(CancelCompute(self.current[0]))
        if isinstance(then, Rehello) and then.forget:  # nothing held is any use
            effects += self._drop(list(self.unacked))
            self.instance = None
        self.state = DISCONNECTED
        return effects + ([then] if then is not None else [])

    def _keep(self, slot: int, result: Any) -> list[Effect]:
        effects = self._drop([slot])  # a recomputed slot replaces its older result
        self.unacked[slot] = result
        while len(self.unacked) > self.max_unacked:  # a coordinator that never acknowledges
            effects += self._drop([next(iter(self.unacked))])
        return effects

    def _drop(self, slots) -> list[Effect]:
        return [DropResult(s, self.unacked.pop(s)) for s in slots if s in self.unacked]

    def _heartbeat(self, now: float) -> proto.Heartbeat:
        """A heartbeat: the cache's counters, and the shards this worker holds when they changed
        since it last said (a bounded, sorted list, for the coordinator's locality)."""
        shards = self._held_shards()
        if shards is None:
            shards = self.shards_said or []
        shards = sorted({int(k) for k in shards if int(k) >= 0})[:proto.MAX_HELD_SHARDS]
        state, cache = self.beat_state(now), self._cache_counters()
        if shards == self.shards_said:
            return proto.Heartbeat(state=state, cache=cache)
        self.shards_said = shards
        return proto.Heartbeat(state=state, shards=shards, cache=cache)

    def _ready(self, now: float) -> Send:
        self.announced = self.credits_now(now)
        return Send(proto.Ready(credits=self.announced, fingerprint=self.fingerprint))

    def _announce(self, now: float) -> list[Effect]:
        """A heartbeat and a READY at once: paused or resumed, capped or back."""
        return [Send(self._heartbeat(now)), self._ready(now)]

    def _hand_back(self, now: float, slots: list[int]) -> list[Effect]:
        """Slots whose data is not here and cannot be fetched today go back at once, after a
        READY 0: the coordinator gives them to others, not to us again."""
        self.ask_again_at = now + self.capped_retry_s
        return self._announce(now) + [Send(proto.Handback(slots=slots, reason=HANDBACK_REASON))]
