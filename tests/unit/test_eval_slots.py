"""Evaluation handed to workers, as pure logic with a fake clock: the scheduler's side slots
(interleaving, failover, version in use), the plan of ranges, the combining of sums, the auto
rule, and the round core's evaluation from planning to `Evaluated`."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import TensorDataset

from idlegrad.common.builtin_jobs import digits, lm
from idlegrad.common.eval_sums import combine_sums
from idlegrad.common.job import Job, build, evaluate, evaluation_sums
from idlegrad.coordinator.effects import Evaluated
from idlegrad.coordinator.eval_slots import AUTO_CHEAP_S, WorkerEvaluation, choose, plan_ranges
from idlegrad.coordinator.rounds import RoundCore
from idlegrad.coordinator.sampler import Sampler
from idlegrad.coordinator.scheduler import (Assign, CancelSlots, Decoded, Evicted, Scheduler,
                                            SchedulerConfig)
from .scheduling import Dealing, NoModel
from idlegrad.coordinator.trust import TrustConfig, TrustPolicy


def make(n=400, batch=4, **config) -> Dealing:
    return Dealing(Scheduler(SchedulerConfig(batch_size=batch, **config), Sampler(n, None)))


def assigns(actions, kind=None, worker=None):
    return [a for a in actions if isinstance(a, Assign) and (kind is None or a.kind == kind)
            and (worker is None or a.worker == worker)]


def start(s: Scheduler, worker: str, credits: int, now: float = 0.0) -> list:
    s.join(worker, {"host": worker}, now)
    return s.ready(worker, credits, now)


def answer_round(s: Scheduler, worker: str, slot: int, now: float) -> list:
    ok, actions = s.result(worker, slot, 0.1, now)
    if any(isinstance(a, Decoded) for a in actions):
        actions = actions + s.applied(s.version + 1, now)
    return actions


# the plan and the sums --------------------------------------------------------------------------


def test_ranges_cover_the_test_set_once():
    assert plan_ranges(10, 4) == [[0, 0, 4], [0, 4, 4], [0, 8, 2]]
    assert plan_ranges(8, 4) == [[0, 0, 4], [0, 4, 4]]
    assert plan_ranges(0, 4) == []
    parts = plan_ranges(1001, 64)
    assert sum(p[2] for p in parts) == 1001
    assert [p[1] for p in parts] == list(range(0, 1001, 64))


def test_sums_combine_into_means_over_every_piece():
    parts = [{"loss": (10.0, 4.0), "accuracy": (3.0, 4.0)},
             {"loss": (2.0, 2.0), "accuracy": (0.0, 2.0)}]
    assert combine_sums(parts) == {"loss": 2.0, "accuracy": 0.5}
    # a metric one piece lacks would be a mean over part of the test set: left out
    assert combine_sums([{"loss": (1.0, 1.0), "x": (1.0, 1.0)}, {"loss": (3.0, 1.0)}]) == {
        "loss": 2.0}
    assert combine_sums([{"loss": (0.0, 0.0)}]) == {}  # counted over nothing
    assert combine_sums([]) == {}


def test_default_classification_sums_of_ranges_equal_the_whole_evaluation():
    torch.manual_seed(0)
    built = build(digits())
    model, job, test = built.model.module, built.job, built.test
    whole = evaluate(job, model, test)
    assert set(whole) == {"loss", "accuracy"}
    pieces = [evaluation_sums(job, model, test, p[1], p[2], chunk=7)
              for p in plan_ranges(len(test), 50)]
    combined = combine_sums(pieces)
    assert combined.keys() == whole.keys()
    for name in whole:
        assert combined[name] == pytest.approx(whole[name], rel=1e-6)


def test_a_regression_job_reports_loss_only():
    x = torch.randn(10, 3)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    job = Job(name="regression", build_model=lambda: torch.nn.Linear(3, 1),
              build_datasets=lambda: (data, data),
              loss=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
              build_optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=4)
    built = build(job)
    sums = evaluation_sums(job, built.model.module, built.test, 2, 8, chunk=3)
    assert set(sums) == {"loss"} and sums["loss"][1] == 8
    with torch.no_grad():
        whole = float(job.loss(built.model.module, data[2:10]))
    assert combine_sums([sums]) == pytest.approx({"loss": whole})


def test_lm_bits_per_byte_are_its_loss_in_base_2(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(60):  # enough files that the hash holds some out
        (corpus / f"f{i}.txt").write_text(("hello world %d " % i) * 40)
    job = lm(corpus=str(corpus), size="tiny", context=16, eval_windows=20)
    built = build(job)
    metrics = evaluate(job, built.model.module, built.test)
    assert set(metrics) == {"loss", "bits_per_byte"}
    assert metrics["bits_per_byte"] == pytest.approx(metrics["loss"] / math.log(2))
    pieces = [evaluation_sums(job, built.model.module, built.test, p[1], p[2])
              for p in plan_ranges(20, 6)]
    assert combine_sums(pieces)["loss"] == pytest.approx(metrics["loss"], rel=1e-5)
    assert sum(p["loss"][1] for p in pieces) == 20  # eval_windows, not the whole held-out part


def test_auto_rule():
    assert choose("auto", False, 100.0, 1.0).where == "coordinator"  # means: never workers
    assert choose("workers", True).where == "workers"
    assert choose("coordinator", True).where == "coordinator"
    assert choose("auto", True, AUTO_CHEAP_S / 2, 0.001).where == "coordinator"  # cheap
    assert choose("auto", True, 1.0, 1000.0).where == "coordinator"  # 0.1% of the run
    assert choose("auto", True, 1.0, 50.0).where == "workers"  # 2% of the run


def test_a_worker_evaluation_completes_once_every_range_answered():
    e = WorkerEvaluation(version=3, samples=100, started=10.0, ranges={1: [0, 0, 4], 2: [0, 4, 2]})
    assert not e.answer(1, {"loss": (4.0, 4.0)}, 1.0)
    assert not e.answer(1, {"loss": (400.0, 4.0)}, 1.0)  # a repeat does not count twice
    assert not e.answer(9, {"loss": (0.0, 1.0)}, 1.0)  # not one of its slots
    assert e.answer(2, {"loss": (8.0, 2.0)}, 2.0)
    assert e.metrics() == {"loss": 2.0}
    assert e.seconds(workers=2) == 1.5  # the fleet's compute seconds, per worker


# the scheduler's side slots -------------------------------------------------------------------


def test_side_slots_interleave_with_round_slots():
    s = make(n=400, batch=4)
    first = start(s, "a", 1)
    assert [a.kind for a in assigns(first)] == ["gradient"]
    ids = s.add_side(0, plan_ranges(12, 4), 0.0)
    actions = s.deal(0.0)
    assert len(ids) == 3 and actions == []  # no free credit
    assert s.version_in_use(0)
    kinds = []
    slot = first[0].slot
    for t in range(1, 9):
        out = assigns(answer_round(s, "a", slot, float(t)) if kinds[-1:] != ["eval"]
                      else s.side_result("a", slot, float(t))[1])
        assert len(out) == 1
        kinds.append(out[0].kind)
        slot = out[0].slot
    # one eval slot, then a round's, then the next eval slot: never two eval slots in a row
    # while there is training to do
    assert kinds[:6] == ["eval", "gradient", "eval", "gradient", "eval", "gradient"]
    assert kinds[6:] == ["gradient", "gradient"]  # the evaluation is done
    assert not s.side and not s.version_in_use(0)


def test_side_slots_go_back_to_back_when_there_is_no_training_left():
    s = Dealing(Scheduler(SchedulerConfig(batch_size=4), Sampler(4, 1)))  # one round in all
    first = assigns(start(s, "a", 1))
    answer_round(s, "a", first[0].slot, 1.0)
    assert s.sampler.exhausted
    s.add_side(s.version, plan_ranges(8, 4), 1.0)
    actions = s.deal(1.0)
    (a,) = assigns(actions)
    assert a.kind == "eval" and a.parts == [[0, 0, 4]]
    assert a.version == 1 and a.send_model  # it computed the round at version 0
    ok, actions = s.side_result("a", a.slot, 2.0)
    assert ok
    (b,) = assigns(actions)
    assert b.kind == "eval" and b.parts == [[0, 4, 4]]


def test_eval_slots_go_to_workers_that_answered_a_round_slot_while_one_is_active():
    # a name that only asks for work (a flood of them) must not hold a range for the long
    # deadline of a worker never measured
    s = Dealing(Scheduler(SchedulerConfig(batch_size=4, heartbeat_s=1.0, liveness=3),
                          Sampler(4, 1)))  # one round in all
    first = assigns(start(s, "a", 1))
    answer_round(s, "a", first[0].slot, 1.0)
    assert assigns(start(s, "newcomer", 4, 1.0)) == []
    s.add_side(s.version, plan_ranges(8, 4), 1.0)
    out = assigns(s.deal(1.0))
    assert [(x.worker, x.kind) for x in out] == [("a", "eval")]
    # with nobody proven left, the newcomer takes what is waiting
    s.seen("newcomer", 4.0)
    out = assigns(s.tick(4.1))
    assert out and {x.worker for x in out} == {"newcomer"}


def test_a_vanished_holders_eval_slot_goes_to_another_worker():
    s = make(n=400, batch=4, heartbeat_s=1.0, liveness=3)
    start(s, "a", 2)
    start(s, "b", 1)
    ids = s.add_side(0, plan_ranges(4, 4), 0.0)
    actions = s.deal(0.0)
    assert actions == []  # every credit is taken
    # a answers a round slot: its freed credit takes the eval slot
    a_slot = sorted(s.workers["a"].assigned)[0]
    out = answer_round(s, "a", a_slot, 0.5)
    (evaluation,) = assigns(out, kind="eval")
    assert evaluation.worker == "a" and not evaluation.send_model  # it has version 0
    # a goes silent; b stays heard from
    s.seen("b", 3.0)
    out = s.tick(3.6)
    assert any(isinstance(x, Evicted) and x.worker == "a" for x in out)
    assert ids[0] in s.side and ids[0] not in s.workers["b"].assigned
    # b's next free credit takes it
    b_slot = sorted(s.workers["b"].assigned)[0]
    (again,) = assigns(answer_round(s, "b", b_slot, 3.7), kind="eval")
    assert again.worker == "b" and again.slot == ids[0] and again.parts == [[0, 0, 4]]
    ok, _ = s.side_result("b", ids[0], 4.0)
    assert ok and not s.side
    # a's late answer, from a worker that is gone, is not taken
    assert s.side_result("a", ids[0], 4.1) == (False, [])


def test_a_late_eval_slot_is_handed_out_again_and_the_first_answer_wins():
    s = make(n=400, batch=4, min_deadline_s=5.0)
    start(s, "a", 1)
    start(s, "b", 1)
    s.pause()  # so that the credits freed below go to the eval slot only
    for w in ("a", "b"):
        (slot,) = s.workers[w].assigned
        s.result(w, slot, 0.1, 0.1)
    s.resume(0.2)
    # (resume refilled both with round slots; free one of them for the evaluation)
    ids = s.add_side(s.version, [[0, 0, 4]], 0.3)
    _ = s.deal(0.3)
    (a_round,) = [x for x in s.workers["a"].assigned if x not in s.side]
    (ev,) = assigns(answer_round(s, "a", a_round, 0.4), kind="eval")
    assert ev.worker == "a"
    s.seen("b", 6.0)
    s.seen("a", 6.0)
    s.tick(6.0)  # past its 5 s deadline: requeued, a still holds it
    (b_round,) = [x for x in s.workers["b"].assigned if x not in s.side]
    (copy,) = assigns(answer_round(s, "b", b_round, 6.1), kind="eval")
    assert copy.worker == "b" and copy.slot == ids[0]
    ok, actions = s.side_result("b", ids[0], 6.2)
    assert ok and [c for c in actions if isinstance(c, CancelSlots)] == [CancelSlots("a", ids)]
    assert s.side_result("a", ids[0], 6.3)[0] is False


def test_dropping_an_evaluation_cancels_its_slots():
    s = Dealing(Scheduler(SchedulerConfig(batch_size=4), Sampler(4, 1)))
    first = assigns(start(s, "a", 1))
    answer_round(s, "a", first[0].slot, 1.0)
    s.add_side(s.version, plan_ranges(8, 4), 1.0)
    actions = s.deal(1.0)
    (a,) = assigns(actions)
    out = s.drop_side(2.0)
    assert CancelSlots("a", [a.slot]) in out
    assert not s.side and not s.workers["a"].assigned and not s.version_in_use(s.version)


# the round core ---------------------------------------------------------------------------------


def test_the_core_combines_worker_sums_into_the_evaluation_of_its_version():
    scheduler = Dealing(Scheduler(SchedulerConfig(batch_size=4), Sampler(4, 1)))
    core = RoundCore(scheduler, NoModel(), TrustPolicy(TrustConfig(), reference=1.0))
    core.join("a", {}, "a", 0.0)
    (first,) = assigns(core.ready("a", 1, 0.0))
    core.result("a", first.slot, [torch.zeros(1)], 1.0, 0.1, 0.5, samples=4, loss=1.0)
    out = core.evaluate(plan_ranges(6, 4), 4, 1.0)
    (a,) = assigns(out)
    assert a.kind == "eval" and a.version == 1
    # an answer for another version is dropped, and its range handed out again
    (again,) = assigns(core.evaluated("a", a.slot, 0, {"loss": (1.0, 4.0)}, 0.1, 1.5))
    assert core.counters["eval_results_dropped"] == 1
    assert again.slot == a.slot and again.parts == [[0, 0, 4]]
    # from a worker not holding it: dropped
    assert core.evaluated("b", a.slot, 1, {"loss": (1.0, 4.0)}, 0.1, 1.6) == []
    assert core.counters["eval_results_dropped"] == 2
    out = core.evaluated("a", a.slot, 1, {"loss": (4.0, 4.0), "accuracy": (2.0, 4.0)}, 0.5, 2.0)
    (b,) = assigns(out)
    assert b.parts == [[0, 4, 2]]
    out = core.evaluated("a", b.slot, 1, {"loss": (6.0, 2.0), "accuracy": (2.0, 2.0)}, 0.25, 3.0)
    (done,) = [e for e in out if isinstance(e, Evaluated)]
    assert done == Evaluated(1, 4, {"loss": 10.0 / 6, "accuracy": 4.0 / 6}, 0.75)
    assert core.evaluation is None
