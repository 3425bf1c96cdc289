"""What one worker key may cost the coordinator (coordinator/budgets.py, issue 27 item 5): the
budgets alone with a fake clock, the scheduler's bound on open rounds, the blob service's queue
per key, and the server's path (the in-memory pair, tests/unit/pair.py) where a result for a slot
its sender does not hold is dropped before its gradient is read.

Without keys the pair's coordinator hears a key when the test hands `Coordinator.handle` one: the
sender's identity is then that key, as behind a CURVE socket."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
import zmq

from idlegrad.common import protocol as proto
from idlegrad.common.coding import Redundancy
from idlegrad.common.errors import ConfigError
from idlegrad.coordinator.blobserve import BlobService
from idlegrad.coordinator.budgets import (DECODE, OVER_RATE, UNHELD, BudgetConfig, KeyBudgets,
                                          TokenBucket)
from idlegrad.coordinator.server import CoordinatorConfig
from idlegrad.coordinator.transport import ZmqTransport

from .pair import Pair
from .scheduling import make

KEY = b"k" * 40  # one key (Z85 is 40 characters)
OTHER = b"o" * 40
PARAMS = 64


class Fleet:
    """Who holds which name and slot, as the gate and the scheduler would say."""

    def __init__(self):
        self.owner: dict[str, str] = {}
        self.held: set[tuple[str, int]] = set()
        self.credits: dict[str, int] = {}

    def identity(self, name: str, key=None) -> str:
        if key is not None:
            return "key:" + key.decode()
        return self.owner.get(name, name)

    def budgets(self, **config) -> KeyBudgets:
        return KeyBudgets(BudgetConfig(**config), self.identity,
                          lambda name, slot: (name, slot) in self.held,
                          lambda name: self.credits.get(name, 0))


def test_one_key_holds_at_most_its_names_and_a_name_it_lost_frees_its_place():
    fleet = Fleet()
    budgets = fleet.budgets(names=3)
    me = "key:" + KEY.decode()
    for name in ("a", "b", "c"):
        assert budgets.hello(me, name) is None
        fleet.owner[name] = me  # connected (the gate's key_of)
    refusal = budgets.hello(me, "d")
    assert refusal is not None and refusal.code == "names" and "3 names" in refusal.reason
    assert budgets.hello(me, "b") is None  # a name it holds may say hello again
    assert budgets.hello("key:" + OTHER.decode(), "d") is None  # another key's budget
    del fleet.owner["a"]  # evicted, banned or gone: the gate forgot it
    assert budgets.hello(me, "d") is None
    fleet.owner["d"] = me
    assert sorted(budgets.names_of(me)) == ["b", "c", "d"]


def test_the_credits_of_all_the_names_of_a_key_are_bounded_together():
    fleet = Fleet()
    budgets = fleet.budgets(credits=64)
    me = "key:" + KEY.decode()
    granted = []
    for name in ("a", "b", "c", "d"):
        budgets.hello(me, name)
        fleet.owner[name] = me
        fleet.credits[name] = budgets.credits(me, name, 1024)
        granted.append(fleet.credits[name])
    assert granted == [64, 0, 0, 0]
    assert budgets.credits(me, "a", 10) == 10  # asking again, a name's own credits are not others'
    fleet.credits["a"] = 10
    assert budgets.credits(me, "b", 1024) == 54
    assert budgets.counters["credits_over_budget"] == 3 * 1024 + 960 + 970
    # without keys a name is its own identity: bounded alone
    assert fleet.budgets(credits=64).credits("solo", "solo", 2) == 2


def test_results_for_slots_not_held_are_not_worth_decoding():
    fleet = Fleet()
    budgets = fleet.budgets()
    fleet.held.add(("a", 7))
    assert budgets.result("a", "a", 7, now=0.0) == DECODE
    assert budgets.result("a", "a", 8, now=0.0) == UNHELD
    assert budgets.result("a", "b", 7, now=0.0) == UNHELD  # another's slot
    assert budgets.counters["results_unheld"] == 2


def test_results_per_key_are_rationed_by_a_token_bucket():
    fleet = Fleet()
    budgets = fleet.budgets(results_per_s=10.0, results_burst=5.0)
    fleet.held |= {("a", 1), ("b", 1)}
    # five at once (the burst), all names of one identity together
    assert [budgets.result("me", n, 1, now=100.0) for n in "ababab"] == [DECODE] * 5 + [OVER_RATE]
    assert budgets.counters["results_over_budget"] == 1
    assert budgets.result("other", "a", 1, now=100.0) == DECODE  # another key's bucket
    assert budgets.result("me", "a", 1, now=100.0625) == OVER_RATE  # not a whole token back yet
    assert budgets.result("me", "a", 1, now=100.125) == DECODE
    # a second later the bucket is full again, never fuller
    assert sum(budgets.result("me", "a", 1, now=101.25) == DECODE for _ in range(20)) == 5
    assert fleet.budgets(results_per_s=0).result("me", "a", 1, now=0.0) == DECODE  # no limit


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_result_over_its_keys_rate_is_not_read_and_its_slot_is_dealt_again(mode):
    # Two workers answering faster than their budget. The results over it are not read, and
    # their slots go back to the round: dropped with the slot still held, each worker held one
    # it had already answered, and under --sync (a worker holding a slot takes no other) the
    # run stopped for good (test_eval_on_workers, on digits at 270 results a second a worker).
    budgets = BudgetConfig(results_per_s=10.0, results_burst=2.0)
    p = Pair(CoordinatorConfig(job="synthetic", job_args={"params": PARAMS, "batch_size": 16},
                               partitions=2, epochs=1, eval_every=3600, heartbeat_s=0.5,
                               mode=mode, budgets=budgets))
    p.worker("w1")
    p.worker("w2")
    p.run(steps=20_000)
    assert p.coordinator.stop_reason == "epochs"
    final = p.final()
    assert p.counters["results_over_budget"] > 10
    assert final["scheduler"]["slots_handed_back"] == p.counters["results_over_budget"]
    assert p.events("over_budget")


def test_a_token_bucket_refills_at_its_rate_up_to_its_burst():
    bucket = TokenBucket(rate=2.0, burst=3.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.take(0.5) and not bucket.take(0.5)
    assert bucket.level(100.0) == 3.0
    assert not bucket.take(-5.0)  # a clock going back gives nothing


def test_budgets_are_checked():
    with pytest.raises(ConfigError):
        BudgetConfig(names=0)
    with pytest.raises(ConfigError):
        BudgetConfig(results_per_s=-1)


# the rounds the fleet's credits can use --------------------------------------------------------


def test_a_worker_asking_many_credits_opens_no_more_rounds_than_credits_can_use():
    """With replicate:2 a worker takes one lease per round, so each of its credits opened a
    round of its own (4,097 rounds under four names of 1,024 credits): the rounds open are
    bounded by what the credits can use."""
    s = make(n=20_000, batch=8, partitions=4, redundancy=Redundancy("replicate", 2),
             min_deadline_s=1000.0)
    s.join("greedy", {}, 0.0)
    s.ready("greedy", 256, 0.0)
    assert len(s.rounds) <= 2 * 256 // 4 + 2
    assert s.fleet.credits == 256
    s.join("honest", {}, 0.0)
    s.ready("honest", 2, 0.0)
    assert s.fleet.credits == 258
    s.leave("greedy", 1.0)
    assert s.fleet.credits == 2


# the blob service's queue per key --------------------------------------------------------------


def test_the_names_of_one_key_share_its_fetch_queue_and_its_turn():
    sha = "ab" * 32
    service = BlobService(None, pass_bytes=10_000, queue_per_worker=16, queue_per_owner=32)
    service.add(sha, 1 << 20)
    fetch = lambda k: proto.Fetch(request=k, sha256=sha, offset=0, length=1000)  # noqa: E731
    refused = 0
    for name in range(256):
        for k in range(16):
            refused += service.request(f"flood{name}", fetch(k), "key:flood") is not None
    assert refused == 256 * 16 - 32
    assert service.request("honest", fetch(0), "key:honest") is None
    # the honest key's chunk goes in the first turns, not after 4,096 of the flood's
    first = service.take()[:2]
    assert {s.worker for s in first} == {"flood0", "honest"}
    service.forget("flood0")
    assert service.request("flood300", fetch(0), "key:flood") is None  # room again
    # without an owner, a worker is its own
    assert service.request("solo", fetch(0)) is None


# the server's path ----------------------------------------------------------------------------


def pair() -> Pair:
    return Pair(CoordinatorConfig(job="synthetic", job_args={"params": PARAMS, "batch_size": 16},
                                  partitions=2, epochs=50, eval_every=3600, heartbeat_s=0.5))


def say(p: Pair, msg: proto.Message, route: bytes, key: bytes = KEY) -> None:
    asyncio.run(p.coordinator.handle([route, *proto.encode(msg)], key=key))


def hello(name: str) -> proto.Hello:
    return proto.Hello(worker_id=name, host="here", cores=1, threads=1, device="cpu",
                       memory_mb=1, versions={})


def test_one_key_under_many_names_is_refused_past_its_names_and_its_credits():
    p = pair()
    for k in range(20):
        say(p, hello(f"n{k}"), f"r{k}".encode())
    names = p.coordinator.budgets.config.names
    assert len(p.coordinator.scheduler.workers) == names
    assert p.counters["hello_names"] == 20 - names
    (refused,) = [m for r, m in p.wire.sent if r == b"r19"]
    assert isinstance(refused, proto.Reject) and refused.code == "names"
    fingerprint = p.wire.to(b"r0", proto.Welcome)[0].fingerprint
    for k in range(4):
        say(p, proto.Ready(credits=1024, fingerprint=fingerprint), f"r{k}".encode())
    capacities = [w.capacity for w in p.coordinator.scheduler.workers.values()]
    assert sum(capacities) == p.coordinator.budgets.config.credits
    assert len(p.coordinator.scheduler.rounds) <= p.coordinator.budgets.config.credits
    # another key is not this one's budget
    say(p, hello("other"), b"o", key=OTHER)
    say(p, proto.Ready(credits=2, fingerprint=fingerprint), b"o", key=OTHER)
    assert p.coordinator.scheduler.workers["other"].capacity == 2
    p.close()


def test_a_result_for_a_slot_its_sender_does_not_hold_is_acked_without_being_decoded():
    p = pair()
    read = Counter()
    model = p.coordinator.training.model
    original = model.gradient_of

    def counted(blob):
        read["gradients"] += 1
        return original(blob)

    model.gradient_of = counted
    say(p, hello("raw"), b"raw")
    fingerprint = p.wire.to(b"raw", proto.Welcome)[0].fingerprint
    say(p, proto.Ready(credits=1, fingerprint=fingerprint), b"raw")
    (task,) = p.wire.to(b"raw", proto.Task)
    size = model.model.numel
    junk = proto.Blob("float32", size, (b"\0" * 4 * size,))
    for slot in (task.slot + 1000, task.slot + 1001):
        sent = len(p.wire.sent)
        say(p, proto.Result(slot=slot, version=task.version, samples=8, loss=0.5,
                            compute_s=0.01, gradient=junk), b"raw")
        (ack,) = [m for r, m in p.wire.sent[sent:] if r == b"raw"]
        assert isinstance(ack, proto.Ack) and ack.slots == [slot]
    assert read["gradients"] == 0
    assert p.counters["results_unheld"] == 2
    # the slot it holds is still read
    say(p, proto.Result(slot=task.slot, version=task.version, samples=8, loss=0.5,
                        compute_s=0.01, gradient=junk), b"raw")
    assert read["gradients"] == 1
    p.close()


# the socket -----------------------------------------------------------------------------------


def test_a_peer_saying_another_connections_routing_id_does_not_take_it_over():
    """ROUTER_HANDOVER would hand the route to whoever says its routing id: the first peer
    would be cut off. Without it the newcomer is ignored and the first keeps its route."""
    transport = ZmqTransport("tcp://127.0.0.1:0")
    endpoint = transport.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    ctx = zmq.Context()
    peers = []

    def peer():
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, b"victim")
        sock.connect(endpoint)
        peers.append(sock)
        return sock

    try:
        victim = peer()
        victim.send(b"first")
        assert transport.direct.poll(5000)
        assert transport.direct.recv_multipart() == [b"victim", b"first"]
        thief = peer()
        thief.send(b"second")
        time.sleep(0.5)  # its handshake is done by then (loopback)
        victim.send(b"again")
        assert transport.direct.poll(5000)
        assert transport.direct.recv_multipart() == [b"victim", b"again"]
        transport.direct.send_multipart([b"victim", b"to the victim"])
        assert victim.poll(5000) and victim.recv() == b"to the victim"
        assert not thief.poll(200)
    finally:
        for peer in peers:
            peer.close(0)
        ctx.term()
        transport.close(0)
