"""The round core's own decisions, with a scheduler and a costless backend (no tensors)."""

from __future__ import annotations

import math

from idlegrad.coordinator.staleness import StalenessRule
from idlegrad.coordinator.effects import Applied, Ban, Used
from idlegrad.coordinator.rounds import RoundCore
from idlegrad.coordinator.sampler import Sampler
from idlegrad.coordinator.scheduler import Assign, SchedulerConfig, Scheduler
from idlegrad.coordinator.simulator import CostlessGradients
from idlegrad.coordinator.trust import TrustConfig, TrustPolicy


def core(**config) -> RoundCore:
    scheduler = Scheduler(SchedulerConfig(batch_size=8, **config), Sampler(1000, None))
    return RoundCore(scheduler, CostlessGradients(1000, 8, StalenessRule()),
                     TrustPolicy(TrustConfig(ban_after=2)))


def test_a_worker_that_reconnects_keeps_its_identity():
    c = core()
    c.join("w", {}, "key:A", 0.0)
    c.join("w", {}, "key:A", 1.0)  # its old session is evicted first
    assert c.identity("w") == "key:A"


def test_a_result_is_used_then_applied_once():
    c = core()
    c.join("w", {}, "w", 0.0)
    (task,) = [a for a in c.ready("w", 1, 0.0) if isinstance(a, Assign)]
    out = c.result("w", task.slot, None, 8.0, 0.1, 1.0, samples=8, loss=2.0)
    assert [e.slot for e in out if isinstance(e, Used)] == [task.slot]
    (applied,) = [e for e in out if isinstance(e, Applied)]
    assert applied.samples == 8 and c.samples_applied == 8 and c.train_loss == 2.0
    again = c.result("w", task.slot, None, 8.0, 0.1, 2.0)  # a duplicate: dropped, not counted
    assert not [e for e in again if isinstance(e, (Used, Applied))]
    assert c.counters["results_dropped"] == 1


def test_non_finite_results_are_refused_and_their_sender_banned():
    c = core()
    c.join("w", {}, "key:A", 0.0)
    for t in (1.0, 2.0):
        (task,) = [a for a in c.ready("w", 1, t) if isinstance(a, Assign)] or [
            a for a in c.resend("w", t) if isinstance(a, Assign)]
        out = c.result("w", task.slot, None, math.nan, 0.1, t)
    assert Ban("w") in out and "w" not in c.scheduler.workers
    assert c.trust.is_banned("key:A") and c.counters["rejected_non_finite"] == 2


def test_an_operators_ban_sends_each_worker_of_the_identity_home_and_requeues_its_slots():
    from idlegrad.coordinator.scheduler import Evicted

    c = core(partitions=2)
    c.join("a", {}, "key:A", 0.0)
    c.join("b", {}, "key:B", 0.0)
    held = [a.slot for a in c.ready("a", 2, 0.0) if isinstance(a, Assign)]
    assert held
    out = c.expel("key:A", "banned by this coordinator's operator", 1.0)
    assert Ban("a", "banned by this coordinator's operator") in out
    assert any(isinstance(e, Evicted) and e.worker == "a" for e in out)
    assert "a" not in c.scheduler.workers and "b" in c.scheduler.workers
    assert c.counters["workers_banned"] == 1
    # its slots go to others
    again = [a.slot for a in c.ready("b", 4, 2.0) if isinstance(a, Assign)]
    assert set(held) <= set(again)
    assert c.expel("key:nobody", "x", 3.0) == []


def test_honest_outliers_are_nobodys_failure_and_are_summed_up_not_logged_one_by_one():
    from idlegrad.coordinator.effects import Compute, Event

    c = RoundCore(Scheduler(SchedulerConfig(batch_size=8, partitions=2, min_deadline_s=1e6,
                                            heartbeat_s=1e6), Sampler(100_000, None)),
                  CostlessGradients(100_000, 8, StalenessRule()),
                  TrustPolicy(TrustConfig(ban_after=2), reference=1.0))
    for w in ("a", "b"):
        c.join(w, {}, w, 0.0)
    tasks = {a.worker: a for w in ("a", "b") for a in c.ready(w, 1, 0.0) if isinstance(a, Assign)}
    for _ in range(200):
        c.trust.accept(4.0, 4.0)  # the run so far: a median of 1 per sample
    events: list = []
    t = 1.0
    for i in range(6):  # each time: a's result is suspected while b's waits for the settle
        norm = 1e3 * 2 ** i  # (each past what the widened screen allows after the last)
        out = c.result("a", tasks["a"].slot, None, norm, 0.1, t, samples=4)
        assert [e for e in out if isinstance(e, Compute)]  # a is computed again here
        out += c.result("b", tasks["b"].slot, None, norm, 0.1, t, samples=4)  # busy: put back
        out += c.computed(None, None, t + 0.1)  # it matches: honest
        events += [e for e in out if isinstance(e, Event)]
        for e in out + c.resend("a", t) + c.resend("b", t):
            if isinstance(e, Assign):
                tasks[e.worker] = e
        t += 1.0
    assert c.counters["suspects_honest"] >= 6 and c.counters["suspects_requeued"] >= 6
    assert c.scheduler.workers["a"].failed == c.scheduler.workers["b"].failed == 0
    assert not [e for e in events if e.kind in ("suspected", "rejected")]
    (summary,) = [e for e in events if e.kind == "verified"]  # one, within the minute
    assert "computed again matched" in summary.text


def test_a_leave_counts_its_requeued_slots_in_words():
    # the walkthrough of issue 29 met "left (banned); 1 slots requeued"
    from idlegrad.coordinator.effects import Event

    c = core()
    c.join("a", {}, "a", 0.0)
    c.join("b", {}, "b", 0.0)
    assert len([x for x in c.ready("a", 1, 0.0) if isinstance(x, Assign)]) == 1
    said = [e.text for e in c.leave("a", "said bye", 1.0) if isinstance(e, Event)]
    assert "a left (said bye); 1 slot requeued" in said, said
    said = [e.text for e in c.leave("b", "said bye", 1.0) if isinstance(e, Event)]
    assert "b left (said bye); 0 slots requeued" in said, said


def test_a_slot_the_jobs_code_failed_on_goes_to_another_worker_and_is_said_once():
    # the walkthrough of issue 29: a BatchNorm job raising on a worker showed it "working", 0
    # failed, 0 samples/s, for good
    from idlegrad.coordinator.effects import Event

    c = core()
    c.join("a", {}, "a", 0.0)
    (task,) = [x for x in c.ready("a", 1, 0.0) if isinstance(x, Assign)]
    out = c.job_failed("a", [task.slot], "ValueError: one value per channel", 1.0)
    (again,) = [x for x in out if isinstance(x, Assign)]  # requeued: the only worker takes it
    assert again.worker == "a" and again.slot == task.slot
    assert c.scheduler.workers["a"].failed == 1 and c.counters["slots_failed_in_job"] == 1
    (said,) = [e for e in out if isinstance(e, Event)]
    assert said.kind == "job_failed" and "one value per channel" in said.text
    c.join("b", {}, "b", 1.0)
    c.ready("b", 1, 1.0)
    out = c.job_failed("a", [again.slot], "ValueError: one value per channel", 2.0)
    assert not [e for e in out if isinstance(e, Event)]  # the same error, not said again
    assert c.scheduler.workers["a"].failed == 2
    # a slot it does not hold is no failure of its
    assert c.job_failed("b", [10 ** 6], "boom", 3.0) is not None
    assert c.scheduler.workers["b"].failed == 0
