"""Failure is an input: kill -9 a worker, kill -9 the coordinator, SIGSTOP a worker past its
eviction; every sample is applied exactly once per epoch all the same.

The digits job runs with a wider hidden layer (a job argument that travels to the workers) so that
training lasts a few seconds: long enough to kill something in the middle of it on any machine.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from idlegrad.coordinator import checkpoint

from .harness import final_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SLOW_DIGITS = ("--job", "digits", "--job-arg", "hidden=4096")


def computing(snap: dict) -> set[str]:
    return {w["id"] for w in snap["workers"] if w["done"] > 0}


def two_workers_mid_training(cluster, names: list[str], epochs: int, total: int, ckpt):
    """Slow digits with two workers, caught once both return results and the model has stepped a
    few times, with most of the `total` samples still to go: the moment to break something.
    Returns the coordinator, the workers, the status feed and that snapshot."""
    coordinator, workers = cluster.start_together(
        [*SLOW_DIGITS, "--epochs", str(epochs), "--checkpoint-dir", str(ckpt)], names)
    status = cluster.status()
    before = status.wait_for(
        lambda s: computing(s) == set(names) and s["version"] >= 20,
        "both workers returning results", alive=[coordinator, *workers])
    assert before["state"] == "training" and before["samples"] < total, \
        "training was over before the fault: the test cannot tell anything"
    return coordinator, workers, status, before


def test_worker_kill9_mid_training_loses_and_duplicates_nothing(cluster, digits_train_size):
    epochs = 30  # long enough to outlast the eviction (3 heartbeats of 0.5 s) on a fast machine
    total = epochs * digits_train_size
    ckpt = cluster.dir / "ckpt"
    coordinator, (survivor, victim), status, before = two_workers_mid_training(
        cluster, ["survivor", "victim"], epochs, total, ckpt)
    victim.kill9()

    # The silent worker is evicted after 3 missed heartbeats, and what it held goes back: its
    # part of a synchronous round (the default) speculated to the survivor once late, which is
    # before the eviction, or requeued at the eviction.
    status.wait_for(lambda s: status.events_of("leave", "victim"), "eviction of the killed worker",
                    alive=[coordinator])
    (leave,) = status.events_of("leave", "victim")
    requeued = int(re.search(r"(\d+) slots? requeued", leave["text"]).group(1))
    speculated = status.last["redundancy"]["slots_speculated"]
    assert "silent" in leave["text"] and requeued + speculated > 0, (leave, speculated)
    assert status.last["rounds"].get("slots_requeued", 0) >= requeued
    assert status.last["rounds"].get("workers_removed", 0) >= 1

    assert status.follow(coordinator) == 0
    assert survivor.wait(timeout=30) == 0
    assert "training finished (epochs)" in survivor.output()
    assert victim.returncode == -9

    final = final_metrics(ckpt / "metrics.jsonl")
    assert final["reason"] == "epochs"
    # Every sample exactly once per epoch: none lost with the killed worker, none applied twice.
    assert final["samples"] == total, (final["samples"], total)
    assert final["version"] > before["version"]
    assert "Traceback" not in coordinator.output() + survivor.output()


def test_coordinator_kill9_and_restart_resumes_from_checkpoint(cluster, digits_train_size):
    epochs = 15
    total = epochs * digits_train_size
    ckpt = cluster.dir / "ckpt"
    args = (*SLOW_DIGITS, "--epochs", str(epochs), "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", "0.5")
    first, workers = cluster.start_together(args, ["w1", "w2"])
    status = cluster.status()

    def saved_versions() -> list[int]:
        return [int(m.group(1)) for e in status.events_of("checkpoint")
                if (m := re.search(r"version (\d+) saved", e["text"]))]

    before = status.wait_for(
        lambda s: computing(s) == {"w1", "w2"} and any(v > 0 for v in saved_versions()),
        "a checkpoint taken mid-training", alive=[first, *workers])
    first.kill9()
    assert before["state"] == "training" and before["samples"] < total, \
        "training was over before the kill: the test cannot tell anything"
    status.close()

    state = checkpoint.load(str(ckpt))
    assert state is not None
    saved_version, saved_samples = int(state["version"]), int(state["samples"])
    assert saved_version > 0 and 0 < saved_samples < total

    second = cluster.coordinator(*args)
    status = cluster.status()
    resumed = status.wait_for(lambda s: True, "answer from the restarted coordinator",
                              alive=[second])
    assert resumed["version"] >= saved_version
    assert "resumed from" in second.output()
    # The workers find the new coordinator process by themselves.
    status.wait_for(lambda s: {w["id"] for w in s["workers"]} == {"w1", "w2"}
                    or not second.running(), "both workers rejoining", alive=[])
    assert status.follow(second) == 0
    for worker in workers:
        assert worker.wait(timeout=30) == 0, f"{worker.name} did not exit 0"
        assert "training finished (epochs)" in worker.output()
        assert f"join: {worker.name} joined" in second.output()

    final = final_metrics(ckpt / "metrics.jsonl")
    assert final["reason"] == "epochs"
    # Rounds open at the checkpoint were replanned, rounds applied after it were redone: exactly
    # one pass over the data per epoch, across both coordinator processes.
    assert final["samples"] == total, (final["samples"], total)
    assert final["version"] > saved_version
    assert "Traceback" not in second.output() + "".join(w.output() for w in workers)


def test_worker_stopped_past_eviction_rejoins_and_its_late_work_is_not_applied_twice(
        cluster, digits_train_size):
    epochs = 25
    total = epochs * digits_train_size
    ckpt = cluster.dir / "ckpt"
    coordinator, (steady, sleeper), status, _ = two_workers_mid_training(
        cluster, ["steady", "sleeper"], epochs, total, ckpt)
    os.kill(sleeper.pid, signal.SIGSTOP)  # a laptop lid closed mid-task
    try:
        status.wait_for(lambda s: status.events_of("leave", "sleeper"),
                        "eviction of the stopped worker", alive=[coordinator])
    finally:
        os.kill(sleeper.pid, signal.SIGCONT)
    (leave,) = status.events_of("leave", "sleeper")
    assert "silent" in leave["text"], leave

    # It wakes up holding slots the coordinator has given away: whatever it sends is refused
    # until it shakes hands again, and then it is back in the fleet.
    status.wait_for(lambda s: len(status.events_of("join", "sleeper")) >= 2,
                    "the woken worker rejoining", alive=[coordinator, sleeper])
    assert status.follow(coordinator) == 0
    for worker in (steady, sleeper):
        assert worker.wait(timeout=30) == 0, f"{worker.name} did not exit 0"
        assert "training finished (epochs)" in worker.output()

    final = final_metrics(ckpt / "metrics.jsonl")
    assert final["reason"] == "epochs"
    assert final["samples"] == total, (final["samples"], total)
    cluster.assert_no_tracebacks()


def test_sigterm_stops_the_coordinator_within_a_moment_whatever_its_heartbeat(cluster):
    """The loop waits for its next tick (half a heartbeat: 30 s here); a signal must wake it."""
    coordinator = cluster.coordinator("--job", "synthetic", "--job-arg", "params=100",
                                      "--epochs", "100000", "--heartbeat", "60",
                                      "--eval-every", "3600")
    status = cluster.status()
    status.wait_for(lambda s: s["state"] in ("waiting", "training"), "the coordinator up",
                    alive=[coordinator])
    sent = time.monotonic()
    os.kill(coordinator.pid, signal.SIGTERM)
    assert coordinator.wait(timeout=20) == 0, coordinator.tail()
    assert time.monotonic() - sent < 5, f"took {time.monotonic() - sent:.1f}s to stop"
    assert "Traceback" not in coordinator.output()
