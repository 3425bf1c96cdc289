"""The wire: every message round-trips, every malformed message is a ProtocolError with the right
reason, and nothing else ever escapes decode()."""

from __future__ import annotations

import dataclasses
import math
import random

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from idlegrad.common import protocol as proto
from idlegrad.common.errors import ProtocolError
from idlegrad.common.protocol import (
    MAX_BLOB_FRAMES, MAX_DEPTH, MAX_FRAME_BYTES, MAX_HEADER_BYTES, MAX_LIST, MAX_NAME, MAX_REPORTED_S,
    MAX_STR, MAX_VERSIONS, MAX_WORKER_ID, MESSAGE_TYPES, PROTOCOL_VERSION,
    Ack, Blob, Bye, Cancel, Control, ControlReply, Heartbeat, Hello, Ready, Reject, Result, Shutdown,
    Status, StatusRequest, Task, Welcome, decode, encode)
from idlegrad.common.tensors import DTYPE_NAMES, from_blob, to_blob

# one-frame blobs are read-only views of the received bytes: torch warns, rightly, and that is fine
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


def wire(frames) -> list[bytes]:
    """What a receiver gets: plain bytes, no shared memory with the sender."""
    return [bytes(f) for f in frames]


def packb(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def grad_tensor(n=300, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def sample_messages() -> list[proto.Message]:
    """At least one instance of every message type, without blobs."""
    return [
        Hello(worker_id="host-1", host="host", cores=8, threads=4, device="cpu", memory_mb=16000,
              versions={"idlegrad": "0.1.0", "torch": "2.3"}),
        Hello(worker_id="w", host="h", cores=0, threads=0, device="cuda:0", memory_mb=0,
              versions={}, job="digits"),
        Ready(credits=2, fingerprint="0123456789abcdef"),
        Ready(credits=0, fingerprint=""),
        Ready(credits=1024, fingerprint="f"),
        Heartbeat(),
        Heartbeat(state="working"),
        Heartbeat(state="paused"),
        Heartbeat(state="coordinator"),
        Heartbeat(state="idle", cache={"hits": 3, "bytes_mirrors": 2**40, "in_flight": 0}),
        proto.Fetch(request=0, sha256="0f" * 32, offset=2**40, length=proto.MAX_CHUNK_BYTES),
        proto.Chunk(request=5, sha256="0f" * 32, offset=0, total=0),
        proto.Chunk(request=5, sha256="0f" * 32, offset=7, total=9, error="busy"),
        Welcome(job="packed", job_args={"data": "0f" * 32}, fingerprint="f", seed=0,
                heartbeat_s=1.0, liveness=3, blob_mirrors=["http://127.0.0.1:8080/m",
                                                           "https://mirror.example.org"]),
        Bye(),
        Bye(reason="owner is back"),
        Hello(worker_id="w", host="h", cores=1, threads=1, device="cpu", memory_mb=1, versions={},
              instance="coordinator-host-123-1700000000.000"),
        Welcome(job="digits", job_args={}, fingerprint="f", seed=0, heartbeat_s=1.0, liveness=3,
                instance="coordinator-host-123-1700000000.000", holding=[3, 5]),
        Ack(slots=[1]),
        Ack(slots=[]),
        proto.Enrol(invitation="0123456789abcdef", secret="A" * 43),
        proto.Enrolled(ok=True, name="vol-012345-1"),
        proto.Enrolled(ok=False, reason="invitation expired"),
        Control(action="ban", worker="w-1"),
        Control(action="unban", worker="A" * 40),
        Control(action="revoke", invitation="0123456789abcdef"),
        proto.CreditRequest(),
        proto.CreditRequest(worker="w-1"),
        proto.Credit(ok=True, worker="w-1", row={"samples": 64, "compute_s": 1.5, "verified": 0,
                                                 "refused": 1, "first_seen": 1.7e9,
                                                 "last_seen": 1.7e9}, identities=3),
        proto.Credit(ok=True),  # nothing earned yet
        proto.Credit(ok=False, reason="a worker key reads only its own credit"),
        proto.Invite(address="tcp://h:5555", uses=3, expires_s=3600.0, name="vol"),
        proto.Invited(ok=True, token="idlegrad-invite:x", invitation="0123456789abcdef",
                      expires=1.7e9),
        proto.Invited(ok=False, reason="no --enrolled"),
        Welcome(job="synthetic", job_args={"params": 5000, "lr": 0.5, "flag": True, "name": "x"},
                fingerprint="abc", seed=7, heartbeat_s=0.5, liveness=3),
        Welcome(job="digits", job_args={}, fingerprint="", seed=0, heartbeat_s=1, liveness=1),
        Task(slot=3, round=1, version=2, parts=[[0, 0, 16], [1, 16, 8]], coefficients=[1.0, -0.5],
             deadline_s=30.0),
        Task(slot=0, round=0, version=0, parts=[[0, 0, 1]], coefficients=[0.0], deadline_s=0.0,
             model=None),
        Task(slot=4, round=1, version=9, parts=[[0, 0, 8]], coefficients=[1.0], deadline_s=5.0,
             snapshot="ab" * 32, snapshot_bytes=4096 + 4 * 10**8),
        Heartbeat(state="capped"),
        proto.Handback(slots=[3, 4], reason="the daily transfer cap is spent"),
        proto.Handback(slots=[]),
        Task(slot=9, round=0, version=4, parts=[[0, 128, 64]], coefficients=[1.0],
             deadline_s=30.0, kind="eval"),
        proto.EvalResult(slot=9, version=4, compute_s=0.5,
                         sums={"loss": [123.5, 64.0], "accuracy": [60.0, 64.0]}),
        proto.EvalResult(slot=1, version=0, compute_s=0.0, sums={"bits_per_byte": [0.0, 0.0]}),
        Cancel(slots=[]),
        Cancel(slots=[1, 2, 2**63 - 1]),
        Reject(code="job", reason="wrong fingerprint"),
        Shutdown(reason="training finished"),
        StatusRequest(),
        StatusRequest(cursor=42),
        Status(snapshot={}),
        Status(snapshot={"workers": [{"id": "w", "samples": 10, "rate": 1.5}], "loss": None,
                         "curve": [[0, 1.0], [1, 0.5]], "ok": True, "raw": b"\x00\x01"}),
        Control(action="pause"),
        Control(action="resume", worker=None),
        Control(action="drain", worker="w-1"),
        ControlReply(action="drain", ok=False, detail="no worker 'x'"),
        ControlReply(action="pause", ok=True),
    ]


# round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("msg", sample_messages(), ids=lambda m: type(m).__name__)
def test_round_trip_plain(msg):
    frames = encode(msg)
    assert len(frames) == 1  # no blob: header only
    got = decode(wire(frames))
    assert type(got) is type(msg)
    assert got == msg


def test_every_message_type_is_covered():
    covered = {type(m).TYPE for m in sample_messages()}
    covered |= {Result.TYPE}  # carried by the blob tests below
    assert covered == set(MESSAGE_TYPES)
    for name, cls in MESSAGE_TYPES.items():
        assert cls.TYPE == name


def test_header_layout():
    header = msgpack.unpackb(encode(Ready(credits=3, fingerprint="fp"))[0])
    assert header == {"v": PROTOCOL_VERSION, "type": "ready", "credits": 3, "fingerprint": "fp"}


def test_optional_fields_may_be_omitted():
    assert decode([packb({"v": PROTOCOL_VERSION, "type": "heartbeat"})]) == Heartbeat(state="idle")
    assert decode([packb({"v": PROTOCOL_VERSION, "type": "bye"})]) == Bye(reason="")
    assert decode([packb({"v": PROTOCOL_VERSION, "type": "status_request"})]) == StatusRequest(cursor=0)
    hello = {"v": PROTOCOL_VERSION, "type": "hello", "worker_id": "w", "host": "h", "cores": 1, "threads": 1,
             "device": "cpu", "memory_mb": 1, "versions": {}}
    assert decode([packb(hello)]).job is None
    assert decode([packb({**hello, "job": None})]).job is None


def _result(gradient: Blob, **kw) -> Result:
    fields = dict(slot=5, version=3, samples=64, loss=0.25, compute_s=1.5)
    fields.update(kw)
    return Result(gradient=gradient, **fields)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_result_blob_round_trip_single_frame(dtype):
    t = grad_tensor(257, dtype)
    msg = _result(to_blob(t))
    frames = encode(msg)
    assert len(frames) == 2
    got = decode(wire(frames))
    assert isinstance(got, Result)
    assert (got.slot, got.version, got.samples, got.loss, got.compute_s) == (5, 3, 64, 0.25, 1.5)
    assert got.gradient.dtype == DTYPE_NAMES[dtype]
    assert got.gradient.numel == 257
    out = from_blob(got.gradient, expect_numel=257, expect_dtype=dtype)
    assert out.dtype == dtype
    assert torch.equal(out, t)


@pytest.mark.parametrize("frame_bytes", [1000, 1001, 7, 4])
def test_result_blob_round_trip_many_frames(frame_bytes):
    t = grad_tensor(1000)  # 4000 bytes
    blob = to_blob(t, frame_bytes=frame_bytes)
    # frames hold whole elements, as evenly as the limit allows
    assert len(blob.frames) == math.ceil(4000 / (frame_bytes // 4 * 4)) > 1
    sizes = [memoryview(f).nbytes for f in blob.frames]
    assert all(n <= frame_bytes and n % 4 == 0 for n in sizes)
    assert max(sizes) - min(sizes) <= 4 * len(sizes)
    frames = encode(_result(blob))
    assert len(frames) == 1 + len(blob.frames)
    header = msgpack.unpackb(frames[0])
    assert header["gradient"] == {"dtype": "float32", "numel": 1000, "frames": len(blob.frames)}
    got = decode(wire(frames))
    assert len(got.gradient.frames) == len(blob.frames)
    assert torch.equal(from_blob(got.gradient, 1000, torch.float32), t)


def test_task_with_model_blob_round_trip():
    model = grad_tensor(2500, seed=3)
    blob = to_blob(model, frame_bytes=1000)
    msg = Task(slot=9, round=4, version=2, parts=[[0, 10, 20]], coefficients=[1.0],
               deadline_s=12.5, model=blob)
    got = decode(wire(encode(msg)))
    assert isinstance(got, Task)
    assert dataclasses.replace(got, model=None) == dataclasses.replace(msg, model=None)
    assert got.model.numel == 2500 and got.model.dtype == "float32"
    assert torch.equal(from_blob(got.model), model)


def test_empty_blob_round_trip():
    t = torch.empty(0)
    blob = to_blob(t)
    assert blob.frames == () and blob.numel == 0
    got = decode(wire(encode(_result(blob))))
    assert got.gradient.numel == 0
    out = from_blob(got.gradient, expect_numel=0)
    assert out.numel() == 0 and out.dtype == torch.float32


def test_blob_nbytes():
    assert Blob("float16", 10).nbytes == 20
    assert Blob("float64", 3).nbytes == 24


def test_to_blob_rejects_what_cannot_travel():
    with pytest.raises(ValueError):
        to_blob(torch.zeros(2, 2))
    with pytest.raises(ValueError):
        to_blob(torch.zeros(3, dtype=torch.int64))


def test_to_blob_is_a_view_and_copes_with_non_contiguous():
    t = torch.zeros(4)
    blob = to_blob(t)
    t[1] = 5.0  # a view: the frame sees the change
    assert from_blob(Blob(blob.dtype, blob.numel, (bytes(blob.frames[0]),)))[1] == 5.0
    base = torch.arange(10, dtype=torch.float32)
    strided = base[::2]
    assert torch.equal(from_blob(to_blob(strided)), strided)


def test_from_blob_expectations():
    blob = to_blob(grad_tensor(10))
    with pytest.raises(ProtocolError) as e:
        from_blob(blob, expect_numel=11)
    assert e.value.reason == "tensor"
    with pytest.raises(ProtocolError) as e:
        from_blob(blob, expect_dtype=torch.float64)
    assert e.value.reason == "tensor"
    assert from_blob(blob, expect_numel=10, expect_dtype=torch.float32).shape == (10,)


def test_from_blob_survives_empty_frames_that_decode_accepts():
    # decode() checks the byte total, so [b"", data] is a valid two-frame blob: from_blob must
    # turn it into the tensor, not crash (a hostile worker could otherwise take the loop down).
    t = grad_tensor(4)
    raw = t.numpy().tobytes()
    header = packb({"v": PROTOCOL_VERSION, "type": "result", "slot": 1, "version": 0, "samples": 1, "loss": 0.0,
                    "compute_s": 0.0, "gradient": {"dtype": "float32", "numel": 4, "frames": 3}})
    msg = decode([header, b"", raw[:6], raw[6:]])
    assert torch.equal(from_blob(msg.gradient, 4, torch.float32), t)
    msg = decode([header, raw[:6], b"", raw[6:]])
    assert torch.equal(from_blob(msg.gradient, 4, torch.float32), t)


# rejections ---------------------------------------------------------------------------------


def reason_of(frames) -> str:
    with pytest.raises(ProtocolError) as e:
        decode(frames)
    assert isinstance(e.value.reason, str)
    return e.value.reason


READY = {"v": PROTOCOL_VERSION, "type": "ready", "credits": 2, "fingerprint": "fp"}
HELLO = {"v": PROTOCOL_VERSION, "type": "hello", "worker_id": "w", "host": "h", "cores": 4, "threads": 2,
         "device": "cpu", "memory_mb": 100, "versions": {"idlegrad": "0.1.0"}}
WELCOME = {"v": PROTOCOL_VERSION, "type": "welcome", "job": "digits", "job_args": {}, "fingerprint": "f",
           "seed": 0, "heartbeat_s": 1.0, "liveness": 3}
TASK = {"v": PROTOCOL_VERSION, "type": "task", "slot": 1, "round": 1, "version": 0, "parts": [[0, 0, 4]],
        "coefficients": [1.0], "deadline_s": 30.0}
RESULT = {"v": PROTOCOL_VERSION, "type": "result", "slot": 1, "version": 0, "samples": 4, "loss": 0.5,
          "compute_s": 0.1, "gradient": {"dtype": "float32", "numel": 2, "frames": 1}}
GRAD = b"\x00" * 8


def test_the_valid_templates_decode():
    assert isinstance(decode([packb(READY)]), Ready)
    assert isinstance(decode([packb(HELLO)]), Hello)
    assert isinstance(decode([packb(WELCOME)]), Welcome)
    assert isinstance(decode([packb(TASK)]), Task)
    assert isinstance(decode([packb(RESULT), GRAD]), Result)


def test_empty_frames():
    assert reason_of([]) == "empty"


def test_oversize_header():
    assert reason_of([b"\x80" + b"\x00" * MAX_HEADER_BYTES]) == "oversize"
    # just under the limit is judged on content, not size
    assert reason_of([b"\xc1" * MAX_HEADER_BYTES]) == "msgpack"


@pytest.mark.parametrize("raw", [
    b"",  # nothing to unpack
    b"\xc1",  # a byte msgpack never uses
    packb(READY)[:-3],  # truncated
    packb(READY) + b"\x00",  # trailing data
    b"\xa5ab",  # string shorter than announced
    b"\x81\xa1v\xc4",  # truncated bin inside a map
    packb({1: 2}),  # an int map key (strict_map_key)
    b"\x81\xa1v\xa2\xff\xfe",  # invalid utf-8 in a str
], ids=["empty", "unused", "truncated", "trailing", "short-str", "short-bin", "int-key", "utf8"])
def test_not_msgpack(raw):
    assert reason_of([raw]) == "msgpack"


@pytest.mark.parametrize("header", [[1, 2], "ready", 5, None, True, 1.5, b"raw"])
def test_header_not_a_map(header):
    assert reason_of([packb(header)]) == "schema"


@pytest.mark.parametrize("version", [0, 1, 2, 3, 4, 6, -1, "5", None, [5], 1.5, 2**64 - 1])
def test_wrong_version(version):
    assert reason_of([packb({**READY, "v": version})]) == "version"


def test_missing_version():
    header = dict(READY)
    del header["v"]
    assert reason_of([packb(header)]) == "version"


@pytest.mark.parametrize("kind", ["nope", "", "READY", 5, None, ["ready"], {"a": 1}, b"ready",
                                  "__class__", "x" * 1000])
def test_unknown_type(kind):
    assert reason_of([packb({**READY, "type": kind})]) == "type"


def test_missing_type():
    header = dict(READY)
    del header["type"]
    assert reason_of([packb(header)]) == "type"


def test_unknown_field():
    assert reason_of([packb({**READY, "extra": 1})]) == "schema"
    assert reason_of([packb({**READY, b"credits": 1})]) == "schema"  # a bytes key is not the field
    assert reason_of([packb({**READY, "TYPE": "x"})]) == "schema"


@pytest.mark.parametrize("template,field", [
    (READY, "credits"), (READY, "fingerprint"), (HELLO, "worker_id"), (HELLO, "versions"),
    (WELCOME, "job_args"), (TASK, "parts"), (TASK, "coefficients"), (RESULT, "loss"),
    ({"v": PROTOCOL_VERSION, "type": "cancel", "slots": []}, "slots"),
    ({"v": PROTOCOL_VERSION, "type": "status", "snapshot": {}}, "snapshot"),
])
def test_missing_required_field(template, field):
    header = dict(template)
    del header[field]
    frames = [packb(header)] + ([GRAD] if template is RESULT else [])
    assert reason_of(frames) == "schema"


def test_missing_required_blob():
    header = dict(RESULT)
    del header["gradient"]
    assert reason_of([packb(header)]) == "schema"
    assert reason_of([packb({**RESULT, "gradient": None})]) == "schema"


def test_required_field_may_not_be_nil():
    assert reason_of([packb({**READY, "credits": None})]) == "schema"


@pytest.mark.parametrize("template,field,value", [
    (READY, "credits", "2"),  # str where int
    (READY, "credits", True),  # bool where int
    (READY, "credits", False),
    (READY, "credits", 2.0),  # float where int
    (READY, "credits", [2]),
    (READY, "credits", 2**63),  # past int64
    (READY, "fingerprint", 5),  # int where str
    (READY, "fingerprint", b"fp"),  # bytes where str
    (READY, "fingerprint", "x" * (MAX_STR + 1)),  # too long
    (WELCOME, "heartbeat_s", float("nan")),
    (WELCOME, "heartbeat_s", float("inf")),
    (WELCOME, "heartbeat_s", float("-inf")),
    (WELCOME, "heartbeat_s", True),  # bool where float
    (WELCOME, "heartbeat_s", "1.0"),
    (WELCOME, "job_args", [1]),  # list where map
    (WELCOME, "job_args", {b"k": 1}),  # non-str key
    (HELLO, "versions", {"torch": 2}),  # map value of the wrong type
    (HELLO, "versions", {"torch": "x" * (MAX_STR + 1)}),
    (HELLO, "versions", "torch"),
    (HELLO, "job", 3),  # Optional[str] still checks the type
    (TASK, "parts", [[0, 0, "4"]]),
    (TASK, "parts", [0, 0, 4]),  # flat list where list of lists
    (TASK, "parts", {"a": 1}),
    (TASK, "coefficients", [float("nan")]),
    (TASK, "coefficients", [None]),
    (RESULT, "loss", float("nan")),
    (RESULT, "compute_s", float("inf")),
], ids=lambda v: repr(v)[:30])
def test_wrong_field_types(template, field, value):
    frames = [packb({**template, field: value})] + ([GRAD] if template is RESULT else [])
    assert reason_of(frames) == "schema"


def test_string_at_the_limit_is_fine():
    assert decode([packb({**READY, "fingerprint": "x" * MAX_STR})]).fingerprint == "x" * MAX_STR


def test_int_where_float_is_accepted():
    assert decode([packb({**WELCOME, "heartbeat_s": 2})]).heartbeat_s == 2


def test_too_long_list():
    assert reason_of([packb({"v": PROTOCOL_VERSION, "type": "cancel", "slots": [0] * (proto.MAX_LIST + 1)})]) in (
        "msgpack", "schema")


@pytest.mark.parametrize("ext", [msgpack.ExtType(5, b"ab"), msgpack.ExtType(0, b""),
                                 msgpack.ExtType(127, b"\x00" * 20)], ids=["ext5", "ext0", "ext127"])
def test_msgpack_ext_types_rejected(ext):
    raw = msgpack.packb({"v": PROTOCOL_VERSION, "type": "status", "snapshot": {"t": ext}})
    assert reason_of([raw]) in ("msgpack", "schema")
    raw = msgpack.packb({"v": PROTOCOL_VERSION, "type": "bye", "reason": ext})
    assert reason_of([raw]) in ("msgpack", "schema")


def test_msgpack_timestamp_rejected():
    raw = msgpack.packb({"v": PROTOCOL_VERSION, "type": "status", "snapshot": {"t": msgpack.Timestamp(1, 0)}})
    assert reason_of([raw]) in ("msgpack", "schema")
    # the same by hand: fixext4 of type -1 (timestamp32)
    raw = (b"\x83" + packb("v") + packb(1) + packb("type") + packb("status") + packb("snapshot")
           + b"\x81" + packb("t") + b"\xd6\xff\x00\x00\x00\x01")
    assert reason_of([raw]) in ("msgpack", "schema")


# blob descriptors ----------------------------------------------------------------------------


def result_with(desc, *frames) -> list:
    return [packb({**RESULT, "gradient": desc}), *frames]


@pytest.mark.parametrize("dtype", ["int64", "float", "", "FLOAT32", None, 4, ["float32"],
                                   {"a": 1}, b"float32"], ids=repr)
def test_blob_bad_dtype(dtype):
    assert reason_of(result_with({"dtype": dtype, "numel": 2, "frames": 1}, GRAD)) == "dtype"


@pytest.mark.parametrize("desc", [
    {"dtype": "float32", "numel": -1, "frames": 1},
    {"dtype": "float32", "numel": 2, "frames": -1},
    {"dtype": "float32", "numel": True, "frames": 1},
    {"dtype": "float32", "numel": 2.0, "frames": 1},
    {"dtype": "float32", "numel": "2", "frames": 1},
    {"dtype": "float32", "numel": 2, "frames": None},
    {"dtype": "float32", "numel": 2},  # a key missing
    {"dtype": "float32", "numel": 2, "frames": 1, "extra": 0},  # a key too many
    [2, "float32", 1],  # not a map
    "float32",
    5,
], ids=lambda d: repr(d)[:40])
def test_blob_bad_descriptor(desc):
    assert reason_of(result_with(desc, GRAD)) == "schema"


def test_blob_frames_count_mismatch():
    desc = {"dtype": "float32", "numel": 2, "frames": 2}
    assert reason_of(result_with(desc, GRAD)) == "frames"  # announced 2, sent 1
    assert reason_of(result_with({**desc, "frames": 1})) == "frames"  # announced 1, sent 0
    # extra frames after the blob
    assert reason_of(result_with({**desc, "frames": 1}, GRAD, b"")) == "frames"
    assert reason_of(result_with({**desc, "frames": 1}, GRAD, GRAD)) == "frames"
    # frames on a message that carries no blob at all
    assert reason_of([packb(READY), b"x"]) == "frames"
    assert reason_of([packb(TASK), GRAD]) == "frames"


def test_blob_byte_count_mismatch():
    desc = {"dtype": "float32", "numel": 2, "frames": 1}
    assert reason_of(result_with(desc, b"\x00" * 7)) == "frames"
    assert reason_of(result_with(desc, b"\x00" * 9)) == "frames"
    assert reason_of(result_with({**desc, "dtype": "float64"}, GRAD)) == "frames"
    assert reason_of(result_with({**desc, "frames": 2}, b"\x00" * 4, b"\x00" * 5)) == "frames"
    assert reason_of(result_with({**desc, "numel": 0, "frames": 1}, b"\x00")) == "frames"
    # a huge announced count does not allocate anything
    assert reason_of(result_with({**desc, "numel": 2**62}, GRAD)) == "frames"


def test_blob_too_many_frames():
    desc = {"dtype": "float32", "numel": MAX_BLOB_FRAMES + 1, "frames": MAX_BLOB_FRAMES + 1}
    assert reason_of(result_with(desc, *([b"\x00" * 4] * (MAX_BLOB_FRAMES + 1)))) == "oversize"


def test_blob_frame_too_large():
    numel = MAX_FRAME_BYTES // 4 + 1
    big = bytes(numel * 4)
    assert reason_of(result_with({"dtype": "float32", "numel": numel, "frames": 1}, big)) == "oversize"


def test_task_model_blob_checked_too():
    desc = {"dtype": "float16", "numel": 4, "frames": 1}
    assert isinstance(decode([packb({**TASK, "model": desc}), b"\x00" * 8]).model, Blob)
    assert decode([packb({**TASK, "model": None})]).model is None
    assert reason_of([packb({**TASK, "model": desc}), b"\x00" * 6]) == "frames"
    assert reason_of([packb({**TASK, "model": {**desc, "dtype": "int8"}}), b"\x00" * 8]) == "dtype"


# semantic checks -----------------------------------------------------------------------------


@pytest.mark.parametrize("template,field", [
    (RESULT, "slot"), (RESULT, "version"), (RESULT, "samples"), (RESULT, "compute_s"),
    (TASK, "slot"), (TASK, "round"), (TASK, "version"), (TASK, "deadline_s"),
    (HELLO, "cores"), (HELLO, "threads"), (HELLO, "memory_mb"), (READY, "credits"),
    ({"v": PROTOCOL_VERSION, "type": "status_request", "cursor": 0}, "cursor"),
])
def test_negative_values(template, field):
    frames = [packb({**template, field: -1})] + ([GRAD] if template is RESULT else [])
    assert reason_of(frames) == "schema"


@pytest.mark.parametrize("template,field,value", [
    # seconds past any real task: the scheduler's sums of squares of them overflow
    (RESULT, "compute_s", 1.7e308), (RESULT, "compute_s", MAX_REPORTED_S * 1.01),
    (RESULT, "waited_s", 1e155),
    # what a worker says of itself stays in memory and in every status snapshot
    (HELLO, "worker_id", ""), (HELLO, "worker_id", "w" * (MAX_WORKER_ID + 1)),
    (HELLO, "host", "h" * (MAX_NAME + 1)), (HELLO, "device", "d" * (MAX_NAME + 1)),
    (HELLO, "instance", "i" * (MAX_NAME + 1)),
    (HELLO, "versions", {f"k{i}": "1" for i in range(MAX_VERSIONS + 1)}),
    (HELLO, "versions", {"k" * (MAX_NAME + 1): "1"}),
    (HELLO, "versions", {"torch": "1" * (MAX_NAME + 1)}),
    ({"v": PROTOCOL_VERSION, "type": "control", "action": "drain"}, "worker",
     "w" * (MAX_WORKER_ID + 1)),
], ids=lambda v: repr(v)[:30])
def test_values_past_their_bounds(template, field, value):
    frames = [packb({**template, field: value})] + ([GRAD] if template is RESULT else [])
    assert reason_of(frames) == "schema"


@pytest.mark.parametrize("heartbeat_s,liveness", [
    (1e-6, 3), (-5.0, 3), (0.0, 3), (1e300, 3), (1.0, 0), (1.0, -3), (1.0, 10**9)])
def test_a_welcome_with_a_session_no_worker_can_keep_is_refused(heartbeat_s, liveness):
    # a beat of a microsecond had the worker heart-beating at full CPU, deaf to SIGTERM
    assert reason_of([packb({**WELCOME, "heartbeat_s": heartbeat_s, "liveness": liveness})]) == "schema"


def test_a_value_of_the_right_type_out_of_range_says_so():
    with pytest.raises(ProtocolError, match=r"task.slot: int out of range"):
        decode([packb({**TASK, "slot": 2**63})])


def test_values_at_their_bounds_are_fine():
    assert decode([packb({**RESULT, "compute_s": MAX_REPORTED_S}), GRAD]).compute_s == MAX_REPORTED_S
    hello = decode([packb({**HELLO, "worker_id": "w" * MAX_WORKER_ID, "host": "h" * MAX_NAME,
                           "versions": {f"k{i}": "v" * MAX_NAME for i in range(MAX_VERSIONS)}})])
    assert len(hello.worker_id) == MAX_WORKER_ID and len(hello.versions) == MAX_VERSIONS


# A hostile coordinator's welcome: its job arguments become a job factory's keyword arguments on
# the worker before it can compare fingerprints.
@pytest.mark.parametrize("job_args,says", [
    ({f"a{i}": 1 for i in range(proto.MAX_JOB_ARGS + 1)}, "at most"),
    ({"a" * (proto.MAX_JOB_ARG_NAME + 1): 1}, "is not an identifier"),
    ({"a-b": 1}, "is not an identifier"), ({"1x": 1}, "is not an identifier"),
    ({"": 1}, "is not an identifier"), ({"__import__('os')": 1}, "is not an identifier"),
    ({"\ufb01le": 1}, "is not an identifier"),  # NFKC makes it "file": ASCII names only
    ({"size": "x" * (proto.MAX_JOB_ARG_STR + 1)}, "string over"),
    ({"size": [10**9] * 100}, "got list"), ({"size": {"a": 1}}, "got dict"),
    ({"size": None}, "got NoneType"), ({"size": b"\x00" * 10}, "got bytes"),
    ({"lr": float("nan")}, "finite"), ({"lr": float("inf")}, "finite"),
], ids=lambda v: repr(v)[:30])
def test_job_args_past_their_bounds_are_refused(job_args, says):
    with pytest.raises(ProtocolError, match=r"welcome\.job_args.*" + says) as e:
        decode([packb({**WELCOME, "job_args": job_args})])
    assert e.value.reason == "schema"


def test_job_args_at_their_bounds_are_fine():
    job_args = {f"a{i}": 1 for i in range(proto.MAX_JOB_ARGS - 5)}
    job_args.update({"n" * proto.MAX_JOB_ARG_NAME: "s" * proto.MAX_JOB_ARG_STR, "big": 2**63 - 1,
                     "small": -(2**63), "lr": 1e-300, "flag": False})
    assert decode([packb({**WELCOME, "job_args": job_args})]).job_args == job_args


@pytest.mark.parametrize("field,value", [
    ("job", ""), ("job", "j" * (MAX_NAME + 1)), ("job", "digits\x1b[2J"), ("job", "a\nb"),
    ("fingerprint", "f" * (MAX_NAME + 1)), ("instance", "i" * (MAX_NAME + 1))])
def test_a_welcome_names_its_job_shortly_and_printably(field, value):
    assert reason_of([packb({**WELCOME, field: value})]) == "schema"


def test_negative_loss_is_fine():
    assert decode([packb({**RESULT, "loss": -2.5}), GRAD]).loss == -2.5


@pytest.mark.parametrize("parts,coefficients", [
    ([[0, 0, 4]], []),
    ([[0, 0, 4]], [1.0, 1.0]),
    ([[0, 0, 4], [0, 4, 4]], [1.0]),
    ([], []),  # a task of nothing
    ([[0, 4]], [1.0]),  # a part of two numbers
    ([[0, 0, 4, 1]], [1.0]),
    ([[]], [1.0]),
    ([[0, -1, 4]], [1.0]),
    ([[-1, 0, 4]], [1.0]),
    ([[0, 0, -4]], [1.0]),
])
def test_task_parts(parts, coefficients):
    assert reason_of([packb({**TASK, "parts": parts, "coefficients": coefficients})]) == "schema"


@pytest.mark.parametrize("fields", [
    {"snapshot": "AB" * 32}, {"snapshot": "ab" * 31}, {"snapshot": "../" * 20 + "abcd"},
    {"snapshot": 5}, {"snapshot": "ab" * 32, "snapshot_bytes": -1}, {"snapshot_bytes": -5}])
def test_a_task_names_its_snapshot_by_sha256_only(fields):
    assert reason_of([packb({**TASK, **fields})]) == "schema"


def test_a_task_carries_a_model_or_names_a_snapshot_never_both():
    grad = grad_tensor(3)
    task = Task(slot=1, round=0, version=1, parts=[[0, 0, 1]], coefficients=[1.0],
                deadline_s=1.0, model=to_blob(grad), snapshot="ab" * 32)
    with pytest.raises(ProtocolError):
        decode(wire(encode(task)))


@pytest.mark.parametrize("header", [
    {"v": PROTOCOL_VERSION, "type": "handback", "slots": [-1]},
    {"v": PROTOCOL_VERSION, "type": "handback", "slots": list(range(1025))},
    {"v": PROTOCOL_VERSION, "type": "handback", "slots": [1], "reason": "r" * 300},
    {"v": PROTOCOL_VERSION, "type": "handback", "slots": "1"},
    {"v": PROTOCOL_VERSION, "type": "handback"},
])
def test_handback_schema(header):
    assert reason_of([packb(header)]) == "schema"


@pytest.mark.parametrize("header", [
    {"v": PROTOCOL_VERSION, "type": "control", "action": "stop"},
    {"v": PROTOCOL_VERSION, "type": "control", "action": ""},
    {"v": PROTOCOL_VERSION, "type": "control", "action": "drain"},
    {"v": PROTOCOL_VERSION, "type": "control", "action": "drain", "worker": ""},
    {"v": PROTOCOL_VERSION, "type": "control", "action": "drain", "worker": 5},
    {"v": PROTOCOL_VERSION, "type": "control", "action": ["pause"]},
    {"v": PROTOCOL_VERSION, "type": "control"},
    {"v": PROTOCOL_VERSION, "type": "control", "action": "pause", "extra": 1},
    {"v": PROTOCOL_VERSION, "type": "control_reply", "action": "pause", "ok": 1},
    {"v": PROTOCOL_VERSION, "type": "control", "action": "ban"},
    {"v": PROTOCOL_VERSION, "type": "control", "action": "unban", "worker": ""},
    {"v": PROTOCOL_VERSION, "type": "control", "action": "ban", "worker": "w" * 129},
    {"v": PROTOCOL_VERSION, "type": "control", "action": "revoke"},
    {"v": PROTOCOL_VERSION, "type": "control", "action": "revoke", "invitation": "../x"},
    {"v": PROTOCOL_VERSION, "type": "control", "action": "revoke", "invitation": "0123456789ABCDEF"},
    {"v": PROTOCOL_VERSION, "type": "credit_request", "worker": ""},
    {"v": PROTOCOL_VERSION, "type": "credit_request", "worker": "w" * 129},
    {"v": PROTOCOL_VERSION, "type": "credit", "ok": True, "row": {"samples": -1}},
    {"v": PROTOCOL_VERSION, "type": "credit", "ok": True, "row": {"password": 1}},
    {"v": PROTOCOL_VERSION, "type": "credit", "ok": True, "row": {"samples": "many"}},
    {"v": PROTOCOL_VERSION, "type": "credit", "ok": True, "reason": "r" * 300},
    {"v": PROTOCOL_VERSION, "type": "invite", "address": "tcp://h:1", "uses": 0},
    {"v": PROTOCOL_VERSION, "type": "invite", "address": "tcp://h:1", "expires_s": -1},
    {"v": PROTOCOL_VERSION, "type": "invite", "address": "tcp://h:1", "name": "n" * 65},
    {"v": PROTOCOL_VERSION, "type": "invite"},
    {"v": PROTOCOL_VERSION, "type": "invited", "ok": True, "token": "t" * 1025},
])
def test_control_schema(header):
    assert reason_of([packb(header)]) == "schema"


@pytest.mark.parametrize("state", ["", "busy", "WORKING", "x" * 100])
def test_heartbeat_unknown_state(state):
    assert reason_of([packb({"v": PROTOCOL_VERSION, "type": "heartbeat", "state": state})]) == "schema"


def test_ready_credits_limit():
    assert decode([packb({**READY, "credits": 1024})]).credits == 1024
    assert reason_of([packb({**READY, "credits": 1025})]) == "schema"
    assert reason_of([packb({**READY, "credits": 2**40})]) == "schema"


def test_decode_accepts_zmq_frame_like_objects():
    class FakeFrame:
        def __init__(self, data):
            self.buffer = memoryview(data)

    t = grad_tensor(2)
    frames = [FakeFrame(f) for f in wire(encode(_result(to_blob(t))))]
    assert torch.equal(from_blob(decode(frames).gradient), t)


# fuzzing -------------------------------------------------------------------------------------


def must_be_message_or_protocol_error(frames):
    try:
        msg = decode(frames)
    except ProtocolError as exc:
        assert isinstance(exc.reason, str) and exc.reason
        return None
    assert isinstance(msg, proto.Message)
    assert type(msg) in MESSAGE_TYPES.values()
    # what decodes must encode again to the same message
    again = decode(wire(encode(msg)))
    assert type(again) is type(msg)
    for f in dataclasses.fields(msg):
        a, b = getattr(msg, f.name), getattr(again, f.name)
        if isinstance(a, Blob):
            assert (a.dtype, a.numel) == (b.dtype, b.numel)
            assert b"".join(bytes(x) for x in a.frames) == b"".join(bytes(x) for x in b.frames)
            try:
                from_blob(a)
            except ProtocolError:
                pass
        else:
            assert packb(a) == packb(b)  # NaN inside a free-form map compares unequal to itself
    return msg


scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.binary(max_size=12))
values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=6) | st.binary(max_size=3), children, max_size=4),
    max_leaves=12)

