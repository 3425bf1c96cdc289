"""Invitations, purely: tokens (common/invitation.py), the decisions (coordinator/invitations.py),
the enrol messages' schema, the gate's enrolment, and the folder the invitations and enrolled
keys live in (coordinator/enrolment.py's Store, on a tmp_path)."""

from __future__ import annotations

import json

import pytest

from idlegrad.common import protocol as proto
from idlegrad.common import security
from idlegrad.common.errors import ConfigError, ProtocolError
from idlegrad.common.invitation import PREFIX, Token, digest, enrol_address, parse
from idlegrad.coordinator.enrolment import Store
from idlegrad.coordinator.gate import WORK, Gate, KeyLists
from idlegrad.coordinator.invitations import (Invitation, Refusals, SourceLimit, judge,
                                              key_name, parse_duration)

KEY = b"k" * 40
SECRET = "s" * 43
INV = Invitation(id="0123456789abcdef", digest=digest(SECRET), uses=2, expires=1000.0,
                 name="vol", created=0.0)


def test_a_token_round_trips_and_carries_nothing_but_address_key_id_secret():
    token = Token("tcp://10.0.0.1:5555", KEY, INV.id, SECRET)
    text = token.encode()
    assert text.startswith(PREFIX) and parse(text) == token
    assert parse("  " + text + "\n") == token


@pytest.mark.parametrize("text", ["", "hello", PREFIX, PREFIX + "!!!!", PREFIX + "e30",
                                  Token("tcp://h:5555", KEY, "XYZ", SECRET).encode(),
                                  Token("tcp://h:5555", KEY, INV.id, "short").encode(),
                                  Token("tcp://h:5555", b"k" * 39, INV.id, SECRET).encode(),
                                  Token("ipc:///tmp/x", KEY, INV.id, SECRET).encode(),
                                  PREFIX + "A" * 2000])
def test_a_malformed_token_is_one_config_error(text):
    with pytest.raises(ConfigError) as err:
        parse(text)
    assert "\n" not in str(err.value)


