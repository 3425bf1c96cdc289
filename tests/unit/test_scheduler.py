"""The scheduler with a fake clock: who holds what, when rounds decode, what fails over."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from idlegrad.coordinator.sampler import Sampler
from idlegrad.coordinator.scheduler import (
    Assign, CancelSlots, Decoded, Evicted, Scheduler, SchedulerConfig)
from .scheduling import Dealing
from idlegrad.coordinator.slots import SlotWork


def make(n=40, batch=4, epochs=None, **config) -> Dealing:
    return Dealing(Scheduler(SchedulerConfig(batch_size=batch, **config), Sampler(n, epochs)))


def of(kind, actions):
    return [a for a in actions if isinstance(a, kind)]


def assigns(actions, worker=None):
    return [a for a in of(Assign, actions) if worker is None or a.worker == worker]


def held(s: Scheduler, worker: str) -> set[int]:
    return set(s.workers[worker].assigned)


def start(s: Scheduler, worker: str, credits: int, now: float = 0.0) -> list:
    """A worker joins and announces its credits: what both lead to (a join that completes the
    quorum deals the others' credits)."""
    joined = s.join(worker, {"host": worker}, now)
    assert not of(Assign, joined) or not s.workers[worker].capacity
    return joined + s.ready(worker, credits, now)


def answer(s: Scheduler, worker: str, slot: int, compute_s: float, now: float):
    """A result as the server handles it: a round it decodes is stepped (`applied` at the next
    version) before the freed credits are refilled. Returns (used, result's actions + refill)."""
    ok, actions = s.result(worker, slot, compute_s, now)
    if of(Decoded, actions):
        assert not assigns(actions)  # nothing is planned before the step
        actions = actions + s.applied(s.version + 1, now)
    return ok, actions


# join, ready, assign --------------------------------------------------------------------------


def test_join_and_ready_assign_up_to_credits():
    s = make(n=40, batch=4, min_deadline_s=30.0)
    actions = start(s, "a", 3)
    a = assigns(actions)
    assert len(a) == len(actions) == 3
    assert [x.worker for x in a] == ["a"] * 3
    assert len({x.slot for x in a}) == 3
    assert len({x.round for x in a}) == 3  # one partition per round: three rounds
    assert [x.parts for x in a] == [[[0, 0, 4]], [[0, 4, 4]], [[0, 8, 4]]]
    assert all(x.coefficients == [1.0] for x in a)
    assert all(x.version == 0 for x in a)
    assert all(x.deadline_s == 30.0 for x in a)
    assert [x.send_model for x in a] == [True, False, False]  # the model once per version
    assert held(s, "a") == {x.slot for x in a}
    assert s.workers["a"].info == {"host": "a"}
    assert s.stats["rounds_opened"] == 3
    # no credit left: ready again with the same credits assigns nothing
    assert s.ready("a", 3, 1.0) == []
    # more credits: one more
    more = assigns(s.ready("a", 4, 1.0))
    assert len(more) == 1 and more[0].send_model is False


def test_ready_zero_credits_assigns_nothing():
    s = make()
    assert start(s, "a", 0) == []
    assert s.rounds == {}


def test_send_model_again_for_a_new_version():
    s = make(n=40, batch=4)
    first = assigns(start(s, "a", 1))[0]
    assert first.send_model
    ok, actions = s.result("a", first.slot, 0.1, 1.0)
    assert ok and of(Decoded, actions)
    assert not assigns(actions)  # the next round waits for the step
    nxt = assigns(s.applied(1, 1.0), "a")
    assert len(nxt) == 1 and nxt[0].version == 1 and nxt[0].send_model is True
    ok, actions = s.result("a", nxt[0].slot, 0.1, 2.0)
    assert assigns(s.applied(1, 2.0), "a")[0].send_model is False  # not stepped: still version 1
    # a second worker needs the model too
    b = assigns(start(s, "b", 1, 2.0))
    assert b[0].send_model is True


def test_no_slot_before_min_workers_have_joined_and_churn_after_is_free():
    s = make(n=40, batch=4, partitions=2, min_workers=3)
    assert start(s, "a", 2) == [] and start(s, "b", 2) == []  # two of three: nothing yet
    assert not s.quorum and not s.rounds
    actions = start(s, "c", 2)
    assert s.quorum
    # the first rounds spread over all three, one slot per worker per pass
    assert {x.worker for x in assigns(actions)} == {"a", "b", "c"}
    s.leave("b", 1.0)
    s.leave("c", 1.0)
    for slot in sorted(held(s, "a")):  # one worker left of three: it goes on alone
        _, actions = answer(s, "a", slot, 0.1, 2.0)
    assert assigns(actions, "a")


def test_rejoin_drops_the_old_session():
    s = make()
    old = assigns(start(s, "a", 2))
    actions = s.join("a", {}, 1.0)
    assert actions == [Evicted("a", "rejoined", 2)]
    assert held(s, "a") == set()
    again = assigns(s.ready("a", 2, 1.0))
    # the requeued slots come first, and the model is sent again to the new session
    assert sorted(x.slot for x in again) == sorted(x.slot for x in old)
    assert again[0].send_model is True


def test_pending_slots_go_before_new_rounds():
    s = make(n=60, batch=6, partitions=3)
    a = assigns(start(s, "a", 2))
    assert len(a) == 2 and a[0].round == a[1].round
    b = assigns(start(s, "b", 2))
    assert b[0].round == a[0].round  # the round's third slot
    assert b[1].round != a[0].round
    assert [x.parts for x in a + b[:1]] == [[[0, 0, 2]], [[0, 2, 2]], [[0, 4, 2]]]


# results and decoding ---------------------------------------------------------------------------


def test_result_accepted_decodes_a_round_of_one_partition():
    s = make(n=40, batch=4)
    x = assigns(start(s, "a", 1))[0]
    ok, actions = s.result("a", x.slot, 0.4, 1.0)
    assert ok
    decoded = of(Decoded, actions)
    assert decoded == [Decoded(round=x.round, version=0, parts=[(0, 0, 4)], samples=4,
                               weights={x.slot: 1.0}, slots=[x.slot],
                               slot_samples={x.slot: 4}, rows={x.slot: ((0, 1.0),)})]
    assert assigns(actions) == []  # the next round waits for the step
    # the freed credit is refilled once the step is applied, with the next round
    refill = assigns(s.applied(1, 1.0))
    assert len(refill) == 1 and refill[0].parts == [[0, 4, 4]] and refill[0].version == 1
    assert x.round not in s.rounds and x.slot not in s.slots
    assert s.stats["results_used"] == 1 and s.stats["rounds_decoded"] == 1
    w = s.workers["a"]
    assert w.done == 1 and w.samples == 4 and w.s_per_sample == pytest.approx(0.1)


def test_round_of_three_partitions_decodes_after_all_three():
    s = make(n=60, batch=6, partitions=3, open_rounds=1)
    a = assigns(start(s, "a", 3))
    assert len(a) == 3 and len({x.round for x in a}) == 1
    assert [x.parts for x in a] == [[[0, 0, 2]], [[0, 2, 2]], [[0, 4, 2]]]
    ok1, act1 = s.result("a", a[2].slot, 0.1, 1.0)
    ok2, act2 = s.result("a", a[0].slot, 0.1, 1.0)
    assert ok1 and ok2
    assert of(Decoded, act1 + act2) == []
    assert a[0].round in s.rounds
    ok3, act3 = s.result("a", a[1].slot, 0.1, 1.0)
    assert ok3
    (d,) = of(Decoded, act3)
    assert d.round == a[0].round and d.samples == 6
    assert d.weights == {x.slot: 1.0 for x in a}
    assert sorted(d.slots) == sorted(x.slot for x in a)
    assert d.parts == [(0, 0, 2), (0, 2, 2), (0, 4, 2)]
    # open_rounds=1: only now (after the step) the next round opens, and the worker gets
    # three slots of it
    assert assigns(act3) == []
    nxt = assigns(s.applied(1, 1.0))
    assert len(nxt) == 3 and len({x.round for x in nxt}) == 1
    assert nxt[0].parts == [[0, 6, 2]]


def test_duplicate_late_and_unknown_results_are_refused_and_counted():
    s = make()
    x = assigns(start(s, "a", 1))[0]
    assert answer(s, "a", x.slot, 0.1, 1.0)[0] is True
    assert s.result("a", x.slot, 0.1, 1.0) == (False, [])  # a repeat
    assert s.result("ghost", x.slot, 0.1, 1.0) == (False, [])  # a worker nobody knows
    assert s.result("a", 9999, 0.1, 1.0) == (False, [])  # a slot nobody handed out
    assert s.stats["results_unexpected"] == 3
    assert s.stats["results_used"] == 1
    assert s.stats["rounds_decoded"] == 1


def test_result_for_a_slot_held_by_another_is_refused():
    s = make(open_rounds=1)
    x = assigns(start(s, "a", 1))[0]
    start(s, "b", 1)
    assert s.result("b", x.slot, 0.1, 1.0) == (False, [])
    assert x.slot in held(s, "a")
    assert s.stats["results_unexpected"] == 1


# eviction, deadlines, failure -------------------------------------------------------------------


def test_eviction_on_silence_requeues_to_another_worker():
    s = make(heartbeat_s=1.0, liveness=3, open_rounds=1)
    x = assigns(start(s, "a", 1, now=0.0))[0]
    assert start(s, "b", 1, now=0.0) == []  # open_rounds=1 and the only slot is a's
    s.seen("b", 2.5, "idle")
    assert s.tick(3.0) == []  # exactly liveness beats of silence: still alive
    s.seen("b", 3.0)
    actions = s.tick(3.01)
    assert of(Evicted, actions) == [Evicted("a", of(Evicted, actions)[0].reason, 1)]
    assert "silent" in of(Evicted, actions)[0].reason
    (again,) = assigns(actions)
    assert again.worker == "b" and again.slot == x.slot and again.round == x.round
    assert again.send_model is True
    assert "a" not in s.workers
    assert s.stats["workers_removed"] == 1
    # the evicted worker's late answer is refused
    assert s.result("a", x.slot, 0.1, 3.5) == (False, [])
    ok, actions = s.result("b", x.slot, 0.1, 3.5)
    assert ok and of(Decoded, actions)[0].weights == {x.slot: 1.0}


def test_a_worker_starting_up_has_a_join_grace_then_the_usual_liveness():
    """Between its hello and its first credits a worker builds its job, data and model, on a
    machine that may be busy: its silence then is not yet a failure."""
    s = make(heartbeat_s=1.0, liveness=3, join_grace_s=20.0)
    s.join("slow", {}, 0.0)
    s.join("gone", {}, 0.0)
    assert s.tick(10.0) == []  # silent 10 s while starting up: still there
    assert set(s.workers) == {"slow", "gone"}
    s.ready("slow", 1, 12.0)  # started: from now on, three beats of silence evict it
    evicted = of(Evicted, s.tick(15.5))
    assert [e.worker for e in evicted] == ["slow"] and "silent for 3.5s" in evicted[0].reason
    evicted = of(Evicted, s.tick(20.5))  # the one that never started, after its grace
    assert [e.worker for e in evicted] == ["gone"]


def test_heartbeats_keep_a_worker_alive():
    s = make(heartbeat_s=1.0, liveness=3, min_deadline_s=1000.0)
    start(s, "a", 1)
    for t in range(1, 20):
        s.seen("a", float(t), "working")
        assert of(Evicted, s.tick(t + 0.5)) == []
    assert s.workers["a"].state == "working"
    s.seen("ghost", 5.0)  # unknown workers are ignored


def test_deadline_miss_requeues_while_the_holder_keeps_it_original_wins():
    s = make(open_rounds=1, min_deadline_s=10.0, heartbeat_s=100.0)
    x = assigns(start(s, "a", 1))[0]
    assert x.deadline_s == 10.0
    assert start(s, "b", 1) == []
    assert s.tick(9.9) == []
    actions = s.tick(10.5)
    (dup,) = assigns(actions)
    assert dup.worker == "b" and dup.slot == x.slot
    assert x.slot in held(s, "a") and x.slot in held(s, "b")
    assert s.stats["deadline_requeues"] == 1 and s.workers["a"].missed == 1
    assert assigns(s.tick(15.0)) == []  # a's miss is requeued once only
    assert s.stats["deadline_requeues"] == 1 and s.workers["a"].missed == 1
    ok, actions = answer(s, "a", x.slot, 5.0, 16.0)  # the original answers first: it wins
    assert ok
    assert CancelSlots("b", [x.slot]) in actions
    assert of(Decoded, actions)[0].weights == {x.slot: 1.0}
    assert s.workers["b"].cancelled == 1
    assert s.result("b", x.slot, 5.0, 17.0) == (False, [])


def test_deadline_miss_the_replacement_wins():
    s = make(open_rounds=1, min_deadline_s=10.0, heartbeat_s=100.0)
    x = assigns(start(s, "a", 1))[0]
    start(s, "b", 1)
    assigns(s.tick(11.0))
    ok, actions = answer(s, "b", x.slot, 1.0, 12.0)
    assert ok
    assert CancelSlots("a", [x.slot]) in actions
    assert len(of(Decoded, actions)) == 1
    assert held(s, "a") == set() or x.slot not in held(s, "a")
    assert s.result("a", x.slot, 9.0, 13.0) == (False, [])


def test_deadline_grows_with_measured_speed():
    s = make(n=100, batch=10, min_deadline_s=1.0, deadline_factor=4.0, speed_alpha=0.5)
    x = assigns(start(s, "a", 1))[0]
    assert x.deadline_s == 1.0  # nothing measured yet: the minimum
    ok, actions = answer(s, "a", x.slot, 2.0, 5.0)  # 0.2 s per sample
    (y,) = assigns(actions)
    assert y.deadline_s == pytest.approx(4.0 * 0.2 * 10)
    ok, actions = answer(s, "a", y.slot, 4.0, 10.0)  # 0.4 s per sample: EWMA 0.3
    assert s.workers["a"].s_per_sample == pytest.approx(0.3)
    assert assigns(actions)[0].deadline_s == pytest.approx(4.0 * 0.3 * 10)


def test_leave_requeues():
    s = make(open_rounds=2)
    a = assigns(start(s, "a", 2))
    assert start(s, "b", 2) == []
    actions = s.leave("a", 1.0, "said bye")
    assert of(Evicted, actions) == [Evicted("a", "said bye", 2)]
    got = assigns(actions)
    assert {x.worker for x in got} == {"b"}
    assert sorted(x.slot for x in got) == sorted(x.slot for x in a)
    assert s.leave("a", 2.0) == []  # already gone


def test_failed_requeues():
    s = make(open_rounds=1)
    x = assigns(start(s, "a", 1))[0]
    start(s, "b", 1)
    actions = s.failed("a", x.slot, 1.0)
    (again,) = assigns(actions)
    assert again.slot == x.slot and again.worker == "b"
    assert s.workers["a"].failed == 1
    assert s.stats["slots_requeued"] == 1
    assert s.failed("a", x.slot, 1.0) == []  # no longer a's
    assert s.failed("ghost", x.slot, 1.0) == []
    ok, actions = s.result("b", x.slot, 0.1, 2.0)
    assert ok and len(of(Decoded, actions)) == 1


def test_failed_slot_can_return_to_the_only_worker():
    s = make(open_rounds=1)
    x = assigns(start(s, "a", 1))[0]
    (again,) = assigns(s.failed("a", x.slot, 1.0))
    assert again.slot == x.slot and again.worker == "a" and again.send_model is False


def test_a_slot_handed_back_goes_to_another_and_counts_against_no_one():
    s = make(open_rounds=1)
    x = assigns(start(s, "a", 1))[0]
    start(s, "b", 1)
    assert s.ready("a", 0, 1.0) == []  # a capped worker first asks for nothing
    (again,) = assigns(s.handback("a", [x.slot, 999], 1.0))
    assert again.slot == x.slot and again.worker == "b"
    assert s.workers["a"].failed == 0 and s.stats["slots_handed_back"] == 1
    assert held(s, "a") == set()
    assert s.handback("a", [x.slot], 1.0) == [] and s.handback("ghost", [x.slot], 1.0) == []


# limits, end, queries --------------------------------------------------------------------------


def test_open_rounds_limit():
    s = make(n=100, batch=4, open_rounds=2)
    a = assigns(start(s, "a", 5))
    assert len(a) == 2 and len(s.rounds) == 2
    assert assigns(start(s, "b", 5)) == []
    ok, actions = s.result("a", a[0].slot, 0.1, 1.0)
    assert of(Decoded, actions) and assigns(actions) == [] and len(s.rounds) == 1
    new = assigns(s.applied(1, 1.0))
    assert len(new) == 1 and len(s.rounds) == 2
    unlimited = make(n=100, batch=4, open_rounds=0)
    assert len(assigns(start(unlimited, "a", 5))) == 5


def test_finished_after_epochs_and_all_rounds_decoded():
    s = make(n=8, batch=4, epochs=1)
    a = assigns(start(s, "a", 4))
    assert len(a) == 2  # only two rounds in the whole plan
    assert s.sampler.exhausted and not s.finished
    s.result("a", a[0].slot, 0.1, 1.0)
    assert assigns(s.applied(1, 1.0)) == []  # nothing left to plan
    assert not s.finished
    ok, actions = s.result("a", a[1].slot, 0.1, 1.0)
    assert ok and assigns(actions) == []
    assert assigns(s.applied(2, 1.0)) == []
    assert s.finished


def test_version_in_use():
    s = make(n=40, batch=4)
    a = assigns(start(s, "a", 2))
    assert s.version_in_use(0) and not s.version_in_use(1)
    ok, actions = s.result("a", a[0].slot, 0.1, 1.0)
    actions += s.applied(1, 1.0)
    assert s.version_in_use(0)  # a[1]'s round is still open at version 0
    assert s.version_in_use(1)  # the refill opened a round at version 1
    s.result("a", a[1].slot, 0.1, 1.0)
    assert not s.version_in_use(0)
    assert 0 not in s.book.rounds_at  # no empty counters left behind


def test_replan_puts_parts_back():
    s = make(n=8, batch=4, epochs=1)
    a = assigns(start(s, "a", 1))[0]
    ok, actions = s.result("a", a.slot, 0.1, 1.0)
    (decoded,) = of(Decoded, actions)
    assert assigns(actions) == []
    # as the server does with a round too stale to apply: replan it, then `applied` at the
    # unchanged version; its parts come out again, as a new round, before new data
    s.replan(decoded)
    assert s.stats["rounds_replanned"] == 1
    assert not s.finished
    (again,) = assigns(s.applied(0, 1.0))
    assert again.parts == [[0, 0, 4]] and again.round != a.round and again.version == 0
    ok, actions = s.result("a", again.slot, 0.1, 2.0)
    assert of(Decoded, actions)[0].parts == [(0, 0, 4)]
    assert not s.finished
    (b,) = assigns(s.applied(1, 2.0))
    assert b.parts == [[0, 4, 4]] and b.version == 1
    ok, actions = s.result("a", b.slot, 0.1, 3.0)
    assert of(Decoded, actions)[0].parts == [(0, 4, 4)]
    assert assigns(s.applied(2, 3.0)) == []
    assert s.finished


def test_open_parts_and_next_id():
    s = Dealing(Scheduler(SchedulerConfig(batch_size=4), Sampler(40), next_id=100))
    assert s.next_id() == 100
    a = assigns(start(s, "a", 2))
    assert all(x.slot >= 100 and x.round >= 100 for x in a)
    assert s.open_parts() == [[(0, 0, 4)], [(0, 4, 4)]]
    assert s.next_id() > max(max(x.slot, x.round) for x in a)


def test_stop_cancels_everything():
    s = make(n=100, batch=4)
    a = assigns(start(s, "a", 2))
    b = assigns(start(s, "b", 1))
    actions = s.stop()
    assert sorted(actions, key=lambda c: c.worker) == [
        CancelSlots("a", sorted(x.slot for x in a)), CancelSlots("b", [b[0].slot])]
    assert held(s, "a") == held(s, "b") == set()
    assert not s.accepting
    assert s.ready("a", 2, 1.0) == []  # no new rounds
    assert s.result("a", a[0].slot, 0.1, 1.0) == (False, [])
    assert s.stop() == []


# property: every sample exactly once ---------------------------------------------------------

WORKERS = ["a", "b", "c"]

OPS = (["result"] * 8 + ["seen"] * 3 + ["tick"] * 3
       + ["stray", "fail", "leave", "rejoin", "ready", "replan", "long_tick"])
ops = st.lists(st.tuples(st.sampled_from(OPS), st.sampled_from(WORKERS + ["all"]),
                         st.integers(0, 20)), min_size=10, max_size=80)


class Harness:
    """Drives a scheduler and mirrors, from the actions alone, what every worker holds.

    Like the server, it steps the model on every `Decoded` (`applied` at the next version) and
    performs the refill that `applied` returns."""

    def __init__(self, s: Scheduler):
        self.s = s
        self.now = 0.0
        self.version = s.version  # the model's version: one step per decoded round
        self.round_version: dict[int, int] = {}  # round -> the version it was planned at
        self.held: dict[str, set[int]] = {}
        self.assigned_ever: dict[int, tuple] = {}  # slot -> (round, parts) of its first Assign
        self.decoded: dict[int, Decoded] = {}
        self.replanned: list[int] = []
        self.accepted: Counter[int] = Counter()
        self.answered_by: dict[int, str] = {}

    def perform(self, actions):
        for a in actions:
            if isinstance(a, Assign):
                assert a.worker in self.s.workers
                assert a.slot not in self.held[a.worker]
                assert a.round not in self.decoded
                self.held[a.worker].add(a.slot)
                first = self.assigned_ever.setdefault(a.slot, (a.round, a.parts, a.coefficients))
                assert first == (a.round, a.parts, a.coefficients)  # a slot never changes
                # a new round is planned at the model's current version, never a stale one
                assert self.round_version.setdefault(a.round, self.version) == a.version
            elif isinstance(a, CancelSlots):
                assert set(a.slots) <= self.held[a.worker]
                self.held[a.worker] -= set(a.slots)
            elif isinstance(a, Evicted):
                self.held[a.worker] = set()
            elif isinstance(a, Decoded):
                assert a.round not in self.decoded  # exactly once
                self.decoded[a.round] = a
                assert set(a.weights) <= set(a.slots)
                assert a.version == self.round_version[a.round]
                self.check_decoded(a)
                # the server steps (or replans) the round, then the scheduler refills
                self.version += 1
                self.perform(self.s.applied(self.version, self.now))
        self.check()

    def check_decoded(self, a: Decoded):
        assert set(a.weights) == set(a.slots)  # code none: every slot, weight 1
        assert all(w == 1.0 for w in a.weights.values())
        for slot in a.slots:
            assert self.accepted[slot] == 1
            assert self.assigned_ever[slot][0] == a.round
        assert sorted(p for slot in a.slots for p in self.assigned_ever[slot][1]) == \
            sorted(list(p) for p in a.parts)

    def check(self):
        for w, slots in self.held.items():
            if w in self.s.workers:
                assert set(self.s.workers[w].assigned) == slots
            else:
                assert slots == set()

    def join(self, w, credits):
        self.perform(self.s.join(w, {}, self.now))
        self.held[w] = set()
        self.perform(self.s.ready(w, credits, self.now))

    def result(self, w, slot):
        self.held[w].discard(slot)
        ok, actions = self.s.result(w, slot, 0.01, self.now)
        if ok:
            self.accepted[slot] += 1
            assert self.accepted[slot] == 1  # the first answer only
        if of(Decoded, actions):
            assert not of(Assign, actions)  # nothing is planned before the step is applied
        self.perform(actions)
        return ok

    def step(self, op, w, k):
        s = self.s
        if w == "all" and op != "seen":
            w = WORKERS[k % len(WORKERS)]
        if op == "result" and w in s.workers and self.held[w]:
            self.result(w, sorted(self.held[w])[k % len(self.held[w])])
        elif op == "stray" and self.assigned_ever:
            slot = sorted(self.assigned_ever)[k % len(self.assigned_ever)]
            if w not in s.workers or slot not in self.held[w]:
                ok, actions = s.result(w, slot, 0.01, self.now)
                # refused, and nothing follows but the deal at the end of any event (a round
                # replanned since the last one may have left work to deal)
                assert not ok and all(isinstance(a, Assign) for a in actions)
                self.perform(actions)
        elif op == "fail" and w in s.workers and self.held[w]:
            slot = sorted(self.held[w])[k % len(self.held[w])]
            self.held[w].discard(slot)
            self.perform(s.failed(w, slot, self.now))
        elif op == "leave":
            self.perform(s.leave(w, self.now))
        elif op == "rejoin":
            self.join(w, k % 4)
        elif op == "ready" and w in s.workers:
            self.perform(s.ready(w, k % 4, self.now))
        elif op == "seen":
            for who in (WORKERS if w == "all" else [w]):
                s.seen(who, self.now)
        elif op in ("tick", "long_tick"):
            self.now += k / 10 if op == "tick" else k
            self.perform(s.tick(self.now))
        elif op == "replan" and self.decoded:
            live = [r for r in sorted(self.decoded) if r not in self.replanned]
            if live:
                r = live[k % len(live)]
                self.replanned.append(r)
                s.replan(self.decoded[r])

    def finish(self):
        """Every slot gets answered: workers come back and answer until training ends."""
        for _ in range(5000):
            if self.s.finished:
                return
            for w in WORKERS:
                if w not in self.s.workers:
                    self.join(w, 2)
                elif self.s.workers[w].capacity < 1:
                    self.perform(self.s.ready(w, 2, self.now))
                self.s.seen(w, self.now)
            busy = [(w, slot) for w in WORKERS for slot in sorted(self.held[w])]
            if not busy:
                # a replanned round waits for the next event; the server ticks every half beat
                self.perform(self.s.tick(self.now))
                busy = [(w, slot) for w in WORKERS for slot in sorted(self.held[w])]
            assert busy, "open rounds but nothing assigned: the scheduler is stuck"
            self.result(*busy[0])
        raise AssertionError("training did not finish")

    def play(self, credits: list[int], script, max_open_rounds: int):
        """The workers join with these credits, the script runs, then training is driven to its
        end; at no point are more than `max_open_rounds` rounds open (0: no limit)."""
        for w, c in zip(WORKERS, credits):
            self.join(w, c)
        for op, w, k in script:
            self.step(op, w, k)
            if max_open_rounds:
                assert len(self.s.rounds) <= max_open_rounds
        self.finish()

    def applied_once_each(self, n: int) -> list[Decoded]:
        """Asserts that training ended with every one of the n samples applied exactly once and
        the tallies matching what happened; returns the rounds applied (decoded, not replanned)."""
        s = self.s
        assert s.finished and s.rounds == {}
        applied = [d for r, d in self.decoded.items() if r not in self.replanned]
        offsets = sorted(o for d in applied for (e, off, c) in d.parts for o in range(off, off + c))
        assert offsets == list(range(n))
        assert sum(d.samples for d in applied) == n
        assert s.stats["rounds_decoded"] == len(self.decoded)
        assert s.stats["results_used"] == sum(self.accepted.values())
        return applied


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 23), batch=st.integers(1, 7), partitions=st.integers(1, 3),
       open_rounds=st.integers(0, 3), credits=st.lists(st.integers(0, 3), min_size=3, max_size=3),
       script=ops)
