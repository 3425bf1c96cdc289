"""`--settle-on workers` as pure logic: a disagreement between two verified copies is computed by a
third worker (never one of the two senders), whose result decides which copy was wrong once a
second settler agrees (or, with none, the coordinator: tests/unit/test_kin.py); the wrong copy's
sender is refused as when the coordinator computes it. With no worker outside the dispute, now or
later, the coordinator computes it after all."""

from __future__ import annotations

import torch

from idlegrad.coordinator.effects import Compute, Refused, Used
from idlegrad.coordinator.rounds import RoundCore
from idlegrad.coordinator.sampler import Sampler
from idlegrad.coordinator.scheduler import Assign, CancelSlots, Scheduler, SchedulerConfig
from idlegrad.coordinator.trust import TrustConfig, TrustPolicy

from .scheduling import VectorBackend, verified_core

RIGHT = [torch.full((4,), 2.0)]  # norm 4: an honest slot of 4 samples at reference norm 1
WRONG = [torch.full((4,), -2.0)]  # the same size, sign-flipped


def core_with(workers: dict[str, int], settle_on_workers: bool = True) -> tuple[RoundCore, list]:
    return verified_core(workers, settle_on_workers)


def assigns(effects, worker=None):
    return [e for e in effects if isinstance(e, Assign) and (worker is None or e.worker == worker)]


def dispute(core: RoundCore, first: Assign, second: Assign, now: float = 1.0) -> list:
    """`first`'s holder answers right, `second`'s wrong: the copies disagree."""
    out = core.result(first.worker, first.slot, RIGHT, 4.0, 0.1, now, samples=4, loss=1.0)
    return out + core.result(second.worker, second.slot, WRONG, 4.0, 0.1, now, samples=4,
                             loss=1.0)


def copies_of_one_row(effects) -> tuple[Assign, Assign]:
    by_round: dict[int, list[Assign]] = {}
    for a in assigns(effects):
        by_round.setdefault(a.round, []).append(a)
    first, second = next(v for v in by_round.values() if len(v) == 2)
    return first, second


def test_a_third_worker_settles_a_disagreement_and_the_wrong_copy_is_refused_once_confirmed():
    core, out = core_with({"a": 1, "b": 1, "c": 2})
    first, second = copies_of_one_row(out)
    assert {first.worker, second.worker} <= {"a", "b", "c"}
    out = dispute(core, first, second)
    assert not [e for e in out if isinstance(e, Compute)]  # nothing computed here
    third = ({"a", "b", "c"} - {first.worker, second.worker}).pop()
    assert core.settlement.side_slot is not None
    # the parties' free credits never take it
    assert not [a for a in assigns(out) if a.round == 0]
    for party in (first.worker, second.worker):
        held = sorted(core.scheduler.workers[party].assigned)[0]
        out = core.result(party, held, RIGHT, 4.0, 0.1, 1.2, samples=4, loss=1.0)
        assert not [a for a in assigns(out) if a.round == 0], out
    # the third's next free credit takes it
    held = sorted(core.scheduler.workers[third].assigned)[0]
    out = core.result(third, held, RIGHT, 4.0, 0.1, 1.5, samples=4, loss=1.0)
    (settle,) = [a for a in assigns(out) if a.round == 0]
    assert settle.worker == third
    assert settle.parts == first.parts and settle.coefficients == first.coefficients
    assert settle.version == first.version
    out = core.result(third, settle.slot, [t.clone() for t in RIGHT], 4.0, 0.1, 2.0, samples=4)
    # it blames the second copy: one settler's word refuses nobody, and with no fourth worker
    # for a second opinion (tests/unit/test_kin.py has one) the coordinator confirms it
    assert not [e for e in out if isinstance(e, Refused)]
    (compute,) = [e for e in out if isinstance(e, Compute)]
    assert compute.slot == first.slot and core.counters["settled_here_no_quorum"] == 1
    out = core.computed([t.clone() for t in RIGHT], None, 2.1)
    refused = [e for e in out if isinstance(e, Refused)]
    assert [(r.worker, r.reason) for r in refused] == [(second.worker, "replica")]
    assert core.trust.offenders[second.worker].reasons["replica"] == 1
    assert core.settlement.busy is None and not core.scheduler.side


def test_with_no_third_worker_the_coordinator_computes_it():
    core, out = core_with({"a": 1, "b": 1})
    first, second = copies_of_one_row(out)
    out = dispute(core, first, second)
    (compute,) = [e for e in out if isinstance(e, Compute)]
    assert compute.slot == first.slot
    assert core.counters["settled_here_no_third"] == 1 and not core.scheduler.side


