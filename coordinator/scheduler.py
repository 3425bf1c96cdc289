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
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Optional, Union

from ..common import coding
from ..common.coding import Code
from .sampler import Part, Sampler


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


@dataclass(frozen=True)
class Evicted:
    worker: str
    reason: str
    requeued: int


@dataclass(frozen=True)
class Drained:
    """A draining worker holds no more slots: send it home."""

    worker: str


Action = Union[Assign, CancelSlots, Decoded, Evicted, Drained]


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
    s_per_sample: Optional[float] = None
    done: int = 0
    samples: int = 0
    cancelled: int = 0
    missed: int = 0
    failed: int = 0
    staleness: int = 0  # sum over its results of (version at arrival - version of the slot)
    draining: bool = False  # gets no new slots; sent home once it holds none

    @property
    def free(self) -> int:
        if self.paused_since is not None:
            return 0  # whatever credits it announced, a paused worker takes nothing new
        return self.capacity - len(self.assigned)


@dataclass
class Slot:
    id: int
    round: int
    row: list[tuple[int, float]]  # (partition index, coefficient)
    samples: int
    holders: set[str] = field(default_factory=set)
    arrived: bool = False
    queued: bool = False  # waiting in the pending queue for a (further) holder


@dataclass
class Round:
    id: int
    version: int
    parts: list[Part]
    code: Code
    slots: list[int]  # slot ids, in code row order
    arrived: set[int] = field(default_factory=set)  # code rows that arrived

    @property
    def samples(self) -> int:
        return sum(p[2] for p in self.parts)


