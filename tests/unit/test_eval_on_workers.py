"""Evaluation as tasks (`--eval-on workers`), on the in-memory pair (tests/unit/pair.py; moved
from the integration suite, which keeps one run of it end to end): the coordinator hands ranges
of the test set to workers and combines their sums; it evaluates nothing itself during the run,
and an evaluation survives the worker holding one of its slots being killed."""

from __future__ import annotations

from idlegrad.coordinator.server import CoordinatorConfig

from .pair import Pair


def evaluations(records: list[dict]) -> tuple[list[dict], dict]:
    """The metrics log's evaluations during the run (each the workers'), and its final line.
    The coordinator's only evaluation is the last word: of the final model, after training."""
    final = records[-1]
    assert final.get("final") is True, final
    evals = [r for r in records[:-1] if r.get("metrics")]
    own = [r for r in evals if r["eval_on"] == "coordinator"]
    assert len(own) <= 1 and final["counters"].get("evaluations_coordinator", 0) == len(own)
    if own:
        assert own[0] is evals[-1] and own[0]["version"] == final["version"], evals
    during = [r for r in evals if r["eval_on"] != "coordinator"]
    assert {r["eval_on"] for r in during} <= {"workers"}
    return during, final


def check_evaluated_on_workers(records: list[dict], samples: int) -> None:
    """A run evaluated on workers (its metrics log `records`), which applied `samples`: the
    workers' evaluations track the training, and the coordinator made none but the last."""
    during, final = evaluations(records)
    assert len(during) >= 2, "evaluations during the run"
    assert all(set(r["metrics"]) == {"loss", "accuracy"} for r in during)
    counters = final["counters"]
    assert counters["evaluations_workers"] == len(during)
    assert final["metrics"]["accuracy"] > 0.85, final
    # the workers' evaluations track the training: the last is far better than the first
    assert during[-1]["metrics"]["loss"] < 0.5 * during[0]["metrics"]["loss"], during
    # evaluation slots are not training: the samples applied are the epochs' exactly
    assert final["samples"] == samples
    assert final["scheduler"]["side_answered"] >= 2


def run(tmp_path, epochs: int, every: float) -> Pair:
    return Pair(CoordinatorConfig(job="digits", epochs=epochs, eval_on="workers",
                                  eval_every=every, metrics_path=str(tmp_path / "metrics.jsonl"),
                                  heartbeat_s=0.5))


def test_workers_evaluate_and_the_coordinator_does_not(tmp_path):
    epochs = 6
    pair = run(tmp_path, epochs, every=0.2)
    workers = [pair.worker("w1"), pair.worker("w2")]
    pair.run()
    pair.close()
    assert all(w.left is not None and not w.left.refused for w in workers)
    check_evaluated_on_workers(pair.metrics(),
                               epochs * len(pair.coordinator.training.built.train))


def test_an_evaluation_survives_its_workers_death(tmp_path):
    pair = run(tmp_path, 3, every=0.3)
    victim = pair.worker("victim")

    def holding() -> bool:
        evaluation = pair.coordinator.snapshot()["evaluation"]
        return evaluation is not None and "victim" in evaluation["holders"]

    pair.run(until=holding, finish=False)
    in_flight = pair.coordinator.snapshot()["evaluation"]["version"]
    victim.kill()
    steady = pair.worker("steady")
    pair.run()
    pair.close()
    assert steady.left is not None and not steady.left.refused
    during, final = evaluations(pair.metrics())
    # the evaluation the victim held a slot of was completed, by the others, on the workers
    assert any(r["version"] == in_flight and r["eval_on"] == "workers" for r in during), during
    assert final["scheduler"]["side_requeued"] >= 1
    assert pair.events("leave", "victim")
    assert final["metrics"]["accuracy"] > 0.8, final