field_names = sorted({f.name for cls in MESSAGE_TYPES.values() for f in dataclasses.fields(cls)})
dtype_values = st.sampled_from(sorted(proto.DTYPE_SIZES)) | values
descriptors = st.fixed_dictionaries(
    {"dtype": dtype_values, "numel": st.integers(-2, 12) | values,
     "frames": st.integers(-1, 5) | values})
field_values = (values | descriptors | st.integers(-3, 3)
                | st.lists(st.lists(st.integers(-1, 20), max_size=4), max_size=3)
                | st.sampled_from(sorted(proto.Heartbeat.STATES)))
frame_lists = st.lists(st.binary(max_size=40), max_size=4)


@st.composite
def structured_headers(draw):
    """Headers that look like messages, so the fuzzer gets past the first checks."""
    kind = draw(st.sampled_from(sorted(MESSAGE_TYPES)) | values)
    header = {"v": draw(st.just(PROTOCOL_VERSION) | values), "type": kind}
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    names = [f.name for f in dataclasses.fields(cls)] if cls else field_names
    for name in draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names))):
        header[name] = draw(field_values)
    if draw(st.booleans()):
        header[draw(st.sampled_from(field_names) | st.text(max_size=5))] = draw(field_values)
    return header


_VALID_FRAMES = [wire(encode(m)) for m in sample_messages() + [
    _result(to_blob(grad_tensor(6), frame_bytes=8)),
    Task(slot=1, round=1, version=1, parts=[[0, 0, 2]], coefficients=[1.0], deadline_s=1.0,
         model=to_blob(grad_tensor(3, torch.float16)))]]