def test_every_round_decoded_once_and_every_sample_once(n, batch, partitions, open_rounds,
                                                       credits, script):
    s = Dealing(Scheduler(SchedulerConfig(batch_size=batch, partitions=partitions, open_rounds=open_rounds,
                                  heartbeat_s=1.0, liveness=3, min_deadline_s=2.5),
                  Sampler(n, epochs=1)))
    h = Harness(s)
    h.play(credits, script, max_open_rounds=open_rounds)
    applied = h.applied_once_each(n)
    assert all(e == 0 for d in applied for (e, _, _) in d.parts)


# a worker paused by its owner (issue 4) ----------------------------------------------------------


def test_paused_worker_gets_nothing_new_and_keeps_its_slots_for_the_grace():
    s = make(open_rounds=2, pause_grace_s=5.0, min_deadline_s=1000.0, heartbeat_s=100.0)
    held_a = {x.slot for x in assigns(start(s, "a", 2, now=0.0))}
    assert len(held_a) == 2
    s.seen("a", 1.0, "paused")
    assert s.workers["a"].paused_since == 1.0 and s.workers["a"].pauses == 1
    assert s.ready("a", 0, 1.0) == []
    assert start(s, "b", 1, now=1.0) == []  # open_rounds=2: both rounds are a's
    s.seen("a", 3.0, "paused")  # a repeated paused beat does not restart the grace
    assert s.workers["a"].paused_since == 1.0
    assert s.tick(5.9) == []  # within the grace: a short pause finishes its slots
    assert held(s, "a") == held_a
    actions = s.tick(6.0)
    assert CancelSlots("a", sorted(held_a)) in actions
    (moved,) = assigns(actions)  # b has one credit
    assert moved.worker == "b" and moved.slot in held_a
    assert held(s, "a") == set() and s.stats["pause_withdrawn"] == 2
    assert s.workers["a"].cancelled == 2
    assert s.result("a", moved.slot, 1.0, 6.5) == (False, [])  # its late answer is refused
    ok, actions = s.result("b", moved.slot, 1.0, 7.0)
    assert ok and of(Decoded, actions) and assigns(actions) == []
    (second,) = assigns(s.applied(1, 7.0))  # the other withdrawn slot goes to b next
    assert second.worker == "b" and {moved.slot, second.slot} == held_a


