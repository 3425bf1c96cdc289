"""Operator controls in the scheduler (pause, resume, drain) and the status snapshot, purely."""

from __future__ import annotations

import time
from collections import deque

import pytest

from idlegrad.common import protocol as proto
from idlegrad.coordinator.sampler import Sampler
from idlegrad.coordinator.scheduler import (
    Assign, CancelSlots, Decoded, Drained, Scheduler, SchedulerConfig)
from .scheduling import Dealing
from idlegrad.coordinator.status import build_snapshot, events_after


def make(n=400, batch=4, **config) -> Dealing:
    return Dealing(Scheduler(SchedulerConfig(batch_size=batch, **config), Sampler(n, None)))


def of(kind, actions):
    return [a for a in actions if isinstance(a, kind)]


def start(s: Scheduler, worker: str, credits: int, now: float = 0.0) -> list:
    s.join(worker, {"host": f"host-{worker}", "device": "cpu", "cores": 4, "threads": 2}, now)
    return s.ready(worker, credits, now)


# pause / resume -------------------------------------------------------------------------------


def test_pause_hands_out_nothing_but_held_slots_still_count():
    s = make()
    held = of(Assign, start(s, "a", 2))
    assert len(held) == 2
    s.pause()
    assert s.paused
    # a new worker gets nothing while paused
    assert of(Assign, start(s, "b", 2, now=1.0)) == []
    # results of held slots are still used (and decode), but free no new slot
    used, actions = s.result("a", held[0].slot, 0.1, now=2.0)
    assert used and of(Decoded, actions)
    actions += s.applied(1, 2.0)  # the server steps the model: still no refill while paused
    assert of(Assign, actions) == []
    assert len(s.workers["a"].assigned) == 1
    # ticks (requeues, liveness) assign nothing either
    s.seen("b", 2.0)
    assert of(Assign, s.tick(2.5)) == []


def test_resume_fills_every_free_credit():
    s = make()
    start(s, "a", 2)
    s.pause()
    start(s, "b", 3, now=1.0)
    actions = s.resume(now=2.0)
    assert not s.paused
    got = of(Assign, actions)
    assert [a.worker for a in got] == ["b", "b", "b"]
    assert s.workers["b"].free == 0


def test_pause_keeps_requeued_slots_for_after_resume():
    s = make(min_deadline_s=5.0)
    held = of(Assign, start(s, "a", 1))
    s.pause()
    start(s, "b", 1, now=0.0)
    s.seen("a", 5.5)
    s.seen("b", 5.5)
    assert of(Assign, s.tick(6.0)) == []  # a's slot is late and requeued, but nobody gets it
    assert s.pending() == 1
    again = of(Assign, s.resume(6.1))
    assert [(a.worker, a.slot) for a in again] == [("b", held[0].slot)]


# drain ----------------------------------------------------------------------------------------


def test_drain_an_idle_worker_is_drained_at_once():
    s = make()
    start(s, "a", 0)
    assert s.drain("a", now=1.0) == [Drained("a")]
    assert s.workers["a"].draining
    # announced once only
    assert of(Drained, s.tick(1.1)) == []


def test_drain_waits_for_held_slots_and_gives_no_new_ones():
    s = make()
    held = of(Assign, start(s, "a", 2))
    start(s, "b", 1)
    assert of(Drained, s.drain("a", now=1.0)) == []
    used, actions = s.result("a", held[0].slot, 0.1, now=2.0)
    assert used and of(Decoded, actions)
    actions += s.applied(1, 2.0)
    assert [a.worker for a in of(Assign, actions)] == []  # b is full, a is draining
    assert of(Drained, actions) == []
    used, actions = s.result("a", held[1].slot, 0.1, now=3.0)
    assert used and of(Decoded, actions)
    actions += s.applied(2, 3.0)
    assert of(Drained, actions) == [Drained("a")]
    assert all(a.worker != "a" for a in of(Assign, actions))
    assert s.workers["a"].assigned == {}