_BLOB_CARRIERS = [(RESULT, "gradient"), ({**TASK, "model": None}, "model")]


@st.composite
def blob_frames(draw, desc):
    """Frames for a descriptor: often exactly the announced bytes, cut anywhere (empty pieces too)."""
    dtype, numel, count = desc["dtype"], desc["numel"], desc["frames"]
    sizes = proto.DTYPE_SIZES
    # Exact bytes only for small blobs: a drawn numel can be huge, and so would the data be.
    if (isinstance(dtype, str) and dtype in sizes and isinstance(numel, int) and 0 <= numel <= 1024
            and isinstance(count, int) and 0 <= count <= 6 and draw(st.integers(0, 3))):
        total = numel * sizes[dtype]
        data = draw(st.binary(min_size=total, max_size=total))
        if count == 0:
            return [] if total == 0 else [data]
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=count - 1, max_size=count - 1)))
        bounds = [0, *cuts, total]
        return [data[a:b] for a, b in zip(bounds, bounds[1:])]
    return draw(frame_lists)


@st.composite
def mutated_valid(draw):
    """A valid message's frames, with one thing changed."""
    action = draw(st.sampled_from(["set", "delete", "frames", "bytes", "blob", "blob"]))
    if action == "blob":
        template, name = draw(st.sampled_from(_BLOB_CARRIERS))
        desc = draw(descriptors)
        return [packb({**template, name: desc})] + draw(blob_frames(desc))
    frames = _VALID_FRAMES[draw(st.integers(0, len(_VALID_FRAMES) - 1))]
    header = msgpack.unpackb(frames[0], raw=False)
    if action == "set":
        header[draw(st.sampled_from(sorted(header)))] = draw(field_values)
    elif action == "delete":
        del header[draw(st.sampled_from(sorted(header)))]
    elif action == "frames":
        frames = frames[:1] + draw(frame_lists)
    raw = packb(header)
    if action == "bytes" and raw:
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([draw(st.integers(0, 255))]) + raw[i + 1:]
    return [raw] + frames[1:]


