"""Slots sized to their worker (`--sync`): a round's batch cut in proportion to each worker's
measured speed, each part dealt to its worker, so that the round's slots finish together. A fake
clock: every worker computes its slot in (its seconds per sample) x (samples)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from idlegrad.coordinator.sampler import Sampler, _cuts_by_shares
from idlegrad.coordinator.scheduler import Assign, Decoded
from .scheduling import make

SPEED = {"b": 0.03, "a": 0.01, "c": 0.02}  # seconds per sample: a is 3x faster than b


def assigns(actions) -> list[Assign]:
    return [a for a in actions if isinstance(a, Assign)]


class SyncFleet:
    """Workers with one credit each, answering in virtual time; each round's slots by worker."""

    def __init__(self, workers, batch=120, n=100_000, fixed=None, **config):
        self.s = make(n=n, batch=batch, sync=True, **config)
        self.fixed = fixed or {}  # seconds a worker's slot takes whatever its samples
        self.now = 0.0
        self.held: dict[str, Assign] = {}
        self.rounds: list[dict[str, int]] = []  # per round: worker -> samples of its slot
        self.finished: list[list[float]] = []  # per round: when each slot was answered
        for w in workers:
            self.s.join(w, {}, self.now)
        for w in workers:
            self._take(self.s.ready(w, 1, self.now))

    def _take(self, actions) -> list[Decoded]:
        for task in assigns(actions):
            assert task.worker not in self.held  # sync: one slot a worker
            self.held[task.worker] = task
        return [a for a in actions if isinstance(a, Decoded)]

    def _time(self, w: str, task: Assign) -> float:
        return self.fixed.get(w, 0.0) + SPEED[w] * task.work.samples

    def round(self) -> float:
        """The held slots answered in order of finishing, a worker that finished taking the
        round's next part if one waits (the first round's), until the round decodes; the
        round's span (last - first start)."""
        start = self.now
        done: dict[str, int] = {}
        finished: list[float] = []
        finish = {w: start + self._time(w, t) for w, t in self.held.items()}
        while finish:
            w = min(finish, key=finish.get)
            self.now = finish.pop(w)
            for other in self.s.workers:  # every worker heart-beats while the round runs
                self.s.seen(other, self.now)
            task = self.held.pop(w)
            done[w] = done.get(w, 0) + task.work.samples
            finished.append(self.now - start)
            _, actions = self.s.result(w, task.slot, self._time(w, task), self.now)
            decoded = self._take(actions)
            if decoded:
                assert decoded[0].samples == sum(done.values())
                self._take(self.s.applied(self.s.version + 1, self.now))
                break
            if w in self.held:  # another part of this round
                finish[w] = self.now + self._time(w, self.held[w])
        self.rounds.append(done)
        self.finished.append(finished)
        return self.now - start


def test_cuts_by_shares_are_contiguous_proportional_and_never_empty():
    assert _cuts_by_shares(120, [1.0, 3.0]) == [(0, 30), (30, 120)]
    assert _cuts_by_shares(10, [1.0, 1000.0, 1.0]) == [(0, 1), (1, 9), (9, 10)]
    assert _cuts_by_shares(2, [1.0, 1.0, 1.0]) is None  # fewer samples than shares: equal cut
    assert _cuts_by_shares(9, [1.0, 0.0]) is None
    sampler = Sampler(100, None)
    assert sampler.next_round(60, 3, shares=[1.0, 2.0, 3.0]) == [(0, 0, 10), (0, 10, 20),
                                                                 (0, 30, 30)]
    assert sampler.next_round(60, 3) == [(0, 60, 13), (0, 73, 14), (0, 87, 13)]  # equal, the end


def test_sync_slots_are_cut_to_each_workers_speed_and_the_round_finishes_together():
    # b joined first: its part is row 0, which the faster a (hungry first) must skip
    fleet = SyncFleet(["b", "a"])
    spans = [fleet.round() for _ in range(8)]
    # nothing measured yet: the first round is cut into 8 parts of 15, anyone's, and a, 3x as
    # fast, takes 6 of them while b computes 2 (one equal part each would wait for b's 60
    # samples: 1.8 s)
    assert fleet.rounds[0] == {"a": 90, "b": 30}
    assert spans[0] == pytest.approx(0.9)
    last = fleet.rounds[-1]
    assert sum(last.values()) == 120
    assert last["a"] == pytest.approx(3 * last["b"], abs=2)  # 90 and 30: sized, one part each
    assert spans[-1] == pytest.approx(0.9, abs=0.03)
    assert fleet.s.stats["rounds_sized"] >= 5


