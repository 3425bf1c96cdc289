"""A worker name is bound, for good, to the CURVE key that first said hello under it (gate.py,
names.py): another key is refused it, saying why, while the owner is away and after a restart;
the owner's reconnect always works. Each enrolled key's invitation and each hello's source
address make up its kin (gate.py, `kin`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from idlegrad.common import protocol as proto
from idlegrad.common.errors import ConfigError
from idlegrad.coordinator import names
from idlegrad.coordinator.enrolment import Store
from idlegrad.coordinator.gate import Gate, KeyLists
from idlegrad.coordinator.operators import Operators

OWNER, THIEF = b"o" * 40, b"t" * 40
KEYS = KeyLists(workers=frozenset({OWNER, THIEF}))


def hello(name: str = "laptop") -> proto.Hello:
    return proto.Hello(worker_id=name, host="h", cores=1, threads=1, device="cpu", memory_mb=1,
                       versions={})


def coordinator_gate(folder) -> tuple[Gate, Operators]:
    """A gate as a coordinator with `--checkpoint-dir folder` starts it: what was saved loaded."""
    gate = Gate(KEYS, lambda identity: False)
    operators = Operators(SimpleNamespace(enrolled=None, checkpoint_dir=str(folder)), gate,
                          None, None, None, lambda *a, **k: None)
    operators.load_bans()
    return gate, operators


def test_a_name_stays_its_first_keys_after_the_owner_disconnects():
    gate = Gate(KEYS, lambda identity: False)
    assert gate.admit(OWNER, hello(), b"r1") is None
    gate.connect("laptop", b"r1", OWNER)
    gate.forget("laptop")  # the owner's worker went away (silent, evicted)
    refusal = gate.admit(THIEF, hello(), b"r2")
    assert refusal is not None and refusal.code == "identity"
    reply = refusal.reply(hello())
    assert isinstance(reply, proto.Reject) and "bound to another key" in reply.reason
    assert "--id" in reply.reason  # what the refused worker can do about it
    # the owner comes back, as often as it likes
    for route in (b"r3", b"r4"):
        assert gate.admit(OWNER, hello(), route) is None
        gate.connect("laptop", route, OWNER)
    # and another name is the other key's to take
    assert gate.admit(THIEF, hello("desktop"), b"r5") is None


def test_the_binding_holds_across_a_restart(tmp_path):
    gate, _ = coordinator_gate(tmp_path)
    gate.connect("laptop", b"r1", OWNER)
    assert names.load(str(tmp_path / names.FILENAME)) == {"laptop": OWNER}
    restarted, _ = coordinator_gate(tmp_path)  # a new process: nobody connected yet
    refusal = restarted.admit(THIEF, hello(), b"r2")
    assert refusal is not None and refusal.code == "identity"
    assert restarted.admit(OWNER, hello(), b"r3") is None
    # the thief's name of its own is bound to it in turn, and saved
    restarted.connect("desktop", b"r4", THIEF)
    again, _ = coordinator_gate(tmp_path)
    assert again.admit(OWNER, hello("desktop"), b"r5").code == "identity"


def test_an_unreadable_name_list_fails_closed(tmp_path):
    (tmp_path / names.FILENAME).write_text('{"names": {"laptop": "short"}}')
    with pytest.raises(ConfigError, match="not a name list"):
        coordinator_gate(tmp_path)


def test_without_keys_nothing_is_bound(tmp_path):
    gate = Gate(None, lambda identity: False)
    operators = Operators(SimpleNamespace(enrolled=None, checkpoint_dir=str(tmp_path)), gate,
                          None, None, None, lambda *a, **k: None)
    operators.load_bans()
    gate.connect("laptop", b"r1", None)
    assert gate.owners == {} and not (tmp_path / names.FILENAME).exists()
    assert gate.admit(None, hello(), b"r2") is None  # names are not authenticated


def test_an_enrolled_keys_invitation_is_read_back_from_its_key_file(tmp_path):
    store = Store(str(tmp_path)).prepare()
    invitation, _ = store.mint(uses=2, expires_s=60.0, name="lab", now=0.0)
    store.enrol(invitation, 0, "lab-1", OWNER)
    store.enrol(invitation, 1, "lab-2", THIEF)
    assert store.invitations() == {OWNER: invitation.id, THIEF: invitation.id}
    # a coordinator started on the folder knows it: both keys are one kin
    gate = Gate(KEYS, lambda identity: False)
    operators = Operators(SimpleNamespace(enrolled=str(tmp_path), checkpoint_dir=None), gate,
                          None, None, None, lambda *a, **k: None)
    operators.load_bans()
    kin_a = gate.kin("lab-1", OWNER, b"r1")
    kin_b = gate.kin("lab-2", THIEF, b"r2")
    assert kin_a & kin_b == {"inv:" + invitation.id}


def test_kin_holds_the_hellos_source_address_but_not_loopback():
    gate = Gate(KEYS, lambda identity: False)
    gate.heard_from(b"r1", "192.0.2.7")
    gate.heard_from(b"r2", "192.0.2.7")
    gate.heard_from(b"r3", "127.0.0.1")
    gate.heard_from(b"r4", "127.0.0.1")
    assert gate.kin("a", OWNER, b"r1") & gate.kin("b", THIEF, b"r2") == {"src:192.0.2.7"}
    assert not gate.kin("a", OWNER, b"r3") & gate.kin("b", THIEF, b"r4")
    assert gate.kin("a", OWNER, b"r3") == {"key:" + OWNER.decode()}


def test_the_bindings_are_bounded_and_the_longest_unused_goes_first(tmp_path, monkeypatch):
    monkeypatch.setattr(names, "MAX_NAMES", 2)
    gate, _ = coordinator_gate(tmp_path)
    gate.connect("one", b"r1", OWNER)
    gate.connect("two", b"r2", OWNER)
    gate.connect("one", b"r3", OWNER)  # back: "two" is now the longest unused
    gate.connect("three", b"r4", OWNER)
    assert list(gate.owners) == ["one", "three"]
    restarted, _ = coordinator_gate(tmp_path)
    assert list(restarted.owners) == ["one", "three"]
