"""Settling doubt about results: suspected outliers and verified replicas that disagree. Pure.

Two things make the coordinator compute a slot itself, exactly as a worker does (the round
core's `Compute`), and judge by that third opinion:

- a **suspect**: a result whose norm is far outside the recent median (trust.py). A match is an
  honest outlier (used, and the median learns from it); a mismatch is an offence of its sender.
- a **disagreement** (`--verify-replicas`): two copies of one row from two workers that differ.
  Each copy that does not match is an offence of its sender; the one that does is used.

Where that computation runs (`--settle-on`): here (`Compute`, the driver computes it in a thread
and calls `computed`), or on a third worker (`settle_on_workers`): a side slot of the scheduler
computing the same slot at the same version, which no party to the dispute may take, nor any
worker of a party's kin (its key, the invitation it was enrolled with, its source address:
fleet.py); its result comes back through the round core as the reference, and is judged exactly
as the coordinator's own computation would be. A reference that blames nobody (a suspect that
matches, copies that do) settles it; one that would refuse a result (an offence, and offences
ban) needs a quorum: a second settler, of no party's kin nor the first settler's, whose result
agrees with the first. Settlers that disagree are settled here. With no worker outside the
dispute to take it, now or later (`check`), the coordinator computes it after all.

Two copies agree only when their senders share no kin: copies of one key, invitation or source
address that agree are no second opinion, and a third decides.

One computation at a time, so hostile workers cannot make the coordinator compute more than one
slot at once: a suspect arriving meanwhile goes back to the pool (no offence), a disagreement
waits in a bounded queue (most disagreements meet a busy settle, since a received batch is
handled before the driver sees a settle finish) and past that both copies are computed again by
workers. A disagreement where a sender has been banned meanwhile is not computed: the banned
copy is refused and the other waits for the next copy to agree with.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from dataclasses import replace
from typing import Any, Optional, Protocol

from .effects import Compute, Effect, Event, Refused
from .slots import CompareCopies, SlotWork, Stored
from .trust import TrustPolicy, matches

log = logging.getLogger("idlegrad.coordinator")


class Court(Protocol):
    """What a settlement may see and do of the round core that owns it: this, and nothing else.
    Each call that changes the scheduler returns the core's interpretation of what follows."""

    store: dict[int, Stored]  # the arrived results of open rounds
    counters: Counter
    trust: TrustPolicy

    def distance(self, a: Any, b: Any) -> float: ...

    def kin(self, worker: str) -> frozenset:
        """Whom `worker` may be one party with (its identity, invitation, source address)."""

    def size(self, a: Any) -> float: ...

    def compute_request(self, slot: int) -> Optional[Compute]: ...

    def put_back(self, worker: str, slot: int, now: float) -> list:
        """The slot goes to someone else, no offence."""

    def agreed(self, first: int, second: int, now: float) -> list: ...

    def disagreed(self, first: int, second: int, now: float) -> list: ...

    def settled(self, first: int, second: int, correct: list[int], now: float,
                kept: Optional[int] = None) -> list: ...

    def third_worker(self, work: SlotWork, parties: frozenset, now: float) -> Optional[int]:
        """A side lease computing `work` for a worker whose identity is not in `parties`; None
        when no such worker is connected."""

    def takers(self, lease: int) -> int: ...

    def withdraw(self, lease: int, now: float) -> list: ...

    def answer_taken(self, worker: str, lease: int, now: float) -> tuple[bool, list]: ...

    def use(self, slot: int, stored: Stored, now: float) -> list: ...

    def refuse(self, worker: str, slot: int, reason: str, detail: str, banned: bool,
               now: float, identity: Optional[str] = None) -> list: ...

    def ban(self, worker: str, now: float, identity: Optional[str] = None) -> list: ...


