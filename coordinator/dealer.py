"""The dealer: who gets which waiting lease, in what order. Pure; one entry point, `deal(now)`.

Workers pull: the hungry ones (free credits) are served in the order they became hungry, one
lease each per pass, so a round's slots spread over the fleet instead of filling the first
worker's credits. A worker takes the oldest waiting round lease it may take, or opens a new round
when none is waiting. What it may take: never a slot sized to another worker (`--sync`, round_book.py) while that one
is active and has not taken it, never a lease it holds, a copy of a row it holds, or a
second lease of a redundant round (one stopped worker must not hold two slots of one round); with
verified replicas never a copy of a row whose held copy is its own or its kin's (the same key,
invitation or source address: fleet.py); with locality first a lease
whose shards it holds (or a round of its home block). Side leases go first, but to a worker only
while it holds none and its last lease was a round's, so side work interleaves with training
instead of starving it; only when no round work is left does a worker take them back to back.

A worker that has answered no round slot yet is unproven: while any active worker is proven, it
takes no side lease; once one of its slots turned late it holds one slot at most and takes no
second chance (a lease handed out before, or a speculative copy). A name that only asks for
work then delays the first copy of a row by a speculation at a time, not a row's every copy.

Nothing is dealt before the quorum of `min_workers` joined, while the operator has paused
training, or to a draining worker; a draining worker that holds nothing is announced `Drained`.
The events of the scheduler never deal: the round core calls `deal` once at the end of each of its
entry points, after it has acted on what the events led to.
"""

from __future__ import annotations

import math
from typing import Optional

from .fleet import Fleet, WorkerRecord
from .leases import LeaseTable
from .locality import Locality
from .round_book import RoundBook
from .sampler import Sampler
from .side_work import SideWork
from .slots import Action, Assign, Drained, Lease, LeaseState
from .speed import SpeedModel

_LOCAL_SCAN = 64  # locality: waiting leases looked at for one of a worker's own shards


