"""Local-SGD tasks (issue 9) with real processes: a coordinator applying an outer optimizer to the
parameter changes that real workers return after H inner steps of the job's optimizer."""

from __future__ import annotations

import pytest

from .harness import final_metrics, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_local_tasks_train_digits_to_target_over_emulated_slow_links_with_bf16_results(cluster):
    ckpt = cluster.dir / "ckpt"
    coordinator, workers = cluster.start_together(
        ["--job", "digits", "--task", "local:8", "--target", "accuracy=0.9", "--epochs", "100",
         "--result-dtype", "bfloat16", "--checkpoint-dir", str(ckpt)], ["w1", "w2"],
        worker_args=("--link-mbps", "20"))
    status = cluster.status()

    assert status.follow(coordinator) == 0, "the coordinator did not exit 0 by itself"
    for worker in workers:
        assert worker.wait(timeout=30) == 0, f"{worker.name} did not exit 0"
    final = final_metrics(ckpt / "metrics.jsonl")
    assert final["reason"] == "target"
    assert final["metrics"]["accuracy"] >= 0.9
    assert final["task"] == "local:8"
    # A round is a slot of 8 inner steps of the job's batch (32): versions count outer steps.
    assert final["samples"] >= 8 * 32 * final["version"] * 0.5
    # Per slot of 256 samples: the change up in bfloat16 (2 bytes a parameter), the model down
    # in float32 (4 bytes; not when the worker holds that version already), plus small messages.
    params = 64 * 128 + 128 + 128 * 10 + 10
    assert 2 * params / 256 < final["bytes_per_sample"] < 1.5 * 6 * params / 256
    assert status.last["task"] == "local:8"
    cluster.assert_no_tracebacks()


def test_local_worker_kill9_mid_slot_loses_and_duplicates_nothing(cluster, digits_train_size):
    epochs = 40  # long enough to outlast the eviction (3 heartbeats of 0.5 s)
    total = epochs * digits_train_size
    ckpt = cluster.dir / "ckpt"
    coordinator, (survivor, victim) = cluster.start_together(
        ["--job", "digits", "--job-arg", "hidden=4096", "--task", "local:4",
         "--redundancy", "replicate:2", "--epochs", str(epochs), "--checkpoint-dir", str(ckpt)],
        ["survivor", "victim"])
    status = cluster.status()

    def both_working(s):
        done = {w["id"] for w in s["workers"] if w["done"] > 0}
        return done == {"survivor", "victim"} and s["version"] >= 5

    before = status.wait_for(both_working, "both workers returning results",
                             alive=[coordinator, survivor, victim])
    victim.kill9()
    assert before["state"] == "training" and before["samples"] < total, \
        "training was over before the kill: the test cannot tell anything"
    status.wait_for(lambda s: status.events_of("leave", "victim"), "eviction of the killed worker",
                    alive=[coordinator])

    assert status.follow(coordinator) == 0
    assert survivor.wait(timeout=30) == 0
    assert victim.returncode == -9
    final = final_metrics(ckpt / "metrics.jsonl")
    assert final["reason"] == "epochs"
    # Every sample exactly once per epoch: none lost with the killed worker, none applied twice.
    assert final["samples"] == total, (final["samples"], total)
    assert final["version"] > before["version"]
    assert status.last["redundancy"]["rounds_by_code"].get("replicate", 0) > 0
    records = read_metrics(ckpt / "metrics.jsonl")
    assert records[-1]["metrics"]["accuracy"] > 0.8
    cluster.assert_no_tracebacks()


def test_local_task_with_gradient_coding_is_refused_in_one_line(cluster):
    coordinator = cluster.coordinator("--job", "digits", "--task", "local:10",
                                      "--redundancy", "cyclic:1")
    assert coordinator.wait(timeout=60) == 2
    said = coordinator.said()
    assert len(said) == 1 and "cyclic cannot be used with --task local" in said[0], said