def test_paused_worker_is_not_refilled_even_with_credits_and_resumes_with_ready():
    s = make(pause_grace_s=0.0, min_deadline_s=1000.0, heartbeat_s=100.0)
    assigns(start(s, "a", 1))
    s.seen("a", 1.0, "paused")  # an old worker that only says paused, not READY 0
    actions = s.tick(1.0)
    assert of(CancelSlots, actions) and not assigns(actions)
    assert s.ready("a", 1, 1.5) == []  # still paused: nothing
    s.seen("a", 2.0, "idle")
    assert s.workers["a"].paused_since is None
    (x,) = assigns(s.ready("a", 1, 2.0))
    assert x.worker == "a" and not x.send_model  # its withdrawn slot, at the version it holds
    s.applied(1, 2.0)
    (y,) = assigns(s.ready("a", 2, 2.5))
    assert y.version == 1 and y.send_model  # a newer version: the model goes along (re-sync)


def test_a_short_pause_keeps_the_slots_and_the_answer_counts():
    s = make(pause_grace_s=5.0, min_deadline_s=1000.0, heartbeat_s=100.0)
    (x,) = assigns(start(s, "a", 1))
    s.seen("a", 1.0, "paused")
    s.tick(3.0)
    s.seen("a", 4.0, "working")
    assert s.tick(10.0) == [] and held(s, "a") == {x.slot}
    ok, _ = s.result("a", x.slot, 1.0, 10.5)
    assert ok and s.stats["pause_withdrawn"] == 0


