"""A coordinator with nothing to do rests: after a worker built for another version of the job
came, was stopped (SIGSTOP) past a heartbeat's silence while starting up, and went, the
coordinator's own CPU time stays under a few percent of a core (it was once seen spinning at
55-98% in that state)."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

JOB = """
import os, time
from idlegrad.common.builtin_jobs import synthetic

def make_job():
    if os.environ.get("SLOW_START"):
        time.sleep(1.0)  # a worker starting up on a busy machine
    return synthetic(params={params}, samples=512)
"""


def test_an_idle_coordinator_uses_almost_no_cpu_after_a_mismatched_worker_left(cluster, tmp_path):
    job = tmp_path / "job.py"
    job.write_text(JOB.format(params=2000))
    coordinator = cluster.coordinator("--job", f"{job}:make_job", "--epochs", "1000")
    status = cluster.status()
    status.wait_for(lambda s: s["state"] != "starting", "the coordinator up", alive=[coordinator])
    job.write_text(JOB.format(params=3000))  # the worker builds another version of the job
    cluster.env["SLOW_START"] = "1"
    worker = cluster.worker("other", "--job", f"{job}:make_job", connect_timeout=20)
    status.wait_for(lambda s: any(e["kind"] == "join" for e in s["events"]),
                    "the worker's hello", alive=[coordinator, worker])
    os.kill(worker.pid, signal.SIGSTOP)
    time.sleep(4.0)  # past three heartbeats of silence
    os.kill(worker.pid, signal.SIGCONT)
    assert worker.wait(30) != 0  # it refuses the coordinator's version of the job and exits
    status.close()
    time.sleep(1.0)
    process = psutil.Process(coordinator.pid)
    before = sum(process.cpu_times()[:2])
    time.sleep(4.0)
    share = (sum(process.cpu_times()[:2]) - before) / 4.0
    assert share < 0.03, f"the idle coordinator used {share:.1%} of a core"
    assert coordinator.running
