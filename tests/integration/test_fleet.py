"""Running a volunteer fleet, end to end with real processes on loopback: an operator mints
invitations through the running coordinator, two volunteers join and train, each worker sees its
own credit (`idlegrad worker status`, equal to what `idlegrad credits` shows for its key); a
monitor's ban is refused, an operator's bans (the worker is told, in one line, and stops; a
restart keeps the ban), an invitation revoked remotely is refused and listed as revoked, a key
revoked by SIGHUP is told so, and a flood of bad secrets from one address is told to wait.

What each key's role may do through the server (a worker key reads only its own credit and may
not ban or revoke, a monitor's may not mint, each refusal counted; the credits of a paused fleet
stand still; a ban's and a revocation's rules) is tested on the in-memory pair, in virtual time:
tests/unit/test_fleet.py.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import zmq

from idlegrad.common import protocol as proto
from idlegrad.common.security import client_keys
from idlegrad.monitor.source import ZmqStatusSource

from .hostile_peers import two_free_ports
from .test_invite import idlegrad
from .test_security import keys_generate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


def last_json(out) -> dict:
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def one_error_line(proc_or_out, *words: str) -> str:
    """The one line a refused process printed (no traceback), holding every word."""
    text = proc_or_out.stderr if hasattr(proc_or_out, "stderr") else "\n".join(proc_or_out.said())
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    assert all(word in lines[0] for word in words), (words, lines[0])
    return lines[0]


def test_a_fleet_joins_earns_sees_its_own_credit_and_is_governed_by_its_operator(cluster):
    cluster.address = address = f"tcp://127.0.0.1:{two_free_ports()}"
    keys, enrolled = cluster.dir / "keys", cluster.dir / "enrolled"
    folders = {name: cluster.dir / name for name in ("allow", "monitors", "operators")}
    for folder in folders.values():
        folder.mkdir()
    for name, folder in (("coord", None), ("watcher", "monitors"), ("alice", "operators")):
        keys_generate(name, keys)
        if folder:
            (folders[folder] / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    coordinator_args = ("--job", "digits", "--epochs", "500", "--checkpoint-dir",
                        cluster.dir / "ckpt", "--secret-key", keys / "coord.key_secret",
                        "--allow-keys", folders["allow"], "--monitor-keys", folders["monitors"],
                        "--operator-keys", folders["operators"], "--enrolled", enrolled)
    coordinator = cluster.coordinator(*map(str, coordinator_args))
    pinned = ("--coordinator", address, "--coordinator-key", keys / "coord.key")
    operator = (*pinned, "--secret-key", keys / "alice.key_secret")
    monitor = (*pinned, "--secret-key", keys / "watcher.key_secret")
    as_key = lambda secret: client_keys(str(keys / "coord.key"), str(secret))  # noqa: E731
    status = cluster.status(keys=as_key(keys / "watcher.key_secret"))
    status.wait_for(lambda s: True, "the coordinator up", alive=[coordinator])

    # Minting through the running coordinator, with an operator's key.
    minted = idlegrad(cluster.env, "invite", *operator, "--uses", "2", "--name", "vol")
    assert minted.returncode == 0, minted.stderr
    token = minted.stdout.strip().splitlines()[-1]
    assert len(list((enrolled / "invites").glob("*.json"))) == 1  # persisted by the coordinator

    configs = {}
    for side in ("a", "b"):
        configs[side] = cluster.dir / side / "worker.toml"
        joined = idlegrad(cluster.env, "worker", "join", token, "--config", configs[side])
        assert joined.returncode == 0, joined.stdout + joined.stderr
    name = {side: next(line.split('"')[1] for line in path.read_text().splitlines()
                       if line.startswith("id = ")) for side, path in configs.items()}
    worker_keys = {side: configs[side].parent / "worker.key_secret" for side in configs}
    workers = {side: cluster.spawn(f"worker-{side}", "worker", "--config", configs[side],
                                   "--threads", "1", "--device", "cpu", "--no-idle-policy")
               for side in configs}
    status.wait_for(lambda s: {w["id"]: w["done"] for w in s["workers"]}.keys() >= set(
        name.values()) and all(w["done"] > 0 for w in s["workers"]) and s["version"] >= 3,
        "both enrolled workers training", alive=[coordinator, *workers.values()])
    # A worker waiting for its coordinator said so (it is not silent while it connects).
    assert any("connecting to the coordinator at" in line for line in workers["a"].lines())

    # Paused by the operator: once no slot is out, the credits stand still.
    with ZmqStatusSource(address, keys=as_key(keys / "alice.key_secret")) as alice:
        assert alice.control("pause")[0]
    status.wait_for(lambda s: s["paused"] and not any(w["assigned"] for w in s["workers"]),
                    "paused, no slot out", alive=[coordinator])
    credits = last_json(idlegrad(cluster.env, "credits", *monitor, "--json"))["workers"]
    for side in ("a", "b"):
        mine = last_json(idlegrad(cluster.env, "worker", "status", "--config", configs[side],
                                  "--json"))["projects"]
        (project,) = mine.values()
        assert project["error"] is None and project["worker"] == name[side], project
        assert project["credit"]["samples"] > 0, project
        assert project["credit"]["samples"] == credits[name[side]]["samples"], (project, credits)
        assert project["credit"]["compute_s"] == credits[name[side]]["compute_s"]
    text = idlegrad(cluster.env, "worker", "status", "--config", configs["a"])
    assert text.returncode == 0 and f"{credits[name['a']]['samples']:,} samples accepted" in \
        text.stdout, text.stdout + text.stderr

    # A monitor's ban, refused in one line (the command line's end of the role rules).
    banned = idlegrad(cluster.env, "ban", *monitor, name["a"])
    assert banned.returncode == 1
    one_error_line(banned, "--operator-keys")

    # The operator bans a (by its name): it is told why, stops, and its slots go to b.
    with ZmqStatusSource(address, keys=as_key(keys / "alice.key_secret")) as alice:
        assert alice.control("resume")[0]
    banned = idlegrad(cluster.env, "ban", *operator, name["a"])
    assert banned.returncode == 0 and "banned" in banned.stdout, banned.stdout + banned.stderr
    assert workers["a"].wait(timeout=60) != 0
    one_error_line(workers["a"], "banned", "operator")
    # what it earned, asked with the banned key: it is told it is banned, not left to time out
    asked = idlegrad(cluster.env, "worker", "status", "--config", configs["a"])
    assert asked.returncode == 1
    one_error_line(asked, "banned", "operator")
    version = status.wait_for(lambda s: name["a"] not in {w["id"] for w in s["workers"]},
                              "a gone", alive=[coordinator, workers["b"]])["version"]
    assert "key:" + (configs["a"].parent / "worker.key").read_text().split('"')[1] in \
        json.loads((enrolled / "bans.json").read_text())["bans"]

    # An invitation revoked remotely by the operator's key: the token is then refused, and `invite --list` shows it revoked.
    spare = idlegrad(cluster.env, "invite", *operator, "--name", "spare")
    spare_token = spare.stdout.strip().splitlines()[-1]
    spare_id = next(w for w in spare.stdout.split() if len(w) == 17 and w.endswith(":"))[:-1]
    revoked = idlegrad(cluster.env, "invite", *operator, "--revoke", spare_id)
    assert revoked.returncode == 0 and "revoked" in revoked.stdout, revoked.stderr
    out = idlegrad(cluster.env, "worker", "join", spare_token, "--config",
                   cluster.dir / "c" / "worker.toml", "--timeout", "30")
    assert out.returncode != 0
    one_error_line(out, "revoked")
    listed = idlegrad(cluster.env, "invite", "--enrolled", enrolled, "--list").stdout
    assert any(spare_id in line and line.endswith("revoked") for line in listed.splitlines()), \
        listed

    # A restart keeps the ban: a's key is refused at once, in one line; b trains on.
    os.kill(coordinator.pid, signal.SIGTERM)
    assert coordinator.wait() == 0, coordinator.tail()
    status.close()
    coordinator = cluster.coordinator(*map(str, coordinator_args), name="coordinator")
    status = cluster.status(keys=as_key(keys / "watcher.key_secret"))
    again = cluster.spawn("worker-a", "worker", "--config", configs["a"], "--threads", "1",
                          "--device", "cpu", "--no-idle-policy")
    assert again.wait(timeout=90) != 0
    one_error_line(again, "banned", "operator")
    status.wait_for(lambda s: name["b"] in {w["id"] for w in s["workers"]}
                    and s["version"] > version, "b training after the restart",
                    alive=[coordinator, workers["b"]])

    # b's enrolled key removed and SIGHUP: b is told its key was revoked, and stops.
    (b_key,) = [p for p in (enrolled / "keys").iterdir()
                if (configs["b"].parent / "worker.key").read_text().split('"')[1]
                in p.read_text()]
    b_key.unlink()
    os.kill(coordinator.pid, signal.SIGHUP)
    assert workers["b"].wait(timeout=60) != 0
    one_error_line(workers["b"], "revoked")

    # A flood of bad secrets from one address: a few are answered, then it is told to wait.
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        as_key(worker_keys["b"]).apply(sock)
        sock.connect(f"tcp://127.0.0.1:{int(address.rsplit(':', 1)[1]) + 1}")
        reasons = []
        for _ in range(7):
            sock.send_multipart(proto.encode(proto.Enrol(invitation=spare_id, secret="B" * 43)))
            assert sock.poll(30_000), "the enrolment endpoint did not answer"
            reasons.append(proto.decode(sock.recv_multipart()).reason)
    finally:
        ctx.destroy(linger=0)
    assert all("wrong secret" in r for r in reasons[:5]), reasons
    assert all("too many refused enrolments" in r for r in reasons[5:]), reasons
    status.wait_for(lambda s: s["counters"].get("enrolments_throttled", 0) == 2,
                    "the throttled attempts counted", timeout=30, alive=[coordinator])
    cluster.assert_no_tracebacks()
