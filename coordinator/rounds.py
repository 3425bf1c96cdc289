"""The round core: every decision the coordinator makes about rounds, run by both its drivers.

It owns the scheduler, the gradient store (the results of open rounds), the trust screening and
the settlement of suspects and disagreeing copies (`verify.py`), and a model backend that applies
decoded rounds. Each call takes what happened and `now`, and returns what the driver must do:

- to a worker: `Assign` (send a task), `CancelSlots`, `Drained` (send it home), `Ban` (refuse and
  forget it), `Evicted` (forget its connection);
- here: `Compute` (compute a slot exactly as a worker would, then call `computed`);
- to record: `Evaluated` (an evaluation handed to workers is complete: its metrics),
  `Used` (a result taken into its round), `Applied` (a step taken: ledger, rate, and
  what each result it used earns), `Replanned`, `Event` (the event log), `Joined` and `Refused`
  (for the credits).

No sockets, no clock, no threads. The server (`server.py`) runs it against ZeroMQ and real time,
the simulator (`simulator.py`) against a fleet in virtual time: both get the same interpretation
of the scheduler's actions (decode, apply or replan, compare copies, settle).

The model backend is whatever applies rounds: the server's `ModelState` (torch, snapshots for
the wire), the simulator's costless or real gradients. It offers `version`, `apply(terms, norms,
samples, round_version, in_use)` (the staleness weight used, None when too stale; raises
GradientRejected), `distance(a, b)` / `size(a)` over stored results, and, for a model with
buffers, `merge_buffers(states, weight)`: the end states of the results an applied round used,
each with the samples its slot covers, and the round's staleness weight (the rule is the
backend's: coordinator/aggregator.py's `merge_buffers`). A backend with tensors may say
`mean_square`: the squared norm of the mean gradient its last `apply` stepped with, before
clipping and weighting (None when it stepped with none); the noise scale (noise.py) is measured
only where it does. With `--batch adaptive` (batch_policy.py) the core moves the batch of new
rounds towards the measured noise scale after each measured round, and, where the backend has
a settable `lr_factor`, sets it before each step to the rule's factor for that round's samples.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from typing import Any, Callable, Optional, Protocol, Sequence

from ..common.errors import GradientRejected
from .credits import shares
from .effects import (Applied, Ban, Compute, Contribution, Effect, Evaluated, Event, Joined,
                      Refused, Replanned, Used)
from .eval_slots import EvalShape, WorkerEvaluation
from .batch_policy import Batching, BatchSetting
from .noise import NoiseScale, round_estimate
from .scheduler import Action, CompareCopies, Decoded, Drained, Evicted, Scheduler
from .slots import Assign, CancelSlots, SlotWork, Stored
from .trust import TrustPolicy
from .verify import Settlement

__all__ = ["RoundCore", "Backend", "Stored", "Applied", "Ban", "Compute", "Event", "Replanned",
           "Used"]

log = logging.getLogger("idlegrad.coordinator")


def measured(reported_s: float, since: Optional[float], now: float) -> float:
    """A worker's reported compute seconds for a slot, at most as long as the slot was out (dealt
    at `since`, answered at `now`): its word is credited no further than the coordinator saw."""
    if since is None:
        return 0.0
    return min(max(0.0, reported_s), max(0.0, now - since))


class Backend(Protocol):
    version: int

    def apply(self, terms, norms: Sequence[float], samples: int, round_version: int,
              in_use: Callable[[int], bool]) -> Optional[float]: ...

    def distance(self, a: Any, b: Any) -> float: ...

    def size(self, a: Any) -> float: ...

    def merge_buffers(self, states: Sequence[tuple[Any, int]], weight: float) -> None: ...


class RoundCore:
    """Rounds from task to step. `identity` of a worker is who trust judges and bans (its CURVE
    key, or its worker id without keys): the driver names it when the worker joins."""

    def __init__(self, scheduler: Scheduler, backend: Backend, trust: TrustPolicy,
                 samples_applied: int = 0, settle_on_workers: bool = False,
                 batching: Optional[Batching] = None):
        """`settle_on_workers`: a suspect or a disagreement is computed by a third worker
        rather than here (verify.py); `batching`: the batch policy and learning-rate rule
        (None: the job's fixed batch)."""
        self.scheduler = scheduler
        self.backend = backend
        self.trust = trust
        self.store: dict[int, Stored] = {}  # slot -> its arrived result, while its round is open
        self.identities: dict[str, str] = {}  # worker id -> its identity
        # worker id -> when its last answer arrived: a worker computes its slots one after
        # another, so two slots held at once are credited no more than the time they took
        self.answered_at: dict[str, float] = {}
        self.identity_names: dict[str, str] = {}  # identity -> the worker id it last used
        self.counters: Counter[str] = Counter()
        self._job_errors: dict[str, str] = {}  # worker -> the last error its job raised, as told
        self.samples_applied = samples_applied
        self.train_loss: Optional[float] = None
        self.rate: deque[tuple[float, int]] = deque(maxlen=512)  # (time, samples applied)
        self.settlement = Settlement(_Court(self))
        self.settlement.on_workers = settle_on_workers
        self.evaluation: Optional[WorkerEvaluation] = None  # the one handed to workers, if any
        self.noise = NoiseScale()  # the gradient noise scale, from the applied rounds (noise.py)
        self.batching = batching if batching is not None else Batching(
            BatchSetting(), "none", scheduler.config.batch_size)
        if self.batching.adaptive:
            scheduler.set_batch(self.batching.batch)  # a resumed policy's batch
        self._acts: dict[type, Callable[[Any, float], list]] = {
            Decoded: self._apply, CompareCopies: self.settlement.compare,
            Drained: self._drained, Evicted: self._evicted}

    @property
    def version(self) -> int:
        return self.backend.version

    def identity(self, worker_id: str) -> str:
        return self.identities.get(worker_id, worker_id)

    # what happened (each call returns what the driver must do) ------------------------------

    def kin(self, worker_id: str) -> frozenset:
        """Whom `worker_id` may be one party with (fleet.py): at least its identity."""
        record = self.scheduler.workers.get(worker_id)
        return record.kin if record is not None else frozenset({self.identity(worker_id)})

    def join(self, worker_id: str, info: dict, identity: str, now: float,
             kin: frozenset = frozenset()) -> list:
        """`kin`: whom it may be one party with besides its identity (gate.py)."""
        # a reconnect evicts the worker's old session first (and forgets who that was)
        out = self._interpret(self.scheduler.join(worker_id, info, now), now)
        self.scheduler.workers[worker_id].kin = frozenset(kin) | {identity}
        self.identities[worker_id] = identity
        if identity != worker_id:  # keys (a bounded set) are shown by the name they last used
            self.identity_names[identity] = worker_id
        return self._dealt([Joined(worker_id, identity)] + out, now)

    def ready(self, worker_id: str, credits: int, now: float) -> list:
        return self._dealt(self._interpret(self.scheduler.ready(worker_id, credits, now), now),
                           now)

    def resend(self, worker_id: str, now: float) -> list:
        return self._dealt(self._interpret(self.scheduler.resend(worker_id, now), now), now)

    def leave(self, worker_id: str, reason: str, now: float) -> list:
        return self._dealt(self._leave(worker_id, reason, now), now)

    def tick(self, now: float) -> list:
        return self._dealt(self._interpret(self.scheduler.tick(now), now)
                           + self.settlement.check(now), now)

    def speculate(self, now: float) -> list:
        """Copies of the slots late by `now` (`next_speculation_at`), dealt to free workers."""
        return self._dealt(self._interpret(self.scheduler.speculate(now), now), now)

    def next_speculation_at(self) -> float:
        return self.scheduler.next_speculation_at()

    def stop(self, now: float) -> list:
        """Shutdown: every slot withdrawn, nothing dealt again."""
        self.evaluation = None  # its slots are withdrawn with the rest
        return self._interpret(self.scheduler.stop(), now)

    def evaluate(self, parts: list[list[int]], samples: int, now: float,
                 shape: Optional[EvalShape] = None) -> list:
        """Hand an evaluation of the model as it is now to workers: a side slot per part
        ([0, offset, count] of the test set); `shape`: what an honest answer looks like. At most
        one at a time: a second replaces the first."""
        out = self._drop_evaluation(now) if self.evaluation is not None else []
        ids = self.scheduler.add_side(self.version, parts, now)
        self.evaluation = WorkerEvaluation(self.version, samples, now,
                                           dict(zip(ids, (list(p) for p in parts))), shape=shape)
        self.counters["evaluations_planned"] += 1
        return self._dealt(out, now)

    def drop_evaluation(self, now: float) -> list:
        return self._dealt(self._drop_evaluation(now), now)

    def _drop_evaluation(self, now: float) -> list:
        self.evaluation = None
        return self._interpret(self.scheduler.drop_side(now), now)

    def evaluated(self, worker_id: str, slot: int, version: int,
                  sums: dict[str, tuple[float, float]], compute_s: float, now: float) -> list:
        """A worker's sums for an evaluation slot (schema-checked: few metrics, finite). Taken
        if the worker holds the slot and they are of the evaluation's shape (else refused: the
        range goes to another, an offence of its sender); the last one completes the evaluation
        (`Evaluated`). Its compute seconds count at most as long as the slot was out."""
        evaluation = self.evaluation
        if evaluation is None or slot not in evaluation.ranges:
            self.counters["eval_results_dropped"] += 1
            return self._dealt(self._interpret(self.scheduler.side_result(worker_id, slot, now)[1],
                                              now), now)
        if version != evaluation.version:  # not what it was asked: the range goes to another
            self.counters["eval_results_dropped"] += 1
            return self._dealt(self._interpret(self.scheduler.failed(worker_id, slot, now), now),
                               now)
        since = self.scheduler.held_since(worker_id, slot)
        fault = evaluation.fault(slot, sums) if since is not None else None
        if fault is not None:
            return self._dealt(self._refuse_answer(worker_id, slot, fault, now), now)
        accepted, actions = self.scheduler.side_result(worker_id, slot, now)
        out = []
        if not accepted:
            self.counters["eval_results_dropped"] += 1
        elif evaluation.answer(slot, sums, self._computed(worker_id, compute_s, since, now)):
            self.evaluation = None
            out.append(Evaluated(evaluation.version, evaluation.samples, evaluation.metrics(),
                                 evaluation.seconds(len(self.scheduler.workers))))
        return self._dealt(out + self._interpret(actions, now), now)

    def _refuse_answer(self, worker_id: str, slot: int, fault: str, now: float) -> list:
        """An evaluation answer that cannot be honest: its range goes to another worker, and it
        is an offence of its sender (never the run's concern)."""
        identity = self.identity(worker_id)
        self.counters["eval_results_refused"] += 1
        out: list[Effect] = [Event("rejected", f"evaluation answer from {worker_id} for slot "
                                               f"{slot}: {fault}", worker_id, logging.WARNING),
                             Refused(worker_id, identity, slot, "eval")]
        out += self._interpret(self.scheduler.failed(worker_id, slot, now), now)
        if self.trust.offence(identity, "eval", now):
            out += self._ban(worker_id, now)
        return out

    def seen(self, worker_id: str, state: Optional[str], now: float,
             shards: Optional[list[int]] = None) -> list:
        """A heartbeat: the worker is alive, and says whether its owner needs the machine (or
        has spent the day's transfer allowance), and (`shards`, when they changed) which shards
        of the training set it holds."""
        if shards is not None:
            self.scheduler.holdings(worker_id, shards)
        record = self.scheduler.workers.get(worker_id)
        was_paused = record is not None and record.paused_since is not None
        was_capped = record is not None and record.state == "capped"
        self.scheduler.seen(worker_id, now, state)
        if record is not None and state is not None and was_capped != (state == "capped"):
            if was_capped:
                return [Event("worker_uncapped", f"{worker_id} fetches again: its owner's daily "
                                                 "transfer allowance is back", worker_id)]
            return [Event("worker_capped", f"{worker_id} capped: its owner's daily transfer cap "
                                           "is spent; it computes only on data it holds until "
                                           "00:00 UTC", worker_id)]
        if record is None or was_paused == (state == "paused"):
            return []
        if was_paused:
            return [Event("worker_resumed", f"{worker_id} resumed", worker_id)]
        return [Event("worker_paused", f"{worker_id} paused: its owner needs the machine; its "
                                       f"{len(record.assigned)} slots are withdrawn after "
                                       f"{self.scheduler.config.pause_grace_s:g}s", worker_id)]

    def control(self, action: str, worker: Optional[str], now: float) -> tuple[bool, str, list]:
        """An operator's command: pause, resume, or drain a worker. (ok, what it did, effects)"""
        scheduler = self.scheduler
        if action == "pause":
            if scheduler.paused:
                return True, "training was already paused", []
            scheduler.pause()
            return True, "training paused", [Event("pause", "training paused by the operator: "
                                                            "no new slots")]
        if action == "resume":
            if not scheduler.paused:
                return True, "training was not paused", []
            return True, "training resumed", self._dealt(
                [Event("resume", "training resumed by the operator")]
                + self._interpret(scheduler.resume(now), now), now)
        if action == "drain":
            if worker not in scheduler.workers:
                return False, f"no worker {str(worker)[:80]!r}", []
            return True, f"{worker} draining", self._dealt([
                Event("drain", f"{worker} draining: it finishes its slots, then leaves", worker)
            ] + self._interpret(scheduler.drain(worker, now), now), now)
        return False, f"unknown action {action[:20]!r}", []

    def handback(self, worker_id: str, slots: list[int], now: float) -> list:
        """Slots a worker gives back, through no fault of its own: to others, no offence."""
        return self._dealt(self._interpret(self.scheduler.handback(worker_id, slots, now), now),
                           now)

    def job_failed(self, worker_id: str, slots: list[int], error: str, now: float) -> list:
        """The job's own code raised `error` on these slots at the worker: they go to others and
        count as its failures (no offence: the job's code may fail anywhere). Said once per
        worker and error, not once per slot."""
        out: list[Effect] = []
        for slot in slots:
            if slot in self.scheduler.side:
                continue  # an evaluation or a settlement: its deadline gives it to another
            self.counters["slots_failed_in_job"] += 1
            out += self._interpret(self.scheduler.failed(worker_id, slot, now), now)
        if self._job_errors.get(worker_id) != error:
            self._job_errors[worker_id] = error
            out.append(Event("job_failed", f"the job's code failed on {worker_id}: {error!r} "
                                           "(its slots go to others)", worker_id, logging.WARNING))
        return self._dealt(out, now)

    def malformed(self, worker_id: str, slot: int, now: float) -> list:
        """A result whose gradient could not be read: the slot goes to someone else, and it is
        an offence of its sender."""
        out: list[Effect] = [Refused(worker_id, self.identity(worker_id), slot, "malformed")]
        out += self._interpret(self.scheduler.failed(worker_id, slot, now), now)
        if self.trust.offence(self.identity(worker_id), "malformed", now):
            out += self._ban(worker_id, now)
        return self._dealt(out, now)

    def result(self, worker_id: str, slot: int, gradient: Any, norm: float, compute_s: float,
               now: float, waited_s: float = 0.0, samples: int = 0,
               loss: float = math.nan, buffers: Any = None) -> list:
        """A worker's result for `slot`: `gradient` as the backend stores it, `norm` its L2 norm
        (inf or nan when not finite), `buffers` the model's buffers its computation ended with
        (None without buffers). Screened, then used, settled or refused."""
        return self._dealt(self._result(worker_id, slot, gradient, norm, compute_s, now,
                                        waited_s, samples, loss, buffers), now)

    def _result(self, worker_id: str, slot: int, gradient: Any, norm: float, compute_s: float,
                now: float, waited_s: float, samples: int, loss: float, buffers: Any) -> list:
        identity = self.identity(worker_id)
        compute_s = self._computed(worker_id, compute_s,
                                   self.scheduler.held_since(worker_id, slot), now)
        if slot in self.scheduler.side:  # a third worker's computation, to settle a dispute
            return self.settlement.answered(worker_id, identity, slot, gradient, norm, now)
        scale = self.scheduler.slot_scale(worker_id, slot)
        if not math.isfinite(norm):
            verdict = self.trust.judge(identity, math.nan, 1.0, now)
        elif scale is not None:  # a result for a slot it does not hold is dropped below anyway
            verdict = self.trust.judge(identity, norm, scale, now)
        else:
            verdict = None
        stored = Stored(gradient, norm, worker_id, identity, compute_s, waited_s, samples, loss,
                        buffers=buffers, kin=self.kin(worker_id))
        if verdict is not None and verdict.reason == "norm":
            assert scale is not None  # only a finite norm, judged against its slot's scale
            return self.settlement.suspect(slot, stored, scale, verdict.detail, now)
        if verdict is not None and not verdict.ok:
            return self._refuse(worker_id, slot, verdict.reason, verdict.detail, verdict.banned,
                               now)
        return self._use(slot, stored, now)

    def computed(self, reference: Any, error: Optional[str], now: float) -> list:
        """The computation asked for by the last `Compute` is done (`error` if it failed)."""
        return self._dealt(self.settlement.computed(reference, error, now), now)

    # decisions (interpreted, not yet filtered: for the entry points above and verify.py) -------

    def _use(self, slot: int, stored: Stored, now: float) -> list:
        """Hand a screened result to the scheduler; kept if its round still needs it."""
        accepted, actions = self.scheduler.result(stored.worker, slot, stored.compute_s, now,
                                                  stored.waited_s)
        if not accepted:
            self.counters["results_dropped"] += 1
            return self._interpret(actions, now)
        self.store[slot] = stored
        if stored.samples and math.isfinite(stored.loss):
            self.train_loss = stored.loss if self.train_loss is None else (
                0.9 * self.train_loss + 0.1 * stored.loss)
        return [Used(slot)] + self._interpret(actions, now)

    def _refuse(self, worker_id: str, slot: int, reason: str, detail: str, banned: bool,
               now: float, identity: Optional[str] = None) -> list:
        """`identity`: the sender's, where it may have left meanwhile."""
        identity = identity if identity is not None else self.identity(worker_id)
        self.counters["gradients_rejected"] += 1
        self.counters["rejected_" + reason.replace("-", "_")] += 1
        out = [Event("rejected", f"{detail} from {worker_id} for slot {slot}", worker_id,
                     logging.WARNING), Refused(worker_id, identity, slot, reason)]
        out += self._interpret(self.scheduler.failed(worker_id, slot, now), now)
        if banned:
            out += self._ban(worker_id, now)
        return out

    def _ban(self, worker_id: str, now: float, identity: Optional[str] = None) -> list:
        """`identity`: the banned one, where the worker may have left meanwhile."""
        identity = identity if identity is not None else self.identity(worker_id)
        offender = self.trust.offenders[identity]
        self.counters["workers_banned"] += 1
        out = [Event("banned", f"{worker_id} banned after {offender.total} offences "
                               f"({', '.join(f'{k} x{v}' for k, v in offender.reasons.items())})",
                     worker_id, logging.WARNING)]
        if self.identity(worker_id) != identity:
            return out  # the id is someone else's now (the banned one left; another key took it)
        return out + [Ban(worker_id)] + self._leave(worker_id, "banned", now)

    def expel(self, identity: str, reason: str, now: float) -> list:
        """The operator banned `identity`: each of its workers is sent home as banned (told
        `reason`) and its slots go back to the pool."""
        out: list = []
        for worker_id in [w for w, i in self.identities.items() if i == identity]:
            self.counters["workers_banned"] += 1
            out += [Event("banned", f"{worker_id} banned by the operator", worker_id,
                          logging.WARNING), Ban(worker_id, reason)]
            out += self._leave(worker_id, "banned by the operator", now)
        return self._dealt(out, now)

    def _compute_request(self, slot_id: int) -> Optional[Compute]:
        """What computing slot `slot_id` here takes; None once its round has closed."""
        work = self.scheduler.slot_work(slot_id)
        return None if work is None else Compute(slot_id, work)

    def _computed(self, worker_id: str, reported_s: float, since: Optional[float],
                  now: float) -> float:
        """The compute seconds credited for a slot held since `since`: at most the time since it
        was dealt, or since the worker's previous answer if that came later (`answered_at`)."""
        previous = self.answered_at.get(worker_id)
        if since is not None and previous is not None:
            since = max(since, min(previous, now))
        if since is not None:
            self.answered_at[worker_id] = now
        return measured(reported_s, since, now)

    def _leave(self, worker_id: str, reason: str, now: float) -> list:
        if worker_id not in self.scheduler.workers:
            return []
        return self._interpret(self.scheduler.leave(worker_id, now, reason), now)

    # the interpretation of the scheduler's actions ----------------------------------------------

    def _dealt(self, out: list, now: float) -> list:
        """What an entry point leads to, then the work its freed credits are dealt: last, so
        that everything the events led to (a step, a settlement closing a round) is done
        before any slot is handed out again."""
        return out + self._interpret(self.scheduler.deal(now), now)

    def _interpret(self, actions: Sequence[Action], now: float) -> list[Effect]:
        """The scheduler's actions, with those the core acts on itself (a decoded round is
        stepped, copies are compared, a drained or evicted worker is announced) replaced by what
        they lead to, in order; the rest (`Assign`, `CancelSlots`) are the driver's."""
        out: list[Effect] = []
        for action in actions:
            if isinstance(action, (Assign, CancelSlots)):
                out.append(action)
            else:
                out += self._acts[type(action)](action, now)
        return out

    def _drained(self, action: Drained, now: float) -> list[Effect]:
        return [Event("drained", f"{action.worker} drained; sending it home", action.worker),
                action]

    def _evicted(self, action: Evicted, now: float) -> list[Effect]:
        self.identities.pop(action.worker, None)
        self.answered_at.pop(action.worker, None)
        slots = "slot" if action.requeued == 1 else "slots"
        return [Event("leave", f"{action.worker} left ({action.reason}); {action.requeued} {slots} "
                               "requeued", action.worker), action]

    def _apply(self, decoded: Decoded, now: float) -> list:
        """Step with a decoded round (or replan it), then let the scheduler go on."""
        store = self.store
        terms = [(store[s].gradient, w) for s, w in decoded.weights.items()]
        norms = [store[s].norm for s in decoded.weights]
        credits = self._contributions(decoded)
        states = self._buffer_states(decoded)
        observed = self._noise_slots(decoded)
        for slot in decoded.slots:
            store.pop(slot, None)
        staleness = self.backend.version - decoded.version
        out: list = []
        if self.batching.adaptive and hasattr(self.backend, "lr_factor"):
            self.backend.lr_factor = self.batching.factor(
                decoded.samples, self.noise.gradient_sq, self.noise.trace)
        try:
            weight = self.backend.apply(terms, norms, decoded.samples, decoded.version,
                                        self.scheduler.version_in_use)
        except GradientRejected as exc:
            self.counters["rounds_rejected"] += 1
            out.append(Event("rejected", f"round {decoded.round}: {exc}", None, logging.WARNING))
            weight = None
        else:
            if weight is None:
                self.counters["rounds_too_stale"] += 1
            elif states:
                self.backend.merge_buffers(states, weight)
        if weight is None:
            self.scheduler.replan(decoded)
            out.append(Replanned(decoded.round, staleness, len(terms), decoded.slots))
        else:
            self.samples_applied += decoded.samples
            self.rate.append((now, self.samples_applied))
            mean_square = getattr(self.backend, "mean_square", None)  # optional (above)
            if observed and mean_square is not None:
                estimate = round_estimate(observed, [part[2] for part in decoded.parts],
                                          mean_square)
                self.noise.observe(estimate)
                if estimate is not None:
                    out += self._rebatch()
            out.append(Applied(decoded.round, self.backend.version, decoded.parts,
                               decoded.samples, staleness, weight, len(terms), decoded.slots,
                               credits))
        return out + self._interpret(self.scheduler.applied(self.backend.version, now), now)

    def _rebatch(self) -> list:
        """After a measured round: the batch of new rounds, as the policy now has it."""
        scheduler = self.scheduler
        before = scheduler.batch
        batch = self.batching.observe(self.noise.b_simple, scheduler.fleet_rate(),
                                      scheduler.round_multiple())
        if batch is None:
            return []
        scheduler.set_batch(batch)
        self.counters["batch_changes"] += 1
        b_simple = self.noise.b_simple
        return [Event("batch", f"round batch {before} -> {batch} (noise scale "
                               f"{'-' if b_simple is None else f'{b_simple:.0f}'}; learning "
                               f"rate by {self.batching.rule})")]

    @staticmethod
    def _used(decoded: Decoded) -> list[int]:
        """The slots whose results a decoded round uses (a zero decoding weight uses none)."""
        return [s for s, w in decoded.weights.items() if w] or list(decoded.weights)

    def _noise_slots(self, decoded: Decoded) -> list[tuple[float, tuple]]:
        """The used results of a decoded round as the noise scale reads them: (the squared norm
        of each, measured on arrival; its code row). None of a round of local tasks (their
        results are parameter changes, not gradients) or whose rows are not known."""
        if self.scheduler.task_mode.local:
            return []
        used = self._used(decoded)
        if any(s not in decoded.rows for s in used):
            return []
        return [(self.store[s].norm ** 2, decoded.rows[s]) for s in used]

    def _buffer_states(self, decoded: Decoded) -> list[tuple[Any, int]]:
        """The buffers each result a decoded round uses ended with, weighted by the samples its
        slot covers: the scheduler's count, never the worker's word (a worker claiming many
        samples would outweigh the rest). Whatever the code, the same used slots as the credit:
        a replicated row counts once, a cyclic slot by all the parts it covers."""
        return [(self.store[s].buffers, decoded.slot_samples.get(s, 0))
                for s in self._used(decoded) if self.store[s].buffers is not None]

    def _contributions(self, decoded: Decoded) -> tuple[Contribution, ...]:
        """What each result a decoded round uses earns, should it be applied: the round's
        samples shared out by the samples each used slot covers (a slot of a cyclic code covers
        several parts, so its share is not its own count), whole numbers that add up."""
        used = self._used(decoded)
        split = shares(decoded.samples, [decoded.slot_samples.get(s, 0) for s in used])
        return tuple(Contribution(self.store[s].identity, n, self.store[s].compute_s,
                                  self.store[s].verified_by) for s, n in zip(used, split))

    # figures ----------------------------------------------------------------------------------

    def samples_per_s(self, now: float, window: float = 5.0) -> float:
        if len(self.rate) < 2:
            return 0.0
        end_t, end_n = self.rate[-1]
        now = max(now, end_t)  # so the rate decays to 0 when nothing is applied
        for t, n in self.rate:
            if now - t <= window:
                break
        else:
            return 0.0
        return (end_n - n) / (now - t) if now > t else 0.0

    def trust_summary(self) -> dict:
        summary = self.trust.summary()
        name = lambda identity: self.identity_names.get(identity, identity)  # noqa: E731
        summary["banned"] = [name(i) for i in summary["banned"]]
        summary["offenders"] = {name(i): o for i, o in summary["offenders"].items()}
        return summary


class _Court:
    """The round core as its settlement sees it (verify.Court): the store, the counters, trust,
    the backend's comparisons, and the few scheduler calls a settlement makes, each interpreted."""

    def __init__(self, core: RoundCore):
        self._core = core
        self.store = core.store
        self.counters = core.counters
        self.trust = core.trust
        self.compute_request = core._compute_request
        self.use = core._use
        self.refuse = core._refuse
        self.ban = core._ban

    def distance(self, a: Any, b: Any) -> float:
        return self._core.backend.distance(a, b)

    def size(self, a: Any) -> float:
        return self._core.backend.size(a)

    def _interpreted(self, actions: list, now: float) -> list:
        return self._core._interpret(actions, now)

    def put_back(self, worker: str, slot: int, now: float) -> list:
        return self._interpreted(self._core.scheduler.put_back(worker, slot, now), now)

    def agreed(self, first: int, second: int, now: float) -> list:
        return self._interpreted(self._core.scheduler.copies_agreed(first, second, now), now)

    def disagreed(self, first: int, second: int, now: float) -> list:
        return self._interpreted(self._core.scheduler.copies_disagreed(first, second, now), now)

    def settled(self, first: int, second: int, correct: list[int], now: float,
                kept: Optional[int] = None) -> list:
        return self._interpreted(
            self._core.scheduler.copies_settled(first, second, correct, now, kept), now)

    def third_worker(self, work: SlotWork, parties: frozenset, now: float) -> Optional[int]:
        core = self._core
        workers = core.scheduler.workers
        exclude = frozenset(w for w in workers if core.kin(w) & parties)
        if len(workers) <= len(exclude):
            return None
        return core.scheduler.add_side_task(work, exclude, now)

    def takers(self, lease: int) -> int:
        return self._core.scheduler.side_takers(lease)

    def kin(self, worker: str) -> frozenset:
        return self._core.kin(worker)

    def withdraw(self, lease: int, now: float) -> list:
        return self._interpreted(self._core.scheduler.drop_side_slot(lease, now), now)

    def answer_taken(self, worker: str, lease: int, now: float) -> tuple[bool, list]:
        accepted, actions = self._core.scheduler.side_result(worker, lease, now)
        return accepted, self._interpreted(actions, now)
