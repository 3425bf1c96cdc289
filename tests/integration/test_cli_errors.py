"""Errors as a user sees them: one line on stderr, a non-zero status, no traceback."""

from __future__ import annotations

import time

import pytest

from idlegrad.cli.processes import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def one_line(proc, logs_allowed: bool = False) -> str:
    """The one line the user is told (stdout and stderr together), besides log records where
    `logs_allowed` (a worker logs its settings as it starts)."""
    output = proc.output()
    if not logs_allowed:
        assert len(proc.lines()) == 1, f"{proc.name} printed more than one line:\n{output}"
    assert "Traceback" not in output, output
    said = proc.said()
    assert len(said) == 1, f"{proc.name} printed {len(said)} lines besides its logs:\n{output}"
    assert proc.lines()[-1] == said[0], f"the error is not the last line:\n{output}"
    return said[0]


def test_unknown_job_is_a_usage_error(cluster):
    proc = cluster.spawn("coordinator", "coordinator", "--job", "nosuchjob",
                         "--bind", cluster.address, "--threads", "1")
    assert proc.wait(timeout=60) == 2
    line = one_line(proc)
    assert line.startswith("idlegrad coordinator: error:") and "nosuchjob" in line


def test_a_mirror_with_nothing_to_mirror_is_one_line(cluster, tmp_path):
    """A small model goes inline and digits has no pack: a --blob-mirror would serve nothing."""
    proc = cluster.spawn("coordinator", "coordinator", "--job", "digits", "--blob-mirror",
                         "http://127.0.0.1:9/", "--bind", cluster.address, "--threads", "1")
    assert proc.wait(timeout=60) == 2
    line = one_line(proc)
    assert "--blob-mirror" in line and "--snapshot-min-mb" in line
    (tmp_path / "file").write_text("not a folder")
    bad = cluster.spawn("bad", "coordinator", "--job", "digits", "--snapshot-dir",
                        str(tmp_path / "file" / "under"), "--bind", cluster.address)
    assert bad.wait(timeout=60) == 2
    assert "--snapshot-dir" in one_line(bad)


def test_address_in_use_is_a_usage_error_naming_the_address(cluster):
    first = cluster.coordinator("--job", "digits")
    cluster.status().wait_for(lambda s: True, "answer from the first coordinator", alive=[first])
    second = cluster.spawn("second", "coordinator", "--job", "digits", "--bind", cluster.address,
                           "--threads", "1")
    assert second.wait(timeout=60) == 2
    line = one_line(second)
    assert line.startswith("idlegrad coordinator: error:") and cluster.address in line
    assert first.running(), "the first coordinator must not be disturbed"


def test_worker_gives_up_on_an_unreachable_coordinator(cluster):
    address = f"tcp://127.0.0.1:{free_port()}"  # nobody listens there
    started = time.monotonic()
    proc = cluster.spawn("worker", "worker", "--coordinator", address, "--connect-timeout", "1",
                         "--threads", "1")
    code = proc.wait(timeout=30)
    took = time.monotonic() - started
    assert code != 0
    assert took < 10, f"gave up only after {took:.1f}s"
    line = one_line(proc, logs_allowed=True)
    assert line.startswith("idlegrad worker: error:") and address in line


def test_a_worker_started_before_its_coordinator_waits_for_it(cluster):
    """No --connect-timeout: the worker says it waits until the coordinator answers, and joins
    the coordinator started after it (as after a restart of any length)."""
    worker = cluster.spawn("worker", "worker", "--coordinator", cluster.address, "--id", "early",
                           "--threads", "1", "--device", "cpu", "--no-idle-policy")
    deadline = time.monotonic() + 30
    while "connecting to the coordinator" not in worker.output() and time.monotonic() < deadline:
        assert worker.running(), worker.output()
        time.sleep(0.1)
    assert "until it answers" in worker.output(), worker.output()
    time.sleep(2)
    assert worker.running()
    cluster.coordinator("--job", "digits")
    cluster.status().wait_for(lambda s: [w["id"] for w in s["workers"]] == ["early"],
                              "the early worker joins", timeout=60)


def test_top_without_a_terminal_prints_one_snapshot_as_text(cluster):
    """Piped or under a service manager, `idlegrad top` has no terminal to draw on: it says so
    in one line and prints what `idlegrad status` prints, instead of escape codes or a
    traceback."""
    import subprocess
    import sys

    coordinator = cluster.coordinator("--job", "digits")
    cluster.status().wait_for(lambda s: True, "the coordinator up", alive=[coordinator])
    out = subprocess.run([sys.executable, "-m", "idlegrad.cli", "top", "--coordinator",
                          cluster.address], stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=60, env=cluster.env)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().splitlines() == [
        "idlegrad top: not a terminal: one snapshot instead (idlegrad status)"]
    assert f"idlegrad coordinator at {cluster.address}" in out.stdout and "\x1b" not in out.stdout
    assert "workers: 0" in out.stdout, out.stdout
