"""Stragglers cost nothing (issue 3): a worker SIGSTOPped mid-training does not block rounds under
a redundant code (speculation off, so the code alone carries the rounds). The coordinator's heartbeat is long (5 s: eviction after 15 s), so the rounds
that decode while the stopped worker is still registered and holding slots decode because of the
code (or a speculative copy), not because the stopped worker was evicted.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from .harness import final_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# A small learning rate: training must outlast the checks made while the victim is stopped.
SLOW_DIGITS = ("--job", "digits", "--job-arg", "hidden=4096", "--job-arg", "lr=0.00015")


def worker_of(snap: dict, name: str):
    return next((w for w in snap["workers"] if w["id"] == name), None)


# One code with real processes; each code is run on the in-memory pair, in virtual time
# (tests/unit/test_stragglers.py).
@pytest.mark.parametrize("redundancy", ["cyclic:1"])
def test_sigstopped_worker_does_not_block_rounds(cluster, request, redundancy):
    ckpt = cluster.dir / "ckpt"
    coordinator, workers = cluster.start_together(
        [*SLOW_DIGITS, "--target", "accuracy=0.96", "--epochs", "200", "--partitions", "3",
         "--redundancy", redundancy, "--heartbeat", "5", "--task-timeout", "120",
         "--open-rounds", "1", "--no-speculate", "--checkpoint-dir", str(ckpt)], ["w1", "w2", "victim"])
    victim = workers[2]
    stopped = []

    def resume_victim():  # runs before the cluster's finalizer reaps everyone
        if stopped and victim.running():
            os.kill(victim.pid, signal.SIGCONT)
    request.addfinalizer(resume_victim)
    status = cluster.status()

    before = status.wait_for(
        lambda s: (worker_of(s, "victim") or {}).get("done", 0) >= 1
        and (worker_of(s, "victim") or {}).get("assigned"),
        "the victim computing", timeout=60, alive=[coordinator, *workers])
    os.kill(victim.pid, signal.SIGSTOP)
    stopped.append(time.monotonic())
    assert before["state"] == "training"
    assert before["redundancy"]["code"] == redundancy
    # A status a second after the stop, in which the coordinator has heard nothing from the
    # victim for that second: what it sent before the stop has arrived (loopback delivers in
    # milliseconds), and its `done` is final from then on.
    before = status.wait_for(
        lambda s: time.monotonic() - stopped[0] >= 1.0
        and (worker_of(s, "victim") or {}).get("last_seen_s", 0) >= 1.0,
        "the stopped worker silent for a second", timeout=10, alive=[coordinator])
    done_when_stopped = worker_of(before, "victim")["done"]
    victim_done = []  # its `done` in every status that still lists it

    def watch_victim(snap):
        if (entry := worker_of(snap, "victim")) is not None:
            victim_done.append(entry["done"])

    # Rounds keep decoding while the stopped worker is registered and holds slots (< 15 s).
    after = status.wait_for(
        lambda s: s["version"] >= before["version"] + 10, "rounds decoding past the stopped worker",
        timeout=12, alive=[coordinator])
    assert time.monotonic() - stopped[0] < 14.5
    held = worker_of(after, "victim")
    assert held is not None, "the stopped worker was evicted: the test proves nothing"
    assert held["assigned"], "the stopped worker holds no slot: the rounds did not need the code"
    assert not status.events_of("leave", "victim")

    # Training reaches its target; the stopped worker never answered.
    watch_victim(after)
    assert status.follow(coordinator, timeout=90, each=watch_victim) == 0
    final = final_metrics(ckpt / "metrics.jsonl")
    assert final["reason"] == "target" and final["metrics"]["accuracy"] >= 0.96
    assert victim_done and set(victim_done) == {done_when_stopped}, victim_done
    # (listed or evicted at the end, it was stopped all along: it cannot have answered)
    assert psutil.Process(victim.pid).status() == psutil.STATUS_STOPPED
    for w in workers[:2]:
        assert w.wait(timeout=30) == 0
    os.kill(victim.pid, signal.SIGCONT)
    cluster.assert_no_tracebacks()