class Dealer:
    def __init__(self, config, fleet: Fleet, leases: LeaseTable, rounds: RoundBook,
                 side: SideWork, speed: SpeedModel, sampler: Sampler,
                 locality: Optional[Locality]):
        self.config = config
        self.fleet = fleet
        self.leases = leases
        self.rounds = rounds
        self.side = side
        self.speed = speed
        self.sampler = sampler
        self.locality = locality
        self.paused = False  # the operator paused training: nothing is dealt
        self._proven: Optional[bool] = None  # `_proven_active`, found out once per deal

    def _proven_active(self) -> bool:
        """Whether an active worker has answered a round slot (asked only about a worker that
        has not: walking the fleet once per deal, and only then)."""
        if self._proven is None:
            self._proven = any(w.active and not w.unproven for w in self.fleet.workers.values())
        return self._proven

    def deal(self, now: float) -> list[Action]:
        self._proven = None
        actions: list[Action] = [Drained(w) for w in self.fleet.drained()]
        if not self.fleet.quorate() or self.paused or not self.fleet.hungry:
            return actions
        if self.leases.side_pending:
            actions += self._deal_side(now, alternate=True)
        actions += self._deal_rounds(now)
        if self.leases.side_pending and self.fleet.hungry:  # no round work: side back to back
            actions += self._deal_side(now, alternate=False)
        return actions

    # round leases -----------------------------------------------------------------------------

    def _deal_rounds(self, now: float) -> list[Action]:
        actions: list[Action] = []
        pending = self.leases.pending
        # Nothing to hand out (the plan is exhausted, the open-round limit reached): every
        # hungry worker would come away empty, so none is asked.
        can_open = self.rounds.can_open()
        if not pending and not can_open:
            return actions
        progress = True
        while progress and self.fleet.hungry:
            progress = False
            for worker_id in self.fleet.hungry_in_order():
                if not pending and not can_open:
                    return actions  # nothing left for the rest of the pass either
                worker = self.fleet.workers[worker_id]
                if worker.free > 0 and not (
                        (self.config.sync and len(worker.assigned) >= self.config.pipeline)
                        or (worker.assigned and worker.unproven and worker.speed.late)):
                    # With locality: a waiting lease of its shards, else a round of its own
                    # block, else whatever is waiting.
                    local = self.locality is not None
                    lease = self._next_for(worker, local)
                    if lease is None and can_open:
                        can_open = self.rounds.open_round(worker)  # one that cannot, stays so
                        if can_open:
                            lease = self._next_for(worker, local)
                    if lease is None and local:
                        lease = self._next_for(worker)
                    if lease is not None:
                        actions.append(self._hand_out(worker, lease, now))
                        worker.side_last = False
                        progress = True
                self.fleet.update_hunger(worker)
        return actions

    def _next_for(self, worker: WorkerRecord, local: bool = False) -> Optional[Lease]:
        """The oldest waiting round lease `worker` may take (see the module's rules). `local`:
        only one whose shards it holds or may take anyway, among the first `_LOCAL_SCAN`."""
        pending = self.leases.pending
        if not pending or self.rounds.sits_out(worker):
            return None
        leases, rounds = self.leases.leases, self.rounds.rounds
        scan = _LOCAL_SCAN if local else math.inf
        rows: set = set()
        mine: set = set()
        if worker.assigned:
            held = [leases[s] for s in worker.assigned if s in leases and not leases[s].side]
            rows = {(s.round, s.row) for s in held}
            mine = {s.round for s in held}
        skipped: list[int] = []
        found = None
        while pending and scan > 0:
            scan -= 1
            lease_id = pending.popleft()
            lease = leases.get(lease_id)
            if lease is None or not lease.needed:
                continue  # its round closed while it waited, or a copy of it arrived
            round_ = rounds[lease.round]
            if round_.verified is not None:
                if round_.verified.sender(lease_id) is not None:
                    lease.state = LeaseState.OUT  # answered by a holder it came back from: held
                    continue
                if (not round_.verified.may_take(worker.id, lease.row, worker.kin)
                        or self._kin_computes(round_, lease, worker)):
                    skipped.append(lease_id)
                    continue
            if worker.assigned and (
                    worker.id in lease.holders or (lease.round, lease.row) in rows
                    or (lease.round in mine and (self.config.sync or round_.code.tolerance > 0))):
                skipped.append(lease_id)
                continue
            if self._reserved_for_another(lease, worker):
                skipped.append(lease_id)
                continue
            if worker.unproven and worker.speed.late and (lease.speculated or lease.started):
                skipped.append(lease_id)  # a second chance: not for one that never answers
                continue
            if local and not self._local_for(worker, lease):
                skipped.append(lease_id)
                continue
            found = lease
            break
        pending.extendleft(reversed(skipped))
        return found

    def _kin_computes(self, round_, lease: Lease, worker: WorkerRecord) -> bool:
        """Whether another copy of `lease`'s verified row is out with `worker`'s kin: the two
        copies would not be two opinions."""
        workers = self.fleet.workers
        for other in round_.copies.get(lease.row, ()):
            held = self.leases.leases.get(other)
            if other != lease.id and held is not None and any(
                    h != worker.id and h in workers and workers[h].kin & worker.kin
                    for h in held.holders):
                return True
        return False

    def _reserved_for_another(self, lease: Lease, worker: WorkerRecord) -> bool:
        """Whether `lease` is a slot sized to another worker that may still take it: that
        worker is active and the slot was never handed out. One that left, paused or is being
        drained, or a slot it gave back, goes to whoever asks."""
        owner_id = lease.reserved
        if owner_id is None or owner_id == worker.id or lease.started:
            return False
        owner = self.fleet.get(owner_id)
        return owner is not None and owner.active

    def _local_for(self, worker: WorkerRecord, lease: Lease) -> bool:
        """Whether the locality pass may give `lease` to `worker`."""
        assert self.locality is not None  # the locality pass runs only with locality
        round_ = self.rounds.rounds[lease.round]
        # A round's age in versions over the rounds open: about the slot times it has waited
        # (each open round steps the version once per slot time, roughly).
        waited = (self.rounds.version - round_.version) / max(1, len(self.rounds.rounds))
        return (self.locality.affine(worker.id, round_.block)
                or self.locality.anybodys(round_.block, waited, lease.speculated))

    def _hand_out(self, worker: WorkerRecord, lease: Lease, now: float) -> Assign:
        deadline = now + self.speed.deadline_s(worker.speed, lease.samples, worker.capacity)
        prefetch: tuple[int, ...] = ()
        if self.locality is not None and not lease.side:
            prefetch = self.locality.hint(worker.id, self.sampler.epoch, self.sampler.open_blocks,
                                          self.sampler.block_left)
        send_model = worker.model_version != lease.work.version
        assign = self.leases.hand_out(worker, lease, now, deadline, send_model, prefetch)
        if not lease.side:
            self.rounds.watch_late(worker, now)
        return assign

    # side leases ------------------------------------------------------------------------------

    def _deal_side(self, now: float, alternate: bool) -> list[Action]:
        """Hand waiting side leases to hungry workers holding none; with `alternate`, only to
        those whose last lease was a round's; to proven workers only while one is active."""
        actions: list[Action] = []
        open_side = self.side.open
        for worker_id in self.fleet.hungry_in_order():
            if not self.leases.side_pending:
                break
            worker = self.fleet.workers[worker_id]
            if (worker.free <= 0 or (alternate and worker.side_last)
                    or any(s in open_side for s in worker.assigned)
                    or (worker.unproven and self._proven_active())):
                continue
            lease = self._next_side_for(worker)
            if lease is None:
                continue
            actions.append(self._hand_out(worker, lease, now))
            worker.side_last = True
            self.fleet.update_hunger(worker)
        return actions

    def _next_side_for(self, worker: WorkerRecord) -> Optional[Lease]:
        """The oldest waiting side lease `worker` may take (not one it is excluded from)."""
        pending = self.leases.side_pending
        skipped: list[int] = []
        found = None
        while pending:
            lease_id = pending.popleft()
            candidate = self.side.open.get(lease_id)
            if candidate is None or candidate.state is not LeaseState.WAITING:
                continue
            if worker.id in candidate.exclude:
                skipped.append(lease_id)
                continue
            found = candidate
            break
        pending.extendleft(reversed(skipped))
        return found