def test_drain_done_when_last_slot_is_cancelled_or_fails():
    s = make(min_deadline_s=5.0)
    held = of(Assign, start(s, "a", 2))
    start(s, "b", 2)
    s.drain("a", now=0.5)
    # a's first slot fails: requeued; the second is late, given to b, and b wins
    actions = s.failed("a", held[0].slot, now=1.0)
    assert of(Drained, actions) == []
    s.seen("a", 5.5)
    s.seen("b", 5.5)
    s.tick(6.0)
    # b frees a credit and takes the late slot
    b_slots = sorted(s.workers["b"].assigned)
    used, actions = s.result("b", b_slots[0], 0.1, now=6.1)
    assert of(Decoded, actions)
    actions += s.applied(1, 6.1)
    assert any(a.slot == held[1].slot and a.worker == "b" for a in of(Assign, actions))
    used, actions = s.result("b", held[1].slot, 0.1, now=6.2)
    assert used and of(Decoded, actions)
    assert CancelSlots("a", [held[1].slot]) in actions
    actions += s.applied(2, 6.2)
    assert Drained("a") in actions


def test_drain_unknown_worker_raises_and_a_left_worker_is_forgotten():
    s = make()
    with pytest.raises(KeyError):
        s.drain("nobody", now=0.0)
    start(s, "a", 1)
    s.drain("a", now=0.1)
    s.leave("a", now=0.2)
    assert of(Drained, s.tick(0.3)) == []


def test_drained_worker_does_not_block_pause_or_others():
    s = make()
    start(s, "a", 1)
    s.pause()
    assert s.drain("a", now=1.0) == []  # it still holds its slot
    used, actions = s.result("a", next(iter(s.workers["a"].assigned)), 0.1, now=2.0)
    assert used and of(Decoded, actions)
    actions += s.applied(1, 2.0)
    assert of(Drained, actions) == [Drained("a")]  # paused: the drain still completes
    assert of(Assign, actions) == []


# snapshot -------------------------------------------------------------------------------------


def _scheduler_with(n_workers: int) -> Dealing:
    s = make(n=100_000, batch=8)
    for i in range(n_workers):
        start(s, f"w{i:04d}", 2, now=float(i) / 1000)
    for i in range(0, n_workers, 2):  # half of them have answered once
        w = s.workers[f"w{i:04d}"]
        slot = next(iter(w.assigned))
        s.result(w.id, slot, 0.05, now=2.0)
        s.applied(s.version + 1, 2.0)  # as the server does after each decoded round
    return s


def test_snapshot_content():
    s = _scheduler_with(3)
    s.drain("w0001", now=2.0)
    s.pause()
    events = deque(({"id": i, "kind": "join", "text": f"e{i}"} for i in range(5, 15)), maxlen=10)
    curve = [{"t": 1.0, "version": 1, "samples": 8, "loss": 2.0, "metrics": {"accuracy": 0.1}}]
    snap = build_snapshot(s, 3.0, {"job": "digits", "state": "training", "version": 7},
                          curve=curve, events=events, cursor=10, last_event=14,
                          redundancy={"code": "none"})
    assert snap["job"] == "digits" and snap["version"] == 7
    assert snap["state"] == "paused" and snap["paused"] is True
    assert [w["id"] for w in snap["workers"]] == ["w0000", "w0001", "w0002"]
    w0, w1 = snap["workers"][0], snap["workers"][1]
    assert w0["host"] == "host-w0000" and w0["device"] == "cpu" and w0["cores"] == 4
    assert w0["done"] == 1 and w0["samples"] == 8 and w0["samples_per_s"] == pytest.approx(160.0)
    assert w0["last_seen_s"] == pytest.approx(1.0) and w0["credits"] == 2
    assert w1["state"] == "draining" and w1["done"] == 0 and w1["samples_per_s"] == 0.0
    assert w0["state"] == "working"  # said idle (between slots) but holds slots
    s.workers["w0002"].assigned.clear()
    again = build_snapshot(s, 3.0, {})
    assert again["workers"][2]["state"] == "idle"
    assert [e["id"] for e in snap["events"]] == [11, 12, 13, 14]
    assert snap["cursor"] == 14
    assert snap["curve"] == curve
    assert snap["redundancy"] == {"code": "none"}
    assert snap["rounds"]["open"] == len(s.rounds) and snap["rounds"]["decoded"] == 2
    # what goes on the wire decodes again
    again = proto.decode(proto.encode(proto.Status(snapshot=snap)))
    assert again.snapshot["workers"] == snap["workers"]


