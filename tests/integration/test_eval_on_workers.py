"""Evaluation as tasks (`--eval-on workers`), end to end: a real coordinator hands ranges of the
test set to real workers and combines their sums; the coordinator evaluates nothing itself
during the run. (An evaluation surviving the death of a worker holding one of its slots, and
this run's rules, are checked on the in-memory pair: tests/unit/test_eval_on_workers.py.)"""

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