def test_paused_worker_still_evicted_when_silent():
    s = make(pause_grace_s=100.0, heartbeat_s=1.0, liveness=3)
    assigns(start(s, "a", 1))
    s.seen("a", 0.5, "paused")
    assert of(Evicted, s.tick(4.0))


# redundancy: replication, cyclic codes, speculation, sync, adaptive (issue 3) --------------------

from idlegrad.common.coding import parse_redundancy  # noqa: E402
from idlegrad.coordinator import adaptive  # noqa: E402


def coded(redundancy: str, **config) -> Dealing:
    return make(redundancy=parse_redundancy(redundancy), **config)


def test_replicate_round_has_two_copies_and_decodes_without_a_stopped_worker():
    s = coded("replicate:2", n=60, batch=6, partitions=3, open_rounds=1, min_deadline_s=1000.0,
              heartbeat_s=1000.0)
    first = [assigns(start(s, w, 1))[0] for w in "abc"]
    (round_,) = s.rounds.values()
    assert round_.code.name == "replicate:2" and len(round_.slots) == 6
    # the first copies go out first: the three workers cover the whole batch
    assert sorted(tuple(map(tuple, x.parts)) for x in first) == [((0, 0, 2),), ((0, 2, 2),),
                                                                 ((0, 4, 2),)]
    d = assigns(start(s, "d", 1))[0]  # a fourth worker takes the oldest second copy
    stopped = first[0]
    assert d.parts == stopped.parts and d.slot != stopped.slot
    ok, actions = s.result("b", first[1].slot, 0.1, 1.0)
    assert ok and not of(Decoded, actions)
    # b is refilled with a second copy, never with a copy of the row it just answered
    (b2,) = assigns(actions, "b")
    assert b2.parts == first[2].parts
    ok, actions = s.result("d", d.slot, 0.1, 1.5)
    assert ok and not of(Decoded, actions)
    assert CancelSlots("a", [stopped.slot]) in actions  # its copy arrived: a's is not needed
    assert s.stats["slots_redundant"] == 2  # the spare copy of b's row, and a's
    ok, actions = answer(s, "c", first[2].slot, 0.1, 2.0)
    (dec,) = of(Decoded, actions)
    assert set(dec.weights) == {first[1].slot, d.slot, first[2].slot}
    assert CancelSlots("b", [b2.slot]) in actions  # the leftover copy
    assert dec.samples == 6
    assert s.result("a", stopped.slot, 0.1, 3.0) == (False, [])