def test_the_snapshot_says_it_waits_for_workers_until_min_workers_have_joined():
    s = make(min_workers=2)
    start(s, "a", 2)
    assert build_snapshot(s, 1.0, {"state": "training"})["state"] == "waiting for workers (1 of 2)"
    start(s, "b", 2)
    assert build_snapshot(s, 2.0, {"state": "training"})["state"] == "training"
    s.leave("b", 3.0)  # once reached, the run does not wait again
    assert build_snapshot(s, 4.0, {"state": "training"})["state"] == "training"


def test_worker_mean_staleness():
    s = make()
    a = of(Assign, start(s, "a", 1))
    b = of(Assign, start(s, "b", 1))
    s.result("a", a[0].slot, 0.1, now=1.0)
    s.applied(1, 1.0)
    s.applied(2, 1.0)  # two steps later b answers a slot planned at version 0
    s.result("b", b[0].slot, 0.1, now=1.0)
    snap = build_snapshot(s, 1.0, {})
    rows = {w["id"]: w for w in snap["workers"]}
    assert rows["a"]["staleness"] == 0.0
    assert rows["b"]["staleness"] == 2.0


@pytest.mark.parametrize("cursor,limit,want", [
    (0, 200, list(range(5, 15))),
    (4, 200, list(range(5, 15))),
    (9, 200, list(range(10, 15))),
    (14, 200, []),
    (99, 200, []),  # a cursor from an earlier coordinator process
    (0, 3, [12, 13, 14]),
    (12, 3, [13, 14]),
    (0, 0, []),
])
def test_events_after(cursor, limit, want):
    ring = deque(({"id": i} for i in range(5, 15)), maxlen=10)
    assert [e["id"] for e in events_after(ring, cursor, limit)] == want
    assert [e["id"] for e in events_after(list(ring), cursor, limit)] == want
    assert events_after(deque(), cursor, limit) == []


def test_snapshot_of_1000_workers_is_cheap():
    """The acceptance figure: building and encoding a 1,000-worker snapshot under 20 ms."""
    s = _scheduler_with(1000)
    events = deque(({"id": i, "time": 0.0, "kind": "join", "worker": f"w{i}", "text": "x" * 60}
                    for i in range(1, 1001)), maxlen=1000)
    curve = deque(({"t": float(i), "version": i, "samples": i * 8, "loss": 1.0,
                    "metrics": {"accuracy": 0.5, "loss": 1.0}} for i in range(300)), maxlen=300)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        snap = build_snapshot(s, 3.0, {"job": "x", "state": "training"}, curve=curve,
                              events=events, cursor=0, last_event=1000)
        frames = proto.encode(proto.Status(snapshot=snap))
        best = min(best, time.perf_counter() - t0)
    assert len(snap["workers"]) == 1000 and len(snap["events"]) == 200
    assert len(frames[0]) < proto.MAX_HEADER_BYTES
    print(f"snapshot of 1000 workers: {best * 1000:.2f} ms, {len(frames[0])} bytes")
    assert best < 0.020


def test_snapshot_of_a_fleet_past_the_row_limit_with_the_longest_names_still_decodes():
    """Every monitor refuses a header over 1 MiB: a large fleet, or workers that name themselves
    at the protocol's limits, must not make the status unreadable."""
    from idlegrad.common.protocol import MAX_NAME, MAX_WORKER_ID
    from idlegrad.coordinator.credits import SHOWN_PER_STATUS, Credits
    from idlegrad.coordinator.effects import Applied, Contribution, Joined
    from idlegrad.coordinator.status import WORKERS_PER_STATUS

    n = WORKERS_PER_STATUS + 500
    s = make(batch=8)
    for i in range(n):
        worker_id = f"{i:06d}".ljust(MAX_WORKER_ID, "w")
        s.join(worker_id, {"host": "h" * MAX_NAME, "device": "d" * MAX_NAME, "cores": 4,
                           "threads": 2}, 0.0)
    events = deque(({"id": i, "time": 0.0, "kind": "join", "worker": "w" * MAX_WORKER_ID,
                     "text": "x" * 400} for i in range(1, 201)), maxlen=1000)
    credits = Credits()
    for i in range(n):  # every one has earned: the most samples are shown, a bounded few
        identity = f"key:{i:040d}"
        credits.take([Joined(f"{i:06d}".ljust(MAX_WORKER_ID, "é"), identity),
                      Applied(i, i, [], i + 1, 0, 1.0, 1, [i],
                              (Contribution(identity, i + 1, 1e9, (identity,)),))], 1e9 + i)
    snap = build_snapshot(s, 1.0, {"job": "x", "state": "training",
                                   "credits": credits.table(SHOWN_PER_STATUS)}, events=events)
    assert len(snap["credits"]["workers"]) == SHOWN_PER_STATUS
    assert snap["credits"]["identities"] == n
    assert len(snap["workers"]) == WORKERS_PER_STATUS and snap["workers_total"] == n
    assert snap["workers"][0]["id"].startswith("000000")  # the first to join come first
    frames = proto.encode(proto.Status(snapshot=snap))
    print(f"snapshot of {n} workers at the name limits: {len(frames[0])} bytes")
    assert len(frames[0]) < proto.MAX_HEADER_BYTES * 0.9, len(frames[0])
    assert proto.decode(frames).snapshot["workers_total"] == n


