"""`idlegrad demo`: trains to its target, prints a JSON summary, and leaves no process behind."""

from __future__ import annotations

import json
import re
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


def test_demo_reaches_target_prints_json_and_reaps_its_processes(cluster, request):
    started: dict[int, float] = {}  # pid -> create time, of every process the demo started
    # Should the test fail with the demo still running, whatever it started is killed too.
    request.addfinalizer(lambda: kill_leftovers(started))
    demo = cluster.spawn("demo", "demo", "--workers", "2", "--json")
    parent = psutil.Process(demo.pid)
    end = time.monotonic() + DEADLINE
    while demo.running():
        assert time.monotonic() < end, f"the demo did not finish within {DEADLINE:g}s"
        try:
            for child in parent.children(recursive=True):
                started.setdefault(child.pid, child.create_time())
        except psutil.NoSuchProcess:
            break
        time.sleep(POLL_S / 3)
    assert demo.wait(timeout=10) == 0, demo.tail()

    lines = demo.lines()
    summary = json.loads(lines[-1])
    assert summary["test_accuracy"] >= 0.95
    for key in ("test_loss", "updates", "samples", "wall_s", "workers"):
        assert key in summary, key
    assert summary["workers"] == 2 and summary["updates"] > 0 and summary["samples"] > 0
    assert summary["reached"] is True
    assert "Traceback" not in demo.output()

    # The coordinator and both workers were seen, and none of them outlived the demo.
    assert len(started) >= 3, f"saw only {len(started)} processes started by the demo"
    address = re.search(r"tcp://127\.0\.0\.1:\d+", demo.output())
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