def test_cyclic_round_decodes_without_a_stopped_worker_and_cancels_the_copies():
    # cyclic:1 over 4 partitions: two runs of 2 partitions, each computed by 2 slots; any one
    # slot may be missing, and a decoded round is one copy of each run, weight 1
    s = coded("cyclic:1", n=60, batch=8, partitions=4, open_rounds=1, min_deadline_s=1000.0,
              heartbeat_s=1000.0)
    slots = [assigns(start(s, w, 2))[0] for w in "abcd"]  # spread: one slot of the round each
    assert len({x.round for x in slots}) == 1 and len(s.rounds) == 1
    (round_,) = s.rounds.values()
    assert round_.code.name == "cyclic:1" and len(round_.slots) == 4
    assert all(len(x.parts) == 2 for x in slots)  # each covers s+1 = 2 partitions
    # the first copies go out first: a and b cover the whole batch, c and d hold the copies
    assert slots[0].parts == slots[2].parts and slots[1].parts == slots[3].parts
    assert slots[0].parts != slots[1].parts
    assert all(held(s, w) == {x.slot} for w, x in zip("abcd", slots))
    ok, actions = s.result("b", slots[1].slot, 0.4, 1.0)
    assert ok and not of(Decoded, actions)
    assert CancelSlots("d", [slots[3].slot]) in actions  # its copy arrived
    ok, actions = s.result("c", slots[2].slot, 0.4, 1.0)  # a is stopped: c's copy stands in
    (dec,) = of(Decoded, actions)
    assert dec.weights == {slots[1].slot: 1.0, slots[2].slot: 1.0} and dec.samples == 8
    assert CancelSlots("a", [slots[0].slot]) in actions
    assert assigns(actions) == [] and s.stats["rounds_cyclic"] == 1
    assert assigns(s.applied(1, 1.0))
    assert s.stats["rounds_cyclic"] == 2  # and the next round, opened after the step


