"""Stragglers cost nothing (issue 3), on the in-memory pair (tests/unit/pair.py): a worker frozen
(SIGSTOP) mid-training does not block rounds under a redundant code, speculation off, so the code
alone carries the rounds. The heartbeat is long (5 s: eviction after 15 virtual seconds), so the
rounds that decode while the frozen worker is still registered and holding slots decode because
of the code, not because it was evicted. Each code here; tests/integration/test_stragglers.py
keeps one run with real processes and a real SIGSTOP."""

from __future__ import annotations

import pytest

from idlegrad.coordinator.server import CoordinatorConfig

from .pair import Pair


def row(p: Pair, name: str):
    return next((w for w in p.coordinator.snapshot()["workers"] if w["id"] == name), None)


@pytest.mark.parametrize("redundancy", ["cyclic:1", "replicate:2"])
def test_a_frozen_worker_does_not_block_rounds(tmp_path, redundancy):
    p = Pair(CoordinatorConfig(job="synthetic", job_args={"params": 64, "batch_size": 8},
                               epochs=100_000, eval_every=3600, partitions=3,
                               redundancy=redundancy, heartbeat_s=5.0, min_deadline_s=120.0,
                               open_rounds=1, speculate=False,
                               metrics_path=str(tmp_path / "metrics.jsonl"),
                               ledger_path=str(tmp_path / "ledger.jsonl")))
    for name in ("victim", "w1", "w2"):  # the victim first: it holds a slot of each round
        p.worker(name)
    victim = p.workers[b"victim"]
    p.run(lambda: (row(p, "victim") or {}).get("done", 0) >= 1
          and (row(p, "victim") or {}).get("assigned"), steps=400)
    assert p.coordinator.snapshot()["redundancy"]["code"] == redundancy
    victim.stop()
    stopped_at, version, done = p.clock.now, p.coordinator.version, row(p, "victim")["done"]

    # Rounds keep decoding while the frozen worker is registered and holds slots (< 15 s).
    p.run(lambda: p.coordinator.version >= version + 10, steps=280)  # 14 virtual seconds
    assert p.clock.now - stopped_at < 14.5
    held = row(p, "victim")
    assert held is not None, "the frozen worker was evicted: the test proves nothing"
    assert held["assigned"], "the frozen worker holds no slot: the rounds did not need the code"
    assert held["done"] == done and not p.events("leave", "victim")
    assert victim.computed == done  # it never answered
    p.close()