def test_the_enrolment_endpoint_is_the_next_port():
    assert enrol_address("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5556"
    assert enrol_address("tcp://*:7000") == "tcp://*:7001"
    for bad in ("tcp://h:65535", "tcp://h:*", "ipc:///tmp/s", "tcp://h", "tcp://h:x"):
        with pytest.raises(ConfigError):
            enrol_address(bad)


@pytest.mark.parametrize("inv,used,secret,now,why", [
    (None, 0, SECRET, 0.0, "unknown"),
    (INV, 0, "t" * 43, 0.0, "wrong secret"),
    (INV, 0, SECRET, 1000.0, "expired"),
    (INV, 2, SECRET, 0.0, "used up"),
    (INV, 0, SECRET, 999.0, None),
    (INV, 1, SECRET, 0.0, None)])
def test_judge_refuses_unknown_forged_expired_and_used_up(inv, used, secret, now, why):
    reason = judge(inv, used, secret, now)
    assert (reason is None) if why is None else (why in reason)


def test_key_names_count_the_uses():
    assert key_name(INV, 0) == "vol-012345-1" and key_name(INV, 1) == "vol-012345-2"


def test_durations():
    assert parse_duration("7d") == 7 * 86400 and parse_duration("90") == 90
    assert parse_duration("1.5h") == 5400 and parse_duration("2w") == 14 * 86400
    for bad in ("", "0", "-1d", "7y", "d"):
        with pytest.raises(ConfigError):
            parse_duration(bad)


def test_refusals_are_bounded_per_window():
    r = Refusals(limit=2, window_s=10.0)
    assert r.open(0.0)
    r.refused(0.0)
    r.refused(1.0)
    assert not r.open(5.0)
    assert not r.open(9.9)
    assert r.open(10.5)  # the first has left the window


def test_a_source_gets_a_few_refusals_a_window_then_is_told_to_wait():
    limit = SourceLimit(limit=3, window_s=60.0, max_sources=2)
    for t in (0.0, 10.0, 20.0):
        assert limit.wait("10.0.0.1", t) == 0
        limit.refused("10.0.0.1", t)
    assert limit.wait("10.0.0.1", 30.0) == 30.0  # until its first refusal leaves the window
    assert limit.wait("10.0.0.2", 30.0) == 0  # another source is not held up
    assert "try again in 30s" in SourceLimit.told("10.0.0.1", 29.2)
    assert limit.wait("10.0.0.1", 60.5) == 0  # one refusal left the window: one more try
    limit.refused("10.0.0.1", 61.0)
    assert limit.wait("10.0.0.1", 62.0) == 8.0
    assert limit.wait("10.0.0.1", 200.0) == 0 and "10.0.0.1" not in limit.sources


def test_a_flood_of_sources_forgets_the_least_recently_refused():
    limit = SourceLimit(limit=1, window_s=60.0, max_sources=2)
    for i, source in enumerate(("a", "b", "c")):
        limit.refused(source, float(i))
    assert list(limit.sources) == ["b", "c"]
    assert limit.wait("a", 3.0) == 0 and limit.wait("c", 3.0) > 0


def test_a_revoked_invitation_is_refused_only_to_the_secret_holder():
    assert "revoked" in judge(INV, 0, SECRET, 10.0, revoked=True)
    assert "wrong secret" in judge(INV, 0, "x" * 43, 10.0, revoked=True)
    assert judge(INV, 0, SECRET, 10.0, revoked=False) is None


def test_an_invitation_record_is_checked_when_read():
    assert Invitation.from_json(INV.to_json()) == INV
    for broken in ({**INV.to_json(), "uses": 0}, {**INV.to_json(), "id": "../x"},
                   {**INV.to_json(), "extra": 1}, [], {**INV.to_json(), "name": "a b"}):
        with pytest.raises(ValueError):
            Invitation.from_json(broken)


def test_enrol_messages_are_checked():
    ok = proto.Enrol(invitation=INV.id, secret=SECRET)
    assert proto.decode(proto.encode(ok)) == ok
    for bad in (proto.Enrol(invitation="x" * 16, secret=SECRET),
                proto.Enrol(invitation=INV.id, secret="s" * 44),
                proto.Enrol(invitation=INV.id, secret="é" * 43),
                proto.Enrolled(ok=False, reason="r" * 5000)):
        with pytest.raises(ProtocolError):
            proto.decode(proto.encode(bad))


def test_the_gate_lets_an_enrolled_key_work_and_only_work():
    g = Gate(KeyLists(), lambda identity: False)
    assert not g.handshake(KEY)
    g.enrol(KEY)
    assert g.handshake(KEY) and g.may(KEY, WORK) and not g.may(KEY, "read")
    plain = Gate(None, lambda identity: False)
    plain.enrol(KEY)
    assert plain.keys is None  # no keys: nothing to enrol into


def test_the_store_keeps_a_hash_counts_uses_and_survives_a_reread(tmp_path):
    store = Store(str(tmp_path)).prepare()
    inv, secret = store.mint(1, 60.0, "vol", now=100.0)
    record = (tmp_path / "invites" / f"{inv.id}.json").read_text()
    assert secret not in record and json.loads(record)["digest"] == digest(secret)
    assert store.load(inv.id) == inv and store.used(inv.id) == 0
    assert judge(store.load(inv.id), store.used(inv.id), secret, 120.0) is None
    store.enrol(inv, 0, key_name(inv, 0), KEY)
    again = Store(str(tmp_path))
    assert again.used(inv.id) == 1 and again.enrolled_keys() == frozenset({KEY})
    assert "used up" in judge(again.load(inv.id), again.used(inv.id), secret, 120.0)
    assert [(i.id, revoked) for i, _, revoked in again.all()] == [(inv.id, False)]
    assert not list(tmp_path.rglob("*.tmp*"))
    assert again.revoke(inv.id, 130.0) is True and again.revoke(inv.id, 131.0) is False
    assert again.revoke("fedcba9876543210", 131.0) is None  # no such invitation
    # revoked, and still listed as such; the keys it enrolled stay
    assert again.revoked(inv.id) and Store(str(tmp_path)).revoked(inv.id)
    assert [(i.id, revoked) for i, _, revoked in again.all()] == [(inv.id, True)]
    assert again.load(inv.id) == inv and again.enrolled_keys() == frozenset({KEY})
    (tmp_path / "invites" / "0000000000000000.used").write_text("garbage")
    assert again.used("0000000000000000") > 1000  # unreadable: used up


def test_the_store_reads_nothing_outside_its_folder(tmp_path):
    store = Store(str(tmp_path)).prepare()
    (tmp_path / "outside.json").write_text(json.dumps(INV.to_json()))
    assert store.load("../outside") is None and store.revoke("../outside", 0.0) is None
    assert (tmp_path / "outside.json").exists()
    (tmp_path / "invites" / "fedcba9876543210.json").write_text(json.dumps(INV.to_json()))
    assert store.load("fedcba9876543210") is None  # a record under another id's name


def test_join_refuses_to_overwrite_a_configuration_before_enrolling(tmp_path):
    from idlegrad.worker.join import join

    config = tmp_path / "worker.toml"
    config.write_text('coordinator = "tcp://127.0.0.1:5555"\n')
    token = Token("tcp://127.0.0.1:9", KEY, INV.id, SECRET).encode()
    with pytest.raises(ConfigError, match="exists"):
        join(token, str(config), timeout_s=0.1)
    assert not (tmp_path / "worker.key_secret").exists()  # nothing made, no use spent


def test_join_without_an_answer_is_one_line_and_writes_no_configuration(tmp_path):
    import zmq.auth

    from idlegrad.common.errors import IdlegradError
    from idlegrad.worker.join import join

    public, _ = zmq.auth.create_certificates(str(tmp_path), "coord")
    server = zmq.auth.load_certificate(public)[0]
    token = Token("tcp://127.0.0.1:9", server, INV.id, SECRET).encode()  # nobody listens
    with pytest.raises(IdlegradError, match="no answer") as err:
        join(token, str(tmp_path / "w" / "worker.toml"), timeout_s=0.3)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "w" / "worker.toml").exists()
    assert (tmp_path / "w" / "worker.key_secret").exists()  # kept for the next try


