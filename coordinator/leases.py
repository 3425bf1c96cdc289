"""The lease table: every slot handed out or waiting, round or side, in one lifecycle. Pure.

A lease waits in one of two queues (rounds' slots, side slots), goes out to holders with a
deadline, and ends arrived, dead or forgotten. The table is the one place that hands a lease to a
worker (`hand_out`, which builds the `Assign`), takes it back (`let_go`, `requeue`), cancels its
holders, and knows which deadlines are due: it is what rounds (round_book.py) and side work
(side_work.py) have in common.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, deque
from typing import Callable, Iterator, Optional

from .fleet import WorkerRecord
from .slots import Assign, CancelSlots, Lease, LeaseState


class LeaseTable:
    def __init__(self, stats: Counter, next_id: int = 1):
        self.stats = stats
        self.leases: dict[int, Lease] = {}
        self.pending: deque[int] = deque()  # round leases waiting for a (further) holder
        self.side_pending: deque[int] = deque()  # side leases waiting for a holder
        self._deadline_due: list[tuple[float, int, str, int]] = []  # (deadline, seq, worker, id)
        self._seq = itertools.count()
        self._next_id = next_id
        # the dict's own lookup: `get` is called on every answer, deal and deadline
        self.get: Callable[[int], Optional[Lease]] = self.leases.get

    def take_id(self) -> int:
        """A fresh id, for a lease or a round (they share one sequence, as on the wire)."""
        self._next_id += 1
        return self._next_id - 1

    def next_id(self) -> int:
        return self._next_id

    def add(self, lease: Lease) -> None:
        """A new lease, waiting at the back of its queue."""
        self.leases[lease.id] = lease
        lease.state = LeaseState.WAITING
        (self.side_pending if lease.side else self.pending).append(lease.id)

    def add_first(self, lease: Lease) -> None:
        """A new lease waiting at the front of its queue (a speculative copy: it is late)."""
        self.leases[lease.id] = lease
        lease.state = LeaseState.WAITING
        (self.side_pending if lease.side else self.pending).appendleft(lease.id)

    def forget(self, lease_id: int) -> Optional[Lease]:
        """Drop a lease from the table (its round closed, or a side lease ended); its queue
        entry is skipped when it comes up."""
        return self.leases.pop(lease_id, None)

    def hand_out(self, worker: WorkerRecord, lease: Lease, now: float, deadline: float,
                 send_model: bool, prefetch: tuple = ()) -> Assign:
        """`worker` holds `lease` from `now` until `deadline`: the task that tells it so."""
        worker.assigned[lease.id] = deadline
        heapq.heappush(self._deadline_due, (deadline, next(self._seq), worker.id, lease.id))
        if lease.state is LeaseState.WAITING:
            lease.state = LeaseState.OUT
        lease.holders.add(worker.id)
        lease.started[worker.id] = now
        if send_model:
            lease.with_model.add(worker.id)
        else:
            lease.with_model.discard(worker.id)
        return self._task(worker, lease, deadline - now, send_model, prefetch)

    def reissue(self, worker: WorkerRecord, lease: Lease, deadline_s: float) -> Assign:
        """A lease `worker` holds, told again with its model (after a reconnect)."""
        return self._task(worker, lease, deadline_s, True)

    @staticmethod
    def _task(worker: WorkerRecord, lease: Lease, deadline_s: float, send_model: bool,
              prefetch: tuple = ()) -> Assign:
        """The one place an `Assign` is made: the worker will have the work's model."""
        worker.model_version = lease.work.version
        return Assign(worker=worker.id, slot=lease.id, round=lease.round, work=lease.work,
                      deadline_s=deadline_s, send_model=send_model, prefetch=prefetch)

    def requeue(self, lease: Lease) -> bool:
        """Back in its queue, at the front, for a (further) holder. Whether it was requeued:
        not when it is waiting already, has arrived or died, or was forgotten."""
        if lease.state is not LeaseState.OUT or lease.id not in self.leases:
            return False
        lease.state = LeaseState.WAITING
        if lease.side:
            self.side_pending.appendleft(lease.id)
            self.stats["side_requeued"] += 1
        else:
            self.pending.appendleft(lease.id)
            self.stats["slots_requeued"] += 1
        return True

    def let_go(self, lease_id: int, worker_id: str) -> bool:
        """`worker_id` no longer holds the lease: it is requeued if nobody else holds it. Whether
        that left it without holders (a round lease) or requeued it (a side lease)."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return False
        lease.holders.discard(worker_id)
        if lease.holders:
            return False
        requeued = self.requeue(lease)
        return requeued if lease.side else True

    def cancel_holders(self, lease: Lease, workers: dict[str, WorkerRecord],
                       on_cancel: Callable[[WorkerRecord, Lease], None]) -> list[CancelSlots]:
        """Every holder of `lease` stops computing it (`on_cancel` for each: speed readings,
        hunger); the cancellations to send."""
        actions = []
        for holder in sorted(lease.holders):
            worker = workers.get(holder)
            if worker is None or worker.assigned.pop(lease.id, None) is None:
                continue
            worker.cancelled += 1
            on_cancel(worker, lease)
            actions.append(CancelSlots(holder, [lease.id]))
        lease.holders.clear()
        return actions

    def due_deadlines(self, now: float, workers: dict[str, WorkerRecord]
                      ) -> Iterator[tuple[WorkerRecord, Lease]]:
        """Leases whose holder's deadline passed before `now` (each once: the holder keeps it,
        with no deadline, and may still answer first)."""
        due = self._deadline_due
        while due and due[0][0] < now:
            deadline, _, worker_id, lease_id = heapq.heappop(due)
            worker = workers.get(worker_id)
            if worker is None or worker.assigned.get(lease_id) != deadline:
                continue  # answered, cancelled, withdrawn or requeued already
            worker.missed += 1
            worker.assigned[lease_id] = math.inf
            lease = self.leases.get(lease_id)
            if lease is not None:
                yield worker, lease

    def clear_queues(self) -> None:
        self.pending.clear()
        self.side_pending.clear()
