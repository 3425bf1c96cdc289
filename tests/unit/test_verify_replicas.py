"""Verified replicas (--verify-replicas) in the pure scheduler: a row of a replicated round
arrives only once two copies from different workers agree; a disagreement waits for a settle."""

from __future__ import annotations

import pytest

from idlegrad.common.coding import parse_redundancy
from idlegrad.common.errors import ConfigError
from idlegrad.coordinator.sampler import Sampler
from idlegrad.coordinator.scheduler import (
    Assign, CancelSlots, CompareCopies, Decoded, Scheduler, SchedulerConfig)
from .scheduling import Dealing

QUIET = dict(min_deadline_s=1000.0, heartbeat_s=1000.0)  # no deadline or silence interferes


def verified(redundancy="replicate:2", n=40, batch=4, **config) -> Dealing:
    return Dealing(Scheduler(SchedulerConfig(batch_size=batch, redundancy=parse_redundancy(redundancy),
                                     verify_replicas=True, open_rounds=1, **{**QUIET, **config}),
                     Sampler(n, None)))


def of(kind, actions):
    return [a for a in actions if isinstance(a, kind)]


def start(s: Scheduler, worker: str, credits: int = 1, now: float = 0.0) -> list[Assign]:
    s.join(worker, {"host": worker}, now)
    return of(Assign, s.ready(worker, credits, now))


def test_a_row_waits_for_two_agreeing_copies_and_its_replica_is_not_cancelled():
    s = verified()
    (a,) = start(s, "a")
    (b,) = start(s, "b")
    assert a.parts == b.parts and a.slot != b.slot  # the two copies of the round's one row
    ok, actions = s.result("a", a.slot, 0.1, 1.0)
    assert ok  # the server keeps the result ...
    assert not of(Decoded, actions) and not of(CompareCopies, actions)  # ... but it is not used
    assert not of(CancelSlots, actions) and b.slot in s.workers["b"].assigned
    ok, actions = s.result("b", b.slot, 0.1, 2.0)
    assert ok and not of(Decoded, actions)
    assert of(CompareCopies, actions) == [CompareCopies(a.round, (a.slot, b.slot), ("a", "b"))]
    actions = s.copies_agreed(a.slot, b.slot, 2.5)
    (decoded,) = of(Decoded, actions)
    assert decoded.weights == {a.slot: 1.0} and decoded.samples == 4
    assert s.stats["replicas_agreed"] == 1 and s.stats["replicas_disagreed"] == 0
    s.applied(s.version + 1, 2.5)  # the round is stepped; the freed credits are dealt
    assert s.copies_agreed(a.slot, b.slot, 3.0) == []  # a stale verdict changes nothing


def test_the_sender_of_a_held_copy_never_computes_its_second_opinion():
    s = verified()
    (a,) = start(s, "a", credits=2)  # never two slots of one redundant round at once
    ok, actions = s.result("a", a.slot, 0.1, 1.0)
    assert ok and not of(Assign, actions)  # the other copy waits for another worker
    (b,) = start(s, "b")
    assert b.parts == a.parts
    ok, actions = s.result("b", b.slot, 0.1, 2.0)
    assert of(CompareCopies, actions)[0].workers == ("a", "b")


def test_a_disagreement_settled_uses_the_copy_that_matches():
    s = verified(partitions=2, batch=8)
    copies = start(s, "a") + start(s, "b") + start(s, "c") + start(s, "d")
    first_row = [x for x in copies if x.parts == copies[0].parts]
    other_row = [x for x in copies if x.parts != copies[0].parts]
    assert len(first_row) == len(other_row) == 2
    x, y = first_row
    s.result(x.worker, x.slot, 0.1, 1.0)
    _, actions = s.result(y.worker, y.slot, 0.1, 1.0)
    (compare,) = of(CompareCopies, actions)
    s.copies_disagreed(x.slot, y.slot, 1.0)
    assert s.stats["replicas_disagreed"] == 1
    actions = s.copies_settled(x.slot, y.slot, [y.slot], 2.0)  # the second copy was right
    assert not of(Decoded, actions)  # the other row has not arrived yet
    p, q = other_row
    s.result(p.worker, p.slot, 0.1, 3.0)
    s.result(q.worker, q.slot, 0.1, 3.0)
    (decoded,) = of(Decoded, s.copies_agreed(p.slot, q.slot, 3.5))
    assert set(decoded.weights) == {y.slot, p.slot}


def sender(s: Scheduler, copy: Assign):
    """Whose result for `copy` the scheduler holds (None: none)."""
    return s.rounds[copy.round].verified.sender(copy.slot)


def disputed(s: Scheduler):
    """Workers a and b each answer a copy of one row, and the copies disagree."""
    (a,) = start(s, "a")
    (b,) = start(s, "b")
    s.result("a", a.slot, 0.1, 1.0)
    s.result("b", b.slot, 0.1, 1.0)
    s.copies_disagreed(a.slot, b.slot, 1.0)
    return a, b


