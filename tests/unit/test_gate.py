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


# the operator's bans, and who reads which credit ------------------------------------------------

def nobody(name):
    return None


def test_an_operators_ban_names_a_worker_its_name_or_its_key_and_holds_for_its_hello():
    g = gate()
    g.connect("w1", b"one", WORKER)
    identities = {"w1": "key:" + WORKER.decode()}
    ok, detail, identity = g.ban("ban", "w1", identities, nobody)
    assert ok and identity == "key:" + WORKER.decode() and "banned" in detail
    refusal = g.admit(WORKER, HELLO, b"two")
    assert refusal.counter == "hello_banned" and "operator" in refusal.reason
    assert g.admit(WORKER, proto.Heartbeat(state="idle"), b"one").counter == \
        "messages_banned_key"
    # `worker status` from the banned key: told it is banned, not left to time out
    reply = g.admit(WORKER, proto.CreditRequest(), b"three").reply(proto.CreditRequest())
    assert not reply.ok and "banned" in reply.reason and "operator" in reply.reason
    assert g.ban("ban", "w1", identities, nobody)[1].endswith("already banned")
    # a worker gone, known by name to the credits; a key in Z85; an unknown name
    named = {"gone": "key:" + BOTH.decode()}.get
    assert g.ban("ban", "gone", {}, named)[2] == "key:" + BOTH.decode()
    assert g.ban("ban", MONITOR.decode(), {}, nobody)[2] == "key:" + MONITOR.decode()
    ok, detail, _ = g.ban("ban", "stranger", {}, nobody)
    assert not ok and "no worker or key" in detail
    assert set(g.bans) == {"key:" + k.decode() for k in (WORKER, BOTH, MONITOR)}
    # lifted
    assert g.ban("unban", "w1", identities, nobody)[0]
    assert g.admit(WORKER, HELLO, b"two") is None
    assert not g.ban("unban", "w1", identities, nobody)[0]


def test_without_keys_a_ban_is_of_the_worker_id_and_the_trust_ban_says_its_own_reason():
    g = gate(keys=None, banned={"bad"})
    assert g.ban("ban", "w9", {}, nobody)[2] == "w9"  # not seen yet: still banned by id
    assert "operator" in g.admit(None, HELLO.__class__(**{**HELLO.__dict__, "worker_id": "w9"}),
                                 b"r").reason
    assert "bad gradients" in g.ban_reason("bad") and g.ban_reason("w1") is None
    fresh = gate(keys=None)
    fresh.load_bans({"w9": "w9"})  # as saved: a restarted coordinator refuses it again
    assert fresh.is_banned("w9") and not fresh.is_banned("w1")


def test_a_worker_key_reads_only_its_own_credit_a_monitor_any():
    g = gate()
    own = "key:" + WORKER.decode()
    g.connect("w1", b"one", WORKER)
    g.connect("w2", b"two", BOTH)
    named = {"w1": own, "old": "key:" + BOTH.decode()}.get
    request = proto.CreditRequest()
    for key in (WORKER, MONITOR, OPERATOR, BOTH):  # any listed key may ask for its own
        assert g.admit(key, request, b"r") is None
    assert g.admit(STRANGER, request, b"r").counter == "credits_refused"
    assert g.credit_of(WORKER, None, named) == (own, None)
    assert g.credit_of(WORKER, "w1", named) == (own, None)  # its own name
    for other in ("w2", "old", "nobody"):
        identity, refusal = g.credit_of(WORKER, other, named)
        assert identity is None and refusal.counter == "credits_refused"
        reply = refusal.reply(proto.CreditRequest(worker=other))
        assert isinstance(reply, proto.Credit) and not reply.ok and not reply.row
        assert "--monitor-keys" in reply.reason
    assert g.credit_of(MONITOR, "w2", named) == ("key:" + BOTH.decode(), None)
    assert g.credit_of(OPERATOR, "old", named) == ("key:" + BOTH.decode(), None)
    plain = gate(keys=None)
    assert plain.credit_of(None, "w7", nobody) == ("w7", None)
    assert plain.credit_of(None, None, nobody)[1] is not None


def test_minting_an_invitation_is_an_operators_command():
    g = gate()
    invite = proto.Invite(address="tcp://h:5555")
    assert g.admit(OPERATOR, invite, b"r") is None
    for key in (WORKER, MONITOR):
        refusal = g.admit(key, invite, b"r")
        assert refusal.counter == "controls_refused"
        reply = refusal.reply(invite)
        assert isinstance(reply, proto.Invited) and not reply.ok and not reply.token
        proto.decode(proto.encode(reply))
