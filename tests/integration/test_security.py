"""CurveZMQ: only listed keys talk to the coordinator, each in its role (a worker key only works,
a monitor key reads the status, an operator key also commands); a key revoked by SIGHUP is cut
off; without keys the coordinator will not listen beyond loopback unless told --insecure.

Keys come from the real `idlegrad keys generate`; the coordinator, the workers and the monitor
are real processes and sockets on loopback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from idlegrad.common import protocol as proto
from idlegrad.common.security import client_keys
from idlegrad.monitor.source import ZmqStatusSource

from .harness import DEADLINE

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

HIDDEN = 1024  # a wider model, so training outlasts the checks
NUMEL = 64 * HIDDEN + HIDDEN + HIDDEN * 10 + 10


def keys_generate(name: str, directory: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "idlegrad.cli", "keys", "generate", name,
                          "--dir", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (directory / f"{name}.key").is_file() and (directory / f"{name}.key_secret").is_file()


def key_flags(keys: Path, name: str) -> list[str]:
    return ["--coordinator-key", str(keys / "coord.key"),
            "--secret-key", str(keys / f"{name}.key_secret")]


def test_only_listed_keys_train_and_a_revoked_key_is_cut_off(cluster):
    keys, allow, monitors = cluster.dir / "keys", cluster.dir / "allow", cluster.dir / "monitors"
    allow.mkdir()
    monitors.mkdir()
    for name in ("coord", "w1", "w2", "intruder", "monitor"):
        keys_generate(name, keys)
    for name in ("w1", "w2"):
        (allow / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    (monitors / "monitor.key").write_bytes((keys / "monitor.key").read_bytes())

    coordinator = cluster.coordinator(
        "--job", "digits", "--job-arg", f"hidden={HIDDEN}", "--epochs", "500",
        "--secret-key", str(keys / "coord.key_secret"), "--allow-keys", str(allow),
        "--monitor-keys", str(monitors))
    w1 = cluster.worker("w1", *key_flags(keys, "w1"))
    w2 = cluster.worker("w2", *key_flags(keys, "w2"))
    intruder = cluster.worker("intruder", *key_flags(keys, "intruder"), connect_timeout=600)
    status = cluster.status(keys=client_keys(str(keys / "coord.key"),
                                             str(keys / "monitor.key_secret")))
    snap = status.wait_for(lambda s: {w["id"] for w in s["workers"]} == {"w1", "w2"}
                           and s["version"] >= 5, "w1 and w2 training",
                           alive=[coordinator, w1, w2])
    ids = lambda s: {w["id"] for w in s["workers"]}  # noqa: E731

    # An unlisted key: a raw CURVE client that says hello and sends a poisoned result.
    ctx = zmq.Context()
    try:
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        client_keys(str(keys / "coord.key"), str(keys / "intruder.key_secret")).apply(rogue)
        rogue.connect(cluster.address)
        rogue.send_multipart(proto.encode(proto.Hello(
            worker_id="w1", host="evil", cores=1, threads=1, device="cpu", memory_mb=1,
            versions={})))
        huge = np.full(NUMEL, 1e6, dtype=np.float32)
        rogue.send_multipart(proto.encode(proto.Result(
            slot=1, version=0, samples=1, loss=0.0, compute_s=0.1,
            gradient=proto.Blob("float32", NUMEL, (huge.tobytes(),)))), copy=True)
        assert not rogue.poll(2000), "a peer with an unlisted key got an answer"
        # A monitor without keys hears nothing either.
        with ZmqStatusSource(cluster.address) as plain:
            assert plain.fetch(timeout=1.5) is None
    finally:
        ctx.destroy(linger=0)

    snap = status.wait_for(lambda s: s["counters"].get("handshakes_refused", 0) >= 2,
                           "the unlisted keys refused", timeout=30, alive=[coordinator])
    assert ids(snap) == {"w1", "w2"}, snap["workers"]
    assert not status.events_of("join", "intruder")
    assert snap["bad_messages"] == {}, snap["bad_messages"]  # nothing of theirs even decoded
    assert snap["rounds"].get("results_unexpected", 0) == 0
    assert intruder.running() and "joined" not in intruder.output()

    # Revoke w2: remove its key and send SIGHUP.
    (allow / "w2.key").unlink()
    os.kill(coordinator.pid, signal.SIGHUP)
    status.wait_for(lambda s: "w2" not in ids(s) and s["counters"].get("workers_revoked", 0) == 1,
                    "w2 revoked", timeout=30, alive=[coordinator])
    assert status.events_of("revoked", "w2"), status.events
    # Told it is revoked, w2 stops; what it sent on its old connection before hearing so is
    # dropped (unless it had nothing in flight: an idle w2 sent nothing, seen in CI). Either way
    # nothing it sends is used, it does not come back, and w1 trains on.
    cut = status.wait_for(lambda s: s["counters"].get("messages_unlisted_key", 0) >= 1
                          or not w2.running(),
                          "w2's later messages dropped, or w2 gone", timeout=30,
                          alive=[coordinator, w1])
    assert w2.wait(timeout=30) != 0 and "revoked" in w2.output(), w2.tail()
    version = cut["version"]  # (w2 has exited: no sleep needed for it to stay out)
    after = status.wait_for(lambda s: s["version"] > version, "w1 training on", timeout=30,
                            alive=[coordinator, w1])
    assert ids(after) == {"w1"}, after["workers"]
    assert len(status.events_of("join", "w2")) == 1  # it never got back in
    assert not status.events_of("join", "intruder")
    cluster.assert_no_tracebacks()


def test_a_worker_key_may_only_work_and_an_operator_key_commands(cluster):
    """Real keys and processes: a worker's key asking to pause or drain is refused (and counted),
    a monitor's key reads the status but may not command, an operator's key pauses, resumes and
    drains; SIGHUP re-reads the operator and monitor folders too."""
    keys = cluster.dir / "keys"
    folders = {name: cluster.dir / name for name in ("allow", "monitors", "operators")}
    for folder in folders.values():
        folder.mkdir()
    for name in ("coord", "w1", "w2", "watcher", "alice"):
        keys_generate(name, keys)
    for name, folder in (("w1", "allow"), ("w2", "allow"), ("watcher", "monitors"),
                         ("alice", "operators")):
        (folders[folder] / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    coordinator = cluster.coordinator(
        "--job", "digits", "--job-arg", f"hidden={HIDDEN}", "--epochs", "500",
        "--secret-key", str(keys / "coord.key_secret"), "--allow-keys", str(folders["allow"]),
        "--monitor-keys", str(folders["monitors"]),
        "--operator-keys", str(folders["operators"]))
    w1 = cluster.worker("w1", *key_flags(keys, "w1"))
    w2 = cluster.worker("w2", *key_flags(keys, "w2"))
    watcher = cluster.status(keys=client_keys(str(keys / "coord.key"),
                                              str(keys / "watcher.key_secret")))
    as_w1 = cluster.status(keys=client_keys(str(keys / "coord.key"), str(keys / "w1.key_secret")))
    alice = cluster.status(keys=client_keys(str(keys / "coord.key"),
                                            str(keys / "alice.key_secret")))
    ids = lambda s: {w["id"] for w in s["workers"]}  # noqa: E731
    watcher.wait_for(lambda s: ids(s) == {"w1", "w2"} and s["version"] >= 3,
                     "w1 and w2 training", alive=[coordinator, w1, w2])

    # w1's own key, on a connection of its own: it may work, nothing else
    for action, worker in (("pause", None), ("drain", "w2"), ("resume", None)):
        ok, detail = as_w1.source.control(action, worker, timeout=10)
        assert not ok and "--operator-keys" in detail, (action, detail)
    assert as_w1.fetch(timeout=5) is None and "--monitor-keys" in as_w1.source.refused
    # the monitor's key reads, but may not command
    ok, detail = watcher.source.control("pause", timeout=10)
    assert not ok and "--operator-keys" in detail
    snap = watcher.wait_for(lambda s: s["counters"].get("controls_refused", 0) == 4,
                            "the refused commands counted", timeout=30, alive=[coordinator])
    assert not snap["paused"] and ids(snap) == {"w1", "w2"}
    assert snap["counters"].get("status_refused", 0) == 1
    assert w1.running() and w2.running()

    # the operator's key: pause, resume, drain
    ok, detail = alice.source.control("pause", timeout=10)
    assert ok, detail
    alice.wait_for(lambda s: s["paused"], "training paused", timeout=30, alive=[coordinator])
    ok, detail = alice.source.control("resume", timeout=10)
    assert ok, detail
    version = alice.wait_for(lambda s: not s["paused"], "training resumed", timeout=30,
                             alive=[coordinator])["version"]
    alice.wait_for(lambda s: s["version"] > version, "training going on", timeout=60,
                   alive=[coordinator])
    ok, detail = alice.source.control("drain", "w2", timeout=10)
    assert ok, detail
    assert w2.wait(timeout=60) == 0
    alice.wait_for(lambda s: ids(s) == {"w1"}, "w2 drained", timeout=30, alive=[coordinator, w1])

    # SIGHUP re-reads every folder: alice is now a monitor only, the watcher an operator
    (folders["operators"] / "alice.key").rename(folders["monitors"] / "alice.key")
    (folders["monitors"] / "watcher.key").rename(folders["operators"] / "watcher.key")
    os.kill(coordinator.pid, signal.SIGHUP)
    alice.wait_for(lambda s: any("1 monitor key, 1 operator key" in e["text"]
                                 for e in alice.events_of("keys")),
                   "the key folders re-read", timeout=30, alive=[coordinator])
    ok, detail = alice.source.control("pause", timeout=10)
    assert not ok and "--operator-keys" in detail
    ok, detail = watcher.source.control("pause", timeout=10)
    assert ok, detail
    snap = watcher.wait_for(lambda s: s["paused"], "paused by the new operator", timeout=30,
                            alive=[coordinator])
    assert snap["counters"]["controls_refused"] == 5
    assert w1.running()
    cluster.assert_no_tracebacks()


def test_no_keys_means_loopback_only(cluster):
    """One of each with a real process (exit status 2, one line, no traceback); every case is in
    tests/unit/test_cli.py."""
    port = cluster.address.rsplit(":", 1)[1]
    proc = cluster.spawn("open", "coordinator", "--job", "digits", "--bind", f"tcp://*:{port}")
    assert proc.wait(timeout=DEADLINE) == 2
    said = proc.said()
    assert len(said) == 1 and "refusing to listen" in said[0] and "--insecure" in said[0], said
    keys = cluster.dir / "keys"
    keys_generate("coord", keys)
    proc = cluster.spawn("badkeys", "coordinator", "--job", "digits", "--bind", cluster.address,
                         "--secret-key", str(keys / "coord.key"), "--allow-keys", str(keys))
    assert proc.wait(timeout=DEADLINE) == 2
    said = proc.said()
    assert len(said) == 1 and "holds no secret key" in said[0], said
    cluster.assert_no_tracebacks()


def test_demo_with_curve_keys(tmp_path):
    out = subprocess.run([sys.executable, "-m", "idlegrad.cli", "demo", "--workers", "2", "--curve",
                          "--json", "--keep", str(tmp_path / "demo"), "--timeout", "180"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["reached"] and summary["workers_seen"] == 2
    log = (tmp_path / "demo" / "coordinator.log").read_text()
    assert "(CURVE, 2 worker keys, 0 monitor keys, 1 operator key)" in log


def test_half_open_connections_are_shed(cluster):
    """Raw TCP connections that never finish the handshake are closed by the coordinator, and it
    keeps answering meanwhile."""
    import socket

    from idlegrad.coordinator.transport import HANDSHAKE_S

    coordinator = cluster.coordinator("--job", "digits", "--epochs", "1000")
    status = cluster.status()
    status.wait_for(lambda s: True, "the coordinator answering", alive=[coordinator])
    host, port = cluster.address.removeprefix("tcp://").rsplit(":", 1)
    silent = [socket.create_connection((host, int(port)), timeout=5) for _ in range(20)]
    try:
        for conn in silent:
            conn.settimeout(HANDSHAKE_S + 10)
        t0 = time.monotonic()
        for conn in silent:
            data = b""
            try:
                while True:  # the greeting ZeroMQ sends, then the close
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
            except ConnectionResetError:
                pass
        waited = time.monotonic() - t0
        assert waited < HANDSHAKE_S + 10, waited
        assert status.fetch(timeout=2) is not None
    finally:
        for conn in silent:
            conn.close()
