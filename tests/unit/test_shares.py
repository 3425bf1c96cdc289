"""The share scheduler alone, on a fake clock: one compute thread, tasks run back to back."""

from __future__ import annotations

import pytest

from idlegrad.worker.shares import ShareScheduler


def run(scheduler: ShareScheduler, seconds: float, start: float = 0.0, task_s=lambda name: 1.0,
        ready=lambda name, now: True) -> tuple[dict[str, float], float]:
    """Run tasks back to back from `start` for `seconds`; compute-seconds per project."""
    got = {name: 0.0 for name in scheduler.shares}
    now = start
    while now < start + seconds:
        name = scheduler.pick([n for n in scheduler.shares if ready(n, now)], now)
        if name is None:
            now += 1.0
            continue
        now += task_s(name)
        scheduler.charge(name, task_s(name), now)
        got[name] += task_s(name)
    return got, now


def part(got: dict[str, float], name: str) -> float:
    return got[name] / sum(got.values())


@pytest.mark.parametrize("shares", [{"a": 3, "b": 1}, {"a": 1, "b": 1, "c": 2}, {"a": 0.5, "b": 9.5}])
def test_compute_follows_the_shares(shares):
    got, _ = run(ShareScheduler(shares), 600)
    total = sum(shares.values())
    for name, share in shares.items():
        assert part(got, name) == pytest.approx(share / total, abs=0.02), got


def test_tasks_of_different_lengths_are_counted_by_their_seconds():
    # b's tasks take four times as long: it runs a quarter as many for the same seconds
    got, _ = run(ShareScheduler({"a": 1, "b": 1}), 600, task_s=lambda n: 0.5 if n == "a" else 2.0)
    assert part(got, "a") == pytest.approx(0.5, abs=0.02), got


def test_a_project_that_is_down_gives_its_share_to_the_others():
    scheduler = ShareScheduler({"a": 3, "b": 1})
    run(scheduler, 100)
    got, _ = run(scheduler, 100, start=100, ready=lambda n, now: n == "b")
    assert got == {"a": 0.0, "b": pytest.approx(100, abs=1)}
    assert scheduler.pick([], 300) is None


def test_a_returning_project_is_served_at_once_but_does_not_flood():
    scheduler = ShareScheduler({"a": 3, "b": 1})
    _, now = run(scheduler, 200)
    # a down for 200 s: b has the machine
    _, now = run(scheduler, 200, start=now, ready=lambda n, t: n == "b")
    # a returns: it gets the next task (not starved) ...
    assert scheduler.pick(["a", "b"], now) == "a"
    # ... and from then on its share, not the 200 s it missed (no flood)
    got, _ = run(scheduler, 40, start=now)
    assert part(got, "a") == pytest.approx(0.75, abs=0.06), got


def test_a_project_that_was_away_long_ago_is_not_starved_by_old_history():
    scheduler = ShareScheduler({"a": 1, "b": 1}, half_life_s=60)
    run(scheduler, 1000, ready=lambda n, t: n == "a")  # a alone for a long time
    got, _ = run(scheduler, 60, start=1000)
    assert part(got, "b") == pytest.approx(0.5, abs=0.05), got


@pytest.mark.parametrize("shares, problem", [({}, "at least one"), ({"a": 0}, "positive"),
                                             ({"a": -1}, "positive"), ({"a": float("nan")}, "positive")])
def test_bad_shares_are_refused(shares, problem):
    with pytest.raises(ValueError, match=problem):
        ShareScheduler(shares)


def test_an_owed_project_whose_task_is_on_its_way_is_waited_for():
    # a's coordinator deals one task per result: a is never asking when the slot frees
    scheduler = ShareScheduler({"a": 3, "b": 1})
    assert scheduler.pick(["b"], 0.0, expected=["a"]) is None  # a is owed: wait for it
    scheduler.charge("a", 3.0, 3.0)
    assert scheduler.pick(["b"], 3.0, expected=["a"]) == "b"  # b is owed now: no wait


def test_one_task_per_result_still_follows_the_shares():
    # each project has a task only right after its last one went back; with the wait for the
    # owed one, the split is the shares' (without it, every other task: 50:50)
    scheduler = ShareScheduler({"a": 3, "b": 1})
    got, now, last = {"a": 0.0, "b": 0.0}, 0.0, None
    while now < 400:
        asking = [n for n in "ab" if n != last]  # the one just served waits for its next task
        name = scheduler.pick(asking, now, expected=[last] if last else [])
        name = name or last  # waited: its task arrived
        now += 1.0
        scheduler.charge(name, 1.0, now)
        got[name] += 1.0
        last = name
    assert part(got, "a") == pytest.approx(0.75, abs=0.02), got


def test_an_expected_project_is_not_lifted_but_an_absent_one_is():
    scheduler = ShareScheduler({"a": 1, "b": 1})
    scheduler.charge("b", 10.0, 0.0)
    scheduler.pick(["b"], 0.0, expected=["a"])
    assert scheduler.used["a"] == 0.0  # up, its task coming: it keeps its claim
    scheduler.pick(["b"], 0.0)
    assert scheduler.used["a"] == pytest.approx(10.0)  # away: no claim builds
