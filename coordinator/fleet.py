"""The fleet: who is connected, what each may take, who is silent, paused or draining. Pure.

A worker's record holds its credits and the slots it holds (with their deadlines), its state as it
last said it, and its speed (speed.py). The fleet keeps the hungry workers (free credits, in the
order they became hungry: the dealer serves them in that order), the draining ones, whether the
quorum of `min_workers` was ever reached, and the due times of silences and pause graces, so that
a tick looks only at what is due, never at the whole fleet. A worker that has joined but not yet
announced credits is starting up (its job, data and model built, on a machine that may be busy):
it is given `join_grace_s` of silence rather than the usual few heartbeats.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from .speed import WorkerSpeed


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
    settled: bool = False  # it has announced credits: its start-up (job, data, model) is over
    # who it may be one party with: its identity, its key's invitation, its source address
    # (gate.py, `kin`); a verified row's two copies, or a settlement and its parties, never share
    kin: frozenset = frozenset()

    @property
    def free(self) -> int:
        if self.paused_since is not None:
            return 0  # whatever credits it announced, a paused worker takes nothing new
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

    @property
    def unproven(self) -> bool:
        """It has answered no slot yet: its speed and its honesty are still unknown."""
        return self.done == 0

    @property
    def active(self) -> bool:
        """Whether it takes work: credits announced, not paused, not draining."""
        return self.capacity > 0 and self.paused_since is None and not self.draining


class Fleet:
    def __init__(self, silence_s: float, pause_grace_s: float, min_workers: int = 1,
                 join_grace_s: float = 0.0):
        self.silence_s = silence_s  # silent this long: evicted
        # ... or this long before its first credits: a worker starting up on a busy machine
        # (importing torch, building its job and data) may not be heard for a while
        self.join_grace_s = max(silence_s, join_grace_s)
        self.pause_grace_s = pause_grace_s  # paused this long: its slots are withdrawn
        self.min_workers = min_workers
        self.workers: dict[str, WorkerRecord] = {}
        # the dict's own lookup: `get` is called on every message
        self.get: Callable[[str], Optional[WorkerRecord]] = self.workers.get
        self.credits = 0  # the credits of every worker here, together (round_book.py's bound)
        self.hungry: dict[str, None] = {}  # workers with free credits, in arrival order
        self.draining: set[str] = set()  # workers that take no new slots and leave once done
        self._unannounced: set[str] = set()  # draining workers not yet announced as Drained
        self.quorum = min_workers <= 1  # min_workers have joined (at some moment)
        self._seq = itertools.count()
        self._silence_due: list[tuple[float, int, str, int]] = []  # (due, seq, worker, session)
        self._grace_due: list[tuple[float, int, str, int, float]] = []  # ... paused since

    def __len__(self) -> int:
        return len(self.workers)

    def join(self, worker_id: str, info: dict, now: float) -> WorkerRecord:
        worker = WorkerRecord(worker_id, dict(info), joined=now, last_seen=now,
                              session=next(self._seq))
        self.workers[worker_id] = worker
        self._watch_silence(worker)
        return worker

    def set_capacity(self, worker: WorkerRecord, credits: int) -> None:
        self.credits += credits - worker.capacity
        worker.capacity = credits

    def remove(self, worker_id: str) -> WorkerRecord:
        worker = self.workers.pop(worker_id)
        self.credits -= worker.capacity
        self.hungry.pop(worker_id, None)
        self.draining.discard(worker_id)
        self._unannounced.discard(worker_id)
        return worker

    def seen(self, worker: WorkerRecord, now: float, state: Optional[str]) -> None:
        worker.last_seen = now
        if state is None:
            return
        if state == "paused" and worker.paused_since is None:
            worker.paused_since = now
            worker.pauses += 1
            heapq.heappush(self._grace_due, (now + self.pause_grace_s, next(self._seq),
                                             worker.id, worker.session, now))
        elif state != "paused":
            worker.paused_since = None
        worker.state = state
        self.update_hunger(worker)

    def settle(self, worker: WorkerRecord) -> None:
        """`worker` announced credits: its start-up is over, and so is its join grace."""
        if not worker.settled:
            worker.settled = True
            self._watch_silence(worker)

    def update_hunger(self, worker: WorkerRecord) -> None:
        if worker.free > 0 and not worker.draining:
            self.hungry.setdefault(worker.id, None)
        else:
            self.hungry.pop(worker.id, None)

    def drain(self, worker: WorkerRecord) -> None:
        self.hungry.pop(worker.id, None)
        if not worker.draining:
            worker.draining = True
            self.draining.add(worker.id)
            self._unannounced.add(worker.id)

    def drained(self) -> list[str]:
        """Draining workers that hold nothing any more, announced once each."""
        done = sorted(w for w in self._unannounced if not self.workers[w].assigned)
        self._unannounced.difference_update(done)
        return done

    def quorate(self) -> bool:
        """Whether slots may be handed out: `min_workers` joined once (it latches)."""
        if not self.quorum and len(self.workers) >= self.min_workers:
            self.quorum = True
        return self.quorum

    def active(self) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.active]

    def sample_active(self, limit: int) -> list[WorkerRecord]:
        """Every active worker in a small fleet; in a large one at most `limit`, the hungry first
        (they take the next round's slots)."""
        if len(self.workers) <= limit:
            return self.active()
        chosen: dict[str, WorkerRecord] = {}
        for worker in itertools.chain((self.workers[w] for w in self.hungry),
                                      self.workers.values()):
            if len(chosen) >= limit:
                break
            if worker.id not in chosen and worker.active:
                chosen[worker.id] = worker
        return list(chosen.values())

    def hungry_in_order(self) -> Iterator[str]:
        """The hungry workers in order, read a few at a time rather than copied whole.

        While a pass runs only the worker just visited can leave `hungry`, and none joins, so
        the visited ones still there are a prefix of it and the rest follow in order."""
        kept = 0
        while True:
            chunk = list(itertools.islice(self.hungry, kept, kept + 64))
            if not chunk:
                return
            for worker_id in chunk:
                yield worker_id
                if worker_id in self.hungry:
                    kept += 1

    def absent(self, seconds: float) -> None:
        """The caller was not running for `seconds`: that time counts as no worker's silence."""
        for worker in self.workers.values():
            worker.last_seen += seconds

    def due_silent(self, now: float) -> Iterator[WorkerRecord]:
        """Workers silent too long at `now` (the others are watched again)."""
        due = self._silence_due
        while due and due[0][0] <= now:
            _, _, worker_id, session = heapq.heappop(due)
            worker = self.workers.get(worker_id)
            if worker is None or worker.session != session:
                continue
            if now - worker.last_seen > self._silence_for(worker):
                yield worker
            else:
                self._watch_silence(worker, after=now)

    def due_withdrawal(self, now: float) -> Iterator[WorkerRecord]:
        """Paused workers whose grace ran out at `now` and who still hold slots."""
        due = self._grace_due
        while due and due[0][0] <= now:
            _, _, worker_id, session, since = heapq.heappop(due)
            worker = self.workers.get(worker_id)
            if worker is None or worker.session != session or worker.paused_since != since:
                continue
            if now - since < self.pause_grace_s:  # rounding: not yet
                heapq.heappush(due, (math.nextafter(now, math.inf), next(self._seq), worker_id,
                                     session, since))
            elif worker.assigned:
                yield worker

    def _watch_silence(self, worker: WorkerRecord, after: float = -math.inf) -> None:
        """Queue the moment `worker` would have been silent too long, unless heard from again."""
        due = max(worker.last_seen + self._silence_for(worker), math.nextafter(after, math.inf))
        heapq.heappush(self._silence_due, (due, next(self._seq), worker.id, worker.session))

    def _silence_for(self, worker: WorkerRecord) -> float:
        return self.silence_s if worker.settled else self.join_grace_s