FUZZ = settings(max_examples=400, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(frame_lists)
def test_fuzz_raw_bytes(frames):
    must_be_message_or_protocol_error(frames)


@FUZZ
@given(values, frame_lists)
def test_fuzz_arbitrary_headers(header, frames):
    must_be_message_or_protocol_error([packb(header)] + frames)


@FUZZ
@given(structured_headers(), frame_lists)
def test_fuzz_structured_headers(header, frames):
    must_be_message_or_protocol_error([packb(header)] + frames)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_valid())
def test_fuzz_mutated_messages(frames):
    must_be_message_or_protocol_error(frames)


# chunked views of a blob's frames ------------------------------------------------------------


def test_blob_chunks_view_every_frame_without_copying():
    from idlegrad.common.tensors import blob_chunks

    t = torch.arange(10, dtype=torch.float32)
    blob = to_blob(t, frame_bytes=12)  # frames of 3, 3, 3 and 1 elements
    chunks = blob_chunks(blob, 10, torch.float32)
    assert [c.numel() for c in chunks] == [3, 3, 3, 1]
    assert torch.equal(torch.cat(chunks), t)
    t[0] = 42.0  # views of the same memory: nothing was copied
    assert chunks[0][0] == 42.0
    with pytest.raises(ProtocolError):
        blob_chunks(blob, 11, torch.float32)
    with pytest.raises(ProtocolError):
        blob_chunks(blob, 10, torch.float64)


