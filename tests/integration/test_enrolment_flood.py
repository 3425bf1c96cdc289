"""The enrolment endpoint under a stranger's flood, with a real coordinator (--enrolled) on
loopback: while hundreds of idle connections are open (more than its cap, which a lowered file
descriptor limit makes 64) and forged enrolments arrive from a dozen source addresses (more than
the window's overall refusal budget), a valid `idlegrad worker join` still enrols, and the
coordinator lives through its checkpoints. The flood's sources are other loopback addresses
(127.0.0.2 and up), so that the joiner's own (127.0.0.1) is not the flood's.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time

import pytest
import zmq

from idlegrad.common import protocol as proto
from idlegrad.common import security
from idlegrad.common.invitation import parse
from idlegrad.common.security import client_keys
from idlegrad.coordinator import enrolment
from idlegrad.coordinator.invitations import REFUSALS_PER_WINDOW

from .hostile_peers import curve_dealer, two_free_ports

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NOFILE = 256  # the coordinator's soft limit: its enrolment connections are capped at 64
IDLE = 300
FORGING_SOURCES = 12  # x 3 forgeries: past the window's overall budget (20), spread thin
JOIN_TIMEOUT_S = 12


def test_a_valid_join_enrols_through_idle_connections_and_forged_enrolments(cluster):
    cluster.address = f"tcp://127.0.0.1:{two_free_ports()}"
    enrol_port = int(cluster.address.rsplit(":", 1)[1]) + 1
    keys, allow, monitors = cluster.dir / "keys", cluster.dir / "allow", cluster.dir / "monitors"
    for d in (keys, allow, monitors):
        d.mkdir()
    security.generate("coord", str(keys))
    security.generate("monitor", str(keys))
    (monitors / "monitor.key").write_bytes((keys / "monitor.key").read_bytes())
    server_key = security.load_keypair(str(keys / "coord.key_secret"))[0]
    store = enrolment.Store(str(cluster.dir / "enrolled")).prepare()
    _, token = enrolment.issue(store, cluster.address, server_key, 1, 3600, "vol", time.time())

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(NOFILE, hard), hard))  # inherited
    try:
        coordinator = cluster.coordinator(
            "--job", "digits", "--epochs", "500", "--checkpoint-dir", str(cluster.dir / "ckpt"),
            "--checkpoint-every", "1", "--secret-key", str(keys / "coord.key_secret"),
            "--allow-keys", str(allow), "--monitor-keys", str(monitors),
            "--enrolled", str(store.dir))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    status = cluster.status(keys=client_keys(str(keys / "coord.key"),
                                             str(keys / "monitor.key_secret")))
    status.wait_for(lambda s: True, "the coordinator answering", timeout=60,
                    alive=[coordinator])

    ctx = zmq.Context()
    ctx.setsockopt(zmq.MAX_SOCKETS, 4096)
    try:
        idle = [curve_dealer(ctx, server_key, "127.0.0.2", enrol_port) for _ in range(IDLE)]
        time.sleep(1.0)  # their handshakes done: on main, the coordinator now holds them all
        forgers = [curve_dealer(ctx, server_key, f"127.0.0.{3 + i}", enrol_port)
                   for i in range(FORGING_SOURCES)]
        parsed = parse(token)
        forged = proto.encode(proto.Enrol(invitation=parsed.id, secret="A" * 43))
        for sock in forgers:
            for _ in range(3):
                sock.send_multipart(forged)
        answered, deadline = 0, time.monotonic() + 10
        while answered < REFUSALS_PER_WINDOW and time.monotonic() < deadline:
            for sock in forgers:
                while sock.poll(0):
                    sock.recv_multipart()
                    answered += 1
            time.sleep(0.05)
        time.sleep(0.5)  # the rest would be answered by now, if they were to be
        answered += sum(len(s.recv_multipart()) > 0 for s in forgers if s.poll(0))
        # the window's overall budget is spent: on main, a valid token was now dropped unread
        assert answered < 3 * FORGING_SOURCES, "every forgery was answered: no budget spent"

        other = cluster.dir / "joined" / "worker.toml"
        started = time.monotonic()
        joined = subprocess.run(
            [sys.executable, "-m", "idlegrad.cli", "worker", "join", token, "--config",
             str(other), "--timeout", str(JOIN_TIMEOUT_S)],
            env=cluster.env, capture_output=True, text=True, timeout=JOIN_TIMEOUT_S + 60)
        assert joined.returncode == 0, joined.stdout + joined.stderr
        assert other.is_file() and "coordinator_key" in other.read_text()
        join_s = time.monotonic() - started

        time.sleep(2.0)  # two checkpoints with the flood still connected
        assert coordinator.running(), coordinator.tail()
        snap = status.wait_for(lambda s: s["counters"].get("enrolled") == 1
                               and s["counters"].get("enrolment_connections_refused", 0) > 0,
                               "the join counted, the idle flood cut at the cap", timeout=20,
                               alive=[coordinator])
        counters = snap["counters"]
        assert counters.get("enrolments_dropped", 0) > 0
        print(f"{len(idle)} idle connections; join took {join_s:.1f}s; counters: "
              f"{ {k: v for k, v in counters.items() if 'enrol' in k} }")
    finally:
        ctx.destroy(linger=0)
    assert coordinator.running(), coordinator.tail()
    cluster.assert_no_tracebacks()

