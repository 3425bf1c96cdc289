"""A hostile worker among honest ones: its scaled gradients are refused (none is applied), it is
banned after repeated offences, it is told so and leaves, and training reaches the accuracy a
clean run does."""

from __future__ import annotations

import pytest

from .harness import final_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# A run of 20 epochs lasts about a second here, and settling the attacker's three results holds
# the coordinator's rounds for a fifth of it: on a 2-core machine loaded four deep, the rounds
# applied meanwhile came in stale and weighted down, and one such run ended at 0.911 against
# its clean run's 0.961 (loss 0.28 against 0.10: not trained as far). Twice the epochs halve
# that share, and train both runs closer to where they level off.
EPOCHS = 40
# Asynchronous runs differ by a little even without an attacker (the order results arrive in).
# A gradient scaled x1000 that got through would cost far more than this.
ACCURACY_SLACK = 0.03


def clean_accuracy(cluster) -> float:
    ckpt = cluster.dir / "clean"
    coordinator, workers = cluster.start_together(
        ["--job", "digits", "--epochs", str(EPOCHS), "--checkpoint-dir", str(ckpt)],
        ["c1", "c2", "c3", "c4", "c5"])
    assert coordinator.wait() == 0
    for w in workers:
        assert w.wait(timeout=30) == 0
    return final_metrics(ckpt / "metrics.jsonl")["metrics"]["accuracy"]


def test_a_worker_sending_scaled_gradients_is_refused_and_banned(cluster, digits_train_size):
    clean = clean_accuracy(cluster)
    poison = "scale:1000"
    ckpt = cluster.dir / "ckpt"
    coordinator, workers = cluster.start_together(
        ["--job", "digits", "--epochs", str(EPOCHS), "--checkpoint-dir", str(ckpt),
         "--ban-after", "3"], ["w1", "w2", "w3", "w4"])
    evil = cluster.worker("evil", "--poison", poison)
    status = cluster.status()
    seen_evil = []

    def banned(snap: dict) -> bool:
        seen_evil.extend(w for w in snap["workers"] if w["id"] == "evil")
        return "evil" in snap["trust"]["banned"]

    snap = status.wait_for(banned, "the poisoned worker banned", alive=[coordinator])
    assert evil.wait(timeout=60) != 0
    assert "banned" in evil.output()
    assert snap["counters"]["rejected_norm"] == 3, snap["counters"]
    assert snap["counters"]["workers_banned"] == 1
    assert snap["trust"]["offenders"]["evil"]["offences"] == 3
    assert not any(w["done"] for w in seen_evil), seen_evil  # not one of its results was used
    assert status.events_of("banned", "evil")
    assert status.follow(coordinator) == 0
    final = final_metrics(ckpt / "metrics.jsonl")
    assert final["reason"] == "epochs"
    assert final["samples"] == EPOCHS * digits_train_size
    print(f"accuracy: clean {clean:.4f}, with a poisoned worker {final['metrics']['accuracy']:.4f}")
    assert final["metrics"]["accuracy"] >= clean - ACCURACY_SLACK, (clean, final["metrics"])
    # no honest worker was ever refused
    assert set(status.last["trust"]["offenders"]) == {"evil"}, status.last["trust"]
    for w in workers:
        assert w.wait(timeout=30) == 0
    cluster.assert_no_tracebacks()
