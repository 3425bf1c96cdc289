"""The status endpoint, `idlegrad status`, the `top` app and the operator's controls, for real.

A coordinator with a long run (it does not finish during a test) and two real workers; every
process is reaped by the `cluster` fixture.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import pytest

from idlegrad.cli.processes import free_port, idlegrad_command
from idlegrad.monitor.source import ZmqStatusSource

from .harness import DEADLINE

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LONG_RUN = ["--job", "digits", "--epochs", "100000"]


def training(cluster, names=("w1", "w2")):
    coordinator = cluster.coordinator(*LONG_RUN)
    workers = [cluster.worker(name) for name in names]
    status = cluster.status()
    snap = status.wait_for(
        lambda s: sorted(w["id"] for w in s["workers"]) == sorted(names)
        and all(w["done"] > 0 for w in s["workers"]),
        "both workers joined and working", alive=[coordinator, *workers])
    return coordinator, workers, status, snap


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(idlegrad_command(*args), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_status_json_table_and_the_app_see_both_workers_while_training(cluster):
    coordinator, workers, status, first = training(cluster)

    out = run_cli("status", "--coordinator", cluster.address, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    for key in ("version", "samples", "samples_per_s", "metrics", "workers"):
        assert key in doc, key
    assert sorted(w["id"] for w in doc["workers"]) == ["w1", "w2"]
    for w in doc["workers"]:
        assert {"id", "host", "state", "device", "samples_per_s"} <= set(w)
        assert w["device"] == "cpu" and w["samples_per_s"] > 0
    assert doc["version"] >= first["version"]

    table = run_cli("status", "--coordinator", cluster.address)
    assert table.returncode == 0, table.stderr
    assert "w1" in table.stdout and "w2" in table.stdout and "samples/s" in table.stdout

    # the endpoint answers while training runs: the version moves between answers
    later = status.wait_for(lambda s: s["version"] > doc["version"], "training to go on",
                            alive=[coordinator, *workers])
    assert later["samples"] > doc["samples"]

    from idlegrad.monitor.app import MonitorApp

    async def watch():
        with ZmqStatusSource(cluster.address) as source:
            app = MonitorApp(source, interval=0.3, timeout=1.0)
            async with app.run_test(size=(120, 40)) as pilot:
                end = time.monotonic() + DEADLINE
                while time.monotonic() < end:
                    await pilot.pause(0.2)
                    rows = {r: app.query_one("#workers").get_row(r) for r in app.worker_ids()}
                    if sorted(rows) == ["w1", "w2"] and app.snapshot["version"] > later["version"]:
                        break
                assert app.worker_ids() == ["w1", "w2"], app.connection
                assert "connected to" in app.connection
                rate_col = [c.label.plain for c in app.query_one("#workers").columns.values()
                            ].index("samples/s")
                for row in rows.values():
                    assert float(str(row[rate_col]).replace(",", "")) > 0
                assert "digits" in str(app.query_one("#header").render())

    asyncio.run(watch())
    assert coordinator.running() and all(w.running() for w in workers)
    cluster.assert_no_tracebacks()


def test_pause_stops_progress_resume_restarts_it_and_drain_sends_a_worker_home(cluster):
    coordinator, workers, status, _ = training(cluster)
    with ZmqStatusSource(cluster.address) as source:
        ok, detail = source.control("pause")
        assert ok, detail
        paused = status.wait_for(lambda s: s["state"] == "paused" and s["paused"],
                                 "the paused state", alive=[coordinator])
        # slots already held finish; then nothing moves
        settled = status.wait_for(lambda s: all(w["assigned"] == 0 for w in s["workers"]),
                                  "held slots to finish", alive=[coordinator])
        time.sleep(1.5)
        still = status.fetch()
        assert still["version"] == settled["version"], "the version moved while paused"
        assert still["samples"] == settled["samples"]
        assert paused["version"] <= settled["version"]

        ok, detail = source.control("resume")
        assert ok, detail
        status.wait_for(lambda s: s["version"] > still["version"] and s["state"] == "training",
                        "training to resume", alive=[coordinator, *workers])

        ok, detail = source.control("drain", "w1")
        assert ok and "w1" in detail, detail
        bad_ok, bad_detail = source.control("drain", "nobody")
        assert not bad_ok and "nobody" in bad_detail

    w1, w2 = workers
    assert w1.wait(timeout=DEADLINE) == 0
    assert "drained by the operator" in w1.output()
    after = status.wait_for(lambda s: [w["id"] for w in s["workers"]] == ["w2"],
                            "w1 to leave", alive=[coordinator, w2])
    status.wait_for(lambda s: s["version"] > after["version"], "w2 to go on training",
                    alive=[coordinator, w2])
    kinds = [e["kind"] for e in status.events]
    for kind in ("pause", "resume", "drain", "drained"):
        assert kind in kinds, (kind, kinds)
    assert w2.running() and coordinator.running()
    cluster.assert_no_tracebacks()


def test_status_without_a_coordinator_is_one_line_and_exit_1():
    address = f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    out = run_cli("status", "--coordinator", address, "--timeout", "0.5")
    assert out.returncode == 1
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and address in lines[0] and "no answer" in lines[0]
    assert time.monotonic() - t0 < 30