def test_sync_one_round_one_partition_per_ready_worker_one_slot_each():
    s = make(n=60, batch=6, partitions=1, sync=True, redundancy=parse_redundancy("cyclic:1"))
    for w in "abc":
        s.join(w, {}, 0.0)
    for w in "abc":
        s.workers[w].capacity = 2  # all three ready before the first round opens
    actions = s.ready("a", 2, 0.0)
    got = assigns(actions) + assigns(s.ready("b", 2, 0.0)) + assigns(s.ready("c", 2, 0.0))
    assert len(s.rounds) == 1
    (round_,) = s.rounds.values()
    # nothing measured to size parts by: more parts than workers (4 each, at most the batch)
    assert round_.code.name == "none" and len(round_.parts) == 6
    assert sorted(x.worker for x in got) == ["a", "b", "c"]  # one slot each, credits or not
    ok, actions = s.result("a", got[0].slot, 0.1, 1.0)
    (more,) = assigns(actions)  # a, done first, takes another part of the same round
    assert more.worker == "a" and more.round == got[0].round and len(s.rounds) == 1


def test_the_next_round_is_planned_at_the_stepped_version_sync_and_async():
    """Regression: the refill after a decoded round used to be planned inside `result`, before
    the server stepped the model, so every round (even --sync) ran one version stale. Now
    `result` plans nothing when its round decodes; `applied(v + 1)` plans at version v + 1."""
    # sync: every round at the version of the latest step (staleness 0)
    s = make(n=600, batch=6, sync=True)
    for w in "ab":
        s.join(w, {}, 0.0)
        s.workers[w].capacity = 1
    got = assigns(s.ready("a", 1, 0.0)) + assigns(s.ready("b", 1, 0.0))
    now = 0.0
    # the first round, cut before anything is measured, has more parts than workers: each
    # worker answers the next until it decodes
    while not s.stats["rounds_decoded"]:
        now += 0.1
        task = got.pop(0)
        _, actions = s.result(task.worker, task.slot, 0.1, now)
        assert not assigns(actions) or s.version == 0 and len(s.rounds) == 1
        got += assigns(actions)
    got = assigns(s.applied(1, now))
    for v in range(1, 5):
        assert sorted(x.worker for x in got) == ["a", "b"] and len(s.rounds) == 1
        assert all(x.version == v for x in got) and len({x.round for x in got}) == 1
        assert all(x.send_model for x in got)  # a new version each round: the model goes along
        now += 1.0
        ok, actions = s.result("a", got[0].slot, 0.1, now)
        assert ok and not of(Decoded, actions) and assigns(actions) == []
        ok, actions = s.result("b", got[1].slot, 0.1, now)
        (dec,) = of(Decoded, actions)
        assert ok and dec.version == v and dec.round == got[0].round
        assert assigns(actions) == [] and s.rounds == {}  # nothing planned before the step
        got = assigns(s.applied(v + 1, now))
        assert all(x.version == v + 1 and x.send_model for x in got)
        assert s.version_in_use(v + 1) and not s.version_in_use(v)
    assert s.workers["a"].staleness == s.workers["b"].staleness == 0

    # async, code none (the default): a decoded round's credit is refilled at v + 1
    s = make(n=400, batch=4)
    a = assigns(start(s, "a", 2))
    assert [x.version for x in a] == [0, 0]
    ok, actions = s.result("a", a[0].slot, 0.1, 1.0)
    assert ok and of(Decoded, actions)[0].version == 0 and assigns(actions) == []
    (x,) = assigns(s.applied(1, 1.0))
    assert x.version == 1 and x.send_model
    ok, actions = s.result("a", a[1].slot, 0.1, 2.0)  # planned at 0, answered at 1
    assert ok and of(Decoded, actions)[0].version == 0 and assigns(actions) == []
    (y,) = assigns(s.applied(2, 2.0))
    assert y.version == 2 and y.send_model
    assert s.workers["a"].staleness == 1  # only the round planned before the first step
    ok, actions = s.result("a", x.slot, 0.1, 3.0)  # planned at 1, answered at 2
    assert ok and of(Decoded, actions)[0].version == 1 and assigns(actions) == []
    (z,) = assigns(s.applied(3, 3.0))
    assert z.version == 3 and s.workers["a"].staleness == 2


def late_setup(**config):
    config = {"open_rounds": 2, "min_deadline_s": 1000.0, **config}
    s = coded("none", n=400, batch=4, heartbeat_s=1000.0, speculate=True, spec_floor_s=0.5,
              spec_min_results=2, **config)
    start(s, "a", 1)
    now = 0.0
    for _ in range(3):  # a: 0.1 s per sample, steady
        (x,) = list(held(s, "a"))
        now += 0.4
        answer(s, "a", x, 0.4, now)
    return s, now


def test_a_late_slot_is_speculated_to_a_free_worker_and_applied_once():
    s, now = late_setup()
    (late,) = held(s, "a")
    assert s.tick(now + 0.5) == []  # on time (0.4 s predicted + 0.5 s floor)
    assert start(s, "b", 1, now + 0.5) != []
    (b_first,) = held(s, "b")
    ok, actions = answer(s, "b", b_first, 0.4, now + 0.6)
    (b_next,) = held(s, "b")
    actions = s.tick(now + 1.0)  # a's slot is 1.0 s old: late past 0.4 + 0.5
    assert s.stats["slots_speculated"] == 1
    s.tick(now + 1.1)
    assert s.stats["slots_speculated"] == 1  # one copy per slot
    round_ = s.rounds[s.slots[late].round]
    assert round_.code.slots == 2 and round_.code.name == "none"
    # b finishes its slot and takes the speculative copy first
    ok, actions = answer(s, "b", b_next, 0.4, now + 1.2)
    (copy,) = [x for x in assigns(actions) if x.worker == "b"]
    assert copy.round == round_.id and copy.slot != late
    assert copy.parts == [list(p) for p in round_.parts]
    ok, actions = answer(s, "b", copy.slot, 0.4, now + 1.6)
    (dec,) = of(Decoded, actions)
    assert dec.weights == {copy.slot: 1.0} and CancelSlots("a", [late]) in actions
    assert s.result("a", late, 5.0, now + 5.0) == (False, [])  # the late original is refused