def test_a_third_worker_that_vanishes_with_no_other_leaves_it_to_the_coordinator():
    core, out = core_with({"a": 1, "b": 1, "c": 2})
    first, second = copies_of_one_row(out)
    third = ({"a", "b", "c"} - {first.worker, second.worker}).pop()
    dispute(core, first, second)
    assert core.settlement.side_slot is not None
    out = core.leave(third, "gone", 1.5) + core.tick(1.6)
    (compute,) = [e for e in out if isinstance(e, Compute)]
    assert compute.slot == first.slot and core.settlement.side_slot is None
    assert not core.scheduler.side


def test_settling_on_the_coordinator_is_unchanged():
    core, out = core_with({"a": 1, "b": 1, "c": 2}, settle_on_workers=False)
    first, second = copies_of_one_row(out)
    out = dispute(core, first, second)
    assert [e for e in out if isinstance(e, Compute)]
    assert not core.scheduler.side


def test_settle_on_auto_follows_where_evaluations_run():
    """--settle-on auto (the default) settles where evaluations run; an explicit choice stands."""
    from idlegrad.coordinator.config import CoordinatorConfig, check
    from idlegrad.coordinator.training import Training

    def settling(eval_on: str, settle_on: str = "auto") -> tuple[str, bool]:
        config = CoordinatorConfig(job="digits", eval_on=eval_on, settle_on=settle_on)
        training = Training(config, check(config))
        return training.settle_on, training.core.settlement.on_workers

    assert CoordinatorConfig(job="digits").settle_on == "auto"
    assert settling("workers") == ("workers", True)
    assert settling("coordinator") == ("coordinator", False)
    assert settling("workers", "coordinator") == ("coordinator", False)
    assert settling("coordinator", "workers") == ("workers", True)


def assigned_then_cancelled(effects) -> list[tuple[str, int]]:
    """Tasks an effect list sends and then cancels: the step between them may release their
    model, so the send would find none."""
    sent, both = set(), []
    for e in effects:
        if isinstance(e, Assign):
            sent.add((e.worker, e.slot))
        elif isinstance(e, CancelSlots):
            both += [(e.worker, s) for s in e.slots if (e.worker, s) in sent]
    return both


def test_a_third_workers_answer_closes_the_suspects_round_before_its_credit_is_dealt():
    """A suspect held for settlement still looks unanswered to the scheduler, so it may turn
    late and be speculated. The third worker's answer settles it (its round closes, the step
    releases the round's model) before the answerer's freed credit is dealt: dealt first, the
    credit took the speculative copy, whose task went out after the step and found no model
    (the coordinator stopped on "no snapshot of version")."""
    scheduler = Scheduler(SchedulerConfig(batch_size=4, heartbeat_s=100.0, speculate=True),
                          Sampler(4000, None))
    core = RoundCore(scheduler, VectorBackend(), TrustPolicy(TrustConfig(), reference=1.0),
                     settle_on_workers=True)
    held: dict[str, Assign] = {}

    def deal(effects):
        held.update({a.worker: a for a in assigns(effects)})
        return effects

    for worker in "ab":
        deal(core.join(worker, {}, worker, 0.0) + core.ready(worker, 1, 0.0))
    now = 0.0
    one, big = [torch.full((4,), 1.0)], [torch.full((4,), 200.0)]
    for _ in range(20):  # the speed model learns both workers' pace
        for worker in "ab":
            now += 0.1
            deal(core.result(worker, held[worker].slot, [t.clone() for t in one], 2.0, 0.2, now,
                             samples=4, loss=1.0))
    suspect = held["a"]
    now += 0.1
    deal(core.result("a", suspect.slot, big, 400.0, 0.2, now, samples=4, loss=1.0))
    side = core.settlement.side_slot
    assert side is not None
    while held["b"].slot != side:  # b finishes its slot and takes the settlement
        now += 0.2
        deal(core.result("b", held["b"].slot, [t.clone() for t in one], 2.0, 0.2, now,
                         samples=4, loss=1.0))
    now += 5.0
    core.tick(now - 0.01)  # a's slot is late now: a copy of its row waits for a free worker
    assert any(s.speculated for s in core.scheduler.slots.values() if s.round == suspect.round)
    out = core.result("b", side, [t.clone() for t in big], 400.0, 0.2, now, samples=4)
    assert any(isinstance(e, Used) and e.slot == suspect.slot for e in out)
    assert assigned_then_cancelled(out) == []
    assert not [a for a in assigns(out) if a.round == suspect.round]
    assert sorted(a.worker for a in assigns(out)) == ["a", "b"]  # both freed, both dealt
