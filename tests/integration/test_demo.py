"""`idlegrad demo`: trains to its target, prints a JSON summary, and leaves no process behind."""

from __future__ import annotations

import json
import re
import signal
import time

import psutil
import pytest

from .harness import DEADLINE, POLL_S

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def kill_leftovers(started: dict[int, float]) -> None:
    """SIGKILL what the demo started and left running (only when the test has failed)."""
    procs = []
    for pid, created in started.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created:
                proc.kill()
                procs.append(proc)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def watch_children(demo, started: dict[int, float], until) -> None:
    """Note every process the demo starts (pid -> create time) until `until()` holds."""
    parent = psutil.Process(demo.pid)
    end = time.monotonic() + DEADLINE
    while not until():
        assert demo.running(), demo.tail()
        assert time.monotonic() < end, f"the demo did not get there within {DEADLINE:g}s"
        try:
            for child in parent.children(recursive=True):
                started.setdefault(child.pid, child.create_time())
        except psutil.NoSuchProcess:
            break
        time.sleep(POLL_S / 3)


def test_demo_reaches_target_prints_json_and_reaps_its_processes(cluster, request):
    started: dict[int, float] = {}  # pid -> create time, of every process the demo started
    # Should the test fail with the demo still running, whatever it started is killed too.
    request.addfinalizer(lambda: kill_leftovers(started))
    demo = cluster.spawn("demo", "demo", "--workers", "2", "--json")
    watch_children(demo, started, until=lambda: not demo.running())
    assert demo.wait(timeout=10) == 0, demo.tail()

    lines = demo.lines()
    summary = json.loads(lines[-1])
    assert summary["test_accuracy"] >= 0.95
    for key in ("test_loss", "updates", "samples", "wall_s", "workers"):
        assert key in summary, key
    assert summary["workers"] == 2 and summary["updates"] > 0 and summary["samples"] > 0
    assert summary["reached"] is True
    assert "Traceback" not in demo.output()

    assert_reaped(started, demo.output())


def assert_reaped(started: dict[int, float], output: str) -> None:
    """The coordinator and the workers were seen, and none of them outlived the demo."""
    assert len(started) >= 3, f"saw only {len(started)} processes started by the demo"
    address = re.search(r"tcp://127\.0\.0\.1:\d+", output)
    leftovers = []
    for pid, created in started.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                leftovers.append((pid, proc.cmdline()))
        except psutil.NoSuchProcess:
            pass
    if address:
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if address.group(0) in " ".join(proc.info["cmdline"] or []):
                leftovers.append((proc.info["pid"], proc.info["cmdline"]))
    assert not leftovers, f"the demo left processes running: {leftovers}"


def test_demo_stopped_by_sigterm_reaps_its_processes(cluster, request):
    """`kill`, `timeout` or a closing terminal stop the demo as Ctrl-C does: its coordinator and
    workers go with it (they used to train on, orphaned, until their epochs ran out)."""
    started: dict[int, float] = {}
    request.addfinalizer(lambda: kill_leftovers(started))
    demo = cluster.spawn("demo", "demo", "--workers", "2", "--epochs", "1000", "--target",
                         "accuracy=0.9999")
    watch_children(demo, started, until=lambda: len(started) >= 3 and "coordinator at" in demo.output())
    demo.popen.send_signal(signal.SIGTERM)
    assert demo.wait(timeout=30) == 130, demo.tail()
    assert "interrupted" in demo.output() and "Traceback" not in demo.output()
    assert_reaped(started, demo.output())
