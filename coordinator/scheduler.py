"""Who computes what: the facade over the scheduling rooms. Pure logic.

The scheduler holds no sockets, threads, tensors or clock. Every call takes `now` and returns the
actions its driver (the round core, rounds.py) must perform; it performs none itself, so it is
unit-tested with a fake clock and driven unchanged by the simulator. Its state lives in rooms,
each owning one part of it:

- `slots.py`: the vocabulary: `SlotWork` (what computing a slot means), `Lease` (a slot's record
  and its one lifecycle), the actions (`Assign`, `CancelSlots`, `Decoded`, `CompareCopies`,
  `Evicted`, `Drained`);
- `leases.py`, the lease table: every slot, round or side, its holders and deadlines, the two
  waiting queues, the one place that hands a slot to a worker;
- `fleet.py`: worker records, credits and hunger, pauses and their grace, draining, the quorum of
  `min_workers`, silences;
- `round_book.py`: rounds (DESIGN.md section 3): opening them (batch, code, rows), answers
  arriving, decoding, closing, the adaptive code, speculative copies of late slots, verified
  copies held for comparison;
- `side_work.py`: side leases outside any round (evaluation ranges, settlements on a third
  worker);
- `dealer.py`: who gets which waiting slot, in what order (`deal`).

**Events never deal.** `join`, `ready`, `result`, `failed`, `handback`, `leave`, `tick`, the
verdicts on copies and the side-work calls change state and return what follows from them; the
work that freed credits can take is handed out by `deal(now)`, which the round core calls once at
the end of each of its entry points, after it has acted on the events (stepped a decoded round,
judged copies, closed a settlement). So no decision is taken on a fill the core did not ask for.

Pulling: a worker with a free credit takes the oldest waiting slot it may take, or opens a new
round when none waits. A slot whose holder is silent (evicted) or late (past its deadline) goes
back to its queue; the first answer for a slot wins and its other holders are cancelled. A worker
that says it is paused gets no new slots; the slots it holds stay its own for `pause_grace_s`,
then are withdrawn and requeued. `sync`: one round at a time, code none, one partition per ready
worker and one slot per worker: synchronous SGD, the baseline.

Tasks: the `task_mode` (local.TaskMode) says what a slot computes: coded gradients (the
default), or local steps (sized for the worker that opens the round, each carrying its inner
steps). Locality (locality.py): with a shard-aware order the sampler plans block by block, a
round opened by a worker comes from its home block, and a worker takes waiting slots of its own
blocks first; each `Assign` carries its prefetch hint. Speeds (speed.py): a worker's seconds per
sample and what follows from them (deadlines, lateness, `size_factor`) are the `SpeedModel`'s.

Scale: no call walks the whole fleet. `tick` takes from heaps of due times (silences, pause
graces, deadlines, the moment a slot may turn late) only the entries that are due, checks each
against the live record (stale entries are dropped), and queues the next; `deal` stops as soon as
nothing is left to hand out; adaptive redundancy reads the records of at most `adaptive_sample`
workers. Per slot the cost is flat from 1,000 to 100,000 workers (benchmarks/scheduler_scale.py).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from ..common.coding import Redundancy
from ..common.errors import ConfigError
from .dealer import Dealer
from .fleet import Fleet, WorkerRecord
from .leases import LeaseTable
from .local import TaskMode, check_redundancy
from .locality import Locality
from .round_book import Round, RoundBook
from .sampler import Part, Sampler
from .side_work import SideWork
from .slots import (Action, Assign, CancelSlots, CompareCopies, Decoded, Drained, Evicted, Lease,
                    SlotWork)
from .speed import SpeedModel

__all__ = ["Scheduler", "SchedulerConfig", "Action", "Assign", "CancelSlots", "CompareCopies",
           "Decoded", "Drained", "Evicted", "Lease", "Round", "SlotWork", "WorkerRecord"]


@dataclass(frozen=True)
class SchedulerConfig:
    batch_size: int
    partitions: int = 1  # per round
    open_rounds: int = 0  # rounds open at once; 0: as many as the workers' credits ask for, at most 2 x credits / partitions + 2 (round_book.py)
    heartbeat_s: float = 1.0
    liveness: int = 3  # missed heartbeats before a worker is evicted
    min_deadline_s: float = 30.0
    deadline_factor: float = 4.0  # deadline: this many times the predicted time, at least min
    speed_alpha: float = 0.3  # EWMA weight of the newest observation of seconds per sample
    pause_grace_s: float = 5.0  # a paused worker's slots are withdrawn after this long
    redundancy: Redundancy = Redundancy()  # the code policy of new rounds
    sync: bool = False  # synchronous SGD: one round, code none, a partition per ready worker
    # sync rounds open at once: each worker computes its part of the next while the last is
    # summed and stepped, its gradient then applied up to pipeline - 1 versions after its model
    pipeline: int = 1
    max_batch: Optional[int] = None  # a round's batch never exceeds this
    speculate: bool = False  # duplicate late slots to free workers
    spec_sd: float = 3.0  # late: past mean + spec_sd * sd of the holder's predicted time
    spec_floor_s: float = 0.5  # ... plus at least this
    spec_min_results: int = 3  # a worker's prediction counts after this many results
    adaptive_max_level: int = 2  # adaptive: replicate up to R, cyclic up to S
    adaptive_every: int = 8  # adaptive: choose again after this many new observations
    adaptive_sample: int = 64  # adaptive: time records of at most this many workers (hungry first)
    # A row arrives only once two copies of it agree (CompareCopies); needs replicate:R, R >= 2
    verify_replicas: bool = False
    # no slot is handed out before this many workers have joined (once; churn after is free): a
    # run's first rounds spread over the fleet instead of going to whoever joined first
    min_workers: int = 1
    # a worker that has joined but not yet announced credits may be silent this long (it is
    # starting up: job, data, model), rather than `liveness` heartbeats
    join_grace_s: float = 30.0

    def __post_init__(self):
        # The rules between these options live here and nowhere else: whoever drives a
        # scheduler builds this, so an impossible combination is refused the same way, in one
        # line (a ConfigError, which the CLI prints as it is), whoever asked for it.
        if self.verify_replicas:
            if self.redundancy.kind != "replicate" or self.redundancy.level < 2:
                raise ConfigError(f"--verify-replicas compares the copies of a replicated slot: "
                                  f"it needs --redundancy replicate:R with R >= 2, not "
                                  f"{self.redundancy}")
            if self.sync:
                raise ConfigError("--verify-replicas cannot be used with --sync (its rounds have "
                                  "no copies to compare)")
        if self.pipeline < 1:
            raise ConfigError(f"--pipeline must be at least 1, not {self.pipeline}")
        if self.pipeline > 1 and not self.sync:
            raise ConfigError("--pipeline overlaps synchronous rounds: asynchronous ones open as "
                              "many as --open-rounds says")

    @property
    def speculating(self) -> bool:
        """Whether late slots are duplicated to free workers; in sync rounds too, where the
        workers that finished their parts are free while the round waits for a late one."""
        return self.speculate



class Scheduler:
    """The facade over the scheduling rooms, with the action API the round core drives.

    Events (`join`, `ready`, `result`, `failed`, `handback`, `leave`, `tick`, ...) change state and
    return what follows from them (cancellations, decoded rounds, copies to compare, evictions)
    but never hand out work; `deal(now)` does, once the caller has acted on the events."""

    def __init__(self, config: SchedulerConfig, sampler: Sampler, version: int = 0,
                 next_id: int = 1, *, task_mode: Optional[TaskMode] = None,
                 locality: Optional[Locality] = None):
        """`task_mode`: what a slot computes (local.parse_task); None: coded gradients.
        `locality`: prefer slots whose shards a worker holds (the sampler plans by blocks)."""
        self.task_mode = task_mode if task_mode is not None else TaskMode()
        # Synchronous rounds take every worker: there is no choosing whose shards to use.
        self.locality = locality if not config.sync else None
        check_redundancy(self.task_mode, config.redundancy, config.sync)
        self.config = config
        self.sampler = sampler
        self.speed = SpeedModel(
            alpha=config.speed_alpha, min_deadline_s=config.min_deadline_s,
            deadline_factor=config.deadline_factor, spec_sd=config.spec_sd,
            spec_floor_s=config.spec_floor_s, min_results=config.spec_min_results)
        self.stats: Counter[str] = Counter()
        self.fleet = Fleet(config.heartbeat_s * config.liveness, config.pause_grace_s,
                           config.min_workers, config.join_grace_s)
        self.leases = LeaseTable(self.stats, next_id)
        self.book = RoundBook(config, sampler, self.speed, self.leases, self.fleet,
                              self.task_mode, self.locality, self.stats, version)
        self.side_work = SideWork(self.leases, self.fleet, self.stats, self._freed)
        self.dealer = Dealer(config, self.fleet, self.leases, self.book, self.side_work,
                             self.speed, sampler, self.locality)

    # the rooms' state, as the round core, the status and the tests read it ------------------

    @property
    def workers(self) -> dict[str, WorkerRecord]:
        return self.fleet.workers

    @property
    def rounds(self) -> dict[int, Round]:
        return self.book.rounds

    @property
    def slots(self) -> dict[int, Lease]:
        """Every open lease, round or side."""
        return self.leases.leases

    @property
    def side(self) -> dict[int, Lease]:
        """The open side leases."""
        return self.side_work.open

    @property
    def version(self) -> int:
        return self.book.version

    @property
    def accepting(self) -> bool:
        """Whether new rounds may open (False after `stop`)."""
        return self.book.accepting

    @property
    def paused(self) -> bool:
        return self.dealer.paused

    @property
    def quorum(self) -> bool:
        return self.fleet.quorum

    @property
    def last_code(self) -> str:
        return self.book.last_code

    @property
    def last_costs(self) -> dict[str, float]:
        return self.book.last_costs

    @property
    def slot_spread(self) -> Optional[float]:
        return self.book.slot_spread

    # queries --------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.sampler.exhausted and not self.book.rounds

    @property
    def batch(self) -> int:
        """The batch new rounds of gradient tasks are planned with (before --max-batch)."""
        return self.book.batch or self.config.batch_size

    def set_batch(self, batch: int) -> None:
        """Plan new rounds of `batch` samples (rounds open now keep theirs): --batch adaptive."""
        if batch < 1:
            raise ValueError("a round's batch is at least 1")
        self.book.batch = None if batch == self.config.batch_size else int(batch)

    def fleet_rate(self) -> Optional[float]:
        """The active workers' samples per second as the speed model predicts them (workers
        not yet measured count at the fleet's mean); None before any is measured."""
        rate = 0.0
        for worker in self.fleet.active():
            prediction = self.speed.prediction(worker.speed)
            if prediction is not None and prediction[0] > 0:
                rate += 1.0 / prediction[0]
        return rate or None

    def round_multiple(self) -> int:
        """What a round's batch is cut into: a part per active worker in synchronous rounds,
        else the partitions."""
        if self.config.sync:
            return max(1, len(self.fleet.active()))
        return max(1, self.config.partitions)

    def version_in_use(self, version: int) -> bool:
        """Whether an open round or side lease was planned at `version` (it needs that model)."""
        return self.book.rounds_at[version] > 0 or self.side_work.in_use(version)

    def next_id(self) -> int:
        return self.leases.next_id()

    def pending(self) -> int:
        """Round slots waiting for a (further) holder."""
        return len(self.leases.pending)

    def open_parts(self) -> list[list[Part]]:
        """The parts of every open round: what a checkpoint must replan on resume."""
        return [r.parts for r in sorted(self.book.rounds.values(), key=lambda r: r.id)]

    def slot_work(self, slot_id: int) -> Optional[SlotWork]:
        """What computing an open round's slot means; None once its round has closed."""
        lease = self.leases.get(slot_id)
        if lease is None or lease.side or lease.round not in self.book.rounds:
            return None
        return lease.work

    def slot_scale(self, worker_id: str, slot_id: int) -> Optional[float]:
        """sum |coefficient| x samples over the slot's parts (what a result's size is judged
        against), if `worker_id` holds the round slot; else None."""
        worker = self.fleet.get(worker_id)
        work = self.slot_work(slot_id)
        if worker is None or work is None or slot_id not in worker.assigned:
            return None
        return sum(abs(c) * p[2] for p, c in zip(work.parts, work.coefficients))

    def held_since(self, worker_id: str, slot_id: int) -> Optional[float]:
        """When slot `slot_id` (a round's or a side one) was dealt to `worker_id`, if it holds it
        now: the coordinator's own measure of how long its answer can have taken."""
        worker = self.fleet.get(worker_id)
        lease = self.leases.get(slot_id)
        if worker is None or lease is None or slot_id not in worker.assigned:
            return None
        return lease.started.get(worker_id)

    def holds(self, worker_id: str, slot_id: int) -> bool:
        """Whether `worker_id` holds slot `slot_id` (a round's or a side one) now: asked of a
        result before its gradient is read (budgets.py)."""
        worker = self.fleet.get(worker_id)
        return worker is not None and slot_id in worker.assigned

    def capacity(self, worker_id: str) -> int:
        """The credits `worker_id` announced (0 when it is not here)."""
        worker = self.fleet.get(worker_id)
        return 0 if worker is None else worker.capacity

    def side_takers(self, slot_id: int) -> int:
        """Workers that could take side slot `slot_id` (neither excluded nor draining)."""
        return self.side_work.takers(slot_id)

    # dealing --------------------------------------------------------------------------------

    def deal(self, now: float) -> list[Action]:
        """Hand free credits waiting leases (dealer.py); announce drained workers."""
        return self.dealer.deal(now)

    # events (none of them deals) ------------------------------------------------------------

    def join(self, worker_id: str, info: dict, now: float) -> list[Action]:
        actions: list[Action] = []
        if worker_id in self.fleet.workers:  # a reconnect: its old session's slots are lost
            actions += self._remove(worker_id, "rejoined", now)
        self.fleet.join(worker_id, info, now)
        return actions

    def ready(self, worker_id: str, credits: int, now: float) -> list[Action]:
        worker = self.fleet.workers[worker_id]
        self.fleet.set_capacity(worker, credits)
        worker.last_seen = now
        self.fleet.settle(worker)
        self.fleet.update_hunger(worker)
        return []

    def seen(self, worker_id: str, now: float, state: Optional[str] = None) -> None:
        worker = self.fleet.get(worker_id)
        if worker is not None:
            self.fleet.seen(worker, now, state)

    def holdings(self, worker_id: str, shards: list[int]) -> None:
        """The shards of the training set `worker_id` holds now (its cache): locality prefers
        giving it slots of those."""
        if self.locality is not None and worker_id in self.fleet.workers:
            self.locality.report(worker_id, shards)

    def result(self, worker_id: str, slot_id: int, compute_s: float,
               now: float, waited_s: float = 0.0) -> tuple[bool, list[Action]]:
        """A worker's answer for a round's slot. Returns (use this gradient?, actions).

        `waited_s`: how long the task waited in the worker's queue before its compute began.
        Only the first answer for a slot that is still assigned to this worker is used; late
        replicas, answers for cancelled or finished slots, and repeats are refused (counted).
        """
        worker = self.fleet.get(worker_id)
        lease = self.leases.get(slot_id)
        if worker is None or slot_id not in worker.assigned or lease is None or lease.side:
            self.stats["results_unexpected"] += 1
            return False, []
        del worker.assigned[slot_id]
        worker.last_seen = now
        round_ = self.book.rounds[lease.round]
        lease.holders.discard(worker_id)
        worker.done += 1
        worker.staleness += max(0, self.version - round_.version)
        worker.samples += lease.samples
        worker.compute_s += max(0.0, compute_s)
        if lease.samples and compute_s > 0:
            self.speed.observe_result(worker.speed, compute_s / lease.samples)
        if worker_id in lease.started:
            wall_s = now - lease.started[worker_id]
            if lease.samples and wall_s > waited_s >= 0:
                worker.speed.slot_times.observe(lease.samples, wall_s - waited_s)
            if worker_id in lease.with_model:
                self.speed.observe_link(worker.speed, wall_s, compute_s, waited_s)
        self.speed.slot_answered(worker.speed, lease.speculated)
        self._freed(worker, now)
        verified = round_.verified
        if not lease.needed or (verified is not None and verified.sender(slot_id) is not None):
            self.stats["results_duplicate"] += 1
            return False, []
        if verified is not None:
            return True, self.book.hold(lease, worker_id, worker.kin)
        self.stats["results_used"] += 1
        return True, self.book.arrive(lease, now)

    def copies_agreed(self, first: int, second: int, now: float) -> list[Action]:
        """The two compared copies agree: the row arrives (the first copy is used)."""
        pair = self.book.disputed(first, second)
        if pair is None:
            return []
        round_, row = pair
        assert round_.verified is not None  # a dispute is a verified round's
        round_.verified.end_dispute(row)
        self.stats["replicas_agreed"] += 1
        self.stats["results_used"] += 1
        return self.book.arrive(self.leases.leases[first], now)

    def copies_disagreed(self, first: int, second: int, now: float) -> list[Action]:
        """The two compared copies differ: the row waits for `copies_settled`; the workers
        meanwhile take other work."""
        if self.book.disputed(first, second) is not None:
            self.stats["replicas_disagreed"] += 1
        return []

    def copies_settled(self, first: int, second: int, correct: list[int], now: float,
                       kept: Optional[int] = None) -> list[Action]:
        """A disagreement decided: `correct` holds those of the two found right (by the
        coordinator's own computation). The first of them is used; with none (or when it could
        not be settled), both are computed again, by whoever takes them next, except `kept`,
        one neither proven right nor wrong (its copy's sender was banned), which stays held for
        the next copy to agree with."""
        pair = self.book.disputed(first, second)
        if pair is None:
            return []
        round_, row = pair
        assert round_.verified is not None  # a dispute is a verified round's
        round_.verified.end_dispute(row)
        use = next((s for s in (first, second) if s in correct), None)
        if use is not None:
            self.stats["results_used"] += 1
            return self.book.arrive(self.leases.leases[use], now)
        refused = [s for s in (first, second) if s != kept]
        round_.verified.release(refused)
        for slot_id in refused:
            self.leases.requeue(self.leases.leases[slot_id])
            self.stats["replicas_refused"] += 1
        return self.book.compare_next(round_, row)

    def failed(self, worker_id: str, slot_id: int, now: float) -> list[Action]:
        """A worker's answer that could not be used (bad gradient): the slot goes back, and it
        counts as the worker's failure."""
        worker = self.fleet.get(worker_id)
        if worker is not None and self._take_back(worker, slot_id, now):
            worker.failed += 1
        return []

    def put_back(self, worker_id: str, slot_id: int, now: float) -> list[Action]:
        """A result set aside through no fault of its sender (a suspect that cannot be settled
        now): the slot goes to whoever takes it next; nobody's failure."""
        worker = self.fleet.get(worker_id)
        if worker is not None and self._take_back(worker, slot_id, now):
            self.stats["slots_put_back"] += 1
        return []

    def handback(self, worker_id: str, slot_ids: list[int], now: float) -> list[Action]:
        """The worker cannot compute these slots now, through no fault of its own (their data
        is not in its cache and its transfer cap is spent): they go to others, uncounted."""
        worker = self.fleet.get(worker_id)
        if worker is not None:
            for slot_id in slot_ids:
                if self._take_back(worker, slot_id, now):
                    self.stats["slots_handed_back"] += 1
        return []

    def leave(self, worker_id: str, now: float, reason: str = "left") -> list[Action]:
        if worker_id not in self.fleet.workers:
            return []
        return self._remove(worker_id, reason, now)

    def tick(self, now: float) -> list[Action]:
        """Evict silent workers, withdraw the slots of workers paused past their grace, requeue
        late slots and speculate on slow ones: only what is due. Call about once a heartbeat."""
        actions: list[Action] = []
        for worker in self.fleet.due_silent(now):
            actions += self._remove(worker.id, f"silent for {now - worker.last_seen:.1f}s", now)
        for worker in self.fleet.due_withdrawal(now):
            actions += self._withdraw(worker)
        for _, lease in self.leases.due_deadlines(now, self.fleet.workers):
            self.stats["deadline_requeues"] += 1
            self.leases.requeue(lease)  # requeued once; the holder may still win
        self.book.speculate_due(now)
        return actions

    def next_speculation_at(self) -> float:
        """When a held slot may next turn late by its prediction (math.inf: none is timed): the
        driver calls `speculate` then, between its ticks."""
        return self.book.next_speculation_at()

    def speculate(self, now: float) -> list[Action]:
        """Speculate on the slots that turned late by `now`; nothing else a tick does."""
        self.book.speculate_due(now)
        return []

    def pause(self) -> None:
        """Hand out no more slots; the slots already held are finished and applied."""
        self.dealer.paused = True

    def resume(self, now: float) -> list[Action]:
        self.dealer.paused = False
        return []

    def drain(self, worker_id: str, now: float) -> list[Action]:
        """Give `worker_id` no new slots; `Drained` (when dealing) once it holds none.

        Raises KeyError for a worker that is not registered."""
        self.fleet.drain(self.fleet.workers[worker_id])
        return []

    def applied(self, version: int, now: float) -> list[Action]:
        """The caller handled a `Decoded` round (stepped the model, or replanned the round):
        `version` is the model's version now, at which the slots it frees are planned."""
        self.book.version = version
        return []

    def absent(self, seconds: float) -> None:
        """The caller was not running for `seconds` (a frozen or suspended coordinator): nobody
        could be heard meanwhile, so that time counts as no worker's silence."""
        self.fleet.absent(seconds)

    def resend(self, worker_id: str, now: float) -> list[Assign]:
        """Every slot `worker_id` holds, assigned again with its model: after a reconnect the
        tasks sent down its old connection may never have arrived (the worker ignores those
        it has). Without this a resumed worker could hold phantom slots, and its credits, forever."""
        worker = self.fleet.get(worker_id)
        if worker is None:
            return []
        out = []
        for slot_id, deadline in sorted(worker.assigned.items()):
            lease = self.leases.get(slot_id)
            if lease is None or (not lease.side and lease.round not in self.book.rounds):
                continue
            wait = deadline - now if math.isfinite(deadline) else self.config.min_deadline_s
            out.append(self.leases.reissue(worker, lease, max(0.0, wait)))
        return out

    def replan(self, decoded: Decoded) -> None:
        """A decoded round that could not be applied (too stale): its samples come back."""
        self.stats["rounds_replanned"] += 1
        self.sampler.replan(decoded.parts)

    def stop(self) -> list[CancelSlots]:
        """Open no more rounds and withdraw every assignment (shutdown)."""
        self.book.accepting = False
        self.leases.clear_queues()
        self.side_work.clear()
        actions = []
        for worker in self.fleet.workers.values():
            if worker.assigned:
                actions.append(CancelSlots(worker.id, sorted(worker.assigned)))
                worker.assigned.clear()
        return actions

    # side leases ------------------------------------------------------------------------------

    def add_side(self, version: int, parts: list[list[int]], now: float,
                 kind: str = "eval") -> list[int]:
        """Queue a side lease per part, at `version` (an evaluation's ranges): their ids."""
        return self.side_work.add(version, parts, kind)

    def add_side_task(self, work: SlotWork, exclude: frozenset, now: float) -> int:
        """Queue one side lease computing `work` (what a round's slot computes), for a worker
        not in `exclude`: its id."""
        return self.side_work.add_task(work, exclude)

    def side_result(self, worker_id: str, slot_id: int, now: float
                    ) -> tuple[bool, list[Action]]:
        """A worker's answer for a side lease: (use it?, actions). The first answer from a holder
        wins and its other holders are cancelled; any other is refused (counted)."""
        return self.side_work.answered(worker_id, slot_id, now)

    def drop_side(self, now: float, kind: str = "eval") -> list[Action]:
        """Forget every open side lease of `kind` (an evaluation abandoned)."""
        return self.side_work.drop(kind)

    def drop_side_slot(self, slot_id: int, now: float) -> list[Action]:
        """Forget one open side lease (its holders are cancelled)."""
        return self.side_work.drop_one(slot_id)

    # internals ------------------------------------------------------------------------------

    def _freed(self, worker: WorkerRecord, now: float) -> None:
        """`worker` holds one lease fewer: it may be hungry, and its next late check moves."""
        self.fleet.update_hunger(worker)
        self.book.watch_late(worker, now)

    def _take_back(self, worker: WorkerRecord, slot_id: int, now: float) -> bool:
        """`worker` no longer holds `slot_id`; it is requeued unless another holder may still
        answer. Whether it held it."""
        if worker.assigned.pop(slot_id, None) is None:
            return False
        self._freed(worker, now)
        self.leases.let_go(slot_id, worker.id)
        return True

    def _withdraw(self, worker: WorkerRecord) -> list[Action]:
        """Take every slot back from a (paused) worker: cancelled there, requeued for others."""
        slots = sorted(worker.assigned)
        for slot_id in reversed(slots):
            self.leases.let_go(slot_id, worker.id)
        worker.assigned.clear()
        worker.cancelled += len(slots)
        self.stats["pause_withdrawn"] += len(slots)
        self.fleet.update_hunger(worker)
        return [CancelSlots(worker.id, slots)]

    def _remove(self, worker_id: str, reason: str, now: float) -> list[Action]:
        worker = self.fleet.remove(worker_id)
        if self.locality is not None:
            self.locality.forget(worker_id)
        requeued = 0
        for slot_id in sorted(worker.assigned, reverse=True):
            requeued += self.leases.let_go(slot_id, worker_id)
        self.stats["workers_removed"] += 1
        return [Evicted(worker_id, reason, requeued)]
