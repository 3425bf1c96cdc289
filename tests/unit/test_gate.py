"""The admission policy's roles (coordinator/gate.py), purely: which key may work, read the status
or command, and what a refused sender is told."""

from __future__ import annotations

import pytest

from idlegrad.common import protocol as proto
from idlegrad.coordinator.gate import OPERATE, READ, WORK, Gate, KeyLists

WORKER, MONITOR, OPERATOR, BOTH, STRANGER = (k.encode() * 40 for k in "wmobs")
KEYS = KeyLists(workers=frozenset({WORKER, BOTH}), monitors=frozenset({MONITOR}),
                operators=frozenset({OPERATOR, BOTH}))

HELLO = proto.Hello(worker_id="w1", host="h", cores=1, threads=1, device="cpu", memory_mb=1,
                    versions={})
WORK_MESSAGES = [HELLO, proto.Ready(credits=1, fingerprint="f"), proto.Heartbeat(state="idle"),
                 proto.Bye(reason="done"),
                 proto.Result(slot=1, version=0, samples=1, loss=0.0, compute_s=0.1,
                              gradient=proto.Blob("float32", 0, ()))]
CONTROLS = [proto.Control(action="pause"), proto.Control(action="resume"),
            proto.Control(action="drain", worker="w1")]
STATUS = proto.StatusRequest(cursor=0)


def gate(keys=KEYS, banned=()) -> Gate:
    return Gate(keys, lambda identity: identity in banned)


@pytest.mark.parametrize("key,work,read,operate", [
    (WORKER, True, False, False), (MONITOR, False, True, False), (OPERATOR, False, True, True),
    (BOTH, True, True, True), (STRANGER, False, False, False), (None, False, False, False)])
def test_each_role_may_what_its_folder_says(key, work, read, operate):
    g = gate()
    assert (g.may(key, WORK), g.may(key, READ), g.may(key, OPERATE)) == (work, read, operate)
    assert g.handshake(key) == (key not in (STRANGER, None))
    assert g.listed(key) == g.handshake(key)


def test_without_keys_anyone_may_do_anything():
    g = gate(keys=None)
    assert not g.secure and g.listed(None)
    for msg in [*WORK_MESSAGES, *CONTROLS, STATUS]:
        assert g.admit(None, msg, b"route") is None
    assert not g.handshake(WORKER)  # a coordinator without keys runs no CURVE handshake


@pytest.mark.parametrize("control", CONTROLS)
def test_a_worker_keys_command_is_refused_with_a_control_reply(control):
    g = gate()
    refusal = g.admit(WORKER, control, b"route")
    assert refusal is not None and refusal.counter == "controls_refused"
    assert not refusal.bad_message
    reply = refusal.reply(control)
    assert isinstance(reply, proto.ControlReply)
    assert reply.action == control.action and reply.ok is False
    assert "--operator-keys" in reply.detail
    proto.decode(proto.encode(reply))  # it goes on the wire as it is
    assert g.admit(MONITOR, control, b"route").counter == "controls_refused"
    for key in (OPERATOR, BOTH):
        assert g.admit(key, control, b"route") is None


def test_status_is_for_monitors_and_operators():
    g = gate()
    for key in (MONITOR, OPERATOR, BOTH):
        assert g.admit(key, STATUS, b"route") is None
    refusal = g.admit(WORKER, STATUS, b"route")
    assert refusal.counter == "status_refused"
    reply = refusal.reply(STATUS)
    assert isinstance(reply, proto.Reject) and reply.code == "role"
    assert "--monitor-keys" in reply.reason


@pytest.mark.parametrize("msg", WORK_MESSAGES)
def test_only_worker_keys_work(msg):
    g = gate()
    for key in (WORKER, BOTH):
        assert g.admit(key, msg, b"route") is None
    for key in (MONITOR, OPERATOR):
        refusal = g.admit(key, msg, b"route")
        assert refusal.counter == "work_refused"
        reply = refusal.reply(msg)
        assert isinstance(reply, proto.Reject) and reply.code == "role"
        assert "--allow-keys" in reply.reason


def test_a_banned_operator_key_is_not_heard_at_all():
    g = gate(banned={"key:" + OPERATOR.decode()})
    refusal = g.admit(OPERATOR, CONTROLS[0], b"route")
    assert refusal.counter == "messages_banned_key" and refusal.code is None


def test_the_identity_checks_still_follow_the_role_check():
    g = gate()
    g.connect("w1", b"one", BOTH)
    refusal = g.admit(WORKER, HELLO, b"two")  # another key's worker id
    assert refusal.counter == "hello_identity" and refusal.code == "identity"
    refusal = g.admit(WORKER, proto.Heartbeat(state="idle"), b"one")  # on BOTH's connection
    assert refusal.bad_message


def test_reload_takes_roles_away_and_evicts_who_may_no_longer_work():
    g = gate()
    g.connect("w1", b"one", WORKER)
    g.connect("w2", b"two", BOTH)
    # WORKER leaves every folder; BOTH stays an operator only; MONITOR becomes an operator
    evicted, revoked = g.reload(KeyLists(operators=frozenset({BOTH, MONITOR})))
    assert sorted(evicted) == ["w1", "w2"] and revoked == 2
    assert not g.handshake(WORKER) and g.handshake(BOTH)
    assert g.admit(BOTH, HELLO, b"three").counter == "work_refused"
    assert g.admit(MONITOR, CONTROLS[0], b"route") is None
    assert not g.listed(OPERATOR)
    assert g.admit(OPERATOR, STATUS, b"route").counter == "status_refused"


def test_describe_counts_each_role():
    assert gate().describe() == "2 worker keys, 1 monitor key, 2 operator keys"
    assert gate(keys=None).describe() == "no keys"
