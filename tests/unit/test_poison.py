"""A hostile worker among honest ones (moved from the integration suite onto the in-memory pair,
tests/unit/pair.py): its scaled gradients are refused (none is applied), it is banned after
repeated offences, it is told so and leaves, and training reaches the accuracy a clean run does.
The hostile worker is a real worker session whose engine scales what it computes (--poison)."""

from __future__ import annotations

from idlegrad.coordinator import ledger
from idlegrad.coordinator.server import CoordinatorConfig
from idlegrad.coordinator.trust import TrustConfig

from .pair import Pair

# The pair runs in virtual time, in a fixed order: a clean run and a poisoned one differ by the
# attacker's refused results only, so fewer epochs than with real processes tell them apart.
EPOCHS = 4
ACCURACY_SLACK = 0.03  # a gradient scaled x1000 that got through would cost far more than this


def run(tmp_path, name: str, honest: int, poison=None) -> Pair:
    pair = Pair(CoordinatorConfig(
        job="digits", epochs=EPOCHS, heartbeat_s=0.5, eval_every=3600,
        ledger_path=str(tmp_path / f"{name}.jsonl"), trust=TrustConfig(ban_after=3)))
    for i in range(honest):
        pair.worker(f"{name}{i + 1}")
    if poison is not None:  # it joins a run under way, as in the integration suite
        pair.run(until=lambda: pair.coordinator.version >= 5, finish=False)
        pair.worker("evil", poison=poison)
    pair.run()
    pair.close()
    return pair


def test_a_worker_sending_scaled_gradients_is_refused_and_banned(tmp_path):
    clean = run(tmp_path, "c", 5).final()["metrics"]["accuracy"]
    pair = run(tmp_path, "w", 4, poison=("scale", 1000.0))
    evil = pair.workers[b"evil"]
    assert evil.left is not None and evil.left.refused and "banned" in evil.left.reason
    snap = pair.coordinator.snapshot()
    assert "evil" in snap["trust"]["banned"]
    assert pair.counters["rejected_norm"] == 3, pair.counters
    assert pair.counters["workers_banned"] == 1
    assert snap["trust"]["offenders"]["evil"]["offences"] == 3
    acks = [r for r in ledger.read(str(tmp_path / "w.jsonl")) if r["event"] == "ack"]
    evils = [r for r in acks if r["worker"] == "evil"]
    assert len(evils) >= 3 and not any(r["used"] for r in evils)  # not one of its results used
    assert pair.coordinator.training.credits.accounts["evil"].samples == 0  # nor credited
    assert pair.events("banned", "evil")
    final = pair.final()
    assert final["reason"] == "epochs"
    assert final["trust"]["banned"] == ["evil"]  # in the log, for after the status is gone
    assert final["samples"] == EPOCHS * len(pair.coordinator.training.built.train)
    print(f"accuracy: clean {clean:.4f}, with a poisoned worker {final['metrics']['accuracy']:.4f}")
    assert final["metrics"]["accuracy"] >= clean - ACCURACY_SLACK, (clean, final["metrics"])
    assert set(snap["trust"]["offenders"]) == {"evil"}  # no honest worker was ever refused
    honest = [w for w in pair.workers.values() if w is not evil]
    assert all(w.left is not None and not w.left.refused and w.computed for w in honest)