def test_the_first_sync_round_has_a_part_for_each_worker_still_starting_up():
    # cut for the first worker to announce credits alone, it would compute the whole batch
    fleet = SyncFleet([])
    s = fleet.s
    for w in ("b", "a", "c"):
        s.join(w, {}, 0.0)
    (first,) = assigns(s.ready("b", 1, 0.0))
    # sixteen parts (4 x 4: at least four workers' worth, nothing measured yet), the rest waiting
    assert first.work.samples in (7, 8) and s.pending() == 15
    (held,) = assigns(s.ready("a", 1, 0.1))
    now, done = 0.1, {"a": 0, "b": 0}
    decoded = []
    while not decoded:  # c never comes: a, free again and again, takes the parts left
        now += 0.1
        done["a"] += held.work.samples
        _, actions = s.result("a", held.slot, 0.1, now)
        decoded = [d.samples for d in actions if isinstance(d, Decoded)]
        if s.pending() == 0 and not assigns(actions):
            _, actions = s.result("b", first.slot, now, now)
            done["b"] += first.work.samples
            decoded = [d.samples for d in actions if isinstance(d, Decoded)]
        else:
            (held,) = assigns(actions)
    assert decoded == [120] and done == {"a": 120 - first.work.samples, "b": first.work.samples}


def test_the_first_sync_round_is_cut_small_before_the_others_said_hello():
    # A new coordinator hears its workers' hellos up to a reconnect interval apart: the first
    # to announce credits may be the only one it knows. Cut for it alone, the round was all
    # that worker's, however slow; sixteen parts, the others take theirs as they come.
    fleet = SyncFleet([])
    s = fleet.s
    s.join("b", {}, 0.0)
    (first,) = assigns(s.ready("b", 1, 0.0))
    assert first.work.samples in (7, 8) and s.pending() == 15
    s.join("a", {}, 0.01)
    (second,) = assigns(s.ready("a", 1, 0.01))
    assert second.work.samples in (7, 8)


def test_a_workers_first_result_sizes_its_next_part():
    # A fleet that has just started: after round 1 (sixteen small parts, anyone's), each
    # worker has a few results. Its own reading sizes its part at once, before the three its
    # deadlines wait for (a worker with one, below); the fleet's mean in its place gave both
    # the same and round 2 cut equal parts, at b's pace.
    fleet = SyncFleet(["b", "a"])
    spans = [fleet.round()]
    assert fleet.s.workers["b"].speed.observed == 4  # a, three times faster, computed 12
    spans += [fleet.round() for _ in range(3)]
    assert fleet.rounds[1] == {"a": 90, "b": 30}  # one part each, sized
    assert fleet.rounds[1]["a"] == pytest.approx(90, abs=2)
    assert fleet.rounds[1]["b"] == pytest.approx(30, abs=2)
    assert spans[1] == pytest.approx(0.9, abs=0.03)
    speed = fleet.s.speed
    one = fleet.s.workers["a"].speed
    assert speed.sizing(one) == pytest.approx(SPEED["a"])
    assert speed.judged_by_fleet(type(one)(s_per_sample=0.5, observed=1))  # deadlines still wait
    assert speed.sizing(type(one)()) == pytest.approx(sum(speed.times) / len(speed.times))


def test_parts_are_sized_by_each_workers_fixed_and_per_sample_time_at_an_epochs_end_too():
    """A slot costs its worker a fixed time besides its samples (the model down, the gradient
    up, a slow machine's per-slot Python at its pace). Here a takes 0.1 s + 0.01 s a sample
    and b 0.5 s + 0.03 s; 150 samples an epoch, so rounds of 120 and 30 alternate. Once three
    slots each are answered, a round of 120 ends at T = 1.1 s for both (a 100 samples, b 20),
    and a round of 30 is a's alone: it ends at 0.4 s, before b's fixed part alone would. By
    seconds per sample (the rule before) the short rounds waited for b's 0.5 s every epoch."""
    fleet = SyncFleet(["b", "a"], batch=120, n=150, fixed={"a": 0.1, "b": 0.5})
    times = [fleet.round() for _ in range(12)]
    full, short = fleet.rounds[-2], fleet.rounds[-1]
    if sum(short.values()) != 30:
        full, short = short, fleet.rounds[-3]
    assert full == {"a": 100, "b": 20}
    assert short == {"a": 30}
    assert sorted(times[-2:]) == pytest.approx([0.4, 1.1])
    assert fleet.s.scheduler.book.spreads[-1] < 0.01 or fleet.s.scheduler.book.spreads[-2] < 0.01


