"""The enrolment endpoint's bounds (coordinator/door.py) and the desk that answers it
(enrolment.Desk): a valid token enrols while strangers flood forged ones, refusals are charged to
their source before the overall window, connections are cut at their deadline, over their bytes
and over the cap (the flood's own first), and a message is bounded in all, not only per frame."""

from __future__ import annotations

from collections import Counter

import pytest

from idlegrad.common import protocol as proto
from idlegrad.common.errors import ProtocolError
from idlegrad.coordinator.door import (ANSWER, DROP, WAIT, Connections, RefusalBudget,
                                       connection_cap)
from idlegrad.coordinator.enrolment import ENROL_MAX_BYTES, Desk, Store

NOW = 1_000_000.0


def test_a_source_past_its_share_is_told_to_wait_and_spends_nothing_of_the_window():
    budget = RefusalBudget(per_source=3, per_window=5, window_s=60.0)
    verdicts = [budget.charge("flood", NOW + i)[0] for i in range(50)]
    assert verdicts[:3] == [ANSWER] * 3 and set(verdicts[3:]) == {WAIT}
    # the flood spent 3 of the window's 5: two other sources are still answered
    assert budget.charge("typo", NOW + 51)[0] == ANSWER
    assert budget.charge("other", NOW + 52)[0] == ANSWER
    assert budget.charge("third", NOW + 53)[0] == DROP  # the window's bound, spent by many
    verdict, wait_s = budget.charge("flood", NOW + 54)
    assert verdict == WAIT and wait_s == pytest.approx(6.0)  # until its first leaves the window
    # its first refusal left the window at NOW + 60: heard again, and spends the slot it freed
    assert budget.charge("flood", NOW + 61)[0] == ANSWER
    assert budget.charge("fourth", NOW + 61.5)[0] == ANSWER  # the window's fifth
    assert budget.charge("fifth", NOW + 61.6)[0] == DROP  # the window is full again
    assert budget.charge("later", NOW + 200)[0] == ANSWER  # the window moved on


def test_connections_past_their_deadline_are_cut_the_oldest_first():
    conns = Connections(cap=10, deadline_s=10.0)
    conns.opened("a", "10.0.0.1", 0.0)
    conns.opened("b", "10.0.0.2", 4.0)
    assert conns.due(9.9) == []
    assert conns.due(10.0) == ["a"]
    assert conns.due(13.0) == [] and len(conns) == 1
    conns.closed("b")  # gone by itself
    assert conns.due(100.0) == [] and len(conns) == 0 and conns.per_source == {}


def test_over_the_cap_the_source_holding_the_most_loses_its_oldest():
    conns = Connections(cap=4)
    assert conns.opened("joiner", "10.0.0.9", 0.0) == []
    for i in range(3):
        assert conns.opened(f"idle{i}", "10.0.0.66", 1.0 + i) == []
    # the cap is reached: every new connection of the flood sheds the flood's oldest
    assert conns.opened("idle3", "10.0.0.66", 5.0) == ["idle0"]
    for i in range(4, 100):
        assert conns.opened(f"idle{i}", "10.0.0.66", 5.0 + i) == [f"idle{i - 3}"]
    assert "joiner" in conns.open and len(conns) == 4
    # a second joiner while the flood holds three: the flood pays again
    assert conns.opened("joiner2", "10.0.0.10", 200.0) == ["idle97"]


def test_a_connection_that_receives_more_than_an_enrolment_is_cut_once():
    conns = Connections(cap=4, max_bytes=1000)
    conns.opened(7, "10.0.0.1", 0.0)
    assert not conns.received(7, 1000)
    assert conns.received(7, 1001)
    assert not conns.received(7, 5000) and len(conns) == 0  # forgotten once cut


def test_the_cap_is_well_under_the_descriptor_limit():
    assert connection_cap(1024) == 256
    assert connection_cap(256) == 64
    assert connection_cap(20000) == 256
    assert connection_cap(2) == 1
    assert connection_cap() <= 256


