"""Side work: leases outside any round, the second source of work beside rounds. Pure.

A side lease is one thing to compute at a model version and answer with something other than a
round's gradient: a range of the test set to evaluate ("eval"), or a settlement's recomputation of
a disputed slot by a third worker ("gradient" or "local", which the parties to the dispute may not
take). Side leases share the workers' credits, deadlines, eviction and withdrawal with round
leases (a vanished holder's side lease goes back to its queue); the dealer hands them out between
round slots (dealer.py). Their model version is in use until the last of them is answered or
dropped. They earn no credit and feed no speed reading (a forward pass is not a training step).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Optional

from .fleet import Fleet, WorkerRecord
from .leases import LeaseTable
from .slots import Action, Lease, SlotWork


class SideWork:
    def __init__(self, leases: LeaseTable, fleet: Fleet, stats: Counter,
                 freed: Callable[[WorkerRecord, float], None]):
        """`freed(worker, now)`: what follows when a worker's lease is answered (its hunger, its
        next late check)."""
        self.leases = leases
        self.fleet = fleet
        self.stats = stats
        self._freed = freed
        self.open: dict[int, Lease] = {}  # open side leases
        self._at: Counter[int] = Counter()  # open side leases per model version

    def in_use(self, version: int) -> bool:
        return self._at[version] > 0

    def add(self, version: int, parts: list[list[int]], kind: str = "eval") -> list[int]:
        """A lease per part ([0, offset, count] of the test set, for an evaluation) at
        `version`: their ids."""
        return [self._add(SlotWork(version, [list(part)], [1.0], kind)) for part in parts]

    def add_task(self, work: SlotWork, exclude: frozenset) -> int:
        """A lease computing `work`, for a worker not in `exclude`: its id."""
        return self._add(work, frozenset(exclude))

    def _add(self, work: SlotWork, exclude: frozenset = frozenset()) -> int:
        lease = Lease(self.leases.take_id(), work, exclude=exclude)
        self.open[lease.id] = lease
        self.leases.add(lease)
        self._at[work.version] += 1
        self.stats["side_slots"] += 1
        return lease.id

    def answered(self, worker_id: str, lease_id: int, now: float) -> tuple[bool, list[Action]]:
        """A worker's answer for a side lease: (use it?, actions). The first answer from a holder
        wins and its other holders are cancelled; any other is refused (counted)."""
        worker = self.fleet.get(worker_id)
        lease = self.open.get(lease_id)
        if worker is None or lease is None or lease_id not in worker.assigned:
            self.stats["results_unexpected"] += 1
            return False, []
        del worker.assigned[lease_id]
        worker.last_seen = now
        if lease.work.kind == "eval":
            worker.side_samples += lease.samples
        lease.holders.discard(worker_id)
        self._freed(worker, now)
        self.stats["side_answered"] += 1
        return True, self.close(lease)

    def drop(self, kind: str = "eval") -> list[Action]:
        """Forget every open side lease of `kind` (an evaluation abandoned): their holders are
        cancelled."""
        actions: list[Action] = []
        for lease in [s for s in self.open.values() if s.work.kind == kind]:
            actions += self.close(lease)
        return actions

    def drop_one(self, lease_id: int) -> list[Action]:
        lease = self.open.get(lease_id)
        return [] if lease is None else self.close(lease)

    def close(self, lease: Lease) -> list[Action]:
        actions = self.leases.cancel_holders(lease, self.fleet.workers,
                                             lambda worker, _: self.fleet.update_hunger(worker))
        del self.open[lease.id]
        self.leases.forget(lease.id)
        self._at[lease.work.version] -= 1
        if self._at[lease.work.version] <= 0:
            del self._at[lease.work.version]
        return list(actions)

    def clear(self) -> None:
        for lease_id in self.open:
            self.leases.forget(lease_id)
        self.open.clear()
        self._at.clear()

    def takers(self, lease_id: int) -> int:
        """Workers that could take side lease `lease_id` (neither excluded nor draining),
        counted from the few excluded and draining ones rather than by walking the fleet."""
        lease: Optional[Lease] = self.open.get(lease_id)
        if lease is None:
            return 0
        workers = self.fleet.workers
        excluded = sum(1 for w in lease.exclude if w in workers)
        draining = sum(1 for w in self.fleet.draining if w not in lease.exclude)
        return len(workers) - excluded - draining