def test_slot_times_fit_a_fixed_part_and_a_rate_and_fall_back_to_the_rate_at_one_size():
    from idlegrad.coordinator.speed import SlotTimes

    times = SlotTimes()
    assert times.fit() is None
    for n in (100, 20, 100, 20, 60):
        times.observe(n, 0.2 + 0.004 * n)
    fixed, per_sample = times.fit()
    assert fixed == pytest.approx(0.2) and per_sample == pytest.approx(0.004)
    same = SlotTimes()
    for _ in range(4):
        same.observe(50, 1.0)
    assert same.fit() == pytest.approx((0.0, 0.02))


def test_a_newcomer_gets_a_first_rounds_part_and_its_first_answer_sizes_the_next(monkeypatch):
    # c is ten times slower than b. Sized at the fleet's mean it got about a third of the
    # round, which then lasted ten times its part at b's pace. A first round's part (samples /
    # (4 x workers)) bounds what an unknown machine holds up; a and b share the rest.
    monkeypatch.setitem(SPEED, "c", 0.3)
    fleet = SyncFleet(["a", "b"])
    for _ in range(6):
        fleet.round()
    fleet.s.join("c", {}, fleet.now)  # joins between rounds: takes part from the next one
    fleet._take(fleet.s.ready("c", 1, fleet.now))
    fleet.round()  # the round that was open when c joined
    span = fleet.round()
    first = fleet.rounds[-1]
    assert first["c"] == 10  # 120 / (4 x 3)
    assert first["a"] == pytest.approx(110 * 3 / 4, abs=1)  # a is three times b
    assert first["a"] + first["b"] == 110
    assert span == pytest.approx(3.0, abs=0.05)  # c's 10 samples at 0.3 s each
    fleet.round()
    sized = fleet.rounds[-1]  # c's own reading sizes it now
    rates = {w: 1 / SPEED[w] for w in "abc"}
    for w in "abc":
        assert sized[w] == pytest.approx(120 * rates[w] / sum(rates.values()), abs=1.5)


def test_a_slot_sized_to_a_worker_that_left_goes_to_whoever_asks():
    from idlegrad.coordinator.slots import Lease, SlotWork

    fleet = SyncFleet(["a", "b"])
    dealer = fleet.s.scheduler.dealer
    a = fleet.s.workers["a"]
    lease = Lease(999, SlotWork(0, [[0, 0, 4]], [1.0]), round=1, reserved="b")
    assert dealer._reserved_for_another(lease, a)  # b is active and has not taken it
    lease.started["b"] = 0.0  # b took it once (then gave it back): anyone's
    assert not dealer._reserved_for_another(lease, a)
    lease.started.clear()
    fleet.s.leave("b", fleet.now, "bye")
    assert not dealer._reserved_for_another(lease, a)
    assert not dealer._reserved_for_another(Lease(998, lease.work, round=1), a)


def test_credits_of_a_sized_round_follow_each_workers_samples():
    from idlegrad.coordinator.effects import Applied
    from idlegrad.coordinator.rounds import RoundCore
    from idlegrad.coordinator.sampler import Sampler
    from idlegrad.coordinator.scheduler import Scheduler, SchedulerConfig
    from idlegrad.coordinator.sim_backends import CostlessGradients
    from idlegrad.coordinator.staleness import StalenessRule
    from idlegrad.coordinator.trust import TrustConfig, TrustPolicy

    core = RoundCore(Scheduler(SchedulerConfig(batch_size=120, sync=True),
                               Sampler(100_000, None)),
                     CostlessGradients(100_000, 120, StalenessRule()),
                     TrustPolicy(TrustConfig(), reference=1.0))
    now, held, applied = 0.0, {}, []

    def perform(effects):
        for e in effects:
            if isinstance(e, Assign):
                held[e.worker] = e
            elif isinstance(e, Applied):
                applied.append(e)

    for w in ("b", "a"):
        perform(core.join(w, {}, w, now))
    for w in ("b", "a"):
        perform(core.ready(w, 1, now))
    for _ in range(40):  # the first round's sixteen parts, then sized rounds
        if len(applied) >= 4:
            break
        tasks = dict(held)
        held.clear()
        start = now  # the held slots run side by side
        for w in sorted(tasks, key=lambda w: SPEED[w] * tasks[w].work.samples):
            now = start + SPEED[w] * tasks[w].work.samples
            perform(core.result(w, tasks[w].slot, None, float(tasks[w].work.samples),
                                SPEED[w] * tasks[w].work.samples, now,
                                samples=tasks[w].work.samples))
    last = applied[-1]
    earned = {c.identity: c.samples for c in last.credits}
    assert earned["a"] + earned["b"] == last.samples == 120
    assert earned["a"] == pytest.approx(90, abs=2) and earned["b"] == pytest.approx(30, abs=2)