class Settlement:
    QUEUED = 8  # disagreements waiting for the computation in flight

    def __init__(self, court: Court):
        """`court`: the round core (rounds.py) that owns this settlement, as it sees it."""
        self.core = court
        # what the computation in flight settles: ("suspect", slot, stored, scale, detail) or
        # ("copies", first, second)
        self.busy: Optional[tuple] = None
        self.disputes: deque[CompareCopies] = deque()
        self.on_workers = False  # --settle-on workers: a third worker computes it
        self.side_slot: Optional[int] = None  # the side slot computing it, on workers
        self._excluded: frozenset = frozenset()  # the kin it must not come from
        # a first settler's reference that would blame someone, awaiting a second's: (worker, it)
        self._first: Optional[tuple[str, Any]] = None
        self._honest = 0  # honest outliers since the last summary event
        self._summary_at = -math.inf

    def suspect(self, slot: int, stored: Stored, scale: float, detail: str, now: float) -> list:
        core = self.core
        core.counters["gradients_suspected"] += 1
        if self.busy is not None:
            core.counters["suspects_requeued"] += 1
            return core.put_back(stored.worker, slot, now)
        # No event yet: most suspects late in a run are honest outliers, and the event log
        # would fill with them; a refusal says what was suspected, honest ones are summed up.
        self.busy = ("suspect", slot, stored, scale, detail)
        return self._compute(slot, now)

    def compare(self, action: CompareCopies, now: float) -> list:
        """Two copies of a row: used if they agree; if not, settled by a computation here."""
        core, store = self.core, self.core.store
        first, second = action.slots
        if first not in store or second not in store:  # defensive: never seen
            core.counters["replicas_unsettled"] += 1
            return self._drop(first, second, [], now)
        a, b = store[first], store[second]
        off = core.distance(a.gradient, b.gradient)
        size = max(a.norm, b.norm)
        # One party under two worker ids (one key, invitation or source) would agree with itself:
        # a third opinion decides.
        agree, shared = matches(off, size), _kin(a) & _kin(b)
        if agree and not shared:
            store[first] = replace(a, verified_by=(a.identity, b.identity))
            out = core.agreed(first, second, now)
            store.pop(second, None)  # not used: the first copy is
            return out
        out = core.disagreed(first, second, now)
        detail = (f"copies of slots {first} ({a.worker}) and {second} ({b.worker}) in round "
                  + (f"{action.round} agree, but their senders are of one kin "
                     f"({', '.join(sorted(t.split(':', 1)[0] for t in shared))}: one party)"
                     if agree else
                     f"{action.round} differ by {off / max(size, 1e-12):.3g} of their size"))
        refused = self._refuse_banned(first, second, detail, now)
        if refused is not None:
            return out + refused
        if self.busy is None:
            where = "on a third worker" if self.on_workers else "here"
            out.append(Event("replicas_disagreed", f"{detail}: computing it {where} to "
                                                   "settle it"))
        elif len(self.disputes) < self.QUEUED:
            out.append(Event("replicas_disagreed", f"{detail}: to be computed here"))
            self.disputes.append(action)
            return out
        else:
            out.append(Event("replicas_disagreed", f"{detail}: too many waiting to be computed "
                                                   "here"))
        return out + self._start(action, now)

    def computed(self, reference: Any, error: Optional[str], now: float) -> list:
        """The computation in flight is done: `reference` as the backend compares results, or
        `error` (the job's code failed here, or the slot's model is no longer kept)."""
        busy, self.busy = self.busy, None
        self._first = None
        if busy is None:
            return []
        if busy[0] == "suspect":
            out = self._settle_suspect(busy, reference, error, now)
        else:
            out = self._settle_copies(busy, reference, error, now)
        while self.disputes and self.busy is None:
            out += self._start(self.disputes.popleft(), now)
        return out

    # ------------------------------------------------------------------------------------------

    def _start(self, action: CompareCopies, now: float) -> list:
        core = self.core
        first, second = action.slots
        refused = self._refuse_banned(first, second, f"copies of slots {first} and {second} in "
                                                     f"round {action.round} disagree", now)
        if refused is not None:
            return refused  # (banned while it waited)
        if self.busy is not None:  # too many waiting: both computed again by workers
            core.counters["replicas_unsettled"] += 1
            return [Event("replicas_unsettled", f"copies of slots {first} and {second} in round "
                                                f"{action.round} disagree: both computed again")
                    ] + self._drop(first, second, [], now)
        self.busy = ("copies", first, second)
        return self._compute(first, now)

    def _compute(self, slot: int, now: float) -> list:
        request = self.core.compute_request(slot)
        if request is None:  # (its round closed meanwhile: nothing to settle it against)
            return self.computed(None, "its round has closed", now)
        if self.on_workers:
            return self._compute_elsewhere(request, now)
        return [request]

    def _parties(self) -> frozenset:
        """The kin of those whose results the computation in flight judges."""
        store, busy = self.core.store, self.busy
        assert busy is not None  # asked while a computation is in flight
        if busy[0] == "suspect":
            return _kin(busy[2])
        return frozenset().union(*(_kin(store[s]) for s in busy[1:] if s in store))

    def _compute_elsewhere(self, request, now: float) -> list:
        """Hand the computation to a worker outside the dispute; here if there is none."""
        return self._hand_to_worker(request, self._parties(), now, "settled_here_no_third",
                                    "settlements_on_workers")

    def _hand_to_worker(self, request, parties: frozenset, now: float, none_counter: str,
                        handed_counter: str) -> list:
        """Deal `request` to a worker of none of `parties`' kin; computed here (returned) if
        there is none. The counters say which it was."""
        core = self.core
        self.side_slot = core.third_worker(request.work, parties, now)
        if self.side_slot is None:
            core.counters[none_counter] += 1
            return [request]
        self._excluded = parties
        core.counters[handed_counter] += 1
        return []

    def check(self, now: float) -> list:
        """A settlement waiting for a worker outside the dispute when none is left: computed
        here after all."""
        slot = self.side_slot
        if slot is None or self.core.takers(slot):
            return []
        self.side_slot = None
        self._first = None
        core = self.core
        out = core.withdraw(slot, now)
        core.counters["settled_here_no_third"] += 1
        assert self.busy is not None  # the side slot computes the settlement in flight
        subject = self.busy[1]
        request = core.compute_request(subject)
        if request is None:
            return out + self.computed(None, "its round has closed", now)
        return out + [request]

    def answered(self, worker_id: str, identity: str, slot: int, reference: Any, norm: float,
                 now: float) -> list:
        """A worker's result for a side slot of a settlement: the reference, unless it comes
        from a party to the dispute (a reconnect under another id) or is not finite.

        The answerer's freed credit is dealt only after the settlement: dealt before, it could
        take a speculative copy of the very slot being settled, whose round the settlement then
        closes, and the copy's task would go out with its model already released: the round core
        deals once its entry point is done."""
        core = self.core
        accepted, out = core.answer_taken(worker_id, slot, now)
        if not accepted or slot != self.side_slot:
            core.counters["results_dropped"] += 1
            return out
        return out + self._judged_by(worker_id, identity, reference, norm, now)

    def _judged_by(self, worker_id: str, identity: str, reference: Any, norm: float,
                   now: float) -> list:
        core = self.core
        self.side_slot = None
        kin = core.kin(worker_id) | {identity}
        if kin & self._excluded:
            return self.computed(None, "computed by a party to the dispute", now)
        if not math.isfinite(norm):
            return self.computed(None, "the third worker's result is not finite", now)
        first, self._first = self._first, None
        if first is None and self._blames(reference):
            self._first = (worker_id, reference)  # one settler does not refuse anyone
            return self._second_opinion(kin, now)
        if first is not None:
            off = core.distance(first[1], reference)
            if not matches(off, core.size(reference)):
                core.counters["settlers_disagreed"] += 1
                return [Event("settlers_disagreed", f"{first[0]} and {worker_id} computed the "
                                                    "slot differently: settling it here")
                        ] + self._compute_here(now)
            core.counters["settlement_quorums"] += 1
        core.counters["settled_by_workers"] += 1
        by = f"{first[0]}'s and {worker_id}'s computations" if first else f"{worker_id}'s computation"
        return [Event("settled", f"slot settled by {by}", worker_id)
                ] + self.computed(reference, None, now)

    def _blames(self, reference: Any) -> bool:
        """Whether settling by `reference` would refuse a result of the dispute."""
        core, store, busy = self.core, self.core.store, self.busy
        assert busy is not None  # asked while a computation is in flight
        size = core.size(reference)
        if busy[0] == "suspect":
            return not matches(core.distance(busy[2].gradient, reference), size)
        return any(not matches(core.distance(store[s].gradient, reference), size)
                   for s in busy[1:] if s in store)

    def _second_opinion(self, first_kin: frozenset, now: float) -> list:
        """The first settler's reference would refuse someone: a second settler, of neither
        the parties' kin nor the first's, must agree; here if there is none."""
        core = self.core
        assert self.busy is not None  # a settlement is in flight
        request = core.compute_request(self.busy[1])
        if request is None:
            return self.computed(None, "its round has closed", now)
        out = self._hand_to_worker(request, self._excluded | first_kin, now,
                                   "settled_here_no_quorum", "settlement_second_opinions")
        if out:  # no second settler: computed here, and the first settler's verdict is moot
            self._first = None
        return out

    def _compute_here(self, now: float) -> list:
        assert self.busy is not None  # a settlement is in flight
        request = self.core.compute_request(self.busy[1])
        if request is None:
            return self.computed(None, "its round has closed", now)
        return [request]

    def _settle_suspect(self, busy: tuple, reference: Any, error: Optional[str],
                        now: float) -> list:
        core = self.core
        _, slot, stored, scale, detail = busy
        if error is not None:  # nobody is blamed: the slot goes to someone else
            log.warning("could not compute slot %d to settle it: %s", slot, error)
            return core.put_back(stored.worker, slot, now)
        off = core.distance(stored.gradient, reference)
        size = core.size(reference)
        if matches(off, size):
            core.counters["suspects_honest"] += 1
            core.trust.accept(float(size), scale, verified=True, identity=stored.identity)
            return self._honest_summary(now) + core.use(slot, stored, now)
        core.counters["suspects_wrong"] += 1
        banned = core.trust.confirmed(stored.identity, now)
        return core.refuse(stored.worker, slot, "norm",
                           f"{detail}; computed again, it is {off / max(size, 1e-12):.3g}x off "
                           "the slot's true gradient", banned, now, stored.identity)

    SUMMARY_EVERY_S = 60.0  # honest outliers are summed up in one event at most this often

    def _honest_summary(self, now: float) -> list:
        """One event for the honest outliers since the last: computed again, they matched."""
        self._honest += 1
        if now - self._summary_at < self.SUMMARY_EVERY_S:
            return []
        count, self._honest, self._summary_at = self._honest, 0, now
        factor = self.core.trust.factor()
        return [Event("verified", f"{count} suspected outlier{'s' if count > 1 else ''} computed "
                                  f"again matched: honest, used (the screen now allows "
                                  f"{factor:.3g}x the median norm)")]

    def _settle_copies(self, busy: tuple, reference: Any, error: Optional[str],
                       now: float) -> list:
        core, store = self.core, self.core.store
        _, first, second = busy
        if error is not None:  # nobody is blamed
            log.warning("could not compute slot %d to settle its copies: %s", first, error)
            core.counters["replicas_unsettled"] += 1
            return self._drop(first, second, [], now)
        if first not in store or second not in store:
            return self._drop(first, second, [], now)
        size = core.size(reference)
        correct = [s for s in (first, second)
                   if matches(core.distance(store[s].gradient, reference), size)]
        wrong = [store[s] for s in (first, second) if s not in correct]
        wrong_slots = [s for s in (first, second) if s not in correct]
        out: list[Effect] = [
            Event("verified", f"slot {slot} from {store[slot].worker}: computed here, it "
                              f"matches; {'used' if slot == correct[0] else 'agrees'}",
                  store[slot].worker) for slot in correct]
        if correct:
            store[correct[0]] = replace(store[correct[0]], verified_by=tuple(dict.fromkeys(
                store[s].identity for s in correct)))
        banned = []
        for slot, copy in zip(wrong_slots, wrong):
            core.counters["gradients_rejected"] += 1
            core.counters["rejected_replica"] += 1
            if core.trust.confirmed(copy.identity, now, "replica"):
                banned.append(copy)
            out.append(Event("rejected", f"result for slot {slot} from {copy.worker}: differs "
                                         "from the slot computed here (its copy disagreed)",
                             copy.worker, logging.WARNING))
            out.append(Refused(copy.worker, copy.identity, slot, "replica"))
        out += self._drop(first, second, correct, now)
        for copy in banned:
            out += core.ban(copy.worker, now, copy.identity)
        return out

    def _refuse_banned(self, first: int, second: int, detail: str, now: float) -> Optional[list]:
        """A disagreement where a sender has been banned meanwhile: its copy is refused without
        computing the slot here; the other copy stays held for the next one to agree with."""
        core, store = self.core, self.core.store
        banned = [s for s in (first, second)
                  if s in store and core.trust.is_banned(store[s].identity)]
        if not banned:
            return None
        core.counters["replicas_of_banned"] += len(banned)
        kept = [s for s in (first, second) if s not in banned]
        names = " and ".join(store[s].worker for s in banned)
        out: list[Effect] = [Event("replicas_disagreed", f"{detail}: {names} is banned: its copy "
                                                         "refused, not computed here")]
        for slot in banned:
            copy = store.pop(slot)
            out.append(Refused(copy.worker, copy.identity, slot, "banned"))
        return out + core.settled(first, second, [], now, kept=kept[0] if kept else None)

    def _drop(self, first: int, second: int, correct: list[int], now: float) -> list:
        """Hand a settled disagreement to the scheduler; results not used are let go."""
        core = self.core
        for slot in (first, second):
            if slot not in correct[:1]:
                core.store.pop(slot, None)
        return core.settled(first, second, correct, now)


def _kin(stored: Stored) -> frozenset:
    """Whom a result's sender may be one party with: at least its identity."""
    return stored.kin | {stored.identity}
