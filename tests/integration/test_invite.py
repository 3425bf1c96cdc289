"""Invitations, end to end with real processes on loopback: `idlegrad invite` mints a token,
`idlegrad worker join TOKEN` enrols a fresh key and writes worker.toml, a bare `idlegrad worker`
trains with it; the token's second use, an expired token and a forged one are refused with one
line; a restarted coordinator still admits the enrolled key.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from idlegrad.common import protocol as proto
from idlegrad.common import security
from idlegrad.common.invitation import parse
from idlegrad.common.security import client_keys

from .harness import DEADLINE
from .hostile_peers import two_free_ports
from .test_security import keys_generate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def idlegrad(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "idlegrad.cli", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=DEADLINE)


def test_invite_join_train_refuse_replay_expiry_forgery_and_restart(cluster):
    cluster.address = f"tcp://127.0.0.1:{two_free_ports()}"
    keys, allow, monitors = cluster.dir / "keys", cluster.dir / "allow", cluster.dir / "monitors"
    enrolled = cluster.dir / "enrolled"
    allow.mkdir()
    monitors.mkdir()
    for name in ("coord", "monitor"):
        keys_generate(name, keys)
    (monitors / "monitor.key").write_bytes((keys / "monitor.key").read_bytes())
    coordinator_args = ("--job", "digits", "--epochs", "500", "--checkpoint-dir",
                        cluster.dir / "ckpt", "--secret-key", keys / "coord.key_secret",
                        "--allow-keys", allow, "--monitor-keys", monitors, "--enrolled", enrolled)
    coordinator = cluster.coordinator(*map(str, coordinator_args))
    invite = ("invite", "--coordinator", cluster.address, "--secret-key",
              keys / "coord.key_secret", "--enrolled", enrolled)

    once = idlegrad(cluster.env, *invite, "--uses", "1", "--name", "vol")
    assert once.returncode == 0, once.stderr
    token = once.stdout.strip().splitlines()[-1]
    parsed = parse(token)
    assert parsed.server_key == (keys / "coord.key").read_text().split('"')[1].encode()
    assert parsed.secret not in (enrolled / "invites" / f"{parsed.id}.json").read_text()
    short = idlegrad(cluster.env, *invite, "--expires", "1s")
    assert short.returncode == 0, short.stderr
    expired_token = short.stdout.strip().splitlines()[-1]

    # The volunteer: one command, then a bare `idlegrad worker` (the default worker.toml).
    joined = idlegrad(cluster.env, "worker", "join", token)
    assert joined.returncode == 0, joined.stdout + joined.stderr
    config = Path(cluster.env["XDG_CONFIG_HOME"]) / "idlegrad" / "worker.toml"
    assert config.is_file() and "coordinator_key" in config.read_text()
    name = next(line.split('"')[1] for line in config.read_text().splitlines()
                if line.startswith("id = "))
    assert name.startswith("vol-")
    assert not list(allow.iterdir())  # enrolled, not listed by hand
    worker = cluster.spawn("worker", "worker", "--threads", "1", "--device", "cpu",
                           "--no-idle-policy")
    status = cluster.status(keys=client_keys(str(keys / "coord.key"),
                                             str(keys / "monitor.key_secret")))
    snap = status.wait_for(lambda s: name in {w["id"] for w in s["workers"]} and s["version"] >= 3,
                           "the enrolled worker training", alive=[coordinator, worker])

    # Refused: the second use, an expired token, a forged secret; one line on the worker's side.
    other = cluster.dir / "other" / "worker.toml"
    forged = parsed.__class__(parsed.coordinator, parsed.server_key, parsed.id,
                              "A" * 43).encode()
    for bad, why in ((token, "used up"), (expired_token, "expired"), (forged, "wrong secret")):
        out = idlegrad(cluster.env, "worker", "join", bad, "--config", other, "--timeout", "30")
        assert out.returncode != 0, out.stdout
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and why in lines[0] and "Traceback" not in out.stderr, out.stderr
        assert not other.exists()
    damaged = idlegrad(cluster.env, "worker", "join", token[:-5], "--config", other)
    assert damaged.returncode == 2 and len(damaged.stderr.strip().splitlines()) == 1, \
        damaged.stderr
    snap = status.wait_for(lambda s: s["counters"].get("enrolments_refused", 0) >= 3,
                           "three refusals counted", timeout=30, alive=[coordinator])
    assert snap["counters"].get("enrolled") == 1
    for why in ("used up", "expired", "wrong secret"):
        assert any(why in e["text"] for e in status.events_of("refused")), status.events
    # The refused joins left no key files behind; a key that was never enrolled (one made
    # there now) gets nothing from the training endpoint (it hears nothing, and the
    # coordinator counts the refusal).
    assert not list(other.parent.glob("worker.key*")), list(other.parent.iterdir())
    security.generate("worker", str(other.parent))
    ctx = zmq.Context()
    try:
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        client_keys(str(keys / "coord.key"), str(other.parent / "worker.key_secret")).apply(rogue)
        rogue.connect(cluster.address)
        rogue.send_multipart(proto.encode(proto.Heartbeat(state="idle")))
        assert not rogue.poll(2000), "an unenrolled key got an answer from the training endpoint"
    finally:
        ctx.destroy(linger=0)
    status.wait_for(lambda s: s["counters"].get("handshakes_refused", 0) >= 1,
                    "the unenrolled key's handshake refused", timeout=30, alive=[coordinator])
    listed = idlegrad(cluster.env, "invite", "--enrolled", enrolled, "--list")
    assert f"{parsed.id}" in listed.stdout and "used 1/1" in listed.stdout, listed.stdout

    # A restart keeps the enrolled key: the worker comes back to the new process and trains.
    version = snap["version"]
    os.kill(coordinator.pid, signal.SIGTERM)
    assert coordinator.wait() == 0, coordinator.tail()
    status.close()
    coordinator = cluster.coordinator(*map(str, coordinator_args), name="coordinator")
    status = cluster.status(keys=client_keys(str(keys / "coord.key"),
                                             str(keys / "monitor.key_secret")))
    status.wait_for(lambda s: name in {w["id"] for w in s["workers"]} and s["version"] > version,
                    "the enrolled worker training after the restart", alive=[coordinator, worker])
    assert not status.events_of("refused"), status.events
    # Revoked: the next use is refused as revoked, and the list shows it so.
    revoked = idlegrad(cluster.env, "invite", "--enrolled", enrolled, "--revoke", parsed.id)
    assert revoked.returncode == 0, revoked.stderr
    out = idlegrad(cluster.env, "worker", "join", token, "--config", other, "--timeout", "30")
    assert out.returncode != 0 and "invitation revoked" in out.stderr, out.stderr
    listed = idlegrad(cluster.env, "invite", "--enrolled", enrolled, "--list")
    assert any(parsed.id in line and line.endswith("revoked")
               for line in listed.stdout.splitlines()), listed.stdout
    cluster.assert_no_tracebacks()