def test_the_workers_samples_per_s_add_up_to_the_headers():
    """A worker's rate is what it contributes to applied rounds over the header's window, not its
    compute speed: two workers that each compute a 16-sample slot in 1 ms but answer every 0.1 s
    (links, waiting) showed 16,000 samples/s each against a header of about 320."""
    import torch

    from idlegrad.coordinator.config import CoordinatorConfig, check
    from idlegrad.coordinator.effects import Applied
    from idlegrad.coordinator.scheduler import Assign
    from idlegrad.coordinator.status import coordinator_snapshot
    from idlegrad.coordinator.training import Training

    config = CoordinatorConfig(job="digits", partitions=2)
    training = Training(config, check(config))
    core, numel = training.core, training.model.model.numel
    held: dict[str, int] = {}

    def perform(effects):
        for e in effects:
            if isinstance(e, Assign):
                held[e.worker] = e.slot
            elif isinstance(e, Applied):
                training.applied(e, now)

    now = training.started = 100.0
    for worker in "ab":
        perform(core.join(worker, {}, worker, now) + core.ready(worker, 1, now))
    for _ in range(100):
        now += 0.1
        for worker in "ab":
            slot = held.pop(worker)
            samples = core.scheduler.slots[slot].samples
            norm = core.trust.median() * samples  # of an honest size (zero is suspected)
            gradient = torch.full((numel,), norm / numel ** 0.5)
            perform(core.result(worker, slot, [gradient], norm, 0.001, now,
                                samples=samples, loss=1.0))
    snap = coordinator_snapshot(training, now)
    rows = [w["samples_per_s"] for w in snap["workers"]]
    assert snap["samples_per_s"] == pytest.approx(core.samples_per_s(now), rel=0.1)
    assert sum(rows) == pytest.approx(snap["samples_per_s"], abs=0.02), (rows, snap["samples_per_s"])
    assert all(w["compute_samples_per_s"] > 10 * w["samples_per_s"] > 0 for w in snap["workers"])


def test_the_snapshots_epochs_count_the_samples_it_counts():
    """The walkthrough of issue 29 read "samples 0 (0.0400 epochs)": epochs counted the samples
    planned (rounds open), samples those applied. Both count what was applied now."""
    from idlegrad.coordinator.server import CoordinatorConfig

    from .pair import Pair

    pair = Pair(CoordinatorConfig(job="synthetic", job_args={"params": 100, "batch_size": 16},
                                  partitions=2, epochs=2, eval_every=3600, heartbeat_s=0.5))
    pair.worker("w1")
    pair.run(until=lambda: len(pair.coordinator.scheduler.rounds) > 0, steps=50)
    snap = pair.coordinator.snapshot()
    assert snap["samples"] == 0 and snap["epoch"] == 0, snap["epoch"]
    pair.run(until=lambda: pair.coordinator.samples_applied >= 64, steps=2000)
    snap = pair.coordinator.snapshot()
    assert snap["samples"] > 0
    assert snap["epoch"] == pytest.approx(snap["samples"] / snap["train_samples"], abs=1e-4)
    pair.close()
