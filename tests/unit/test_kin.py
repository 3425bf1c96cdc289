"""Workers of one kin (one key, one invitation, one source address: gate.py, `kin`) are one party:
a verified row's two copies never both come from it, a settlement is never computed by it, and
under `--settle-on workers` nobody is refused on one settler's word (two independent settlers
must agree, else the coordinator computes it)."""

from __future__ import annotations


from idlegrad.coordinator.effects import Applied, Compute, Event, Refused
from idlegrad.coordinator.rounds import RoundCore
from idlegrad.coordinator.scheduler import Assign
from .scheduling import verified_core
from .test_settle_on_workers import RIGHT, WRONG, assigns

INVITATION = frozenset({"inv:0123456789abcdef"})


def core_with(kin: dict[str, frozenset], credits: int = 1) -> tuple[RoundCore, list]:
    """Workers in the order given, each of `kin` (beside its own identity, its name here)."""
    return verified_core({worker: credits for worker in kin}, kin=kin)


def rows(effects) -> dict[int, list[str]]:
    """Round -> the workers its copies went to (one row per round here)."""
    by_round: dict[int, list[str]] = {}
    for a in assigns(effects):
        if a.round:
            by_round.setdefault(a.round, []).append(a.worker)
    return by_round


def answer(core, worker: str, slot: int, value, now: float) -> list:
    return core.result(worker, slot, [t.clone() for t in value], 4.0, 0.1, now, samples=4,
                       loss=1.0)


def test_the_second_copy_of_a_row_never_goes_to_the_first_copys_kin():
    # a and b came with one invitation (two keys, one volunteer); c and d are others
    core, out = core_with({"a": INVITATION, "b": INVITATION, "c": frozenset(), "d": frozenset()})
    dealt = rows(out)
    assert dealt and all(len(w) == 2 for w in dealt.values())
    for workers in dealt.values():
        assert set(workers) != {"a", "b"}, dealt
    # nor once a copy is held: b may not give the row its second opinion
    now = 1.0
    for round_, workers in sorted(dealt.items()):
        for worker in workers:
            slot = next(a.slot for a in assigns(out) if a.worker == worker and a.round == round_)
            now += 0.1
            more = answer(core, worker, slot, RIGHT, now)
            for r, w in rows(more).items():
                dealt.setdefault(r, []).extend(w)
            out += more
    for workers in dealt.values():
        assert not {"a", "b"} <= set(workers), dealt


def test_a_requeued_copy_never_goes_to_the_held_copys_kin():
    core, out = core_with({"a": INVITATION, "c": frozenset(), "b": INVITATION, "d": frozenset()})
    dealt = rows(out)
    (row_of_a,) = [r for r, w in dealt.items() if "a" in w]
    assert sorted(dealt[row_of_a]) == ["a", "c"]
    slot_of = {(a.worker, a.round): a.slot for a in assigns(out)}
    out = answer(core, "a", slot_of["a", row_of_a], RIGHT, 1.0)  # a's copy is held
    out += core.leave("c", "gone", 1.1)  # the other copy waits for a second opinion
    (row_of_b,) = [r for r, w in dealt.items() if "b" in w]
    out += answer(core, "b", slot_of["b", row_of_b], RIGHT, 1.2)  # b asks for work
    assert "b" not in rows(out).get(row_of_a, []), rows(out)
    assert core.scheduler.workers["b"].assigned  # b was dealt something else


def test_copies_of_one_kin_that_agree_are_no_second_opinion():
    core, out = core_with({"a": frozenset(), "b": frozenset(), "c": frozenset(),
                           "d": frozenset()})
    first, second = [a for a in assigns(out) if a.round == min(rows(out))]
    # whatever the dealer did: the two senders turn out to share a source address
    for worker in (first.worker, second.worker):
        core.scheduler.workers[worker].kin |= {"src:198.51.100.7"}
    out = answer(core, first.worker, first.slot, RIGHT, 1.0)
    out += answer(core, second.worker, second.slot, RIGHT, 1.1)
    assert not [e for e in out if isinstance(e, Applied)]  # not accepted on their word
    assert core.settlement.busy is not None and core.settlement.side_slot is not None
    (event,) = [e for e in out if isinstance(e, Event) and e.kind == "replicas_disagreed"]
    assert "one kin (src" in event.text
    side = core.scheduler.side[core.settlement.side_slot]
    assert {first.worker, second.worker} <= side.exclude