def test_a_message_is_bounded_in_all_not_only_per_frame():
    header = proto.encode(proto.Enrol(invitation="0123456789abcdef", secret="s" * 43))[0]
    assert isinstance(proto.decode([header]), proto.Enrol)
    many = [header] + [b"x" * 16] * proto.MAX_MESSAGE_FRAMES  # each frame tiny
    with pytest.raises(ProtocolError, match="frames, at most"):
        proto.decode(many)
    with pytest.raises(ProtocolError, match="bytes, at most 100"):
        proto.decode([header, b"x" * 50], max_bytes=100)
    # the bound fits the largest message a peer may legitimately send: a result's two blobs
    assert proto.MAX_MESSAGE_FRAMES == 1 + 2 * proto.MAX_BLOB_FRAMES


# the desk -------------------------------------------------------------------------------------


class Frame:
    """A received frame as zmq gives it: its bytes, and the properties the desk reads."""

    def __init__(self, data: bytes, key: bytes, source: str):
        self.buffer = memoryview(data)
        self.props = {"User-Id": key.decode(), "Peer-Address": source}

    def get(self, name: str) -> str:
        return self.props[name]


class Owner:
    def __init__(self):
        self.counters: Counter = Counter()
        self.enrolled: list[bytes] = []
        self.events: list[str] = []
        self.gate = self
        self.training = self

    def enrol(self, key: bytes, invitation: str) -> None:
        self.enrolled.append(key)

    def event(self, kind: str, text: str, level=None) -> None:
        self.events.append(kind)


def enrol_frames(inv_id: str, secret: str, key: bytes, source: str) -> list:
    header = proto.encode(proto.Enrol(invitation=inv_id, secret=secret))[0]
    return [b"route", Frame(header, key, source)]


def test_a_valid_token_enrols_while_strangers_flood_forged_ones(tmp_path):
    owner = Owner()
    store = Store(str(tmp_path)).prepare()
    desk = Desk(owner, store)
    inv, secret = store.mint(uses=1, expires_s=3600, name="vol", now=NOW)
    stranger = b"S" * 40
    # a flood from one source, then from a thousand: a minute's every budget spent many times
    for i in range(300):
        desk.handle(enrol_frames(inv.id, f"forged{i}", stranger, "10.6.6.6"), NOW + i * 0.01)
    for i in range(1000):
        desk.handle(enrol_frames("%016x" % i, "guess", stranger, f"10.7.{i // 256}.{i % 256}"),
                    NOW + 3 + i * 0.01)
    assert owner.counters["enrolments_dropped"] > 900  # the flood is mostly not even answered
    assert owner.events.count("refused") <= 20  # nor logged past the window's bound
    joiner = b"J" * 40
    # the joiner shares its source with the flood (one NAT): its valid token still enrols
    reply = desk.handle(enrol_frames(inv.id, secret, joiner, "10.6.6.6"), NOW + 20)
    assert isinstance(reply, proto.Enrolled) and reply.ok, reply
    assert owner.enrolled == [joiner] and owner.counters["enrolled"] == 1


def test_a_many_frame_or_oversized_enrolment_is_refused_and_charged_to_its_source(tmp_path):
    owner = Owner()
    desk = Desk(owner, Store(str(tmp_path)).prepare())
    key = b"K" * 40
    header = proto.encode(proto.Enrol(invitation="0123456789abcdef", secret="s"))[0]
    frames = [b"route", Frame(header, key, "10.0.0.1"), b"", b""]
    reply = desk.handle(frames, NOW)
    assert isinstance(reply, proto.Enrolled) and not reply.ok and "an enrol is one" in reply.reason
    big = proto.encode(proto.Enrol(invitation="0123456789abcdef", secret="s" * 4096))[0]
    assert len(big) > ENROL_MAX_BYTES
    reply = desk.handle([b"route", Frame(big, key, "10.0.0.1")], NOW + 1)
    assert isinstance(reply, proto.Enrolled) and not reply.ok and "bytes" in reply.reason
    assert desk.budget.sources.sources["10.0.0.1"]  # charged to the source