def test_a_sync_round_reports_how_close_together_its_slots_finish():
    fleet = SyncFleet(["b", "a"])
    span = fleet.round()  # 16 parts of 7 or 8: a takes one after another, b fewer
    first = fleet.s.slot_spread
    assert len(fleet.finished[0]) == 16
    p10, p90 = np.percentile(fleet.finished[0], [10, 90])
    assert first == pytest.approx((p90 - p10) / span)
    for _ in range(20):
        fleet.round()
    assert fleet.s.scheduler.book.spreads[-1] < 0.05  # sized parts finish together
    assert fleet.s.slot_spread < first


def test_a_sync_part_late_on_a_slowed_worker_is_speculated_to_one_that_finished():
    fleet = SyncFleet(["b", "a"], speculate=True)
    for _ in range(8):
        fleet.round()
    handed = fleet.now  # the last round's decode handed out this round's slots
    stopped = fleet.held.pop("b")  # b's owner took its cores: alive, its part far behind
    task = fleet.held.pop("a")
    fleet.now += SPEED["a"] * task.work.samples
    _, actions = fleet.s.result("a", task.slot, SPEED["a"] * task.work.samples, fleet.now)
    assert not [a for a in actions if isinstance(a, Decoded)]  # the round waits for b's part
    copy = None
    for _ in range(40):  # ticks, as the server's, a tenth of a second apart
        fleet.now += 0.1
        fleet.s.seen("b", fleet.now)  # heartbeats: not removed, only late
        for given in assigns(fleet.s.tick(fleet.now)):
            copy = given
        if copy is not None:
            break
    assert copy is not None and copy.worker == "a"
    assert copy.work.parts == stopped.work.parts  # b's part, computed on a
    assert fleet.now - handed < stopped.deadline_s  # long before b's deadline would requeue it
    _, actions = fleet.s.result("a", copy.slot, 1.0, fleet.now + 1.0)
    decoded = [a for a in actions if isinstance(a, Decoded)]
    assert decoded and decoded[0].samples == 120
    assert fleet.s.stats["slots_speculated"] == 1