class Scheduler:
    def __init__(self, config: SchedulerConfig, sampler: Sampler, version: int = 0,
                 next_id: int = 1):
        self.config = config
        self.sampler = sampler
        self.version = version
        self.workers: dict[str, WorkerRecord] = {}
        self.rounds: dict[int, Round] = {}
        self.slots: dict[int, Slot] = {}
        self.accepting = True  # False: open no new rounds (pause, shutdown)
        self.paused = False  # True: hand out no slots at all (the operator paused training)
        self._draining: set[str] = set()  # draining workers not yet announced as Drained
        self._pending: deque[int] = deque()
        self._hungry: dict[str, None] = {}  # workers with free credits, in arrival order
        self._rounds_at: Counter[int] = Counter()  # open rounds per model version
        self._next_id = next_id
        self.stats: Counter[str] = Counter()

    # queries --------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.sampler.exhausted and not self.rounds

    def version_in_use(self, version: int) -> bool:
        """Whether an open round was planned at `version` (its slots need that model)."""
        return self._rounds_at[version] > 0

    def next_id(self) -> int:
        return self._next_id

    def pending(self) -> int:
        """Slots waiting for a (further) holder."""
        return len(self._pending)

    def open_parts(self) -> list[list[Part]]:
        """The parts of every open round: what a checkpoint must replan on resume."""
        return [r.parts for r in sorted(self.rounds.values(), key=lambda r: r.id)]

    # events ---------------------------------------------------------------------------------

    def join(self, worker_id: str, info: dict, now: float) -> list[Action]:
        actions: list[Action] = []
        if worker_id in self.workers:  # a reconnect: its old session's slots are lost
            actions += self._remove(worker_id, "rejoined", now)
        self.workers[worker_id] = WorkerRecord(worker_id, dict(info), joined=now, last_seen=now)
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
                elif state != "paused":
                    worker.paused_since = None
                worker.state = state
                self._update_hunger(worker)

    def result(self, worker_id: str, slot_id: int, compute_s: float,
               now: float) -> tuple[bool, list[Action]]:
        """A worker's answer for a slot. Returns (use this gradient?, actions).

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
        slot.holders.discard(worker_id)
        worker.done += 1
        worker.staleness += max(0, self.version - self.rounds[slot.round].version)
        worker.samples += slot.samples
        if slot.samples and compute_s > 0:
            self._observe_speed(worker, compute_s / slot.samples)
        self._update_hunger(worker)
        actions: list[Action] = []
        if slot.arrived:
            self.stats["results_duplicate"] += 1
            return False, self._fill(now)
        slot.arrived = True
        actions += self._cancel_holders(slot)
        round_ = self.rounds[slot.round]
        round_.arrived.add(round_.slots.index(slot_id))
        weights = coding.decode(round_.code, round_.arrived)
        if weights is not None:
            actions += self._close_round(round_, weights)
        self.stats["results_used"] += 1
        return True, actions + self._fill(now)

    def failed(self, worker_id: str, slot_id: int, now: float) -> list[Action]:
        """A worker's answer that could not be used (bad gradient): the slot goes back."""
        worker = self.workers.get(worker_id)
        if worker is None or slot_id not in worker.assigned:
            return []
        del worker.assigned[slot_id]
        worker.failed += 1
        self._update_hunger(worker)
        slot = self.slots.get(slot_id)
        if slot is not None:
            slot.holders.discard(worker_id)
            if not slot.holders:  # another holder may still answer
                self._requeue(slot)
        return self._fill(now)

    def leave(self, worker_id: str, now: float, reason: str = "left") -> list[Action]:
        if worker_id not in self.workers:
            return []
        return self._remove(worker_id, reason, now) + self._fill(now)

    def tick(self, now: float) -> list[Action]:
        """Evict silent workers and requeue late slots. Call about once per heartbeat."""
        actions: list[Action] = []
        silence = self.config.heartbeat_s * self.config.liveness
        for worker in list(self.workers.values()):
            if now - worker.last_seen > silence:
                actions += self._remove(worker.id, f"silent for {now - worker.last_seen:.1f}s", now)
                continue
            if (worker.paused_since is not None and worker.assigned
                    and now - worker.paused_since >= self.config.pause_grace_s):
                actions += self._withdraw(worker)
                continue
            for slot_id, deadline in worker.assigned.items():
                if now > deadline:
                    worker.missed += 1
                    worker.assigned[slot_id] = math.inf  # requeued once; the holder may still win
                    self.stats["deadline_requeues"] += 1
                    self._requeue(self.slots[slot_id])
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

    def applied(self, version: int) -> None:
        """The server stepped the model; new rounds are planned at this version."""
        self.version = version

    def replan(self, decoded: Decoded) -> None:
        """A decoded round that could not be applied (too stale): its samples come back."""
        self.stats["rounds_replanned"] += 1
        self.sampler.replan(decoded.parts)

    def stop(self) -> list[CancelSlots]:
        """Open no more rounds and withdraw every assignment (shutdown)."""
        self.accepting = False
        self._pending.clear()
        actions = []
        for worker in self.workers.values():
            if worker.assigned:
                actions.append(CancelSlots(worker.id, sorted(worker.assigned)))
                worker.assigned.clear()
        return actions

    # internals ------------------------------------------------------------------------------

    def _observe_speed(self, worker: WorkerRecord, s_per_sample: float) -> None:
        a = self.config.speed_alpha
        old = worker.s_per_sample
        worker.s_per_sample = s_per_sample if old is None else a * s_per_sample + (1 - a) * old

    def _deadline(self, worker: WorkerRecord, slot: Slot, now: float) -> float:
        wait = self.config.min_deadline_s
        if worker.s_per_sample is not None:
            predicted = worker.s_per_sample * slot.samples * max(1, worker.capacity)
            wait = max(wait, self.config.deadline_factor * predicted)
        return now + wait

    def _update_hunger(self, worker: WorkerRecord) -> None:
        if worker.free > 0 and not worker.draining:
            self._hungry.setdefault(worker.id, None)
        else:
            self._hungry.pop(worker.id, None)

    def _requeue(self, slot: Slot) -> None:
        if not slot.arrived and not slot.queued and slot.round in self.rounds:
            slot.queued = True
            self._pending.appendleft(slot.id)
            self.stats["slots_requeued"] += 1

    def _cancel_holders(self, slot: Slot) -> list[Action]:
        actions: list[Action] = []
        for holder in sorted(slot.holders):
            worker = self.workers[holder]
            del worker.assigned[slot.id]
            worker.cancelled += 1
            self._update_hunger(worker)
            actions.append(CancelSlots(holder, [slot.id]))
        slot.holders.clear()
        return actions

    def _close_round(self, round_: Round, weights: dict[int, float]) -> list[Action]:
        actions: list[Action] = []
        for row, slot_id in enumerate(round_.slots):
            slot = self.slots.pop(slot_id)
            if not slot.arrived:
                actions += self._cancel_holders(slot)
        del self.rounds[round_.id]
        self._rounds_at[round_.version] -= 1
        if self._rounds_at[round_.version] <= 0:
            del self._rounds_at[round_.version]
        self.stats["rounds_decoded"] += 1
        actions.append(Decoded(
            round=round_.id, version=round_.version, parts=round_.parts, samples=round_.samples,
            weights={round_.slots[row]: w for row, w in weights.items()}, slots=list(round_.slots)))
        return actions

    def _withdraw(self, worker: WorkerRecord) -> list[Action]:
        """Take every slot back from a (paused) worker: cancelled there, requeued for others."""
        slots = sorted(worker.assigned)
        for slot_id in reversed(slots):
            slot = self.slots.get(slot_id)
            if slot is not None:
                slot.holders.discard(worker.id)
                if not slot.holders:
                    self._requeue(slot)
        worker.assigned.clear()
        worker.cancelled += len(slots)
        self.stats["pause_withdrawn"] += len(slots)
        self._update_hunger(worker)
        return [CancelSlots(worker.id, slots)]

    def _remove(self, worker_id: str, reason: str, now: float) -> list[Action]:
        worker = self.workers.pop(worker_id)
        self._hungry.pop(worker_id, None)
        self._draining.discard(worker_id)
        requeued = 0
        for slot_id in sorted(worker.assigned, reverse=True):
            slot = self.slots.get(slot_id)
            if slot is not None:
                slot.holders.discard(worker_id)
                if not slot.holders:
                    self._requeue(slot)
                    requeued += 1
        self.stats["workers_removed"] += 1
        return [Evicted(worker_id, reason, requeued)]

    def _open_round(self) -> bool:
        if not self.accepting:
            return False
        if self.config.open_rounds and len(self.rounds) >= self.config.open_rounds:
            return False
        parts = self.sampler.next_round(self.config.batch_size, self.config.partitions)
        if parts is None:
            return False
        code = coding.none(len(parts))
        round_id = self._take_id()
        slot_ids = []
        for row in range(code.slots):
            entries = code.row(row)
            slot = Slot(self._take_id(), round_id, entries, sum(parts[j][2] for j, _ in entries))
            self.slots[slot.id] = slot
            slot_ids.append(slot.id)
            slot.queued = True
            self._pending.append(slot.id)
        self.rounds[round_id] = Round(round_id, self.version, list(parts), code, slot_ids)
        self._rounds_at[self.version] += 1
        self.stats["rounds_opened"] += 1
        return True

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _next_slot_for(self, worker: WorkerRecord) -> Optional[Slot]:
        skipped: list[int] = []
        found = None
        while self._pending:
            slot_id = self._pending.popleft()
            slot = self.slots.get(slot_id)
            if slot is None or slot.arrived:
                continue  # its round closed while it waited
            if worker.id in slot.holders:
                skipped.append(slot_id)
                continue
            slot.queued = False
            found = slot
            break
        self._pending.extendleft(reversed(skipped))
        return found

    def _fill(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for worker_id in sorted(self._draining):
            if not self.workers[worker_id].assigned:
                self._draining.discard(worker_id)
                actions.append(Drained(worker_id))
        if self.paused:
            return actions
        for worker_id in list(self._hungry):
            worker = self.workers[worker_id]
            while worker.free > 0:
                slot = self._next_slot_for(worker)
                if slot is None:
                    if not self._open_round():
                        break
                    continue
                actions.append(self._assign(worker, slot, now))
            self._update_hunger(worker)
        return actions

    def _assign(self, worker: WorkerRecord, slot: Slot, now: float) -> Assign:
        round_ = self.rounds[slot.round]
        deadline = self._deadline(worker, slot, now)
        worker.assigned[slot.id] = deadline
        slot.holders.add(worker.id)
        send_model = worker.model_version != round_.version
        worker.model_version = round_.version
        return Assign(
            worker=worker.id, slot=slot.id, round=round_.id, version=round_.version,
            parts=[list(round_.parts[j]) for j, _ in slot.row],
            coefficients=[c for _, c in slot.row], deadline_s=deadline - now,
            send_model=send_model)