def test_blob_chunks_of_frames_cut_mid_element_copy_once():
    from idlegrad.common.protocol import Blob
    from idlegrad.common.tensors import blob_chunks

    raw = torch.arange(4, dtype=torch.float32).view(torch.uint8).numpy().tobytes()
    blob = Blob("float32", 4, (raw[:5], raw[5:]))  # a hostile cut: 5 + 11 bytes
    (whole,) = blob_chunks(blob, 4, torch.float32)
    assert torch.equal(whole, torch.arange(4, dtype=torch.float32))


def test_finite_norm():
    from idlegrad.common.tensors import finite_norm

    t = torch.tensor([3.0, 4.0, 0.0])
    assert finite_norm(t) == pytest.approx(5.0)
    assert finite_norm([t[:1], t[1:]]) == pytest.approx(5.0)
    assert finite_norm(t.half()) == pytest.approx(5.0) and finite_norm(torch.empty(0)) == 0.0
    for bad in (float("nan"), float("inf"), -float("inf"), 1e30):  # 1e30: its square overflows
        u = t.clone()
        u[2] = bad
        assert not math.isfinite(finite_norm([u[:2], u[2:]]))


# ten thousand cases, and crafted frames ----------------------------------------------------------

HOSTILE_VALUES = [
    None, True, False, 0, -1, 2**63 - 1, 2**64 - 1, -(2**63), 0.5, -0.0, math.nan, math.inf,
    -math.inf, "", "x" * (proto.MAX_STR + 1), "\udcff".encode("utf-8", "surrogatepass"), b"",
    b"\x00" * 9, [], {}, [[0, 0, 1]], [[-1, 0, 1]], [1.0] * 3, {"a": {"b": [1]}}, {1: 2},
    {"dtype": "float32", "numel": 1, "frames": 1}, {"dtype": "float32", "numel": -1, "frames": 1},
    {"dtype": "int64", "numel": 1, "frames": 1}, msgpack.ExtType(1, b"x"),
    *sorted(proto.Heartbeat.STATES), *sorted(MESSAGE_TYPES), PROTOCOL_VERSION + 1,
]