def serve_until_side(core, workers: list[str], now: float) -> tuple[str, int, float]:
    """Answer the round slots `workers` hold (rightly), in turn, until one of them holds the
    settlement's side slot: (that worker, the side slot, the time)."""
    for _ in range(50):
        side = core.settlement.side_slot
        for worker in workers:
            if side in core.scheduler.workers[worker].assigned:
                return worker, side, now
        for worker in workers:
            held = [s for s in core.scheduler.workers[worker].assigned
                    if s not in core.scheduler.side]
            if held:
                now += 0.1
                answer(core, worker, held[0], RIGHT, now)
    raise AssertionError("no settler took the side slot")


def dispute(kin: dict[str, frozenset]) -> tuple[RoundCore, Assign, Assign, list[str]]:
    """The first round's copies disagree (its first holder right, its second wrong): the core,
    the two copies, and the other workers."""
    core, out = core_with(kin)
    first, second = [a for a in assigns(out) if a.round == min(rows(out))]
    answer(core, first.worker, first.slot, RIGHT, 1.0)
    answer(core, second.worker, second.slot, WRONG, 1.1)
    assert core.settlement.side_slot is not None
    return core, first, second, [w for w in kin if w not in (first.worker, second.worker)]


def refused(effects) -> list[tuple[str, str]]:
    return [(e.worker, e.reason) for e in effects if isinstance(e, Refused)]


def test_a_settlement_is_never_computed_by_a_partys_kin():
    # b (the wrong copy) and c came with one invitation; d is independent
    core, first, second, others = dispute({"a": frozenset(), "b": INVITATION, "c": INVITATION,
                                           "d": frozenset()})
    assert (first.worker, second.worker, others) == ("a", "b", ["c", "d"])
    assert "c" in core.scheduler.side[core.settlement.side_slot].exclude
    settler, _, _ = serve_until_side(core, ["c", "d"], 1.2)
    assert settler == "d"


def test_one_settler_refuses_nobody_two_that_agree_do():
    core, first, second, (c, d) = dispute({w: frozenset() for w in "abcd"})
    settler, side, now = serve_until_side(core, [c, d], 1.2)
    out = answer(core, settler, side, RIGHT, now + 0.1)  # blames the wrong copy's sender
    assert refused(out) == []  # one settler's word is not enough
    assert not [e for e in out if isinstance(e, Compute)]
    assert core.trust.offenders.get(second.worker) is None
    other = d if settler == c else c
    second_settler, side, now = serve_until_side(core, [settler, other], now + 0.1)
    assert second_settler == other  # never the first settler again
    out = answer(core, other, side, RIGHT, now + 0.1)
    assert refused(out) == [(second.worker, "replica")]
    assert core.counters["settlement_quorums"] == 1


def test_settlers_that_disagree_leave_it_to_the_coordinator():
    core, first, second, (c, d) = dispute({w: frozenset() for w in "abcd"})
    hostile, side, now = serve_until_side(core, [c, d], 1.2)
    out = answer(core, hostile, side, WRONG, now + 0.1)  # sides with the wrong copy
    assert refused(out) == []  # the honest copy is not refused on its word
    honest = d if hostile == c else c
    _, side, now = serve_until_side(core, [honest], now + 0.1)
    out = answer(core, honest, side, RIGHT, now + 0.1)
    (compute,) = [e for e in out if isinstance(e, Compute)]
    assert compute.slot == first.slot and refused(out) == []
    out = core.computed(RIGHT, None, now + 0.2)  # the coordinator's own computation decides
    assert refused(out) == [(second.worker, "replica")]


def test_with_one_independent_settler_the_coordinator_confirms_a_blame():
    core, first, second, (c,) = dispute({w: frozenset() for w in "abc"})
    _, side, now = serve_until_side(core, [c], 1.2)
    out = answer(core, c, side, RIGHT, now + 0.1)
    (compute,) = [e for e in out if isinstance(e, Compute)]
    assert refused(out) == [] and core.counters["settled_here_no_quorum"] == 1
    assert refused(core.computed(RIGHT, None, now + 0.2)) == [(second.worker, "replica")]
