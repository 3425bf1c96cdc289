"""Exactly once across reconnects: the coordinator freezes (SIGSTOP) for longer than the workers'
liveness, so every worker gives its connection up and reconnects; results it sent into the
frozen connection were never acknowledged, so it resends them to the same coordinator process,
which resumes its session (it keeps its slots). Every sample is applied exactly once."""

from __future__ import annotations

import os
import signal
import time

import pytest

from .harness import final_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SLOW_DIGITS = ("--job", "digits", "--job-arg", "hidden=4096")


def test_frozen_coordinator_workers_resume_their_sessions_and_resend(cluster, digits_train_size):
    epochs = 200  # long enough to outlast up to five freezes on a fast data path
    total = epochs * digits_train_size
    ckpt = cluster.dir / "ckpt"
    # Heartbeats of 0.5 s and liveness 3: workers give up after 1.5 s of silence. The coordinator
    # evicts on its own clock, which does not run while it is stopped.
    # Asynchronous rounds: a worker keeps computing its two credits' slots, so results queue up
    # behind a frozen connection (in a sync round each worker has sent its one part and waits).
    coordinator, workers = cluster.start_together(
        [*SLOW_DIGITS, "--epochs", str(epochs), "--checkpoint-dir", str(ckpt), "--async"],
        ["w1", "w2"])
    status = cluster.status()
    status.wait_for(lambda s: all(w["done"] >= 3 for w in s["workers"]) and len(s["workers"]) == 2,
                    "both workers computing", alive=[coordinator, *workers])
    # A result sent while the coordinator is frozen is resent only if it was still in the
    # worker's queue when the worker gave its connection up; one the kernel's buffers had taken
    # reaches the coordinator on the old connection when it wakes. Which happens depends on the
    # buffers, so the coordinator is frozen again (up to five times) until a worker has resent.
    for freeze in range(5):
        os.kill(coordinator.pid, signal.SIGSTOP)
        time.sleep(3.0)
        os.kill(coordinator.pid, signal.SIGCONT)
        status.wait_for(lambda s: s["counters"].get("sessions_resumed", 0) >= 2 * (freeze + 1),
                        "the workers resuming their sessions", timeout=60, alive=[coordinator])
        time.sleep(1.0)
        if freeze >= 1 and any("resent" in w.output() for w in workers):
            break
    assert status.follow(coordinator) == 0
    for w in workers:
        assert w.wait(timeout=30) == 0
    logs = "".join(w.output() for w in workers)
    assert "lost the coordinator" in logs  # they did give their connections up
    assert "resent" in logs, logs[-3000:]
    snap = status.last
    assert snap["counters"].get("sessions_resumed", 0) >= 2
    final = final_metrics(ckpt / "metrics.jsonl")
    assert final["reason"] == "epochs"
    assert final["samples"] == total, (final["samples"], total)
    cluster.assert_no_tracebacks()
