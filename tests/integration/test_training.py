"""The happy path: a coordinator and two workers train the built-in digits job to a target."""

from __future__ import annotations

import pytest

from .harness import final_metrics, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_two_workers_train_digits_to_target_and_everyone_exits_cleanly(cluster):
    ckpt = cluster.dir / "ckpt"
    # Training to 0.9 takes well under a second: both workers must join at the same moment.
    coordinator, workers = cluster.start_together(
        ["--job", "digits", "--target", "accuracy=0.9", "--epochs", "100",
         "--checkpoint-dir", str(ckpt)], ["w1", "w2"])
    status = cluster.status()

    assert status.follow(coordinator) == 0, "the coordinator did not exit 0 by itself"
    for worker in workers:
        assert worker.wait(timeout=30) == 0, f"{worker.name} did not exit 0"
        assert "training finished (target)" in worker.output(), f"{worker.name} got no SHUTDOWN"

    log = coordinator.output()
    for worker in workers:
        assert f"join: {worker.name} joined" in log
    final = final_metrics(ckpt / "metrics.jsonl")
    assert final["reason"] == "target"
    assert final["metrics"]["accuracy"] >= 0.9
    assert final["version"] > 0 and final["samples"] > 0
    records = read_metrics(ckpt / "metrics.jsonl")
    assert [r["version"] for r in records] == sorted(r["version"] for r in records)
    assert "start: job digits at version 0" in log
    cluster.assert_no_tracebacks()