def test_join_install_installs_a_service_reading_the_written_file(tmp_path, monkeypatch):
    import argparse

    from idlegrad.cli import worker_cli
    from idlegrad.worker import join, service

    config = tmp_path / "worker.toml"

    def fake_join(text, path, timeout_s):
        with open(path, "w") as f:
            f.write('coordinator = "tcp://127.0.0.1:5555"\nid = "vol-1"\n')
        return ["enrolled"]

    installed = []
    monkeypatch.setattr(join, "join", fake_join)
    monkeypatch.setattr(service, "platform_format", lambda: "systemd")
    monkeypatch.setattr(service, "install", lambda fmt, scope, text, path: installed.append(
        (scope, text)) or ["installed"])
    args = argparse.Namespace(token="t", config=str(config), timeout=1.0, install=True)
    assert worker_cli.run_join(args) == 0
    (scope, text), = installed
    assert scope == "user" and f"--config {config}" in text
    installed.clear()
    config.unlink()
    assert worker_cli.run_join(argparse.Namespace(token="t", config=str(config), timeout=1.0,
                                                  install=False)) == 0
    assert not installed


def test_an_empty_allow_folder_is_expected_with_invitations(tmp_path, caplog):
    from idlegrad.coordinator.config import CoordinatorConfig, load_key_lists

    (tmp_path / "allow").mkdir()
    store = Store(str(tmp_path / "enrolled")).prepare()
    inv, _ = store.mint(1, 60.0, "vol", now=0.0)
    store.enrol(inv, 0, key_name(inv, 0), KEY)
    config = CoordinatorConfig(job="digits", allow_keys=str(tmp_path / "allow"),
                               enrolled=str(tmp_path / "enrolled"))
    with caplog.at_level("WARNING"):
        assert load_key_lists(config).workers == frozenset({KEY})
    assert "holds no" not in caplog.text
    with caplog.at_level("WARNING"):
        load_key_lists(CoordinatorConfig(job="digits", allow_keys=str(tmp_path / "allow")))
    assert "holds no" in caplog.text


def test_the_bans_are_kept_whole_and_a_damaged_list_is_one_line(tmp_path):
    from idlegrad.coordinator import bans

    assert bans.path_for(None, None) is None
    assert bans.path_for(str(tmp_path / "e"), str(tmp_path / "c")) == str(tmp_path / "e" /
                                                                            bans.FILENAME)
    path = bans.path_for(None, str(tmp_path / "ckpt"))
    assert bans.load(path) == {}
    bans.save(path, {"key:" + "A" * 40: "w1", "w2": "w2"})
    assert bans.load(path) == {"key:" + "A" * 40: "w1", "w2": "w2"}
    assert not list(tmp_path.rglob("*.tmp*"))
    for damaged in ("{", '{"bans": [1]}', '{"other": {}}', '{"bans": {"k": 1}}'):
        (tmp_path / "ckpt" / bans.FILENAME).write_text(damaged)
        with pytest.raises(ConfigError, match="not a ban list"):
            bans.load(path)


def test_a_refused_join_leaves_no_key_files_but_keeps_a_pair_it_found(tmp_path, monkeypatch):
    from idlegrad.worker import join as join_mod

    def refuse(token, keys, timeout_s):
        raise join_mod.InvitationRefused("the coordinator refused the invitation: used up")

    monkeypatch.setattr(join_mod, "enrol", refuse)
    token = Token("tcp://127.0.0.1:9", KEY, INV.id, SECRET).encode()
    config = tmp_path / "worker.toml"
    with pytest.raises(join_mod.InvitationRefused):
        join_mod.join(token, str(config))
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no keys, no configuration
    security.generate("worker", str(tmp_path))  # a pair of an earlier join: the owner's
    with pytest.raises(join_mod.InvitationRefused):
        join_mod.join(token, str(config))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker.key", "worker.key_secret"]
