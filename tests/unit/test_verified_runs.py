"""Verified replicas (--verify-replicas) over whole runs, on the in-memory pair
(tests/unit/pair.py; moved from the integration suite, which keeps the run settled on workers
end to end): a worker whose results have an honest size but are wrong (sign-flipped, which the
norm check cannot see) disagrees with the copies of its slots; the coordinator computes those
slots itself, refuses its results and bans it, and training ends with every sample applied once
and the accuracy of a clean run. The flipper is a real worker session whose engine flips what it
computes (--poison flip)."""

from __future__ import annotations

from idlegrad.coordinator.server import CoordinatorConfig
from idlegrad.coordinator.target import Target
from idlegrad.coordinator.trust import TrustConfig

from .pair import Pair

# In virtual time and a fixed order, a clean run and an attacked one differ by the attacker's
# refused results only: fewer epochs than with real processes tell them apart.
EPOCHS = 2
ACCURACY_SLACK = 0.03  # what a sign-flipped gradient let through would cost is far more
FLIP = ("flip", -1.0)


def verified(honest: int, epochs: int = EPOCHS, ban_after: int = 3, evil: bool = False,
             **config) -> Pair:
    pair = Pair(CoordinatorConfig(**{
        "job": "digits", "epochs": epochs, "redundancy": "replicate:2", "verify_replicas": True,
        "trust": TrustConfig(ban_after=ban_after), "heartbeat_s": 0.5, "eval_every": 3600,
        **config}))
    for i in range(honest):
        pair.worker(f"w{i + 1}")
    if evil:  # it joins a run under way
        pair.run(until=lambda: pair.coordinator.version >= 3, finish=False)
        pair.worker("evil", poison=FLIP)
    pair.run()
    pair.close()
    return pair


def honest_ones_done(pair: Pair) -> bool:
    return all(w.left is not None and not w.left.refused and w.computed
               for w in pair.workers.values() if w.name != "evil")


def test_a_worker_flipping_signs_is_caught_by_its_replicas_and_banned():
    clean = verified(4)
    final = clean.final()  # its tallies are the whole run's
    assert clean.coordinator.snapshot()["redundancy"]["verify_replicas"]
    assert final["scheduler"].get("replicas_agreed", 0) > 0, final["scheduler"]
    assert final["scheduler"].get("replicas_disagreed", 0) == 0, final["scheduler"]  # honest
    assert not final["counters"].get("gradients_rejected"), final["counters"]

    pair = verified(4, evil=True)
    evil = pair.workers[b"evil"]
    assert evil.left is not None and evil.left.refused and "banned" in evil.left.reason
    last = pair.coordinator.snapshot()
    assert "evil" in last["trust"]["banned"]
    assert last["trust"]["offenders"]["evil"]["reasons"].get("replica", 0) >= 3, last["trust"]
    assert pair.counters["workers_banned"] == 1
    assert pair.events("replicas_disagreed") and pair.events("banned", "evil")
    attacked = pair.final()
    assert attacked["reason"] == "epochs"
    # every sample applied exactly once
    assert attacked["samples"] == EPOCHS * len(pair.coordinator.training.built.train)
    assert attacked["scheduler"].get("replicas_disagreed", 0) >= 3, attacked["scheduler"]
    assert attacked["counters"].get("rejected_replica", 0) >= 3, attacked["counters"]
    accuracy = final["metrics"]["accuracy"]
    print(f"accuracy: clean {accuracy:.4f}, with a sign-flipping worker "
          f"{attacked['metrics']['accuracy']:.4f}")
    assert attacked["metrics"]["accuracy"] >= accuracy - ACCURACY_SLACK, (accuracy, attacked)
    assert set(last["trust"]["offenders"]) == {"evil"}, last["trust"]  # no honest one refused
    assert honest_ones_done(pair)


def test_local_tasks_with_verified_replicas_reach_the_target_and_ban_a_sign_flipper():
    pair = verified(3, epochs=100, ban_after=2, evil=True, task="local:8",
                    target=Target.parse("accuracy=0.9"), eval_every=0.5)
    final, last = pair.final(), pair.coordinator.snapshot()
    print(f"local: {final['metrics']}; trust {last['trust']}; counters {last['counters']}")
    assert final["reason"] == "target" and final["metrics"]["accuracy"] >= 0.9
    assert final["scheduler"].get("replicas_agreed", 0) > 0, final["scheduler"]
    # the flipper's changes were refused whenever they were compared; no honest one ever was
    assert set(last["trust"]["offenders"]) <= {"evil"}, last["trust"]
    assert honest_ones_done(pair)
    if final["counters"].get("rejected_replica", 0) >= 2:  # ban_after 2
        evil = pair.workers[b"evil"]
        assert final["counters"]["workers_banned"] == 1, final["counters"]
        assert evil.left is not None and "banned" in evil.left.reason