def test_a_disagreement_with_no_copy_right_sends_both_back_to_the_pool():
    s = verified()
    a, b = disputed(s)
    actions = s.copies_settled(a.slot, b.slot, [], 2.0)
    assert not of(Decoded, actions)
    assert s.stats["replicas_refused"] == 2
    # a and b (free again) take them back: neither may hold the other's copy's answer
    again = of(Assign, actions)
    assert sorted(x.slot for x in again) == sorted([a.slot, b.slot])
    for x in again:
        s.result(x.worker, x.slot, 0.1, 3.0)
    compare = of(CompareCopies, s.copies_settled(a.slot, b.slot, [], 3.0)) or None
    assert compare is None  # the old verdict is stale: nothing happens
    assert sender(s, a) and sender(s, b)


def test_a_vanished_holder_of_the_second_copy_is_replaced():
    s = verified()
    (a,) = start(s, "a")
    (b,) = start(s, "b")
    s.result("a", a.slot, 0.1, 1.0)
    s.leave("b", 1.5)
    (c,) = start(s, "c", now=2.0)
    assert c.slot == b.slot  # requeued: the second opinion still comes
    _, actions = s.result("c", c.slot, 0.1, 3.0)
    assert of(CompareCopies, actions)[0].workers == ("a", "c")


def test_a_withdrawn_holder_of_the_second_copy_is_replaced():
    s = verified(pause_grace_s=1.0)
    (a,) = start(s, "a")
    (b,) = start(s, "b")
    s.result("a", a.slot, 0.1, 1.0)
    s.seen("b", 1.0, "paused")
    s.seen("a", 2.5)
    s.seen("b", 2.5)
    actions = s.tick(2.5)
    assert CancelSlots("b", [b.slot]) in actions
    (c,) = start(s, "c", now=3.0)
    assert c.slot == b.slot


def test_a_late_copy_speculated_can_be_the_second_opinion():
    s = verified(speculate=True, spec_min_results=1, min_deadline_s=1000.0)
    (a,) = start(s, "a")
    (b,) = start(s, "b")
    s.result("a", a.slot, 0.1, 0.1)  # a measured: 0.025 s per sample
    _, actions = s.result("a", 0, 0.0, 0.1)  # noise: refused, changes nothing
    s.workers["b"].speed.s_per_sample, s.workers["b"].speed.observed = 0.025, 5
    s.seen("a", 5.0)
    s.seen("b", 5.0)
    s.tick(5.0)  # b is far past its prediction: its copy is speculated ...
    assert s.stats["slots_speculated"] == 1
    (c,) = start(s, "c", now=5.0)  # ... to a free worker (not a, who answered the row)
    assert c.parts == a.parts and c.slot not in (a.slot, b.slot)
    _, actions = s.result("c", c.slot, 0.1, 6.0)
    assert of(CompareCopies, actions)[0].slots == (a.slot, c.slot)
    actions = s.copies_agreed(a.slot, c.slot, 6.0)
    assert CancelSlots("b", [b.slot]) in actions and of(Decoded, actions)


def test_three_copies_the_third_waits_while_the_first_two_are_settled():
    s = verified("replicate:3")
    a, b, c = start(s, "a")[0], start(s, "b")[0], start(s, "c")[0]
    s.result("a", a.slot, 0.1, 1.0)
    s.result("b", b.slot, 0.1, 1.0)
    s.copies_disagreed(a.slot, b.slot, 1.0)
    _, actions = s.result("c", c.slot, 0.1, 1.5)  # held: the pair is being settled
    assert not of(CompareCopies, actions)
    actions = s.copies_settled(a.slot, b.slot, [], 2.0)
    # a requeued copy and the held third are compared once the requeued one comes back
    assert not of(CompareCopies, actions)
    again = of(Assign, actions)
    assert {x.worker for x in again} <= {"a", "b"} and again
    _, actions = s.result(again[0].worker, again[0].slot, 0.1, 3.0)
    assert of(CompareCopies, actions)[0].slots == (c.slot, again[0].slot)


@pytest.mark.parametrize("redundancy, sync", [("none", False), ("cyclic:1", False),
                                              ("adaptive", False), ("replicate:2", True)])
def test_verification_needs_replicas(redundancy, sync):
    with pytest.raises(ConfigError) as info:
        Dealing(Scheduler(SchedulerConfig(batch_size=4, redundancy=parse_redundancy(redundancy),
                                  verify_replicas=True, sync=sync), Sampler(40, None)))
    assert "--verify-replicas" in str(info.value) and "\n" not in str(info.value)


def test_distance_reads_chunks_cut_anywhere():
    import torch

    from idlegrad.common.tensors import distance

    a = torch.randn(1000, dtype=torch.float32)
    b = torch.randn(1000, dtype=torch.float32)
    expected = float(torch.linalg.vector_norm(a.double() - b.double()))
    cut_a = [a[:10], a[10:10], a[10:700], a[700:]]
    cut_b = [b[:333], b[333:]]
    assert distance(cut_a, cut_b, block=64) == pytest.approx(expected, rel=1e-6)
    assert distance([a], [a]) == 0.0
    with pytest.raises(ValueError):
        distance([a], [b[:999]])