def test_a_worker_late_twice_holds_fewer_slots():
    s = coded("none", n=400, batch=4, min_deadline_s=1000.0, heartbeat_s=1000.0, speculate=True,
              spec_floor_s=0.1, spec_min_results=2)
    start(s, "a", 4)
    now = 0.0
    for _ in range(4):
        slot = sorted(held(s, "a"))[0]
        now += 0.4
        answer(s, "a", slot, 0.4, now)
    assert s.workers["a"].speed.size_factor == 1.0 and len(held(s, "a")) == 4
    s.tick(now + 100.0)  # all four late
    assert s.workers["a"].speed.late == 4 and s.workers["a"].speed.size_factor < 1.0
    assert s.workers["a"].limit < 4
    for slot in sorted(held(s, "a")):
        answer(s, "a", slot, 0.4, now + 101)
    assert held(s, "a")  # refilled after each step ...
    assert len(held(s, "a")) <= s.workers["a"].limit  # ... but only up to its smaller limit


def test_a_name_that_never_answers_holds_one_slot_and_takes_no_second_chance():
    # one key's name asking for many slots and answering nothing (issue 27's flood): its
    # slots are speculated as soon as the first it was handed is late on its own, and from
    # then on it holds at most one slot, never a copy handed out before
    s, now = late_setup(open_rounds=16, min_deadline_s=5.0)
    start(s, "flood", 8, now)
    flooded = held(s, "flood")
    assert len(flooded) == 8
    s.seen("a", now + 1.0)
    s.seen("flood", now + 1.0)
    s.tick(now + 1.0)  # 1.0 s: past one slot's 0.4 s + 0.5 s, far from eight slots' time
    assert all(s.slots[x].speculated for x in flooded)
    for _ in range(10):  # a answers the copies: the flood's are cancelled as they arrive
        (x,) = held(s, "a")
        now += 0.4
        answer(s, "a", x, 0.4, now + 1.0)
    assert len(held(s, "flood")) == 1  # (its late streak alone would leave it two of eight)
    # a slot past a's deadline goes back to the queue: a second chance, not for the flood

    # a slot past its holder's deadline goes back to the queue: a second chance, which a late
    # name that never answered does not take, and a newcomer does
    s = coded("none", n=400, batch=4, open_rounds=1, min_deadline_s=5.0, heartbeat_s=1000.0)
    (x,) = assigns(start(s, "a", 1))
    s.seen("a", 6.0)
    s.tick(6.0)
    assert s.stats["deadline_requeues"] == 1
    s.join("flood", {"host": "flood"}, 6.0)
    s.workers["flood"].speed.late = 1  # (a slot of its turned late before)
    assert assigns(s.ready("flood", 8, 6.0)) == []
    (c,) = assigns(start(s, "c", 1, 6.0))
    assert c.slot == x.slot


def test_max_batch_caps_the_round():
    s = make(n=100, batch=10, max_batch=4)
    (x,) = assigns(start(s, "a", 1))
    assert x.parts == [[0, 0, 4]]


def test_adaptive_chooses_none_without_stragglers_and_redundancy_with_a_heavy_tail():
    steady = [0.01] * 64
    assert str(adaptive.choose([steady] * 3, partitions=3)[0]) == "none"
    assert str(adaptive.choose([steady] * 6, partitions=3)[0]) == "none"
    assert str(adaptive.choose([[0.01, 0.0102, 0.0099] * 7] * 6, partitions=6)[0]) == "none"
    rng = np.random.default_rng(0)
    heavy = list(0.01 * (1 + rng.pareto(1.2, 200)))  # heavy-tailed: now and then 10-100x
    choice, costs = adaptive.choose([heavy] * 6, partitions=3)
    assert choice.kind != "none", costs
    assert costs[str(choice)] < 0.95 * costs["none"]
    stalls = [0.01] * 40 + [0.5] * 10  # one task in five stalls 50x
    assert adaptive.choose([stalls] * 3, partitions=3)[0].kind != "none"
    assert str(adaptive.choose([], partitions=3)[0]) == "none"
    assert str(adaptive.choose([[], []], partitions=3)[0]) == "none"


def test_adaptive_prefers_replication_when_one_worker_is_slow_and_one_stalls():
    # The straggler benchmark's fleet (one worker 5x slow, one stalling now and then, the rest
    # steady) with one round open at a time: replicas of the slow worker's partition go to the
    # fast workers that finish first, where a cyclic code makes every slot twice the work and
    # still waits for the stalling worker whenever the slow one is one of the stragglers.
    fast = [0.01] * 32
    fleet = [[0.05] * 32, [0.01] * 26 + [0.2] * 6, fast, fast, fast]
    choice, costs = adaptive.choose(fleet, partitions=6, samples_per_partition=256,
                                    open_rounds=1, speculation=adaptive.Speculation())
    assert str(choice) == "replicate:2", costs
    assert costs["replicate:2"] < costs["cyclic:1"] < costs["none"]


def test_adaptive_prediction_is_pull_based_per_worker():
    # Two workers, two partitions, one of them 10x slow: `none` must wait for the slow one
    # (its slot started at once); `replicate:2` lets the fast worker take the second copy and
    # decode after two fast slots. A prediction that pooled the records would miss this.
    fast, slow = np.array([1.0]), np.array([10.0])
    rng = np.random.default_rng(0)
    none = adaptive.predict(adaptive.Redundancy("none"), [fast, slow], 2, 1.0, 8, rng, 1)
    rep = adaptive.predict(adaptive.Redundancy("replicate", 2), [fast, slow], 2, 1.0, 8, rng, 1)
    assert none == pytest.approx(10.0 / 2)
    assert rep == pytest.approx(2.0 / 2)  # latency: the fast worker's two slots
    # no worker computes a row twice, and a copy whose row arrived is skipped, not computed
    cyc = adaptive.predict(adaptive.Redundancy("cyclic", 1), [fast, fast], 2, 1.0, 4, rng, 1)
    assert cyc == pytest.approx(2.0 / 2)  # each slot covers two partitions; any one decodes


