"""Several projects per worker, by share (moved from the integration suite onto the in-memory
pair, tests/unit/pair.py): one worker process serving two real coordinators, its sessions sharing
the process's one compute slot (worker/projects.py's ComputeSlot and ShareScheduler) at shares
3:1. Shares are measured as the integration test measured them, by the compute-seconds each
coordinator's status shows for the worker, but in virtual time: no sleeps, and no load on the
machine can move them. tests/integration/test_projects.py keeps one run with real processes."""

from __future__ import annotations

from idlegrad.coordinator.server import CoordinatorConfig

from .pair import Clock, Pair, compute_slot, run_together, turns

TURNS = 400  # 20 virtual seconds at the pair's 0.05 s a turn


def coordinator(path) -> CoordinatorConfig:
    # an endless job: the test decides how long each phase lasts
    return CoordinatorConfig(job="synthetic", job_args={"params": 64, "batch_size": 8},
                             epochs=100_000, eval_every=3600, heartbeat_s=0.5,
                             metrics_path=str(path) + ".metrics.jsonl",
                             ledger_path=str(path) + ".ledger.jsonl")


def compute_s(pair: Pair, worker: str = "shared") -> float:
    """The worker's compute-seconds, as its coordinator's status shows them (0 before it joins)."""
    rows = [w for w in pair.coordinator.snapshot()["workers"] if w["id"] == worker]
    return rows[0]["compute_s"] if rows else 0.0


def test_one_worker_splits_its_time_between_two_coordinators_by_share(tmp_path):
    clock = Clock()
    pairs = {name: Pair(coordinator(tmp_path / name), clock=clock) for name in "ab"}
    slot = compute_slot({"a": 3, "b": 1}, clock)
    sessions = {name: pairs[name].worker("shared", shared=(slot, name)) for name in "ab"}
    both = list(pairs.values())
    try:
        run_together(both, until=lambda: all(compute_s(p) > 0 for p in both), steps=200)
        turns(both, 40)  # past the first slots
        before = {name: compute_s(p) for name, p in pairs.items()}
        turns(both, TURNS)
        got = {name: compute_s(p) - before[name] for name, p in pairs.items()}
        split = got["a"] / (got["a"] + got["b"])
        print(f"compute in {TURNS} turns: {got}, a's part {split:.1%} (share 75%)")
        # one compute thread: never more than the time that passed, and none of it idle
        together = got["a"] + got["b"]
        assert 0.9 * TURNS * pairs["a"].step_s <= together <= TURNS * pairs["a"].step_s + 1e-6, got
        assert got["b"] > 0 and 0.72 <= split <= 0.78, got

        # b goes down: a gets the worker's whole time, and the worker keeps serving it
        pairs["b"].kill()
        gone = lambda: sessions["b"].session.state != "serving"  # noqa: E731
        run_together(both, until=gone, steps=200)  # b's session timed out: reconnecting
        start_a = compute_s(pairs["a"])
        turns(both, TURNS // 2)
        alone = compute_s(pairs["a"]) - start_a
        print(f"a alone: {alone:.2f} s in {TURNS // 2} turns; both before: {together / 2:.2f}")
        assert alone >= 0.9 * together / 2, (alone, together)
        assert sessions["a"].serving and sessions["b"].serving  # b's session reconnecting
    finally:
        for p in both:
            p.close()
