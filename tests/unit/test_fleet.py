"""Governing a fleet by key (moved from tests/integration/test_fleet.py onto the in-memory pair,
tests/unit/pair.py): a coordinator with key folders (workers, monitors, operators), two worker
keys training, each peer speaking with its own key as it would behind CURVE. What each role may
do through the server (not the gate alone, tests/unit/test_gate.py): an operator pauses, and
once no slot is out the credits stand still; a worker key reads its own credit row and nothing
else, may not ban or revoke, a monitor may not ban or mint, each refusal counted; an operator's
ban tells the worker in one line, it stops, its place goes to the other, and the ban holds for a
restarted coordinator; a key removed from --allow-keys and re-read (SIGHUP) is told so and stops.
tests/integration/test_fleet.py keeps the run with real processes, the command line and
enrolment."""

from __future__ import annotations

import asyncio
import json
import shutil

from idlegrad.common import protocol as proto
from idlegrad.common import security
from idlegrad.coordinator.server import CoordinatorConfig

from .pair import Pair

ROLES = {"wa": "allow", "wb": "allow", "watcher": "monitors", "alice": "operators"}


def fleet(tmp_path) -> tuple[CoordinatorConfig, dict[str, bytes]]:
    """A coordinator's config with key folders, and each peer's public key by name."""
    keys = tmp_path / "keys"
    security.generate("coord", str(keys))
    folders = {folder: tmp_path / folder for folder in set(ROLES.values())}
    key = {}
    for name, folder in ROLES.items():
        public, _ = security.generate(name, str(keys))
        folders[folder].mkdir(exist_ok=True)
        shutil.copy(public, folders[folder])
        key[name] = security.load_public(public)
    return CoordinatorConfig(
        job="synthetic", job_args={"params": 64, "batch_size": 8}, epochs=100_000,
        eval_every=3600, heartbeat_s=0.5, secret_key=str(keys / "coord.key_secret"),
        allow_keys=str(folders["allow"]), monitor_keys=str(folders["monitors"]),
        operator_keys=str(folders["operators"]), checkpoint_dir=str(tmp_path / "ckpt"),
        metrics_path=str(tmp_path / "metrics.jsonl"),
        ledger_path=str(tmp_path / "ledger.jsonl")), key


def training(config: CoordinatorConfig, key: dict[str, bytes]) -> Pair:
    """The pair with wa and wb joining (at its first `run`)."""
    p = Pair(config)
    for name in ("wa", "wb"):
        p.worker(name, key=key[name])
    return p


def both_computing(tmp_path) -> tuple[Pair, CoordinatorConfig, dict[str, bytes]]:
    """A fleet whose two workers have each computed a slot."""
    config, key = fleet(tmp_path)
    p = training(config, key)
    a, b = p.workers[b"wa"], p.workers[b"wb"]
    p.run(lambda: a.computed and b.computed, steps=400)
    return p, config, key


def rows(p: Pair) -> dict[str, dict]:
    return {w["id"]: w for w in p.coordinator.snapshot()["workers"]}


def control(p: Pair, key: bytes, action: str, **what) -> proto.ControlReply:
    reply = p.ask(proto.Control(action=action, **what), key=key)
    assert isinstance(reply, proto.ControlReply), reply
    return reply


def test_a_paused_fleet_earns_nothing_and_each_key_may_only_what_its_role_says(tmp_path):
    config, key = fleet(tmp_path)
    p = training(config, key)
    p.run(lambda: rows(p).keys() >= {"wa", "wb"} and all(w["done"] for w in rows(p).values())
          and p.coordinator.version >= 3, steps=400)

    assert control(p, key["alice"], "pause").ok
    p.run(lambda: not any(w["assigned"] for w in rows(p).values()), steps=400)
    seen = p.ask(proto.CreditRequest(worker="wa"), key=key["watcher"])
    assert seen.ok and seen.worker == "wa" and seen.row["samples"] > 0, seen
    p.turns(40)
    assert p.ask(proto.CreditRequest(worker="wa"), key=key["watcher"]).row == seen.row

    # wb's key reads its own row, never wa's, and no status either
    own = p.ask(proto.CreditRequest(), key=key["wb"])
    assert own.ok and own.worker == "wb" and own.row["samples"] > 0, own
    theirs = p.ask(proto.CreditRequest(worker="wa"), key=key["wb"])
    assert not theirs.ok and not theirs.row and "own credit" in theirs.reason, theirs
    status = p.ask(proto.StatusRequest(), key=key["wb"])
    assert isinstance(status, proto.Reject) and "--monitor-keys" in status.reason, status
    # a worker's key may not ban nor revoke, a monitor's may not ban nor mint
    for who, action, what in (("wb", "ban", {"worker": "wa"}),
                              ("wb", "revoke", {"invitation": "0123456789abcdef"}),
                              ("watcher", "ban", {"worker": "wa"})):
        reply = control(p, key[who], action, **what)
        assert not reply.ok and "--operator-keys" in reply.detail, (who, action, reply)
    minted = p.ask(proto.Invite(address="tcp://127.0.0.1:1"), key=key["watcher"])
    assert isinstance(minted, proto.Invited) and not minted.ok and not minted.token
    counters = p.coordinator.snapshot()["counters"]
    assert (counters.get("controls_refused"), counters.get("credits_refused"),
            counters.get("status_refused")) == (4, 1, 1), counters
    assert rows(p).keys() >= {"wa", "wb"}  # refusals changed nothing
    p.close()


def test_an_operators_ban_stops_the_worker_and_holds_for_a_restarted_coordinator(tmp_path):
    p, config, key = both_computing(tmp_path)
    a = p.workers[b"wa"]

    reply = control(p, key["alice"], "ban", worker="wa")
    assert reply.ok and "banned" in reply.detail, reply
    p.run(lambda: a.left is not None, steps=100)
    told = p.wire.to(b"wa", proto.Reject)[-1]
    assert told.code == "banned" and "operator" in told.reason, told
    assert a.left.refused and "operator" in a.left.reason, a.left
    assert "wa" not in rows(p)
    version = p.coordinator.version
    p.run(lambda: p.coordinator.version >= version + 3, steps=400)  # b has the work
    assert "key:" + key["wa"].decode() in json.loads(
        (tmp_path / "ckpt" / "bans.json").read_text())["bans"]
    p.close()

    again = training(config, key)  # restarted: wa's key refused at its hello, b trains on
    a, b = again.workers[b"wa"], again.workers[b"wb"]
    again.run(lambda: a.left is not None and b.computed >= 3, steps=400)
    assert a.left.refused and "operator" in a.left.reason and a.computed == 0, a.left
    assert again.wire.to(b"wa", proto.Reject)[-1].code == "banned"
    again.close()


def test_a_key_removed_and_reread_is_told_it_was_revoked_and_stops(tmp_path):
    p, _, _ = both_computing(tmp_path)
    a, b = p.workers[b"wa"], p.workers[b"wb"]
    (tmp_path / "allow" / "wb.key").unlink()
    asyncio.run(p.coordinator.reload_keys())  # SIGHUP
    p.run(lambda: b.left is not None, steps=100)
    assert b.left.refused and "revoked" in b.left.reason, b.left
    assert p.counters["workers_revoked"] == 1 and "wb" not in rows(p)
    done = a.computed
    p.run(lambda: a.computed >= done + 3, steps=100)  # a trains on
    p.close()