def test_verify_replicas_is_refused_in_one_line_where_it_cannot_work():
    from idlegrad.coordinator.config import CoordinatorConfig, check

    check(CoordinatorConfig(job="digits", redundancy="replicate:2", verify_replicas=True))
    for redundancy, sync, dtype, says in [("none", False, "float32", "replicate:R"),
                                          ("replicate:2", True, "float32", "--sync"),
                                          ("replicate:3", False, "bfloat16", "float32")]:
        with pytest.raises(ConfigError) as info:
            check(CoordinatorConfig(job="digits", redundancy=redundancy,
                                    mode="sync" if sync else "auto",
                                    result_dtype=dtype, verify_replicas=True))
        assert says in str(info.value) and "\n" not in str(info.value)


def test_a_copy_kept_from_a_refused_pair_waits_for_the_next_copy():
    s = verified()
    a, b = disputed(s)
    s.leave("b", 1.5)  # banned, say: its copy is refused, a's is neither right nor wrong
    actions = s.copies_settled(a.slot, b.slot, [], 2.0, kept=a.slot)
    assert sender(s, a) == "a" and sender(s, b) is None
    assert not of(Assign, actions)  # a answered the row: it may not take b's copy
    (c,) = start(s, "c", now=3.0)
    assert c.slot == b.slot
    _, actions = s.result("c", c.slot, 0.1, 4.0)
    assert of(CompareCopies, actions)[0].slots == (a.slot, b.slot)
    assert of(Decoded, s.copies_agreed(a.slot, b.slot, 4.0))


def test_a_copy_past_its_deadline_is_handed_out_again_and_its_first_answer_is_held():
    s = verified(min_deadline_s=10.0)
    (a,) = start(s, "a")
    (b,) = start(s, "b")
    for w in "ab":
        s.seen(w, 11.0)
    s.tick(11.0)  # both copies are late: requeued, their holders may still answer
    assert s.stats["deadline_requeues"] == 2
    s.result("a", a.slot, 0.1, 11.5)  # a's answer is held while its slot waits in the queue
    (c,) = start(s, "c", now=12.0)
    assert c.slot == b.slot  # not a's slot, which has its answer, nor a new round
    _, actions = s.result("c", c.slot, 0.1, 13.0)
    assert CancelSlots("b", [b.slot]) in actions  # the slot has its answer: b's copy is not needed
    assert of(CompareCopies, actions)[0].workers == ("a", "c")


def test_copies_that_agree_withdraw_the_tasks_handed_out_with_them():
    """The second copy's arrival yields the comparison and, after it, the fill that hands out
    more slots; the comparison agreeing closes the round (and releases its model) before those
    tasks are sent. They are dropped, not sent for a slot and a model that are gone (this
    crashed the coordinator: "no snapshot of version 0")."""
    import asyncio
    import time

    import torch

    from idlegrad.common import protocol as proto
    from idlegrad.coordinator.server import Coordinator, CoordinatorConfig

    from .fakes import RecordingTransport

    coordinator = Coordinator(CoordinatorConfig(
        job="synthetic", job_args={"params": 2000, "samples": 256}, redundancy="replicate:3",
        verify_replicas=True, open_rounds=1, speculate=False, heartbeat_s=1000))
    coordinator.transport = transport = RecordingTransport()
    core, s = coordinator.core, coordinator.scheduler

    async def go():
        for w in ("e", "a", "b"):
            coordinator.gate.connect(w, w.encode(), None)
            await coordinator.perform(core.join(w, {}, w, time.monotonic()))
            if w == "e":  # paused while the round is dealt: its third copy waits
                s.seen("e", time.monotonic(), "paused")
            await coordinator.perform(core.ready(w, 1, time.monotonic()))
        held = {w: next(iter(s.workers[w].assigned)) for w in ("a", "b")}
        g = torch.randn(coordinator.training.model.model.numel)  # of an honest norm per sample
        g *= core.trust.median() * s.slot_scale("a", held["a"]) / float(g.norm())
        for w in ("a", "b"):
            if w == "b":
                s.seen("e", time.monotonic(), "idle")  # hungry again: the next fill hands it the copy
            await coordinator.perform(core.result(w, held[w], [g.clone()], float(g.norm()), 0.1,
                                                  time.monotonic(), samples=1, loss=1.0))

    asyncio.run(go())
    assert coordinator.version == 1
    tasks_to_e = [m.version for m in transport.to(b"e", proto.Task)]
    assert tasks_to_e == [1], transport.sent  # only the next round's task, at the new version


def test_a_comparison_goes_out_alone_and_the_fill_waits_for_its_verdict():
    """Slots handed out with the comparison could be withdrawn by its verdict (the round closing)
    before the caller sent them: the second copy yields the comparison and nothing else."""
    s = verified("replicate:3")
    a, b = start(s, "a")[0], start(s, "b")[0]
    s.result("a", a.slot, 0.1, 1.0)
    s.join("c", {}, 1.2)
    s.ready("c", 1, 1.2)
    _, actions = s.result("b", b.slot, 0.1, 1.5)
    assert [type(x) for x in actions] == [CompareCopies], actions