def test_adaptive_scheduler_starts_replicated_then_follows_the_record():
    s = coded("adaptive", n=1000, batch=6, partitions=3, min_deadline_s=1000.0,
              heartbeat_s=1000.0)
    for w in "abc":
        start(s, w, 1)
    assert {r.code.name for r in s.rounds.values()} == {"replicate:2"}  # nothing measured yet
    for t in [0.01] * 40 + [0.5] * 10:
        for w in "abc":
            s.speed.observe(t, s.workers[w].speed)
    assert s.book.choose_code(3).kind != "none"
    assert s.last_costs and "none" in s.last_costs


import numpy as np  # noqa: E402

REDUNDANCY = ["none", "replicate:2", "cyclic:1", "cyclic:2", "adaptive"]


class CodedHarness(Harness):
    def perform(self, actions):
        if self.s.config.sync:  # one round at a time, planned at the current version: never stale
            assert all(a.version == self.version for a in of(Assign, actions))
        super().perform(actions)

    def check_decoded(self, a: Decoded):
        # at most once, only accepted slots, and the decoded sum covers every sample once
        assert set(a.weights) <= {s for s in a.slots if self.accepted[s] == 1}
        coverage: dict[tuple, float] = {}
        for slot, w in a.weights.items():
            rnd, parts, coefficients = self.assigned_ever[slot]
            assert rnd == a.round
            for p, c in zip(parts, coefficients):
                coverage[tuple(p)] = coverage.get(tuple(p), 0.0) + w * c
        assert sorted(coverage) == sorted(tuple(p) for p in a.parts)
        assert all(abs(v - 1.0) < 1e-9 for v in coverage.values()), coverage


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 23), batch=st.integers(1, 7), partitions=st.integers(1, 4),
       open_rounds=st.integers(0, 3), credits=st.lists(st.integers(0, 3), min_size=3, max_size=3),
       redundancy=st.sampled_from(REDUNDANCY), speculate=st.booleans(), sync=st.booleans(),
       script=ops)
def test_coded_rounds_applied_once_and_every_sample_once(n, batch, partitions, open_rounds,
                                                        credits, redundancy, speculate, sync,
                                                        script):
    s = Dealing(Scheduler(SchedulerConfig(batch_size=batch, partitions=partitions, open_rounds=open_rounds,
                                  heartbeat_s=1.0, liveness=3, min_deadline_s=2.5,
                                  redundancy=parse_redundancy(redundancy), speculate=speculate,
                                  spec_floor_s=0.05, spec_min_results=1, adaptive_every=2,
                                  sync=sync),
                  Sampler(n, epochs=1)))
    h = CodedHarness(s)
    h.play(credits, script, max_open_rounds=1 if sync else open_rounds)
    h.applied_once_each(n)
    assert all(v <= 1 for v in h.accepted.values())


def test_slot_scale_is_the_coded_samples_of_a_slot_its_caller_holds():
    s = coded("cyclic:1", n=60, batch=6, partitions=3, open_rounds=1, min_deadline_s=1000.0,
              heartbeat_s=1000.0)
    got = assigns(start(s, "a", 1) + start(s, "b", 1) + start(s, "c", 1))
    assert len(got) == 3
    for x in got:
        expected = sum(abs(c) * p[2] for p, c in zip(x.parts, x.coefficients))
        assert s.slot_scale(x.worker, x.slot) == pytest.approx(expected)
    x, y = got[:2]
    assert s.slot_scale(y.worker, x.slot) is None  # not its slot
    assert s.slot_scale("nobody", x.slot) is None and s.slot_scale(x.worker, 10 ** 6) is None
    s.result(x.worker, x.slot, 0.1, 1.0)
    assert s.slot_scale(x.worker, x.slot) is None  # answered: no longer held


def test_slot_work_reads_back_what_the_holders_were_sent_until_the_round_closes():
    s = coded("cyclic:1", n=60, batch=6, partitions=3, open_rounds=1, min_deadline_s=1000.0,
              heartbeat_s=1000.0)
    got = assigns(start(s, "a", 1) + start(s, "b", 1) + start(s, "c", 1))
    for x in got:
        work = s.slot_work(x.slot)
        assert work == x.work == SlotWork(x.version, x.parts, x.coefficients, "gradient", 0)
    decoded = []
    for x in got:
        decoded += of(Decoded, s.result(x.worker, x.slot, 0.1, 1.0)[1])
    assert decoded and all(s.slot_work(x.slot) is None for x in got)


def test_a_late_part_of_a_sync_round_is_speculated_to_the_worker_that_finished():
    assert SchedulerConfig(batch_size=4, speculate=True).speculating
    assert SchedulerConfig(batch_size=4, speculate=True, sync=True).speculating
    assert not SchedulerConfig(batch_size=4, speculate=False, sync=True).speculating
    s = make(n=400, batch=4, sync=True, speculate=True, spec_min_results=1, spec_floor_s=0.0,
             min_deadline_s=1000.0, heartbeat_s=1000.0)
    # the first round is cut small (4 parts of 1), anyone's: each takes one, then the next
    held = {a.worker: a for a in assigns(start(s, "fast", 1)) + assigns(start(s, "slow", 1))}
    assert sorted(held) == ["fast", "slow"] and {a.round for a in held.values()} == {1}
    now = 0.0
    while {a.round for a in held.values()} == {1}:
        now += 0.1
        worker = min(held)  # fast first, then slow
        _, actions = answer(s, worker, held.pop(worker).slot, 0.1, now)
        held.update((a.worker, a) for a in assigns(actions))
    fast, slow = held["fast"], held["slow"]  # the second round: a partition each
    assert fast.round == slow.round != 1
    answer(s, "fast", fast.slot, 0.1, now + 0.1)
    began = now
    for later in (1.0, 10.0, 100.0):  # slow is far past the fleet's prediction
        s.seen("slow", began + later)
        copies = assigns(s.tick(began + later))
        if copies:
            break
    assert [(c.worker, c.work.parts) for c in copies] == [("fast", slow.work.parts)]
    assert s.stats["slots_speculated"] == 1


def test_resend_reassigns_every_held_slot_with_its_model():
    s = make(n=100, batch=4, partitions=2)
    held = assigns(start(s, "a", 2))
    assert len(held) == 2
    again = s.resend("a", now=1.0)
    assert sorted(a.slot for a in again) == sorted(a.slot for a in held)
    assert all(a.send_model for a in again)  # the worker may have lost every task
    assert [a.parts for a in sorted(again, key=lambda a: a.slot)] == \
        [a.parts for a in sorted(held, key=lambda a: a.slot)]
    assert s.resend("nobody", now=1.0) == []


def test_time_the_coordinator_was_absent_is_no_workers_silence():
    s = make(n=100, batch=4, heartbeat_s=1.0, liveness=3)
    start(s, "a", 1, now=0.0)
    s.absent(10.0)  # frozen from t=0.5 to t=10.5, say
    assert not any(isinstance(a, Evicted) for a in s.tick(10.6))
    assert any(isinstance(a, Evicted) for a in s.tick(14.0))  # silent 3.x s of its own time