def test_a_sync_part_is_speculated_a_rounds_time_past_its_prediction_between_ticks():
    # rounds of a tenth of a second: half a second of floor would be five rounds of waiting
    fleet = SyncFleet(["b", "a"], batch=12, speculate=True)
    for _ in range(8):
        fleet.round()
    book = fleet.s.scheduler.book
    round_s = sorted(book.round_times)[len(book.round_times) // 2]
    assert round_s == pytest.approx(0.09, abs=0.01)  # 9 + 3 samples at 0.01 and 0.03 s each
    assert book.spec_floor() == pytest.approx(round_s, abs=0.005)
    handed = fleet.now
    stopped = fleet.held.pop("b")  # b's owner took its cores: alive, its part far behind
    task = fleet.held.pop("a")
    fleet.now += SPEED["a"] * task.work.samples
    fleet.s.result("a", task.slot, SPEED["a"] * task.work.samples, fleet.now)
    due = fleet.s.next_speculation_at()  # the driver wakes then, tick or not
    predicted = SPEED["b"] * stopped.work.samples
    assert due == pytest.approx(handed + predicted + round_s, abs=0.01)
    # a slot sent with its model is late only past the worker's typical link time as well
    # (the prediction is compute only): none measured here, 0.3 s on a slower link
    b = fleet.s.workers["b"]
    assert b.id in fleet.s.slots[stopped.slot].with_model and b.speed.link_s == pytest.approx(0)
    b.speed.link_times.extend([0.3] * 8)
    book.watch_late(b, fleet.now)
    assert fleet.s.next_speculation_at() == pytest.approx(due + 0.3)
    b.speed.link_times.clear()
    book.watch_late(b, fleet.now)
    assert assigns(fleet.s.speculate(due - 0.001)) == []
    (copy,) = assigns(fleet.s.speculate(due + 0.001))
    assert copy.worker == "a" and copy.work.parts == stopped.work.parts
    assert fleet.s.next_speculation_at() == math.inf  # nothing else is timed


def _speculated_round_without(fleet: "SyncFleet", silent: str,
                              beating: bool = True) -> list[Assign]:
    """This round: `silent` never answers its part (heart-beating, or not), the others answer
    theirs, and a copy of the silent part (speculated once late, on whoever finished) decodes
    it. The next round's hand-out."""
    fleet.held.pop(silent)  # alive, never answering
    for w in list(fleet.held):
        task = fleet.held.pop(w)
        fleet.now += SPEED[w] * task.work.samples
        fleet.s.result(w, task.slot, SPEED[w] * task.work.samples, fleet.now)
    copy = None
    for _ in range(40):
        fleet.now += 0.1
        if beating:
            fleet.s.seen(silent, fleet.now)
        copy = next(iter(assigns(fleet.s.tick(fleet.now))), None)
        if copy is not None:
            break
    assert copy is not None and copy.worker != silent
    fleet.now += 0.5
    _, actions = fleet.s.result(copy.worker, copy.slot, 0.5, fleet.now)
    assert [a for a in actions if isinstance(a, Decoded)]
    return assigns(fleet.s.applied(fleet.s.version + 1, fleet.now))


def _answered_alone(fleet: "SyncFleet", given: list[Assign], beating: bool = True) -> list[Assign]:
    (task,) = given
    fleet.now += 1.0
    if beating:
        fleet.s.seen("b", fleet.now)
    _, actions = fleet.s.result(task.worker, task.slot, 1.0, fleet.now)
    assert [a for a in actions if isinstance(a, Decoded)]
    return assigns(fleet.s.applied(fleet.s.version + 1, fleet.now))


def test_a_sync_round_reserves_no_part_for_a_worker_still_holding_a_late_one():
    """A worker that stays alive but never answers (a hostile key asking for slots it never
    computes, benchmarks/hostile.py `ready_flood`): once its late part was speculated and the
    round decoded, the next rounds are cut for the others, for ever longer terms while it
    answers nothing. Before, every round cut it a part again and waited for that part to turn
    late."""
    fleet = SyncFleet(["b", "a"], speculate=True)
    for _ in range(8):
        fleet.round()
    given = _speculated_round_without(fleet, "b")
    # the next round: all of it on a, which answers alone, well before b's deadline
    assert [t.worker for t in given] == ["a"] and given[0].work.samples == 120, given
    given = _answered_alone(fleet, given)
    # then b is cut a part on probation; late again, it sits out three rounds
    assert sorted(t.worker for t in given) == ["a", "b"]
    fleet.held = {t.worker: t for t in given}
    given = _speculated_round_without(fleet, "b")
    for _ in range(3):
        assert [t.worker for t in given] == ["a"], given
        given = _answered_alone(fleet, given)
    assert sorted(t.worker for t in given) == ["a", "b"]


def test_a_late_worker_that_never_answered_anything_sits_out_longer_terms():
    """A name that has never answered a slot (hostile.py's ready_flood: heart-beating names that
    never compute) sits out 4^s - 1 rounds a time, not 2^s - 1: it has shown nothing but
    lateness, and each probe costs the fleet a round's wait."""
    fleet = SyncFleet(["b", "a"], speculate=True)
    for _ in range(8):
        fleet.round()
    fleet.s.join("c", {}, fleet.now)
    fleet._take(fleet.s.ready("c", 1, fleet.now))
    while "c" not in fleet.held:
        fleet.round()
    assert fleet.s.workers["c"].done == 0
    given = _speculated_round_without(fleet, "c")
    rounds_out = 0
    while sorted(t.worker for t in given) == ["a", "b"]:
        fleet.held = {t.worker: t for t in given}
        fleet.s.seen("c", fleet.now)
        fleet.round()
        given = list(fleet.held.values())
        rounds_out += 1
    assert rounds_out == 3 and "c" in fleet.held


def test_a_late_worker_that_stopped_heart_beating_is_not_probed_until_it_is_heard_again():
    """A worker stopped (SIGSTOP: its owner's debugger, a laptop's lid) or killed sends no
    heartbeat: after its term it is cut no probation part, whose wait would cost the fleet a
    round each time, until it is heard from again."""
    fleet = SyncFleet(["b", "a"], speculate=True)
    for _ in range(8):
        fleet.round()
    given = _speculated_round_without(fleet, "b", beating=False)
    for _ in range(4):  # its term is one round; silent, it stays out
        assert [t.worker for t in given] == ["a"], given
        given = _answered_alone(fleet, given, beating=False)
    fleet.s.seen("b", fleet.now)  # SIGCONT: it heart-beats again
    given = _answered_alone(fleet, given, beating=False)
    assert sorted(t.worker for t in given) == ["a", "b"]


def test_a_worker_whose_late_part_a_copy_made_moot_is_cut_parts_again_and_sized_as_before():
    """An honest worker late once (its owner busy for a moment): the copy's answer cancels its
    part, so it never answers that one. It sits out one round, not the run (a 15x-slowed
    worker of benchmarks/fleet.py got no part after its first late one), and once it answers
    its probation part in time it is a taker like any other."""
    fleet = SyncFleet(["b", "a"], speculate=True)
    for _ in range(8):
        fleet.round()
    before = fleet.rounds[-1]["b"]
    given = _speculated_round_without(fleet, "b")
    given = _answered_alone(fleet, given)
    fleet.held = {t.worker: t for t in given}
    for _ in range(3):
        fleet.round()
        assert sorted(fleet.rounds[-1]) == ["a", "b"]
    assert fleet.rounds[-1]["b"] == pytest.approx(before, abs=2)
    assert fleet.s.workers["b"].speed.late_streak == 0


def test_a_worker_left_out_by_a_fixed_time_measured_while_busy_is_probed_and_comes_back():
    """b's first slots take 3 s whatever their size (its owner busy): its fixed time is past
    the round's end, so it is cut no part, and would get no new reading either. After
    PROBE_AFTER rounds left out it is cut one sample; the owner gone, that probe answers in
    b's real time, and b is sized into the rounds again. Left out for good (its fixed time
    really past the end), it is probed after 8, then 16, then 32 rounds."""
    from idlegrad.coordinator.round_book import PROBE_AFTER

    fleet = SyncFleet(["a", "b"], batch=120, fixed={"b": 3.0})
    for _ in range(6):  # b's first readings, all at 3 s
        fleet.round()
    fleet.fixed["b"] = 0.0  # the owner gone
    probes, back = [], None
    for i in range(40):
        fleet.round()
        got = fleet.rounds[-1].get("b")
        if got == 1:
            probes.append(i)
        elif got and back is None:
            back = i
    assert probes and probes[0] < PROBE_AFTER + 2  # the first probe, after 8 rounds out
    assert back is not None and back < probes[0] + 6  # then b is sized in again
    assert fleet.rounds[-1]["b"] == pytest.approx(30, abs=2)  # at its speed: a 3x as fast

    stuck = SyncFleet(["a", "b"], batch=120, fixed={"b": 3.0})
    rounds = [stuck.round() for _ in range(80)]
    probed = [i for i, r in enumerate(stuck.rounds) if r.get("b") == 1]
    gaps = [b - a for a, b in zip(probed, probed[1:])]
    assert len(probed) >= 3 and gaps[:2] == [16, 32]  # a probe every 16, then every 32 rounds
    assert sum(rounds) < 80 * 1.3 + 3 * 3.0  # each probe costs its round b's 3 s, no more


def test_newcomers_in_a_round_of_few_samples_leave_the_measured_workers_a_positive_share():
    fleet = SyncFleet(["a", "b"])
    for _ in range(4):
        fleet.round()
    book = fleet.s.scheduler.book
    for w in ("c", "d", "e"):
        fleet.s.join(w, {}, fleet.now)
    workers = list(fleet.s.scheduler.fleet.workers.values())
    chosen, shares = book.slot_shares(workers, 3)
    assert shares is not None and all(share > 0 for share in shares)
    by_worker = dict(zip((w.id for w in chosen), shares))
    assert by_worker["c"] == by_worker["d"] == by_worker["e"] == 3 / 20
    assert sum(shares) == pytest.approx(3)
