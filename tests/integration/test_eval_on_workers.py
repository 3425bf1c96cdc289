"""Evaluation as tasks (`--eval-on workers`), end to end: a real coordinator hands ranges of the
test set to real workers and combines their sums; the coordinator evaluates nothing itself
during the run, and an evaluation survives the worker holding one of its slots being killed."""

from __future__ import annotations

import pytest

from .harness import DEADLINE, final_metrics, read_metrics

pytestmark = pytest.mark.integration


def evaluations(path) -> tuple[list[dict], dict]:
    """The metrics log's evaluations during the run (each the workers'), and its final line.
    The coordinator's only evaluation is the last word: of the final model, after training."""
    final = final_metrics(path)
    evals = [r for r in read_metrics(path)[:-1] if r.get("metrics")]
    own = [r for r in evals if r["eval_on"] == "coordinator"]
    assert len(own) <= 1 and final["counters"].get("evaluations_coordinator", 0) == len(own)
    if own:
        assert own[0] is evals[-1] and own[0]["version"] == final["version"], evals
    during = [r for r in evals if r["eval_on"] != "coordinator"]
    assert {r["eval_on"] for r in during} <= {"workers"}
    return during, final


def test_workers_evaluate_and_the_coordinator_does_not(cluster, digits_train_size):
    metrics = cluster.dir / "metrics.jsonl"
    coordinator, workers = cluster.start_together(
        ["--job", "digits", "--epochs", "20", "--eval-on", "workers", "--eval-every", "0.2",
         "--metrics", str(metrics)], ["w1", "w2"])
    assert coordinator.wait(DEADLINE) == 0, cluster.report()
    for proc in workers:
        assert proc.wait(DEADLINE) == 0, cluster.report()
    during, final = evaluations(metrics)
    assert len(during) >= 2, "evaluations during the run"
    assert all(set(r["metrics"]) == {"loss", "accuracy"} for r in during)
    counters = final["counters"]
    assert counters["evaluations_workers"] == len(during)
    assert final["metrics"]["accuracy"] > 0.85, final
    # the workers' evaluations track the training: the last is far better than the first
    assert during[-1]["metrics"]["loss"] < 0.5 * during[0]["metrics"]["loss"], during
    # evaluation slots are not training: the samples applied are the epochs' exactly
    assert final["samples"] == 20 * digits_train_size
    assert final["scheduler"]["side_answered"] >= 2
    cluster.assert_no_tracebacks()


def test_an_evaluation_survives_its_workers_death(cluster):
    metrics = cluster.dir / "metrics.jsonl"
    # every slot of the victim stalls 5 s: it holds an evaluation slot long enough to be killed
    # with it
    coordinator, (victim,) = cluster.start_together(
        ["--job", "digits", "--epochs", "3", "--eval-on", "workers", "--eval-every", "0.3",
         "--metrics", str(metrics)], ["victim"], ["--stall", "1:5"])
    status = cluster.status()
    snap = status.wait_for(
        lambda s: s.get("evaluation") is not None and "victim" in s["evaluation"]["holders"],
        "the victim holding an evaluation slot", alive=[coordinator, victim])
    in_flight = snap["evaluation"]["version"]
    victim.kill9()
    # slowed (each slot sleeps 30 times its compute) so that the training outlasts the victim's
    # eviction (1.5 s of silence): alone at full speed it finished in a tenth of a second, and
    # the evaluation in flight with it
    steady = cluster.worker("steady", "--slowdown", "30")
    assert status.follow(coordinator) == 0, cluster.report()
    assert steady.wait(DEADLINE) == 0, cluster.report()
    during, final = evaluations(metrics)
    # the evaluation the victim held a slot of was completed, by the others, on the workers
    assert any(r["version"] == in_flight and r["eval_on"] == "workers" for r in during), during
    assert final["scheduler"]["side_requeued"] >= 1
    assert status.events_of("leave", "victim")
    assert final["metrics"]["accuracy"] > 0.8, final
