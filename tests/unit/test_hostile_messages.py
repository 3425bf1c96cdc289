"""Hostile messages, on the in-memory pair (tests/unit/pair.py; moved from the integration
suite, which keeps what only a socket can be sent: frames over ZMQ_MAXMSGSIZE, bytes that are
not ZeroMQ): while two workers train, peers send random bytes, truncated and malformed msgpack,
wrong schemas, a wrong protocol version, lying length fields and results from a peer that never
said hello; a fake worker shakes hands properly and answers its task with a NaN gradient, then
with one of the wrong size; another announces another job's fingerprint. The coordinator counts
and drops all of it, and training goes on to the end with every sample applied exactly once.
Each message reaches the coordinator as the socket hands it over: routing id, then frames."""

from __future__ import annotations

import math

import msgpack
import numpy as np

from idlegrad.common import protocol as proto
from idlegrad.coordinator.server import CoordinatorConfig

from .pair import Pair

EPOCHS = 10


def packb(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def hello(worker_id: str) -> proto.Hello:
    return proto.Hello(worker_id=worker_id, host="nowhere", cores=1, threads=1, device="cpu",
                       memory_mb=1, versions={"protocol": str(proto.PROTOCOL_VERSION)})


def garbage_frames(numel: int) -> list[list[bytes]]:
    """Bad messages, each counted once by the coordinator (as one bad message); `numel`: the
    model's size, for tensor descriptors that lie about what follows."""
    valid = proto.encode(hello("truncated"))[0]
    desc = lambda numel, frames: {"dtype": "float32", "numel": numel, "frames": frames}  # noqa: E731
    result = lambda gradient: {"v": proto.PROTOCOL_VERSION, "type": "result", "slot": 1,  # noqa: E731
                               "version": 0, "samples": 1, "loss": 0.0, "compute_s": 0.1,
                               "gradient": gradient}
    rng = np.random.default_rng(7)
    return [
        *[[rng.bytes(int(n))] for n in (1, 7, 64, 1000, 65536)],  # random bytes
        [b""],  # an empty header
        [valid[: len(valid) // 2]],  # truncated msgpack
        [packb([1, 2, 3])],  # not a map
        [packb({"v": proto.PROTOCOL_VERSION, "type": "hello", "worker_id": 5})],  # wrong schema
        [packb({"v": proto.PROTOCOL_VERSION, "type": "heartbeat", "state": "idle", "x": 1})],
        [packb({"v": proto.PROTOCOL_VERSION, "type": "heartbeat", "state": "dancing"})],
        [packb({"v": proto.PROTOCOL_VERSION, "type": "rm -rf /"})],  # unknown type
        proto.encode(proto.Shutdown(reason="go home")),  # valid, but not for the coordinator
        [packb(msgpack.ExtType(1, b"pickle?"))],  # ext types are refused
        # huge fake length headers: msgpack containers and strings announcing gigabytes
        [b"\xdd\xff\xff\xff\xff"],  # array32 of 4 G items
        [b"\xdf\xff\xff\xff\xff" + b"\x00" * 16],  # map32 of 4 G pairs
        [b"\xdb\x7f\xff\xff\xff" + b"x" * 100],  # str32 of 2 GiB
        [b"\xc6\xff\xff\xff\xff" + b"x" * 100],  # bin32 of 4 GiB
        # tensor descriptors that lie about what follows
        [packb(result(desc(2**40, 1))), b"\x00" * 16],
        [packb(result(desc(numel, 1)))],  # a frame announced, none sent
        [packb(result(desc(numel, 10**6)))],  # a million frames announced
        [packb(result({"dtype": "pickle", "numel": 1, "frames": 1})), b"\x00" * 4],
        [packb(result(desc(1, 1))), b"\x00" * 4, b"extra"],  # a frame too many
    ]


def to(pair: Pair, route: bytes, kind: type) -> list:
    return pair.wire.to(route, kind)


def test_hostile_input_is_counted_and_dropped_while_training_goes_on():
    # asynchronous rounds: the fake worker is handed a task as soon as it is ready, not at the
    # next round's opening
    pair = Pair(CoordinatorConfig(job="digits", epochs=EPOCHS, heartbeat_s=0.5,
                                  eval_every=3600, mode="async"))
    workers = [pair.worker("w1"), pair.worker("w2")]
    total = EPOCHS * len(pair.coordinator.training.built.train)
    numel = pair.coordinator.training.model.model.numel
    pair.run(until=lambda: pair.coordinator.version >= 10, finish=False)
    before = pair.coordinator.snapshot()
    assert len(before["workers"]) == 2 and before["state"] == "training"
    assert before["samples"] < total

    # 1. A fake worker that shakes hands properly, then answers its task with NaNs.
    fake = b"fake"
    pair.frames(proto.encode(hello("nan-worker")), fake)
    (welcome,) = to(pair, fake, proto.Welcome)
    pair.frames(proto.encode(proto.Ready(credits=1, fingerprint=welcome.fingerprint)), fake)
    (task,) = to(pair, fake, proto.Task)
    assert task.model is not None and task.model.numel == numel
    nan = np.full(numel, np.nan, dtype=np.float32)
    pair.frames(proto.encode(proto.Result(
        slot=task.slot, version=task.version, samples=sum(p[2] for p in task.parts), loss=1.0,
        compute_s=0.01, gradient=proto.Blob("float32", numel, (nan.tobytes(),)))), fake)
    # Its slot went back to the pool, so it is handed the next one: answer it with a gradient
    # of the wrong size.
    _, task2 = to(pair, fake, proto.Task)
    short = np.zeros(10, dtype=np.float32)
    pair.frames(proto.encode(proto.Result(
        slot=task2.slot, version=task2.version, samples=1, loss=1.0, compute_s=0.01,
        gradient=proto.Blob("float32", 10, (short.tobytes(),)))), fake)
    pair.frames(proto.encode(proto.Bye(reason="done cheating")), fake)

    # 1b. One that announces another job's fingerprint (an old or hostile worker: ours leaves
    # by itself) is refused before it gets a task.
    wrong = b"wrong"
    pair.frames(proto.encode(hello("wrong-job")), wrong)
    assert to(pair, wrong, proto.Welcome)
    pair.frames(proto.encode(proto.Ready(credits=1, fingerprint="0" * 16)), wrong)
    (refusal,) = to(pair, wrong, proto.Reject)
    assert refusal.code == "job" and not to(pair, wrong, proto.Task), refusal

    # 2. Garbage from a peer that never said hello.
    attacker = b"attacker"
    bad = garbage_frames(numel)
    for frames in bad:
        pair.frames(frames, attacker)
    # A well-formed RESULT with a NaN gradient, from a peer the coordinator does not know.
    pair.frames(proto.encode(proto.Result(
        slot=1, version=0, samples=32, loss=0.0, compute_s=0.1,
        gradient=proto.Blob("float32", numel, (nan.tobytes(),)))), attacker)
    (reject,) = to(pair, attacker, proto.Reject)
    assert reject.code == "hello_first", reject

    # 3. A HELLO in a protocol version from the future gets a REJECT saying so.
    future = b"future"
    header = msgpack.unpackb(proto.encode(hello("from-the-future"))[0])
    header["v"] = proto.PROTOCOL_VERSION + 41
    pair.frames([packb(header)], future)
    (reject,) = to(pair, future, proto.Reject)
    assert reject.code == "version" and str(proto.PROTOCOL_VERSION) in reject.reason, reject

    # The coordinator counted every bad message, and trains on.
    pair.run(until=lambda: pair.coordinator.version >= before["version"] + 5, finish=False)
    after = pair.coordinator.snapshot()
    bad_counts = after["bad_messages"]
    print("bad messages counted:", bad_counts)
    assert sum(bad_counts.values()) == len(bad) + 2, bad_counts  # + the future HELLO, the short
    for reason in ("msgpack", "schema", "type", "version", "frames", "oversize", "dtype",
                   "unexpected", "tensor"):
        assert bad_counts.get(reason, 0) >= 1, (reason, bad_counts)
    assert after["counters"].get("hello_first", 0) >= 1
    assert after["counters"]["gradients_rejected"] == 1
    assert any("non-finite gradient from nan-worker" in e["text"]
               for e in pair.events("rejected")), pair.events("rejected")
    assert after["rounds"].get("slots_requeued", 0) >= 1

    # Training goes on past the attack and to the end, with nothing lost or applied twice.
    pair.run()
    pair.close()
    assert all(w.left is not None and not w.left.refused for w in workers)
    final = pair.final()
    assert final["reason"] == "epochs"
    assert final["version"] > after["version"] > before["version"]
    assert final["samples"] == total, (final["samples"], total)
    print("accuracy", final["metrics"]["accuracy"])
    assert final["metrics"]["accuracy"] >= 0.9
    assert math.isfinite(final["metrics"]["loss"])