def hostile_cases(seed: int, count: int) -> list[list[bytes]]:
    """`count` cheap mutations of the valid messages, from `seed`: fields set to hostile values
    or deleted or added, bytes flipped, inserted or cut, frames added, dropped or resized."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        frames = list(_VALID_FRAMES[rng.randrange(len(_VALID_FRAMES))])
        header = msgpack.unpackb(frames[0], raw=False)
        for _ in range(rng.randint(1, 3)):
            op = rng.randrange(9)
            if op <= 2:
                name = rng.choice(sorted(header) + field_names)
                header[name] = rng.choice(HOSTILE_VALUES)
            elif op == 3 and header:
                del header[rng.choice(sorted(header))]
            elif op == 4:
                frames = frames[:1] + [rng.randbytes(rng.randrange(40)) for _ in range(rng.randrange(4))]
            elif op == 5 and len(frames) > 1:
                i = rng.randrange(1, len(frames))
                frames[i] = bytes(frames[i])[:rng.randrange(len(frames[i]) + 1)]
        raw = packb(header)
        op = rng.randrange(6)
        if op == 0:
            raw = raw[:rng.randrange(len(raw) + 1)]
        elif op == 1:
            i = rng.randrange(len(raw))
            raw = raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1:]
        elif op == 2:
            i = rng.randrange(len(raw) + 1)
            raw = raw[:i] + rng.randbytes(rng.randint(1, 9)) + raw[i:]
        cases.append([raw] + frames[1:])
    return cases


CASES_PER_SEED = 100
TEN_THOUSAND = 10_000


def test_fuzz_ten_thousand_cases_are_each_a_message_or_a_clean_rejection():
    """>= 10,000 cases: hypothesis draws seeds (and shrinks to the failing one), each seed expands
    into a hundred cheap mutations, so the whole run takes a second or two."""
    seen = []

    @settings(max_examples=TEN_THOUSAND // CASES_PER_SEED, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.integers(0, 2**64 - 1))
    def run(seed):
        for frames in hostile_cases(seed, CASES_PER_SEED):
            must_be_message_or_protocol_error(frames)
            seen.append(1)

    run()
    assert len(seen) >= TEN_THOUSAND, len(seen)


def _nested(depth: int, kind: str) -> bytes:
    """msgpack bytes of `depth` nested one-item arrays or maps, built without recursion."""
    opener = b"\x91" if kind == "array" else b"\x81\xa1k"
    return opener * depth + b"\xc0"


def _in_header(field_bytes: bytes, kind: str = "status", name: str = "snapshot") -> bytes:
    """A header whose `name` field is the raw msgpack `field_bytes` (spliced, not re-encoded)."""
    head = {"v": PROTOCOL_VERSION, "type": kind}
    raw = packb(head)
    assert raw[0] == 0x82  # fixmap of 2: make it 3 and append the field
    return b"\x83" + raw[1:] + packb(name) + field_bytes


def crafted_frames() -> dict[str, list]:
    """Hand-made hostile messages, by name. Every one must be rejected."""
    result = dict(RESULT)
    nan = float("nan")
    cases: dict[str, list] = {
        # huge length headers: containers and strings announcing gigabytes, with little behind
        "array32 of 4G items": [b"\xdd\xff\xff\xff\xff"],
        "map32 of 4G pairs": [b"\xdf\xff\xff\xff\xff" + b"\x00" * 64],
        "str32 of 4 GiB": [b"\xdb\xff\xff\xff\xff" + b"x" * 100],
        "bin32 of 4 GiB": [b"\xc6\xff\xff\xff\xff" + b"x" * 100],
        "ext32 of 4 GiB": [b"\xc9\xff\xff\xff\xff\x01" + b"x" * 100],
        "array16 of 65535 nils": [b"\xdc\xff\xff" + b"\xc0" * 65535],
        "array of 65537 items": [packb(list(range(MAX_LIST + 1)))],
        "field str32 of 4 GiB": [_in_header(b"\xdb\xff\xff\xff\xff" + b"x" * 10, "hello",
                                            "worker_id")],
        "blob of 2**62 elements": [packb({**result, "gradient": {
            "dtype": "float32", "numel": 2**62, "frames": 1}}), b"\x00" * 16],
        "blob of 2**64 elements": [packb({**result, "gradient": {
            "dtype": "float32", "numel": 2**64 - 1, "frames": 1}}), b"\x00" * 16],
        "blob of 10**9 frames": [packb({**result, "gradient": {
            "dtype": "float32", "numel": 4, "frames": 10**9}}), b"\x00" * 16],
        # deep nesting
        "arrays 100k deep": [_nested(100_000, "array")],
        "maps 100k deep": [_nested(100_000, "map")],
        "arrays 1000 deep in a snapshot": [_in_header(_nested(1000, "array"))],
        "maps 1000 deep in a snapshot": [_in_header(_nested(1000, "map"))],
        "maps 40 deep in job_args": [_in_header(_nested(40, "map"), "welcome", "job_args")],
        # wrong types
        "slot as a string": [packb({**result, "slot": "1"})],
        "slot as a float": [packb({**result, "slot": 1.0})],
        "slot as a bool": [packb({**result, "slot": True})],
        "slot as 2**64": [packb({**result, "slot": 2**64 - 1})],
        "loss as bytes": [packb({**result, "loss": b"0.5"})],
        "parts as a map": [packb({**TASK, "parts": {"0": [0, 0, 4]}})],
        "coefficients of strings": [packb({**TASK, "coefficients": ["1"]})],
        "versions with int values": [packb({"v": PROTOCOL_VERSION, "type": "hello",
                                            "worker_id": "w", "host": "h", "cores": 1,
                                            "threads": 1, "device": "cpu", "memory_mb": 1,
                                            "versions": {"a": 1}})],
        "map keys that are ints": [b"\x82\x01\x01\xa4type\xa5hello"],
        "gradient as a list": [packb({**result, "gradient": [0.0] * 4})],
        "dtype as a list": [packb({**result, "gradient": {
            "dtype": ["float32"], "numel": 1, "frames": 1}}), b"\x00" * 4],
        "dtype object": [packb({**result, "gradient": {
            "dtype": "object", "numel": 1, "frames": 1}}), b"\x00" * 8],
        "version as a string": [packb({**RESULT, "v": str(PROTOCOL_VERSION)})],
        "type as a list": [packb({"v": PROTOCOL_VERSION, "type": ["result"]})],
        # NaN and infinities where numbers must be finite
        "loss NaN": [packb({**result, "loss": nan})],
        "compute_s inf": [packb({**result, "compute_s": float("inf")})],
        "coefficient NaN": [packb({**TASK, "coefficients": [nan]})],
        "deadline -inf": [packb({**TASK, "deadline_s": float("-inf")})],
        "heartbeat_s NaN": [packb({"v": PROTOCOL_VERSION, "type": "welcome", "job": "digits",
                                   "job_args": {}, "fingerprint": "f", "seed": 0,
                                   "heartbeat_s": nan, "liveness": 3})],
        # ext types
        **{f"ext type {code}": [packb(msgpack.ExtType(code, b"x" * 8))] for code in (0, 1, 42, 127)},
        "ext inside a field": [packb({**result, "loss": msgpack.ExtType(5, b"pickle")})],
        "timestamp ext": [b"\xd6\xff\x00\x00\x00\x01"],
        # oversize
        "header over 1 MiB": [packb({"v": PROTOCOL_VERSION, "type": "bye",
                                     "reason": "x" * (MAX_HEADER_BYTES + 1)})],
        "string over the field limit": [packb({"v": PROTOCOL_VERSION, "type": "bye",
                                               "reason": "x" * (proto.MAX_STR + 1)})],
        "frame over 16 MiB": [packb({**result, "gradient": {
            "dtype": "float32", "numel": (MAX_FRAME_BYTES + 4) // 4, "frames": 1}}),
            b"\x00" * (MAX_FRAME_BYTES + 4)],
        "ready with 10**6 credits": [packb({"v": PROTOCOL_VERSION, "type": "ready",
                                            "credits": 10**6, "fingerprint": "f"})],
        # frames that do not match
        "no frames at all": [],
        "blob announced, none sent": [packb({**result, "gradient": {
            "dtype": "float32", "numel": 4, "frames": 1}})],
        "a frame too many": [*wire(encode(sample_result())), b"extra"],
        "bytes short by one": [packb({**result, "gradient": {
            "dtype": "float32", "numel": 4, "frames": 1}}), b"\x00" * 15],
    }
    # truncated: every proper prefix of every sample message's header
    for i, msg in enumerate(sample_messages()):
        header = wire(encode(msg))[0]
        for cut in range(len(header)):
            cases[f"message {i} ({msg.TYPE}) cut at {cut}"] = [header[:cut]]
    return cases


def sample_result() -> proto.Result:
    return _result(to_blob(grad_tensor(4)))


CRAFTED = crafted_frames()


def test_crafted_frames_are_many_and_cover_every_kind():
    names = " ".join(CRAFTED)
    for kind in ("4G", "deep", "as a", "NaN", "ext", "cut at", "over", "frames"):
        assert kind in names, kind
    assert len(CRAFTED) > 500


def test_every_crafted_frame_is_a_clean_rejection_fast_and_small():
    import time
    import tracemalloc

    slow, rejected = [], 0
    tracemalloc.start()
    try:
        for name, frames in CRAFTED.items():
            size = sum(len(f) for f in frames)
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            t0 = time.perf_counter()
            with pytest.raises(ProtocolError) as info:
                decode(frames)
            took = time.perf_counter() - t0
            peak = tracemalloc.get_traced_memory()[1] - base
            assert info.value.reason, name
            # No case may allocate far beyond its own size (a lying length must not be believed).
            assert peak < 4 * size + 2 * 2**20, (name, peak, size)
            if took > 0.5:
                slow.append((name, took))
            rejected += 1
    finally:
        tracemalloc.stop()
    assert not slow, slow
    assert rejected == len(CRAFTED)


def test_nesting_at_the_limit_is_fine():
    ok = decode([_in_header(_nested(MAX_DEPTH - 2, "map"))])
    assert isinstance(ok, proto.Status)
    with pytest.raises(ProtocolError, match="deeper"):
        decode([_in_header(_nested(MAX_DEPTH, "map"))])


@pytest.mark.parametrize("shape", ["array", "map"])
def test_deep_nesting_in_a_typed_field_is_refused_by_its_type(shape):
    """Messages whose fields are all typed skip the depth walk: their checkers go no deeper than
    the type, so a value nested past the limit is refused as the wrong type, not recursed into."""
    deep = _nested(100_000 if shape == "array" else MAX_DEPTH * 4, shape)
    with pytest.raises(ProtocolError) as info:
        decode([_in_header(deep, kind="cancel", name="slots")])
    assert info.value.reason in ("schema", "msgpack")


@pytest.mark.parametrize("sums", [
    {},  # no metric
    {f"m{i}": [1.0, 1.0] for i in range(proto.MAX_EVAL_METRICS + 1)},  # too many
    {"loss": [1.0]},  # not a pair
    {"loss": [1.0, 2.0, 3.0]},
    {"loss": [1.0, -1.0]},  # a negative count
    {"": [1.0, 1.0]},  # no name
    {"x" * (proto.MAX_METRIC_NAME + 1): [1.0, 1.0]},
    {"lo\nss": [1.0, 1.0]},  # not printable
    {"loss": [1e301, 1.0]},
    {"loss": ["1", 1.0]},  # not a number
])
def test_an_eval_result_with_bad_sums_is_refused(sums):
    header = {"v": PROTOCOL_VERSION, "type": "eval_result", "slot": 1, "version": 0,
              "compute_s": 0.1, "sums": sums}
    with pytest.raises(ProtocolError):
        decode([packb(header)])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_an_eval_result_with_non_finite_sums_is_refused(value):
    header = {"v": PROTOCOL_VERSION, "type": "eval_result", "slot": 1, "version": 0,
              "compute_s": 0.1, "sums": {"loss": [value, 1.0]}}
    with pytest.raises(ProtocolError):
        decode([packb(header)])


def test_an_eval_task_has_one_part():
    header = {"v": PROTOCOL_VERSION, "type": "task", "slot": 1, "round": 0, "version": 0,
              "parts": [[0, 0, 4], [0, 4, 4]], "coefficients": [1.0, 1.0], "deadline_s": 1.0,
              "kind": "eval"}
    with pytest.raises(ProtocolError):
        decode([packb(header)])


def test_a_job_identity_travels_checked_and_is_left_out_when_none():
    import idlegrad.common.job as job_mod
    from torch import nn
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.zeros(8, 4), torch.zeros(8, dtype=torch.long))
    job = job_mod.Job(name="j", build_model=lambda: nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)),
                      build_datasets=lambda: (data, data),
                      loss=lambda m, b: m(b[0]).sum(), build_optimizer=lambda p: None, batch_size=4)
    identity = job_mod.build(job).identity
    welcome = proto.Welcome(job="j", job_args={}, fingerprint="f", seed=0, heartbeat_s=1.0,
                            liveness=3, job_identity=identity)
    assert proto.decode(proto.encode(welcome)).job_identity == identity
    # absent at None: a peer that predates the field decodes the header without meeting it
    plain = dataclasses.replace(welcome, job_identity=None)
    assert "job_identity" not in msgpack.unpackb(proto.encode(plain)[0])
    for bad in ({"name": "j", "params": [["w", [-1], "float32"]]}, {"name": "j", "extra": 1},
                {"params": [["w", [2]] ]}, {"train": "many"}, {"data": {"train": 5}},
                {"params": [["w", [1], "f"]] * (proto.MAX_IDENTITY_TENSORS + 1)}):
        with pytest.raises(ProtocolError):
            proto.decode(proto.encode(proto.Ready(credits=0, fingerprint="f", job_identity=bad)))
    assert proto.job_identity_or_none({"params": [["w", [1], "f"]] * 5000}) is None


def test_job_differences_say_what_differs_from_each_side():
    from idlegrad.common.job import job_differences

    here = {"name": "j", "params": [["0.weight", [32, 64], "float32"], ["0.bias", [32], "float32"]],
            "train": 1600, "test": 400, "data": {"train": "a" * 64, "test": None}}
    there = {"name": "k", "params": [["0.weight", [48, 64], "float32"]],
             "buffers": [["1.running_mean", [48], "float32"]], "train": 1500, "test": 400,
             "data": {"train": "b" * 64, "test": None}}
    assert job_differences(here, there, "here", "at the coordinator") == [
        "job name 'j' here, 'k' at the coordinator",
        "parameter 0.weight: [32, 64] float32 here, [48, 64] float32 at the coordinator",
        "parameter 0.bias: [32] float32 here, none at the coordinator",
        "buffer 1.running_mean: none here, [48] float32 at the coordinator",
        "training set: 1600 samples here, 1500 samples at the coordinator",
        "train data manifest aaaaaaaaaaaa here, bbbbbbbbbbbb at the coordinator"]
    assert job_differences(here, here) == []
    many = {"params": [[f"p{i}", [i], "float32"] for i in range(10)]}
    said = job_differences(many, {})
    assert len(said) == 4 and said[-1] == "and 7 more parameters", said
    # one over the limit is one more (singular), as a walkthrough met it: "and 1 more buffers"
    four = {"buffers": [[f"b{i}", [i], "float32"] for i in range(4)]}
    assert job_differences(four, {})[-1] == "and 1 more buffer"
