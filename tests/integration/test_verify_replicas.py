"""Verified replicas (--verify-replicas) with real processes: a worker whose results have an honest
size but are wrong (sign-flipped, which the norm check cannot see) disagrees with the copies of its
slots; the coordinator computes those slots itself, refuses its results and bans it, and training
ends with every sample applied once and the accuracy of a clean run.

End to end here: the run settled on workers, and the refusal without replication. The runs with
the coordinator settling (gradient and local tasks) are on the in-memory pair:
tests/unit/test_verified_runs.py."""

from __future__ import annotations

import pytest

from .harness import final_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

VERIFIED = ("--redundancy", "replicate:2", "--verify-replicas")


def test_verify_replicas_without_replication_is_refused_in_one_line(cluster):
    coordinator = cluster.coordinator("--job", "digits", "--verify-replicas")
    assert coordinator.wait() == 2
    said = coordinator.said()
    assert len(said) == 1 and "needs --redundancy replicate:R" in said[0], said


def test_settled_on_workers_a_sign_flipper_is_still_refused_and_banned(cluster, digits_train_size):
    """--settle-on workers: each disagreement is computed by a third worker, not the
    coordinator; its result decides, and the flipper is refused and banned as before."""
    ckpt = cluster.dir / "ckpt"
    # asynchronous rounds on five workers: 10 epochs ended at 0.85 once in CI, 20 leave a margin
    epochs = 20
    # Nothing dealt before all five joined (--min-workers): their hellos reach the new
    # coordinator up to a reconnect interval apart, and a dispute between the first two to join
    # had no third worker to settle it (settled_here_no_third, once in CI).
    coordinator, workers = cluster.start_together(
        ["--job", "digits", "--epochs", str(epochs), "--checkpoint-dir", str(ckpt),
         "--ban-after", "3", "--settle-on", "workers", "--min-workers", "5", *VERIFIED],
        ["w1", "w2", "w3", "w4"], others=[("evil", ("--poison", "flip"))])
    *workers, evil = workers
    status = cluster.status()
    status.wait_for(lambda s: "evil" in s["trust"]["banned"], "the sign-flipping worker banned",
                    alive=[coordinator])
    assert evil.wait(timeout=60) != 0 and "banned" in evil.output()
    assert status.follow(coordinator) == 0
    final = final_metrics(ckpt / "metrics.jsonl")
    counters = final["counters"]
    assert final["samples"] == epochs * digits_train_size  # every sample applied exactly once
    assert counters.get("rejected_replica", 0) >= 3, counters
    # settled by third workers: the coordinator computed none of them
    assert counters.get("settled_by_workers", 0) >= 3, counters
    assert not counters.get("settled_here_no_third"), counters
    assert status.events_of("settled")
    assert set(final["trust"]["offenders"]) == {"evil"}, final["trust"]  # no honest one refused
    print(f"accuracy {final['metrics']['accuracy']:.4f}")
    assert final["metrics"]["accuracy"] > 0.9, final["metrics"]
    for w in workers:
        assert w.wait(timeout=30) == 0
    cluster.assert_no_tracebacks()
