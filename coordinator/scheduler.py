"""Who computes what: workers, credits, rounds, slots, deadlines, liveness. Pure logic.

The scheduler holds no sockets, threads, tensors or clock. Every call takes `now` and returns the
actions the server must perform (`Assign`, `CancelSlots`, `Decoded`, `Evicted`); it performs none
itself, so it is unit-tested with a fake clock and can be driven by a simulator.

Rounds (DESIGN.md section 3): a round is one batch at one model version, cut into partitions and
covered by the slots of a code. Workers pull: a worker with a free credit takes the oldest pending
slot it does not already hold, or opens a new round when none is pending. A slot whose holder is
silent (evicted) or late (past its deadline) goes back to the pending queue; the first answer for
a slot wins and its other holders are cancelled. A worker that says it is paused (its owner needs
the machine) gets no new slots; the slots it holds stay its own for `pause_grace_s` (a short pause
finishes them), then are withdrawn (cancelled on the worker) and requeued for the others. When
the arrived slots of a round decode, the round is done and `Decoded` says how to combine their
gradients.

Redundancy (DESIGN.md section 3, issue 3): each round's code comes from the `redundancy` policy
(none, replicate:R, cyclic:S, or adaptive: chosen per round by `adaptive.choose` from the recorded
task times). A slot whose row repeats an arrived row is cancelled at once. With `speculate`, a slot
later than its holder's prediction (EWMA mean + `spec_sd` standard deviations of seconds per
sample, plus `spec_floor_s`) gets a duplicate row appended to its round's code, handed to the next
free worker. A worker that keeps missing its predictions holds fewer slots at once (its
`size_factor`). `sync`: one round at a time, code none, one partition per ready worker and one
slot per worker: synchronous SGD, the baseline.

Verified replicas (`verify_replicas`, issue 9): with replicate:R a row arrives only once two
copies of it, from different workers, agree. The first copy's result is held (the server keeps it)
and its replicas go on; the second yields `CompareCopies`, and the server's verdict comes back
through `copies_agreed`, or `copies_disagreed` and then `copies_settled` (with what the
coordinator's own computation found right). The sender of a held copy never takes a copy of the
same row, so two copies always come from two workers. Which copies are held, whose they are and
which rows are in dispute is a round's `VerifiedRows` (verified_rows.py).

Speeds (speed.py): a worker's seconds per sample, the fleet's recent readings, and what follows
from them (deadlines, the moment a slot turns late, `size_factor`) are the `SpeedModel`'s; the
scheduler feeds it readings and asks it.

Tasks: the `task_mode` (local.TaskMode) says what a slot computes. Gradient slots (the default)
are sized by the configured batch; local slots by the task mode, for the worker that opens the
round, and each carries its number of inner steps. `Assign` and `slot_task` say both.

Locality (locality.py): with a shard-aware order the sampler plans block by block, a round
opened by a worker comes from its home block, and a worker takes pending slots of its own blocks
before others' (`_next_slot_for(local=True)`); each `Assign` carries its prefetch hint.

Side slots (issue 18): slots outside any round, each one part to compute at a model version,
answered with something other than a gradient: an evaluation of a range of the test set
(`add_side`, `side_result`, `drop_side`). They share the workers' credits, deadlines, eviction
and withdrawal with round slots (a vanished holder's side slot goes back to the queue), are
handed out before round slots, but a worker takes one only while it holds none and its last
slot was a round's: side work interleaves with training instead of starving it. Only when there
is no round work left does a worker take side slots back to back. Their model version is in use
(`version_in_use`) until the last of them is answered or dropped. They earn no credit and feed
no speed reading (a forward pass is not a training step).

Scale (issue 8): no call walks the whole fleet. `tick` takes from heaps of due times (a worker's
silence, a pause's grace, a slot's deadline, the moment a worker's slot may turn late) only the
entries that are due, checks each against the live record (stale entries are dropped), and
queues the next; `_fill` stops as soon as nothing is left to hand out; adaptive redundancy reads
the records of at most `adaptive_sample` workers. Per slot the cost is flat from 1,000 to 100,000
workers (benchmarks/scheduler_scale.py).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Union

import numpy as np

from ..common import coding
from ..common.coding import Code, Redundancy
from ..common.errors import ConfigError
from . import adaptive
from .local import TaskMode, check_redundancy, inner_steps
from .locality import Locality
from .sampler import Part, Sampler
from .speed import SpeedModel, WorkerSpeed
from .verified_rows import VerifiedRows


_RECHECK_FLEET = 256  # fleets up to this size look at a newcomer's slots every tick
_LOCAL_SCAN = 64  # locality: pending slots looked at for one of a worker's own shards


@dataclass(frozen=True)
class SchedulerConfig:
    batch_size: int
    partitions: int = 1  # per round
    open_rounds: int = 0  # rounds open at once; 0: as many as the workers' credits ask for
    heartbeat_s: float = 1.0
    liveness: int = 3  # missed heartbeats before a worker is evicted
    min_deadline_s: float = 30.0
    deadline_factor: float = 4.0  # deadline: this many times the predicted time, at least min
    speed_alpha: float = 0.3  # EWMA weight of the newest observation of seconds per sample
    pause_grace_s: float = 5.0  # a paused worker's slots are withdrawn after this long
    redundancy: Redundancy = Redundancy()  # the code policy of new rounds
    sync: bool = False  # synchronous SGD: one round, code none, a partition per ready worker
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

    @property
    def speculating(self) -> bool:
        """Whether late slots are duplicated: never in sync rounds, which wait for every worker
        by design."""
        return self.speculate and not self.sync


# actions ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Assign:
    worker: str
    slot: int
    round: int
    version: int
    parts: list[list[int]]
    coefficients: list[float]
    deadline_s: float
    send_model: bool  # the worker's cached model is not at `version`
    kind: str = "gradient"  # gradient | local (local.TaskMode)
    steps: int = 0  # local: inner steps; gradient: 0
    prefetch: tuple[int, ...] = ()  # locality: shards the worker should fetch ahead


@dataclass(frozen=True)
class CancelSlots:
    worker: str
    slots: list[int]


@dataclass(frozen=True)
class Decoded:
    round: int
    version: int
    parts: list[Part]
    samples: int
    weights: dict[int, float]  # slot id -> decoding weight
    slots: list[int]  # every slot of the round: their stored gradients can be released
    slot_samples: dict[int, int] = field(default_factory=dict)  # of the slots in `weights`


@dataclass(frozen=True)
class CompareCopies:
    """Two copies of one row of a verified round have arrived, from different workers: compare
    their stored results, then call `copies_agreed`, or `copies_disagreed` and `copies_settled`."""

    round: int
    slots: tuple[int, int]  # in arrival order
    workers: tuple[str, str]  # their senders


@dataclass(frozen=True)
class Evicted:
    worker: str
    reason: str
    requeued: int


@dataclass(frozen=True)
class Drained:
    """A draining worker holds no more slots: send it home."""

    worker: str


Action = Union[Assign, CancelSlots, Decoded, Evicted, Drained, CompareCopies]


# state ----------------------------------------------------------------------------------------


@dataclass
class WorkerRecord:
    id: str
    info: dict
    joined: float
    last_seen: float
    capacity: int = 0
    state: str = "idle"
    assigned: dict[int, float] = field(default_factory=dict)  # slot -> deadline (scheduler time)
    model_version: Optional[int] = None  # the model version the worker has cached
    paused_since: Optional[float] = None  # when it said "paused" (None: it is not paused)
    pauses: int = 0
    speed: WorkerSpeed = field(default_factory=WorkerSpeed)  # the speed model's record of it
    done: int = 0
    samples: int = 0
    compute_s: float = 0.0  # seconds of compute its results report
    cancelled: int = 0
    missed: int = 0
    failed: int = 0
    staleness: int = 0  # sum over its results of (version at arrival - version of the slot)
    draining: bool = False  # gets no new slots; sent home once it holds none
    session: int = 0  # tells this record's entries in the scheduler's queues from a former one's
    late_check: Optional[int] = None  # its current entry in the speculation queue
    side_last: bool = False  # its last slot was a side slot: the next is a round's, if any
    side_samples: int = 0  # samples of the side slots it answered first (evaluated)

    @property
    def free(self) -> int:
        if self.paused_since is not None:
            return 0  # whatever credits it announced, a paused worker takes nothing new
        # `limit`, without a second property call: this is read on every fill and answer
        return self.speed.slots_allowed(self.capacity) - len(self.assigned)

    @property
    def limit(self) -> int:
        """Slots it may hold at once: its credits, fewer while it keeps missing predictions."""
        return self.speed.slots_allowed(self.capacity)

    @property
    def s_per_sample(self) -> Optional[float]:
        """Its seconds per sample (EWMA); None before its first result."""
        return self.speed.s_per_sample

    @property
    def link_s(self) -> Optional[float]:
        """Its typical link seconds per slot sent with a model; None before one is measured."""
        return self.speed.link_s


@dataclass
class Slot:
    id: int
    round: int
    row: list[tuple[int, float]]  # (partition index, coefficient)
    samples: int
    holders: set[str] = field(default_factory=set)
    arrived: bool = False
    queued: bool = False  # waiting in the pending queue for a (further) holder
    dead: bool = False  # its row repeats an arrived one: no longer needed
    speculated: bool = False  # a duplicate row was appended for it (or it is that duplicate)
    started: dict[str, float] = field(default_factory=dict)  # holder -> when it was assigned
    with_model: set[str] = field(default_factory=set)  # holders it was sent to with the model
    index: int = 0  # its row in the round's code
    kind: str = "gradient"  # what its holder computes: gradient | local (local.TaskMode)
    steps: int = 0  # local: inner steps; gradient: 0


@dataclass
class SideSlot:
    """A slot outside any round: `part` ([0, offset, count] of the test set, for an "eval") to
    compute at `version`. Forgotten once answered or dropped."""

    id: int
    version: int
    part: list[int]
    kind: str = "eval"
    holders: set[str] = field(default_factory=set)
    queued: bool = True
    # a "gradient" or "local" side slot (a settlement computed by a third worker, verify.py):
    # its parts and their coefficients, and the workers that must not compute it (the parties
    # to the dispute)
    parts: list[list[int]] = field(default_factory=list)
    coefficients: list[float] = field(default_factory=lambda: [1.0])
    exclude: frozenset = frozenset()
    steps: int = 0  # a "local" one: inner steps

    @property
    def samples(self) -> int:
        return sum(p[2] for p in self.parts) if self.parts else self.part[2]


class SlotTask(NamedTuple):
    """What computing a slot means, as its holders were told: enough to compute it again."""

    version: int
    parts: list[Part]
    coefficients: list[float]
    kind: str
    steps: int


@dataclass
class Round:
    id: int
    version: int
    parts: list[Part]
    code: Code
    slots: list[int]  # slot ids, in code row order
    arrived: set[int] = field(default_factory=set)  # code rows that arrived
    covered: set[int] = field(default_factory=set)  # partitions some arrived row covers
    copies: dict[tuple, list[int]] = field(default_factory=dict)  # row -> slots computing it
    verified: Optional[VerifiedRows] = None  # verify_replicas: its held copies, by row
    block: Optional[tuple[int, int]] = None  # locality: (epoch, block) its samples lie in

    @property
    def samples(self) -> int:
        return sum(p[2] for p in self.parts)


class Scheduler:
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
        self._speculate = config.speculating
        self.version = version
        self.workers: dict[str, WorkerRecord] = {}
        self.rounds: dict[int, Round] = {}
        self.slots: dict[int, Slot] = {}
        self.accepting = True  # False: open no new rounds (pause, shutdown)
        self.paused = False  # True: hand out no slots at all (the operator paused training)
        self.quorum = config.min_workers <= 1  # min_workers have joined (at some moment)
        self._draining: set[str] = set()  # draining workers not yet announced as Drained
        self._pending: deque[int] = deque()
        self.side: dict[int, SideSlot] = {}  # open side slots
        self._side_pending: deque[int] = deque()
        self._side_at: Counter[int] = Counter()  # open side slots per model version
        self._hungry: dict[str, None] = {}  # workers with free credits, in arrival order
        self._rounds_at: Counter[int] = Counter()  # open rounds per model version
        self._next_id = next_id
        self.stats: Counter[str] = Counter()
        self._choice: tuple[Redundancy, int] = (Redundancy(), -1)  # adaptive: choice, at obs #
        self._choice_key: tuple[int, int] = (0, 0)
        self.last_code = "none"  # the code of the newest round
        self.last_costs: dict[str, float] = {}  # adaptive: the predictions behind the choice
        # Due times, so that a tick touches only what is due rather than every worker (lazy:
        # an entry is checked against the record when it comes up, stale ones are dropped).
        self._seq = itertools.count()
        self._silence_due: list[tuple[float, int, str, int]] = []  # (due, seq, worker, session)
        self._grace_due: list[tuple[float, int, str, int, float]] = []  # ... paused since
        self._deadline_due: list[tuple[float, int, str, int]] = []  # (deadline, seq, worker, slot)
        self._late_due: list[tuple[float, int, str]] = []  # (when a slot may be late, seq, worker)

    # queries --------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.sampler.exhausted and not self.rounds

    def version_in_use(self, version: int) -> bool:
        """Whether an open round was planned at `version` (its slots need that model)."""
        return self._rounds_at[version] > 0 or self._side_at[version] > 0

    def next_id(self) -> int:
        return self._next_id

    def pending(self) -> int:
        """Slots waiting for a (further) holder."""
        return len(self._pending)

    def open_parts(self) -> list[list[Part]]:
        """The parts of every open round: what a checkpoint must replan on resume."""
        return [r.parts for r in sorted(self.rounds.values(), key=lambda r: r.id)]

    def slot_task(self, slot_id: int) -> Optional[SlotTask]:
        """The task of an open slot, as its holders got it; None once its round has closed."""
        slot = self.slots.get(slot_id)
        round_ = self.rounds.get(slot.round) if slot is not None else None
        if round_ is None:
            return None
        return SlotTask(round_.version, [round_.parts[j] for j, _ in slot.row],
                        [c for _, c in slot.row], slot.kind, slot.steps)

    def slot_scale(self, worker_id: str, slot_id: int) -> Optional[float]:
        """sum |coefficient| x samples over the slot's parts (what a result's size is judged
        against), if `worker_id` holds the slot; else None."""
        worker = self.workers.get(worker_id)
        slot = self.slots.get(slot_id)
        if worker is None or slot is None or slot_id not in worker.assigned:
            return None
        round_ = self.rounds.get(slot.round)
        if round_ is None:
            return None
        return sum(abs(c) * round_.parts[j][2] for j, c in slot.row)

    # events ---------------------------------------------------------------------------------

    def join(self, worker_id: str, info: dict, now: float) -> list[Action]:
        actions: list[Action] = []
        if worker_id in self.workers:  # a reconnect: its old session's slots are lost
            actions += self._remove(worker_id, "rejoined", now)
        session = next(self._seq)
        self.workers[worker_id] = WorkerRecord(worker_id, dict(info), joined=now, last_seen=now,
                                               session=session)
        self._watch_silence(self.workers[worker_id])
        return actions

    def ready(self, worker_id: str, credits: int, now: float) -> list[Action]:
        worker = self.workers[worker_id]
        worker.capacity = credits
        worker.last_seen = now
        self._update_hunger(worker)
        return self._fill(now)

    def seen(self, worker_id: str, now: float, state: Optional[str] = None) -> None:
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.last_seen = now
            if state is not None:
                if state == "paused" and worker.paused_since is None:
                    worker.paused_since = now
                    worker.pauses += 1
                    heapq.heappush(self._grace_due, (now + self.config.pause_grace_s,
                                                     next(self._seq), worker.id, worker.session,
                                                     now))
                elif state != "paused":
                    worker.paused_since = None
                worker.state = state
                self._update_hunger(worker)

    def holdings(self, worker_id: str, shards: list[int]) -> None:
        """The shards of the training set `worker_id` holds now (its cache): locality prefers
        giving it slots of those."""
        if self.locality is not None and worker_id in self.workers:
            self.locality.report(worker_id, shards)

    def result(self, worker_id: str, slot_id: int, compute_s: float,
               now: float, waited_s: float = 0.0) -> tuple[bool, list[Action]]:
        """A worker's answer for a slot. Returns (use this gradient?, actions).

        `waited_s`: how long the task waited in the worker's queue before its compute began.
        Only the first answer for a slot that is still assigned to this worker is used; late
        replicas, answers for cancelled or finished slots, and repeats are refused (counted).
        """
        worker = self.workers.get(worker_id)
        if worker is None or slot_id not in worker.assigned:
            self.stats["results_unexpected"] += 1
            return False, []
        del worker.assigned[slot_id]
        worker.last_seen = now
        slot = self.slots[slot_id]
        round_ = self.rounds[slot.round]
        slot.holders.discard(worker_id)
        worker.done += 1
        worker.staleness += max(0, self.version - round_.version)
        worker.samples += slot.samples
        worker.compute_s += max(0.0, compute_s)
        if slot.samples and compute_s > 0:
            self.speed.observe_result(worker.speed, compute_s / slot.samples)
        if worker_id in slot.with_model and worker_id in slot.started:
            self.speed.observe_link(worker.speed, now - slot.started[worker_id], compute_s,
                                    waited_s)
        self.speed.slot_answered(worker.speed, slot.speculated)
        self._update_hunger(worker)
        self._watch_late(worker, now)
        verified = round_.verified
        if (slot.arrived or slot.dead
                or (verified is not None and verified.sender(slot_id) is not None)):
            self.stats["results_duplicate"] += 1
            return False, self._fill(now)
        if verified is not None:
            return True, self._hold(slot, worker_id, now)
        self.stats["results_used"] += 1
        return True, self._arrive(slot, now)

    def _arrive(self, slot: Slot, now: float) -> list[Action]:
        """`slot`'s result is used: its row has arrived; the round decodes, or more is handed out."""
        actions: list[Action] = []
        slot.arrived = True
        actions += self._cancel_holders(slot)
        round_ = self.rounds[slot.round]
        round_.arrived.add(slot.index)
        round_.covered.update(j for j, _ in slot.row)
        for other_id in round_.copies[tuple(slot.row)]:  # replicas, speculation: not needed
            other = self.slots[other_id]
            if not other.arrived and not other.dead:
                other.dead = True
                self.stats["slots_redundant"] += 1
                actions += self._cancel_holders(other, now)
        # Every partition covered is necessary for a decode: the least squares waits for it.
        weights = None
        if len(round_.covered) == round_.code.partitions:
            weights = coding.decode(round_.code, round_.arrived)
        if weights is not None:
            # No new round yet: it must be planned at the version this round's step creates, so
            # the fill waits for `applied` (else even synchronous rounds would run one step stale).
            return actions + self._close_round(round_, weights, now)
        return actions + self._fill(now)

    # verified rounds (verify_replicas) ------------------------------------------------------

    def _hold(self, slot: Slot, worker_id: str, now: float) -> list[Action]:
        """A copy's result arrived: keep it until a copy from another worker is compared with it.
        The row's other copies keep computing (they are the second opinion); only this slot's
        other holders (a deadline handed it out twice) are cancelled: it has its answer."""
        round_ = self.rounds[slot.round]
        row = tuple(slot.row)
        round_.verified.hold(row, slot.id, worker_id)
        actions = self._cancel_holders(slot)
        self.stats["replicas_held"] += 1
        return actions + self._compare_or_fill(round_, row, now)

    def _compare_or_fill(self, round_: Round, row: tuple, now: float) -> list[Action]:
        """Compare the row's first two held copies, else hand out more work. Not both: the
        verdict may close the round (and release its model) before the caller gets to slots
        handed out here, so the fill waits for the verdict (`copies_agreed`, `copies_disagreed`,
        `copies_settled`)."""
        pair = round_.verified.next_pair(row)
        if pair is None:
            return self._fill(now)
        first, second = pair
        return [CompareCopies(round_.id, pair, (round_.verified.sender(first),
                                                round_.verified.sender(second)))]

    def _disputed_pair(self, first: int, second: int) -> Optional[tuple[Round, tuple]]:
        """The round and row of a `CompareCopies` still awaiting its verdict, else None."""
        slot = self.slots.get(first)
        round_ = self.rounds.get(slot.round) if slot is not None else None
        if round_ is None or round_.verified is None:
            return None
        row = round_.verified.row_in_dispute(first, second)
        return None if row is None else (round_, row)

    def copies_agreed(self, first: int, second: int, now: float) -> list[Action]:
        """The two compared copies agree: the row arrives (the first copy is used)."""
        pair = self._disputed_pair(first, second)
        if pair is None:
            return []
        round_, row = pair
        round_.verified.end_dispute(row)
        self.stats["replicas_agreed"] += 1
        self.stats["results_used"] += 1
        return self._arrive(self.slots[first], now)

    def copies_disagreed(self, first: int, second: int, now: float) -> list[Action]:
        """The two compared copies differ: the row waits for `copies_settled`; the workers
        meanwhile take other work."""
        if self._disputed_pair(first, second) is not None:
            self.stats["replicas_disagreed"] += 1
        return self._fill(now)

    def copies_settled(self, first: int, second: int, correct: list[int], now: float,
                       kept: Optional[int] = None) -> list[Action]:
        """A disagreement decided: `correct` holds those of the two found right (by the
        coordinator's own computation). The first of them is used; with none (or when it could
        not be settled), both are computed again, by whoever takes them next, except `kept`,
        one neither proven right nor wrong (its copy's sender was banned), which stays held for
        the next copy to agree with."""
        pair = self._disputed_pair(first, second)
        if pair is None:
            return []
        round_, row = pair
        round_.verified.end_dispute(row)
        use = next((s for s in (first, second) if s in correct), None)
        if use is not None:
            self.stats["results_used"] += 1
            return self._arrive(self.slots[use], now)
        refused = [s for s in (first, second) if s != kept]
        round_.verified.release(refused)
        for slot_id in refused:
            self._requeue(self.slots[slot_id])
            self.stats["replicas_refused"] += 1
        return self._compare_or_fill(round_, row, now)

    def failed(self, worker_id: str, slot_id: int, now: float) -> list[Action]:
        """A worker's answer that could not be used (bad gradient): the slot goes back."""
        worker = self.workers.get(worker_id)
        if worker is None or slot_id not in worker.assigned:
            return []
        del worker.assigned[slot_id]
        worker.failed += 1
        self._update_hunger(worker)
        self._watch_late(worker, now)
        self._let_go(slot_id, worker_id)  # (another holder may still answer)
        return self._fill(now)

    def handback(self, worker_id: str, slot_ids: list[int], now: float) -> list[Action]:
        """The worker cannot compute these slots now, through no fault of its own (their data
        is not in its cache and its transfer cap is spent): they go to others, uncounted."""
        worker = self.workers.get(worker_id)
        if worker is None:
            return []
        for slot_id in slot_ids:
            if worker.assigned.pop(slot_id, None) is None:
                continue
            self.stats["slots_handed_back"] += 1
            slot = self.slots.get(slot_id)
            if slot is not None:
                slot.holders.discard(worker_id)
                if not slot.holders:
                    self._requeue(slot)
        self._update_hunger(worker)
        self._watch_late(worker, now)
        return self._fill(now)

    def leave(self, worker_id: str, now: float, reason: str = "left") -> list[Action]:
        if worker_id not in self.workers:
            return []
        return self._remove(worker_id, reason, now) + self._fill(now)

    def tick(self, now: float) -> list[Action]:
        """Evict silent workers and requeue late slots. Call about once per heartbeat."""
        actions: list[Action] = []
        silence = self.config.heartbeat_s * self.config.liveness
        due = self._silence_due
        while due and due[0][0] <= now:
            _, _, worker_id, session = heapq.heappop(due)
            worker = self.workers.get(worker_id)
            if worker is None or worker.session != session:
                continue
            if now - worker.last_seen > silence:
                actions += self._remove(worker.id, f"silent for {now - worker.last_seen:.1f}s", now)
            else:
                self._watch_silence(worker, after=now)
        due = self._grace_due
        while due and due[0][0] <= now:
            _, _, worker_id, session, since = heapq.heappop(due)
            worker = self.workers.get(worker_id)
            if worker is None or worker.session != session or worker.paused_since != since:
                continue
            if now - since < self.config.pause_grace_s:  # rounding: not yet
                heapq.heappush(due, (math.nextafter(now, math.inf), next(self._seq), worker_id,
                                     session, since))
            elif worker.assigned:
                actions += self._withdraw(worker)
        due = self._deadline_due
        while due and due[0][0] < now:
            deadline, _, worker_id, slot_id = heapq.heappop(due)
            worker = self.workers.get(worker_id)
            if worker is None or worker.assigned.get(slot_id) != deadline:
                continue  # answered, cancelled, withdrawn or requeued already
            worker.missed += 1
            worker.assigned[slot_id] = math.inf  # requeued once; the holder may still win
            self.stats["deadline_requeues"] += 1
            if slot_id in self.side:
                self._requeue_side(self.side[slot_id])
            else:
                self._requeue(self.slots[slot_id])
        due = self._late_due
        while due and due[0][0] <= now:
            _, seq, worker_id = heapq.heappop(due)
            worker = self.workers.get(worker_id)
            if worker is None or worker.late_check != seq:
                continue
            worker.late_check = None
            self._speculate_late(worker, now)
            self._watch_late(worker, now, after=now)
        return actions + self._fill(now)

    def pause(self) -> None:
        """Hand out no more slots; the slots already held are finished and applied."""
        self.paused = True

    def resume(self, now: float) -> list[Action]:
        self.paused = False
        return self._fill(now)

    def drain(self, worker_id: str, now: float) -> list[Action]:
        """Give `worker_id` no new slots; `Drained` once the slots it holds are done.

        Raises KeyError for a worker that is not registered."""
        worker = self.workers[worker_id]
        self._hungry.pop(worker_id, None)
        if not worker.draining:
            worker.draining = True
            self._draining.add(worker_id)
        return self._fill(now)

    def applied(self, version: int, now: float) -> list[Action]:
        """The server handled a `Decoded` round (stepped the model, or replanned the round):
        `version` is the model's version now, at which the slots it frees are planned."""
        self.version = version
        return self._fill(now)

    def absent(self, seconds: float) -> None:
        """The caller was not running for `seconds` (a frozen or suspended coordinator): nobody
        could be heard meanwhile, so that time counts as no worker's silence."""
        for worker in self.workers.values():
            worker.last_seen += seconds

    def resend(self, worker_id: str, now: float) -> list[Assign]:
        """Every slot `worker_id` holds, assigned again with its model: after a reconnect the
        tasks sent down its old connection may never have arrived (the worker ignores those
        it has). Without this a resumed worker could hold phantom slots, and its credits, forever."""
        worker = self.workers.get(worker_id)
        if worker is None:
            return []
        out = []
        for slot_id, deadline in sorted(worker.assigned.items()):
            wait = deadline - now if math.isfinite(deadline) else self.config.min_deadline_s
            side = self.side.get(slot_id)
            if side is not None:
                worker.model_version = side.version
                out.append(self._side_assign(worker, side, max(0.0, wait), True))
                continue
            slot = self.slots.get(slot_id)
            if slot is None or slot.round not in self.rounds:
                continue
            round_ = self.rounds[slot.round]
            worker.model_version = round_.version
            wait = deadline - now if math.isfinite(deadline) else self.config.min_deadline_s
            out.append(Assign(
                worker=worker.id, slot=slot.id, round=round_.id, version=round_.version,
                parts=[list(round_.parts[j]) for j, _ in slot.row],
                coefficients=[c for _, c in slot.row], deadline_s=max(0.0, wait),
                send_model=True, kind=slot.kind, steps=slot.steps))
        return out

    def replan(self, decoded: Decoded) -> None:
        """A decoded round that could not be applied (too stale): its samples come back."""
        self.stats["rounds_replanned"] += 1
        self.sampler.replan(decoded.parts)

    def stop(self) -> list[CancelSlots]:
        """Open no more rounds and withdraw every assignment (shutdown)."""
        self.accepting = False
        self._pending.clear()
        self._drop_side_slots()
        actions = []
        for worker in self.workers.values():
            if worker.assigned:
                actions.append(CancelSlots(worker.id, sorted(worker.assigned)))
                worker.assigned.clear()
        return actions

    # internals ------------------------------------------------------------------------------

    def _watch_silence(self, worker: WorkerRecord, after: float = -math.inf) -> None:
        """Queue the moment `worker` would have been silent too long, unless heard from again."""
        due = max(worker.last_seen + self.config.heartbeat_s * self.config.liveness,
                  math.nextafter(after, math.inf))
        heapq.heappush(self._silence_due, (due, next(self._seq), worker.id, worker.session))

    def _watch_late(self, worker: WorkerRecord, now: float, after: Optional[float] = None) -> None:
        """Queue the first moment a slot of `worker` may turn late (as `_speculate_late` judges).

        The judgement depends on the worker's prediction and on how many slots it holds; both
        change only where this is called again, so the check comes exactly when it is due. A
        worker judged by the fleet's times (few results of its own) is looked at every tick in a
        fleet of up to `_RECHECK_FLEET` workers; in a larger one when the fleet's times of the
        moment say it is due (they drift between its own events)."""
        if not self._speculate or not worker.assigned:
            worker.late_check = None
            return
        prediction = self.speed.prediction(worker.speed)
        due = math.inf
        if prediction is None or (len(self.workers) <= _RECHECK_FLEET
                                  and self.speed.judged_by_fleet(worker.speed)):
            due = now  # the next tick
        if prediction is not None:
            queued = max(1, len(worker.assigned))
            for slot_id in worker.assigned:
                slot = self.slots.get(slot_id)
                if (slot is None or slot.speculated or slot.arrived or slot.dead
                        or worker.id not in slot.started):
                    continue
                due = min(due, self.speed.late_at(prediction, slot.samples, queued,
                                                  slot.started[worker.id]))
        if due == math.inf:
            worker.late_check = None
            return
        if after is not None:
            due = max(due, math.nextafter(after, math.inf))
        worker.late_check = next(self._seq)
        heapq.heappush(self._late_due, (due, worker.late_check, worker.id))

    def _speculate_late(self, worker: WorkerRecord, now: float) -> None:
        """Append a duplicate row for every slot of `worker` that is late past its prediction."""
        prediction = self.speed.prediction(worker.speed)
        if prediction is None:
            return
        queued = max(1, len(worker.assigned))  # it computes its slots one after another
        for slot_id in list(worker.assigned):
            slot = self.slots.get(slot_id)
            if (slot is None or slot.speculated or slot.arrived or slot.dead
                    or slot.round not in self.rounds or worker.id not in slot.started):
                continue
            elapsed = now - slot.started[worker.id]
            if not self.speed.is_late(prediction, slot.samples, queued, elapsed):
                continue
            round_ = self.rounds[slot.round]
            round_.code = coding.speculate(round_.code, slot.index)
            copy = Slot(self._take_id(), round_.id, list(slot.row), slot.samples, speculated=True,
                        index=len(round_.slots), kind=slot.kind, steps=slot.steps)
            self.slots[copy.id] = copy
            round_.slots.append(copy.id)
            round_.copies[tuple(copy.row)].append(copy.id)
            copy.queued = True
            self._pending.appendleft(copy.id)
            slot.speculated = True
            self.stats["slots_speculated"] += 1
            if slot.samples:  # a bound: it has not answered yet
                self.speed.observe(elapsed / slot.samples, worker.speed)
            self.speed.slot_late(worker.speed)

    def _update_hunger(self, worker: WorkerRecord) -> None:
        if worker.free > 0 and not worker.draining:
            self._hungry.setdefault(worker.id, None)
        else:
            self._hungry.pop(worker.id, None)

    def _let_go(self, slot_id: int, worker_id: str) -> bool:
        """`worker_id` no longer holds `slot_id` (a round's or a side slot): requeued if nobody
        else does. Whether it was requeued."""
        slot = self.slots.get(slot_id)
        side = self.side.get(slot_id) if slot is None else None
        holder = slot if slot is not None else side
        if holder is None:
            return False
        holder.holders.discard(worker_id)
        if holder.holders:
            return False
        if side is not None:
            return self._requeue_side(side)
        return self._requeue(slot) is None

    def _requeue(self, slot: Slot) -> None:
        if not slot.arrived and not slot.queued and slot.round in self.rounds:
            slot.queued = True
            self._pending.appendleft(slot.id)
            self.stats["slots_requeued"] += 1

    def _cancel_holders(self, slot: Slot, now: Optional[float] = None) -> list[Action]:
        actions: list[Action] = []
        for holder in sorted(slot.holders):
            worker = self.workers[holder]
            if now is not None and slot.samples and holder in slot.started:  # censored
                self.speed.observe((now - slot.started[holder]) / slot.samples, worker.speed)
            del worker.assigned[slot.id]
            worker.cancelled += 1
            self._update_hunger(worker)
            self._watch_late(worker, slot.started.get(holder, 0.0) if now is None else now)
            actions.append(CancelSlots(holder, [slot.id]))
        slot.holders.clear()
        return actions

    def _close_round(self, round_: Round, weights: dict[int, float],
                     now: Optional[float] = None) -> list[Action]:
        actions: list[Action] = []
        used = {round_.slots[row]: w for row, w in weights.items()}
        slot_samples = {}
        for row, slot_id in enumerate(round_.slots):
            slot = self.slots.pop(slot_id)
            if slot_id in used:
                slot_samples[slot_id] = slot.samples
            if not slot.arrived:
                actions += self._cancel_holders(slot, now)
        del self.rounds[round_.id]
        self._rounds_at[round_.version] -= 1
        if self._rounds_at[round_.version] <= 0:
            del self._rounds_at[round_.version]
        self.stats["rounds_decoded"] += 1
        actions.append(Decoded(
            round=round_.id, version=round_.version, parts=round_.parts, samples=round_.samples,
            weights=used, slots=list(round_.slots), slot_samples=slot_samples))
        return actions

    def _withdraw(self, worker: WorkerRecord) -> list[Action]:
        """Take every slot back from a (paused) worker: cancelled there, requeued for others."""
        slots = sorted(worker.assigned)
        for slot_id in reversed(slots):
            self._let_go(slot_id, worker.id)
        worker.assigned.clear()
        worker.cancelled += len(slots)
        self.stats["pause_withdrawn"] += len(slots)
        self._update_hunger(worker)
        return [CancelSlots(worker.id, slots)]

    def _remove(self, worker_id: str, reason: str, now: float) -> list[Action]:
        worker = self.workers.pop(worker_id)
        if self.locality is not None:
            self.locality.forget(worker_id)
        self._hungry.pop(worker_id, None)
        self._draining.discard(worker_id)
        requeued = 0
        for slot_id in sorted(worker.assigned, reverse=True):
            requeued += self._let_go(slot_id, worker_id)
        self.stats["workers_removed"] += 1
        return [Evicted(worker_id, reason, requeued)]

    def _open_round(self, worker: Optional[WorkerRecord] = None) -> bool:
        if not self.accepting:
            return False
        limit = 1 if self.config.sync else self.config.open_rounds
        if limit and len(self.rounds) >= limit:
            return False
        k = self.config.partitions
        if self.config.sync:
            k = max(1, len(self._active()))
        block = None
        if self.locality is not None and worker is not None:
            block = self.locality.block_for(worker.id, self.sampler.epoch,
                                            self.sampler.open_blocks())
        parts = self.sampler.next_round(self._round_batch(k, worker), k, block)
        if parts is None:
            return False
        code = coding.build(self._policy(len(parts)), len(parts))
        self.last_code = code.name
        self.stats["rounds_" + code.name.split(":")[0]] += 1
        round_id = self._take_id()
        slot_ids = [0] * code.slots  # in code row order
        rows: list[list[tuple[int, float]]] = [[] for _ in range(code.slots)]
        r_idx, c_idx = np.nonzero(code.matrix)
        for r, c, v in zip(r_idx.tolist(), c_idx.tolist(), code.matrix[r_idx, c_idx].tolist()):
            rows[r].append((c, v))  # code.row(r) for every row at once
        counts = [p[2] for p in parts]
        kind, local_task = self.task_mode.kind, self.task_mode.local
        for row in _queue_order(code):
            entries = rows[row]
            samples = (counts[entries[0][0]] if len(entries) == 1
                       else sum(counts[j] for j, _ in entries))
            # A short slot (an epoch's end) takes fewer inner steps, never smaller ones.
            steps = inner_steps(samples, self.config.batch_size) if local_task else 0
            slot = Slot(self._take_id(), round_id, entries, samples, queued=True, index=row,
                        kind=kind, steps=steps)
            self.slots[slot.id] = slot
            slot_ids[row] = slot.id
            self._pending.append(slot.id)
        round_ = Round(round_id, self.version, list(parts), code, slot_ids,
                       verified=VerifiedRows() if self.config.verify_replicas else None,
                       block=self.sampler.block_of(parts[0]) if self.locality else None)
        for slot_id in slot_ids:
            round_.copies.setdefault(tuple(self.slots[slot_id].row), []).append(slot_id)
        self.rounds[round_id] = round_
        self._rounds_at[self.version] += 1
        self.stats["rounds_opened"] += 1
        return True

    def _round_batch(self, k: int = 1, worker: Optional[WorkerRecord] = None) -> int:
        if self.task_mode.local:  # a slot as long as the worker opening the round should run
            speed = worker.speed if worker is not None else WorkerSpeed()
            return k * self.task_mode.slot_samples(speed.s_per_sample, self.config.batch_size,
                                                   speed.link_s)
        batch = self.config.batch_size
        if self.config.max_batch:
            batch = max(1, min(batch, self.config.max_batch))
        return batch

    def _active(self) -> list[WorkerRecord]:
        return [w for w in self.workers.values()
                if w.capacity > 0 and w.paused_since is None and not w.draining]

    def _adaptive_sample(self) -> list[WorkerRecord]:
        """The workers whose records adaptive simulates: every active one in a small fleet; in a
        large one a bounded sample, the hungry first (they take the new round's slots)."""
        limit = self.config.adaptive_sample
        if len(self.workers) <= limit:
            return self._active()
        chosen: dict[str, WorkerRecord] = {}
        for worker in itertools.chain((self.workers[w] for w in self._hungry),
                                      self.workers.values()):
            if len(chosen) >= limit:
                break
            if (worker.id not in chosen and worker.capacity > 0 and worker.paused_since is None
                    and not worker.draining):
                chosen[worker.id] = worker
        return list(chosen.values())

    def _policy(self, k: int) -> Redundancy:
        policy = self.config.redundancy
        if self.config.sync:
            return Redundancy()
        if policy.kind != "adaptive":
            return policy
        if len(self.speed.times) < 8:
            # Nothing measured yet: assume the fleet straggles (volunteers' machines do). A
            # replicated first round or two costs little where nobody is slow, and where one is,
            # a first round without redundancy waits for it.
            if self.config.adaptive_max_level >= 2:
                return Redundancy("replicate", 2)
            return Redundancy()
        active = self._adaptive_sample()
        choice, at = self._choice
        key = (k, len(active))
        observations = self.speed.observations
        if observations - at >= self.config.adaptive_every or self._choice_key != key:
            speculation = None
            if self._speculate:
                speculation = adaptive.Speculation(self.config.spec_sd, self.config.spec_floor_s)
            choice, self.last_costs = adaptive.choose(
                [list(w.speed.recent) for w in active] or [list(self.speed.times)], k,
                samples_per_partition=self._round_batch() / k,
                max_level=self.config.adaptive_max_level, seed=observations,
                open_rounds=self.config.open_rounds, speculation=speculation)
            self._choice = (choice, observations)
            self._choice_key = key
        return choice

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _next_slot_for(self, worker: WorkerRecord, local: bool = False) -> Optional[Slot]:
        """The oldest pending slot for `worker`: never one it holds or a copy of a row it holds,
        and none of a redundant round it already holds a slot of, so that one stopped worker
        never holds two slots of one round (it takes the next when it answers). `local`: only
        a slot whose shards it holds or may take anyway (locality), among the first
        `_LOCAL_SCAN` pending."""
        if not self._pending:
            return None
        scan = _LOCAL_SCAN if local else math.inf
        mine: list[Slot] = []
        rows: set = set()
        rounds: set = set()
        if worker.assigned:
            mine = [self.slots[s] for s in worker.assigned if s in self.slots]
            rows = {(s.round, tuple(s.row)) for s in mine}
            rounds = {s.round for s in mine}
        skipped: list[int] = []
        found = None
        while self._pending and scan > 0:
            scan -= 1
            slot_id = self._pending.popleft()
            slot = self.slots.get(slot_id)
            if slot is None or slot.arrived or slot.dead:
                continue  # its round closed while it waited, or a copy of it arrived
            if self.config.verify_replicas:
                verified = self.rounds[slot.round].verified
                if verified.sender(slot_id) is not None:  # answered by a holder it came back from
                    slot.queued = False
                    continue
                if not verified.may_take(worker.id, tuple(slot.row)):
                    skipped.append(slot_id)
                    continue
            if mine and (worker.id in slot.holders or (slot.round, tuple(slot.row)) in rows
                    or (slot.round in rounds and (
                        self.config.sync or self.rounds[slot.round].code.tolerance > 0))):
                skipped.append(slot_id)
                continue
            if local and not self._local_for(worker, slot):
                skipped.append(slot_id)
                continue
            slot.queued = False
            found = slot
            break
        self._pending.extendleft(reversed(skipped))
        return found

    def _local_for(self, worker: WorkerRecord, slot: Slot) -> bool:
        """Whether the locality pass may give `slot` to `worker`."""
        round_ = self.rounds[slot.round]
        # A round's age in versions over the rounds open: about the slot times it has waited
        # (each open round steps the version once per slot time, roughly).
        waited = (self.version - round_.version) / max(1, len(self.rounds))
        return (self.locality.affine(worker.id, round_.block)
                or self.locality.anybodys(round_.block, waited, slot.speculated))

    def _fill(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for worker_id in sorted(self._draining):
            if not self.workers[worker_id].assigned:
                self._draining.discard(worker_id)
                actions.append(Drained(worker_id))
        if not self.quorum:
            if len(self.workers) < self.config.min_workers:
                return actions
            self.quorum = True
        if self.paused or not self._hungry:
            return actions
        if self._side_pending:
            actions += self._fill_side(now, alternate=True)
        actions += self._fill_rounds(now)
        if self._side_pending and self._hungry:  # no round work for them: side work back to back
            actions += self._fill_side(now, alternate=False)
        return actions

    def _fill_rounds(self, now: float) -> list[Action]:
        actions: list[Action] = []
        # Nothing to hand out (the plan is exhausted, the open-round limit reached): every
        # hungry worker would come away empty, so none is asked.
        can_open = self._can_open()
        if not self._pending and not can_open:
            return actions
        # One slot per hungry worker per pass: a round's slots spread over the fleet instead of
        # filling the first worker's credits (which would run them one after another).
        progress = True
        while progress and self._hungry:
            progress = False
            for worker_id in self._hungry_in_order():
                if not self._pending and not can_open:
                    return actions  # nothing left for the rest of the pass either
                worker = self.workers[worker_id]
                if worker.free > 0 and not (self.config.sync and worker.assigned):
                    # With locality: a pending slot of its shards, else a round of its own
                    # block, else whatever is pending.
                    local = self.locality is not None
                    slot = self._next_slot_for(worker, local)
                    if slot is None and can_open:
                        can_open = self._open_round(worker)  # a round that cannot open now stays so
                        if can_open:
                            slot = self._next_slot_for(worker, local)
                    if slot is None and local:
                        slot = self._next_slot_for(worker)
                    if slot is not None:
                        actions.append(self._assign(worker, slot, now))
                        worker.side_last = False
                        progress = True
                self._update_hunger(worker)
        return actions

    def _hungry_in_order(self):
        """The hungry workers in order, read a few at a time rather than copied whole.

        While a pass runs only the worker just visited can leave `_hungry`, and none joins, so
        the visited ones still there are a prefix of it and the rest follow in order."""
        kept = 0
        while True:
            chunk = list(itertools.islice(self._hungry, kept, kept + 64))
            if not chunk:
                return
            for worker_id in chunk:
                yield worker_id
                if worker_id in self._hungry:
                    kept += 1

    def _can_open(self) -> bool:
        """Whether `_open_round` may open one now (it can still fail on an empty plan)."""
        if not self.accepting:
            return False
        limit = 1 if self.config.sync else self.config.open_rounds
        if limit and len(self.rounds) >= limit:
            return False
        return not self.sampler.exhausted

    def _assign(self, worker: WorkerRecord, slot: Slot, now: float) -> Assign:
        round_ = self.rounds[slot.round]
        deadline = now + self.speed.deadline_s(worker.speed, slot.samples, worker.capacity)
        worker.assigned[slot.id] = deadline
        heapq.heappush(self._deadline_due, (deadline, next(self._seq), worker.id, slot.id))
        slot.holders.add(worker.id)
        slot.started[worker.id] = now
        self._watch_late(worker, now)
        send_model = worker.model_version != round_.version
        if send_model:
            slot.with_model.add(worker.id)
        else:
            slot.with_model.discard(worker.id)
        worker.model_version = round_.version
        prefetch = ()
        if self.locality is not None:
            prefetch = self.locality.hint(worker.id, self.sampler.epoch, self.sampler.open_blocks,
                                          self.sampler.block_left)
        return Assign(
            worker=worker.id, slot=slot.id, round=round_.id, version=round_.version,
            parts=[list(round_.parts[j]) for j, _ in slot.row],
            coefficients=[c for _, c in slot.row], deadline_s=deadline - now,
            send_model=send_model, kind=slot.kind, steps=slot.steps, prefetch=prefetch)


    # side slots -----------------------------------------------------------------------------

    def add_side(self, version: int, parts: list[list[int]], now: float,
                 kind: str = "eval") -> tuple[list[int], list[Action]]:
        """Queue a side slot per part, at `version`: (their ids, what to hand out now)."""
        return self._add_side([SideSlot(self._take_id(), version, list(part), kind)
                               for part in parts], now)

    def add_side_task(self, version: int, parts: list[list[int]], coefficients: list[float],
                      kind: str, steps: int, exclude: frozenset, now: float
                      ) -> tuple[int, list[Action]]:
        """Queue one side slot computing what a round's slot of `parts`, `coefficients`,
        `kind` and `steps` would, at `version`, for a worker not in `exclude`: (its id,
        actions)."""
        slot = SideSlot(self._take_id(), version, [], kind, parts=[list(p) for p in parts],
                        coefficients=list(coefficients), exclude=frozenset(exclude), steps=steps)
        ids, actions = self._add_side([slot], now)
        return ids[0], actions

    def _add_side(self, slots: list[SideSlot], now: float) -> tuple[list[int], list[Action]]:
        ids = []
        for slot in slots:
            version = slot.version
            self.side[slot.id] = slot
            self._side_pending.append(slot.id)
            self._side_at[version] += 1
            ids.append(slot.id)
        self.stats["side_slots"] += len(ids)
        return ids, self._fill(now)

    def side_result(self, worker_id: str, slot_id: int, now: float, fill: bool = True
                    ) -> tuple[bool, list[Action]]:
        """A worker's answer for a side slot: (use it?, actions). The first answer from a holder
        wins and its other holders are cancelled; any other is refused (counted). Without
        `fill`, the freed credit is not dealt yet: the caller acts on the answer first and then
        calls `fill` (a settlement's answer can close the round of a slot a fill would hand out
        again)."""
        worker = self.workers.get(worker_id)
        slot = self.side.get(slot_id)
        if worker is None or slot is None or slot_id not in worker.assigned:
            self.stats["results_unexpected"] += 1
            return False, []
        del worker.assigned[slot_id]
        worker.last_seen = now
        if slot.kind == "eval":
            worker.side_samples += slot.samples
        slot.holders.discard(worker_id)
        self._update_hunger(worker)
        self._watch_late(worker, now)
        self.stats["side_answered"] += 1
        actions = self._close_side(slot)
        return True, actions + (self._fill(now) if fill else [])

    def fill(self, now: float) -> list[Action]:
        """Deal free credits (after a `side_result` without `fill`)."""
        return self._fill(now)

    def drop_side(self, now: float, kind: str = "eval") -> list[Action]:
        """Forget every open side slot of `kind` (an evaluation abandoned): their holders are
        cancelled."""
        actions: list[Action] = []
        for slot in [s for s in self.side.values() if s.kind == kind]:
            actions += self._close_side(slot)
        return actions + self._fill(now)

    def drop_side_slot(self, slot_id: int, now: float) -> list[Action]:
        """Forget one open side slot (its holders are cancelled)."""
        slot = self.side.get(slot_id)
        return [] if slot is None else self._close_side(slot) + self._fill(now)

    def _close_side(self, slot: SideSlot) -> list[Action]:
        actions: list[Action] = []
        for holder in sorted(slot.holders):
            worker = self.workers.get(holder)
            if worker is not None and worker.assigned.pop(slot.id, None) is not None:
                worker.cancelled += 1
                self._update_hunger(worker)
                actions.append(CancelSlots(holder, [slot.id]))
        slot.holders.clear()
        del self.side[slot.id]
        self._side_at[slot.version] -= 1
        if self._side_at[slot.version] <= 0:
            del self._side_at[slot.version]
        return actions

    def _drop_side_slots(self) -> None:
        self.side.clear()
        self._side_pending.clear()
        self._side_at.clear()

    def _requeue_side(self, slot: SideSlot) -> bool:
        if slot.queued or slot.id not in self.side:
            return False
        slot.queued = True
        self._side_pending.appendleft(slot.id)
        self.stats["side_requeued"] += 1
        return True

    def _fill_side(self, now: float, alternate: bool) -> list[Action]:
        """Hand pending side slots to hungry workers holding none; with `alternate`, only to
        those whose last slot was a round's."""
        actions: list[Action] = []
        for worker_id in self._hungry_in_order():
            if not self._side_pending:
                break
            worker = self.workers[worker_id]
            if (worker.free <= 0 or (alternate and worker.side_last)
                    or any(s in self.side for s in worker.assigned)):
                continue
            slot = self._next_side_for(worker)
            if slot is None:
                continue
            slot.queued = False
            deadline = now + self.speed.deadline_s(worker.speed, slot.samples, worker.capacity)
            worker.assigned[slot.id] = deadline
            heapq.heappush(self._deadline_due, (deadline, next(self._seq), worker.id, slot.id))
            slot.holders.add(worker.id)
            send_model = worker.model_version != slot.version
            worker.model_version = slot.version
            worker.side_last = True
            actions.append(self._side_assign(worker, slot, deadline - now, send_model))
            self._update_hunger(worker)
        return actions

    def _next_side_for(self, worker: WorkerRecord) -> Optional[SideSlot]:
        """The oldest pending side slot `worker` may take (not one it is excluded from)."""
        skipped: list[int] = []
        found = None
        while self._side_pending:
            slot_id = self._side_pending.popleft()
            candidate = self.side.get(slot_id)
            if candidate is None or not candidate.queued:
                continue
            if worker.id in candidate.exclude:
                skipped.append(slot_id)
                continue
            found = candidate
            break
        self._side_pending.extendleft(reversed(skipped))
        return found

    def side_takers(self, slot_id: int) -> int:
        """Workers that could take side slot `slot_id` (neither excluded nor draining)."""
        slot = self.side.get(slot_id)
        if slot is None:
            return 0
        return sum(1 for w in self.workers.values() if w.id not in slot.exclude and not w.draining)

    @staticmethod
    def _side_assign(worker: WorkerRecord, slot: SideSlot, deadline_s: float,
                     send_model: bool) -> Assign:
        return Assign(worker=worker.id, slot=slot.id, round=0, version=slot.version,
                      parts=[list(p) for p in slot.parts] or [list(slot.part)],
                      coefficients=list(slot.coefficients), deadline_s=deadline_s,
                      send_model=send_model, kind=slot.kind, steps=slot.steps)


def _queue_order(code: Code) -> list[int]:
    """Rows in the order their slots are queued: first copies of every row before second copies
    (replicas, speculative duplicates), so the first workers cover the whole round."""
    seen: Counter[bytes] = Counter()
    copy = []
    for row in range(code.slots):
        key = code.matrix[row].tobytes()
        copy.append(seen[key])
        seen[key] += 1
    return sorted(range(code.slots), key=lambda r: (copy[r], r))
