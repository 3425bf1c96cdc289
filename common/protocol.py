"""The wire: message dataclasses, one encode/decode pair, limits and schema checks.

A message is multipart: one msgpack header `{"v": PROTOCOL_VERSION, "type": ..., fields...}` and zero
or more raw frames that carry flat tensors (`Blob`). A blob field appears in the header as a
descriptor `{"dtype": ..., "numel": ..., "frames": k}`; its k frames follow the header in the order
the fields are declared. No pickle anywhere: the header is plain msgpack without ext types.

Each message class *is* its schema: `decode` checks every header field against the dataclass's
type hints, so adding a field is one line. This module is pure and imports no torch, so monitors and
the demo front end stay light; `common.tensors` converts blobs to and from torch tensors.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

import msgpack

from .errors import ProtocolError
from .locality_bounds import MAX_HELD_SHARDS, MAX_PREFETCH, MAX_SHUFFLE_WINDOW

# 2: ack; hello.instance; welcome.instance and welcome.holding. 3: task.acks, result.waited_s.
# 4: fetch, chunk, welcome.blob_mirrors, heartbeat.cache (the data plane); task.buffers,
#    result.buffers (model state beyond parameters); welcome.shuffle_window, heartbeat.shards,
#    task.prefetch (locality)
# 5: task.snapshot and task.snapshot_bytes (a large model by name), handback, heartbeat "capped";
#    task kind "eval", eval_result (evaluation on workers)
PROTOCOL_VERSION = 5

MAX_FRAME_BYTES = 16 * 1024 * 1024  # tensor frames are cut to this; larger zero-copy frames slow down
MAX_HEADER_BYTES = 1024 * 1024
MAX_BLOB_FRAMES = 1024  # 16 GiB per blob at most
MAX_STR = 4096
MAX_LIST = 65536
MAX_DEPTH = 32  # containers nest at most this deep in a header (msgpack's own limit is far deeper)
# What a worker says of itself is kept while it stays and shown in every status snapshot: short.
MAX_WORKER_ID = 128  # a host name (at most 64 on Linux) and a pid fit
MAX_NAME = 256  # host, device, instance, each version string
MAX_VERSIONS = 16
# A welcome's job arguments become keyword arguments of a job factory on the worker, before the
# worker can compare fingerprints: a few named scalars, as `--job-arg name=value` makes them.
MAX_JOB_ARGS = 32
MAX_JOB_ARG_NAME = 64
MAX_JOB_ARG_STR = 256
# Seconds a worker reports (compute, wait): past this a report is not a measurement. The
# scheduler averages them, and sums of squares of absurd values overflow.
MAX_REPORTED_S = 1e6
# A session's heartbeat (seconds) and the beats a peer may miss: a worker takes them from the
# coordinator's welcome, and a beat of a microsecond would have it send nothing else.
HEARTBEAT_S_RANGE = (0.01, 86400.0)
LIVENESS_RANGE = (1, 1000)
# Locality's bounds (shards held, a prefetch hint, the shuffle window): common/locality_bounds.py
# A job's identity (what its fingerprint hashes: common/job.py, BuiltJob.identity) travels only
# between peers that both read it, so that each can say what differs when fingerprints do: a
# worker that reads it says so in hello.versions ("job_identity": JOB_IDENTITY_FORMAT), and only
# then does the welcome carry the coordinator's and may its ready carry its own.
# "2": `random_block` too (a job drawing randomness); a peer of "1" would refuse that key, so
# it is sent neither, and only the fingerprints are compared
JOB_IDENTITY_FORMAT = "2"
MAX_IDENTITY_TENSORS = 4096  # parameters and buffers each; a larger model sends none
MAX_TENSOR_DIMS = 16
# ZMQ_MAXMSGSIZE for every socket: the peer is disconnected by ZeroMQ itself past this.
SOCKET_MAX_MSG_BYTES = max(MAX_FRAME_BYTES, MAX_HEADER_BYTES) + 4096

# The data plane (docs/protocol.md): a blob is asked for in chunks of at most this, and a chunk's
# bytes travel as one raw frame.
MAX_CHUNK_BYTES = 1 << 20
MAX_MIRRORS = 16  # welcome.blob_mirrors
MAX_URL = 512
# What a worker's heartbeat may say of its blob cache: counters, each a non-negative int.
CACHE_COUNTERS = frozenset({"hits", "downloads", "in_flight", "bytes_mirrors",
                            "bytes_coordinator", "used_bytes", "failures"})

# An evaluation slot's answer: at most this many metrics, each named by a short printable name.
MAX_EVAL_METRICS = 16
MAX_METRIC_NAME = 64

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class Blob:
    """A flat tensor on the wire: dtype, element count and the frames (buffers) that hold it."""

    dtype: str
    numel: int
    frames: tuple = ()

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class Message:
    TYPE: ClassVar[str] = ""


# worker -> coordinator ------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello(Message):
    """First words of a worker: who it is and what it has."""

    TYPE: ClassVar[str] = "hello"
    worker_id: str
    host: str
    cores: int
    threads: int
    device: str
    memory_mb: int
    versions: dict[str, str]
    job: Optional[str] = None  # the job the worker was configured with; None: any built-in job
    # The coordinator instance (welcome.instance) of the session this worker resumes, with the
    # slots and results it still holds; None: a fresh start.
    instance: Optional[str] = None


@dataclass(frozen=True)
class Ready(Message):
    """How many slots the worker will hold at once (0 while paused), for the job it built."""

    TYPE: ClassVar[str] = "ready"
    credits: int
    fingerprint: str
    # the identity of the job it built, sent when its fingerprint is not the welcome's and the
    # welcome carried job_identity (the coordinator then says what differs)
    job_identity: Optional[dict[str, Any]] = None


@dataclass(frozen=True)
class Result(Message):
    """A slot's coded gradient: sum_j coefficient_j * (summed gradient of partition j)."""

    TYPE: ClassVar[str] = "result"
    slot: int
    version: int
    samples: int
    loss: float
    compute_s: float
    gradient: Blob
    # Seconds the task waited in the worker's queue before its compute began: the coordinator
    # takes it and compute_s from the slot's wall time to learn the worker's link time.
    waited_s: float = 0.0
    # The model's persistent buffers (BatchNorm statistics, counters) as the slot's computation
    # left them, float64, in the order both sides derive from the job; None when it has none.
    buffers: Optional[Blob] = None


@dataclass(frozen=True)
class EvalResult(Message):
    """An evaluation slot's answer: for each metric, [sum, count] over the slot's range of the
    test set at `version` (the coordinator adds them up over the slots: sum / count)."""

    TYPE: ClassVar[str] = "eval_result"
    slot: int
    version: int
    compute_s: float
    sums: dict[str, list[float]]


@dataclass(frozen=True)
class Heartbeat(Message):
    """Liveness, both ways. A worker says what it is doing."""

    TYPE: ClassVar[str] = "heartbeat"
    state: str = "idle"
    # a worker's blob cache, as counted since it started (CACHE_COUNTERS); None: no cache in use
    cache: Optional[dict[str, int]] = None
    # A worker's training shards in its cache (indices into the manifest), when they changed
    # since it last said; None: unchanged. At most MAX_HELD_SHARDS.
    shards: Optional[list[int]] = None

    # "capped": the owner's daily transfer cap is spent; the worker asks for no work that needs
    # data it does not hold until the allowance returns
    STATES: ClassVar[frozenset] = frozenset({"working", "paused", "idle", "coordinator",
                                             "capped"})


@dataclass(frozen=True)
class Fetch(Message):
    """Ask the coordinator for `length` bytes of blob `sha256` from `offset`: one chunk of a blob
    of the data it serves. `request` is the worker's, echoed in the answer."""

    TYPE: ClassVar[str] = "fetch"
    request: int
    sha256: str
    offset: int
    length: int


@dataclass(frozen=True)
class Handback(Message):
    """Slots the worker cannot compute now, through no fault of its own (the data they need is
    not in its cache, and its transfer cap is spent): the coordinator gives them to others.
    With `error`, the job's own code failed on them here (what it raised, one printable line):
    the coordinator gives them to others and counts the failure."""

    TYPE: ClassVar[str] = "handback"
    slots: list[int]
    reason: str = ""
    error: Optional[str] = None


@dataclass(frozen=True)
class Bye(Message):
    TYPE: ClassVar[str] = "bye"
    reason: str = ""


# coordinator -> worker ------------------------------------------------------------------------


@dataclass(frozen=True)
class Welcome(Message):
    """The job by name, arguments and fingerprint (never code), and the session's settings."""

    TYPE: ClassVar[str] = "welcome"
    job: str
    job_args: dict[str, Any]
    fingerprint: str
    seed: int
    heartbeat_s: float
    liveness: int
    instance: str = ""  # this coordinator process; a worker's results are only for the one they came from
    holding: list[int] = field(default_factory=list)  # slots of the resumed session it still holds
    result_dtype: str = "float32"  # how results travel: float32, or bfloat16 (error feedback)
    # HTTP(S) mirrors of the blobs of the job's data, tried before the coordinator
    blob_mirrors: list[str] = field(default_factory=list)
    # 0: each epoch is a full shuffle of the seed; W: the shard-aware order, samples shuffled
    # within blocks of W shards of the (sharded) training set (common/permutation.py)
    shuffle_window: int = 0
    # the identity of the coordinator's job, to a worker whose hello said it reads one
    job_identity: Optional[dict[str, Any]] = None

    RESULT_DTYPES: ClassVar[frozenset] = frozenset({"float32", "bfloat16"})


@dataclass(frozen=True)
class Task(Message):
    """Compute sum_j coefficients[j] * g_j at `version`, g_j the summed gradient of parts[j].

    Each part is [epoch, offset, count] into the seeded permutation of that epoch. The model is
    attached when the worker's cached version differs from `version`.
    """

    TYPE: ClassVar[str] = "task"
    slot: int
    round: int
    version: int
    parts: list[list[int]]
    coefficients: list[float]
    deadline_s: float
    model: Optional[Blob] = None
    # "gradient": the coded gradient above. "local": from `version`, run `steps` inner steps of
    # the job's optimizer over the (single) part, and return coefficient * samples * (model at
    # `version` - model after), the slot's summed parameter change (docs/protocol.md).
    kind: str = "gradient"
    steps: int = 0
    # results the coordinator has taken, as an `Ack` would say: a task sent in answer to a
    # result carries its acknowledgement, one message instead of two
    acks: list[int] = field(default_factory=list)
    # the model's persistent buffers at `version` (float64), sent with `model` when it has any
    buffers: Optional[Blob] = None
    # shards of the training set the worker will likely need next: fetch them ahead (locality)
    prefetch: list[int] = field(default_factory=list)
    # instead of `model` (and `buffers`): the sha256 of the model at `version` as a snapshot
    # blob (common/snapshot.py) of `snapshot_bytes`, fetched from mirrors or the coordinator
    snapshot: Optional[str] = None
    snapshot_bytes: int = 0

    # "eval": evaluate the model at `version` on test samples [offset, offset + count) of the
    # one part [0, offset, count] (the test set in its own order), answered by an eval_result.
    KINDS: ClassVar[frozenset] = frozenset({"gradient", "local", "eval"})


@dataclass(frozen=True)
class Chunk(Message):
    """The answer to a `fetch`: bytes [offset, offset + len(data)) of a blob of `total` bytes, or
    `error` (one line: not served here, or busy) and no data."""

    TYPE: ClassVar[str] = "chunk"
    request: int
    sha256: str
    offset: int
    total: int
    data: Optional[bytes] = None  # one raw frame
    error: str = ""


@dataclass(frozen=True)
class Cancel(Message):
    TYPE: ClassVar[str] = "cancel"
    slots: list[int]


@dataclass(frozen=True)
class Ack(Message):
    """The coordinator has taken these results (used, refused or dropped): forget them."""

    TYPE: ClassVar[str] = "ack"
    slots: list[int]


@dataclass(frozen=True)
class Reject(Message):
    """A refusal. `code` is stable for programs ("hello_first", "job", "version", ...)."""

    TYPE: ClassVar[str] = "reject"
    code: str
    reason: str


@dataclass(frozen=True)
class Shutdown(Message):
    TYPE: ClassVar[str] = "shutdown"
    reason: str


# monitor <-> coordinator -----------------------------------------------------------------------


@dataclass(frozen=True)
class StatusRequest(Message):
    TYPE: ClassVar[str] = "status_request"
    cursor: int = 0  # events after this id are returned


@dataclass(frozen=True)
class Status(Message):
    TYPE: ClassVar[str] = "status"
    snapshot: dict[str, Any]


@dataclass(frozen=True)
class Control(Message):
    """An operator's command: pause or resume training; drain one worker (it finishes the
    slots it holds, gets no more, and is then sent home); ban one (a worker id, or a key in Z85:
    it is sent home and refused from then on, across restarts) or lift a ban; revoke an
    invitation (its unused uses)."""

    TYPE: ClassVar[str] = "control"
    action: str
    worker: Optional[str] = None  # required by "drain", "ban" and "unban"
    invitation: Optional[str] = None  # required by "revoke": 16 hex digits

    ACTIONS: ClassVar[frozenset] = frozenset({"pause", "resume", "drain", "ban", "unban",
                                              "revoke"})
    NEED_WORKER: ClassVar[frozenset] = frozenset({"drain", "ban", "unban"})


@dataclass(frozen=True)
class ControlReply(Message):
    """The answer to a `control`: whether it was done, and one line saying what happened."""

    TYPE: ClassVar[str] = "control_reply"
    action: str
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class CreditRequest(Message):
    """What has this worker earned here? Any listed key may ask; a worker key hears only its own
    row. `worker` names the row to read: needed without keys (where a worker is its id), and,
    with keys, only a monitor or operator may name another key's."""

    TYPE: ClassVar[str] = "credit_request"
    worker: Optional[str] = None


@dataclass(frozen=True)
class Credit(Message):
    """The answer to a `credit_request`: one row of the credits (`row` empty: nothing earned or
    seen yet), the name it is shown by, how many identities hold credit here; or, `ok` false, one
    line saying why not."""

    TYPE: ClassVar[str] = "credit"
    ok: bool
    worker: str = ""
    row: dict[str, float] = field(default_factory=dict)
    identities: int = 0
    reason: str = ""

    FIELDS: ClassVar[frozenset] = frozenset({"samples", "compute_s", "verified", "refused",
                                             "first_seen", "last_seen"})


@dataclass(frozen=True)
class Invite(Message):
    """An operator's request to mint an invitation on the running coordinator (its --enrolled
    folder). `address`: the training address volunteers dial, which goes into the token."""

    TYPE: ClassVar[str] = "invite"
    address: str
    uses: int = 1
    expires_s: float = 7 * 86400.0
    name: str = "worker"


@dataclass(frozen=True)
class Invited(Message):
    """The answer to an `invite`: the token (with the invitation's id and expiry), or one line
    saying why not."""

    TYPE: ClassVar[str] = "invited"
    ok: bool
    token: str = ""
    invitation: str = ""
    expires: float = 0.0
    reason: str = ""


# a volunteer's worker <-> the coordinator's enrolment endpoint ----------------------------------


@dataclass(frozen=True)
class Enrol(Message):
    """Enrol the sender's CURVE key (the key of its handshake, never a key it names) as a worker
    key, with an invitation's id and one-time secret. Heard only on the enrolment endpoint."""

    TYPE: ClassVar[str] = "enrol"
    invitation: str  # 16 hex digits
    secret: str  # 43 base64url characters


@dataclass(frozen=True)
class Enrolled(Message):
    """The answer to an `enrol`: the key is now a worker key (with the worker name to use), or
    one line saying why not."""

    TYPE: ClassVar[str] = "enrolled"
    ok: bool
    name: str = ""
    reason: str = ""


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (Hello, Ready, Result, EvalResult, Heartbeat, Fetch, Handback, Bye, Welcome, Task, Chunk,
                Cancel, Ack, Reject, Shutdown, StatusRequest, Status, Control, ControlReply,
                CreditRequest, Credit, Invite, Invited, Enrol, Enrolled)
}


# schema ---------------------------------------------------------------------------------------


def _schema(cls: type[Message]) -> list[tuple[str, Any, bool]]:
    hints = typing.get_type_hints(cls)
    return [
        (f.name, hints[f.name],
         f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in dataclasses.fields(cls)
    ]


_SCHEMAS = {name: _schema(cls) for name, cls in MESSAGE_TYPES.items()}



def _is_optional(hint) -> tuple[bool, Any]:
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return True, args[0]
    return False, hint


def _check(value, hint, where: str):
    """Raise ProtocolError unless `value` (already msgpack-decoded) fits `hint`."""
    _validator(hint)(value, where)


def _validator(hint) -> Callable[[Any, str], None]:
    """A checker for values of type `hint`, built once per schema field: decoding walks no type
    hints and formats no paths unless a value is wrong."""
    if hint is Any:
        return lambda value, where: None  # bounded by msgpack's own limits; None is a value too
    optional, base = _is_optional(hint)
    check = _base_validator(base)
    if optional:
        def check_optional(value, where):
            if value is not None:
                check(value, where)
        return check_optional

    def check_required(value, where):
        if value is None:
            raise ProtocolError("schema", f"{where} is missing")
        check(value, where)
    return check_required


def _base_validator(hint) -> Callable[[Any, str], None]:
    origin = typing.get_origin(hint)
    if origin is list:
        (item_hint,) = typing.get_args(hint)
        item = _validator(item_hint)

        def check_list(value, where):
            if not isinstance(value, list) or len(value) > MAX_LIST:
                raise ProtocolError("schema", f"{where} must be a list")
            i = 0
            try:  # items are checked with an empty path; it is filled in only on an error
                for i, v in enumerate(value):
                    item(v, "")
            except ProtocolError as exc:
                raise ProtocolError(exc.reason, f"{where}[{i}]{exc.detail}") from None
        return check_list
    if origin is dict:
        _, item_hint = typing.get_args(hint)
        item = _validator(item_hint)

        def check_map(value, where):
            if not isinstance(value, dict):
                raise ProtocolError("schema", f"{where} must be a map")
            key = ""
            try:
                for key, v in value.items():
                    if not isinstance(key, str):
                        raise ProtocolError("schema", f"{where} keys must be strings")
                    item(v, "")
            except ProtocolError as exc:
                if not isinstance(key, str):
                    raise
                raise ProtocolError(exc.reason, f"{where}.{key[:40]}{exc.detail}") from None
        return check_map
    name = getattr(hint, "__name__", str(hint))
    if hint is bool:
        def ok(v):
            return isinstance(v, bool)
    elif hint is int:
        def ok(v):
            return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63
    elif hint is float:
        def ok(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    elif hint is str:
        def ok(v):
            return isinstance(v, str) and len(v) <= MAX_STR
    else:
        raise TypeError(f"unsupported schema type {hint!r}")

    def check_scalar(value, where):
        if not ok(value):
            got = type(value).__name__
            if got == name:  # the right type: out of range (a 64-bit int, a finite float)
                raise ProtocolError("schema", f"{where}: {name} out of range")
            raise ProtocolError("schema", f"{where} must be {name}, got {got}")
    return check_scalar


TENSOR, RAW = "tensor", "raw"  # fields that travel in frames: a Blob, or `bytes` (one frame)


_FieldSpec = tuple[str, bool, Optional[str], bool, Optional[Callable]]


def _fields(schema) -> list[_FieldSpec]:
    """(name, required, TENSOR/RAW/None for a header value, may be None, checker) for each field
    of a message; a header value has a checker."""
    out: list[_FieldSpec] = []
    for name, hint, required in schema:
        optional, base = _is_optional(hint)
        if base is Blob:
            out.append((name, required, TENSOR, optional, None))
        elif base is bytes:
            out.append((name, required, RAW, optional, None))
        else:
            out.append((name, required, None, optional, _validator(hint)))
    return out


_FIELDS = {kind: _fields(schema) for kind, schema in _SCHEMAS.items()}
# ZMQ_MAXMSGSIZE bounds a frame, not a message: a message of many frames is refused by its count
# and by the sum of its frames before anything is read (decode).
MAX_MESSAGE_FRAMES = 1 + max(
    sum(MAX_BLOB_FRAMES if blob == TENSOR else 1 for _, _, blob, _, _ in fields if blob)
    for fields in _FIELDS.values())
MAX_MESSAGE_BYTES = MAX_HEADER_BYTES + (MAX_MESSAGE_FRAMES - 1) * MAX_FRAME_BYTES
# header fields whose default is None: left out of the header at None, so that a field added
# this way reaches no peer that would refuse it as unknown until it is used
_LEFT_OUT_WHEN_NONE = {
    kind: frozenset(f.name for f in dataclasses.fields(MESSAGE_TYPES[kind]) if f.default is None)
    - {name for name, _, blob, _, _ in _FIELDS[kind] if blob}
    for kind in _FIELDS}
_FIELD_NAMES = {kind: frozenset(name for name, _, _ in schema) | {"v", "type"}
                for kind, schema in _SCHEMAS.items()}


def _mentions_any(hint) -> bool:
    return hint is Any or any(_mentions_any(arg) for arg in typing.get_args(hint))


_UNTYPED_KINDS = frozenset(kind for kind, schema in _SCHEMAS.items()
                           if any(_mentions_any(hint) for _, hint, _ in schema))


# encode / decode ------------------------------------------------------------------------------


def encode(msg: Message) -> list:
    """Message -> [header bytes, blob frames...], ready for send_multipart(copy=False)."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": msg.TYPE}
    frames: list = []
    for name, _, blob, _, _ in _FIELDS[msg.TYPE]:
        value = getattr(msg, name)
        if value is None and name in _LEFT_OUT_WHEN_NONE[msg.TYPE]:
            continue  # as good as absent to every decoder, also those that predate the field
        if blob == TENSOR and value is not None:
            header[name] = {"dtype": value.dtype, "numel": value.numel, "frames": len(value.frames)}
            frames.extend(value.frames)
        elif blob == RAW and value is not None:
            header[name] = {"nbytes": memoryview(value).nbytes}
            frames.append(value)
        else:
            header[name] = value
    return [msgpack.packb(header, use_bin_type=True), *frames]


def _no_ext(code, data):
    raise ProtocolError("schema", "msgpack ext types are not allowed")


def _frame_bytes(frame) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame or bytes-like
    return memoryview(buf)


def decode(frames: Sequence, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """[header, blob frames...] -> Message, or ProtocolError. Never anything else. `max_bytes`:
    the most all the frames together may hold (an endpoint that hears only small messages says
    so)."""
    if not frames:
        raise ProtocolError("empty", "no frames")
    if len(frames) > MAX_MESSAGE_FRAMES:
        raise ProtocolError("oversize", f"{len(frames)} frames, at most {MAX_MESSAGE_FRAMES}")
    total = sum(_frame_bytes(f).nbytes for f in frames)
    if total > max_bytes:
        raise ProtocolError("oversize", f"a message of {total} bytes, at most {max_bytes}")
    raw = _frame_bytes(frames[0])
    if raw.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError("oversize", f"header of {raw.nbytes} bytes")
    try:
        header = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, ext_hook=_no_ext, use_list=True,
            max_str_len=MAX_HEADER_BYTES,
            max_bin_len=MAX_HEADER_BYTES, max_array_len=MAX_LIST, max_map_len=MAX_LIST,
            max_ext_len=0)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types; all mean "not a valid header"
        raise ProtocolError("msgpack", f"{type(exc).__name__}: {exc}"[:200]) from None
    if not isinstance(header, dict):
        raise ProtocolError("schema", "header must be a map")
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError("version", f"protocol {version!r}, expected {PROTOCOL_VERSION}")
    kind = header.get("type")
    if not isinstance(kind, str) or kind not in MESSAGE_TYPES:
        raise ProtocolError("type", f"unknown message type {str(kind)[:40]!r}")
    cls = MESSAGE_TYPES[kind]
    unknown = header.keys() - _FIELD_NAMES[kind]
    if unknown:
        raise ProtocolError("schema", f"{kind}: unknown fields {sorted(map(str, unknown))[:5]}")
    # Typed fields are checked no deeper than their types go; only an `Any` field can nest
    # without bound (a message without one, a result say, skips the walk)
    if kind in _UNTYPED_KINDS and _too_deep(header, MAX_DEPTH):
        raise ProtocolError("schema", f"header nests deeper than {MAX_DEPTH}")

    values: dict[str, Any] = {}
    next_frame = 1
    for name, required, blob, optional, check in _FIELDS[kind]:
        if name not in header and not required:
            continue
        value = header.get(name)
        if blob:
            if value is None and optional:
                values[name] = None
                continue
            take = _take_blob if blob == TENSOR else _take_raw
            values[name], next_frame = take(value, frames, next_frame, f"{kind}.{name}")
            continue
        assert check is not None  # a header value has one (_fields)
        check(value, f"{kind}.{name}")
        values[name] = value
    if next_frame != len(frames):
        raise ProtocolError("frames", f"{kind}: {len(frames) - next_frame} unexpected frames")
    msg = cls(**values)
    _semantic_checks(msg)
    return msg


def _too_deep(value, limit: int) -> bool:
    """Whether containers nest more than `limit` deep (iteratively: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, (dict, list)))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, (dict, list)))
    return False


def _take_blob(desc, frames: Sequence, start: int, where: str) -> tuple[Blob, int]:
    if not isinstance(desc, dict) or set(desc) != {"dtype", "numel", "frames"}:
        raise ProtocolError("schema", f"{where} must be a tensor descriptor")
    dtype, numel, count = desc["dtype"], desc["numel"], desc["frames"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:  # a list or map is unhashable
        raise ProtocolError("dtype", f"{where}: dtype {str(dtype)[:20]!r} not allowed")
    for key, v in (("numel", numel), ("frames", count)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ProtocolError("schema", f"{where}.{key} must be a non-negative int")
    if count > MAX_BLOB_FRAMES:
        raise ProtocolError("oversize", f"{where}: {count} frames")
    end = start + count
    if end > len(frames):
        raise ProtocolError("frames", f"{where}: {count} frames announced, {len(frames) - start} sent")
    parts = tuple(_frame_bytes(f) for f in frames[start:end])
    nbytes = sum(p.nbytes for p in parts)
    if nbytes != numel * DTYPE_SIZES[dtype]:
        raise ProtocolError("frames", f"{where}: {nbytes} bytes for {numel} x {dtype}")
    if any(p.nbytes > MAX_FRAME_BYTES for p in parts):
        raise ProtocolError("oversize", f"{where}: frame over {MAX_FRAME_BYTES} bytes")
    return Blob(dtype, numel, parts), end


def _take_raw(desc, frames: Sequence, start: int, where: str) -> tuple[memoryview, int]:
    """One raw frame of at most MAX_FRAME_BYTES, of the length its descriptor announced."""
    if not isinstance(desc, dict) or set(desc) != {"nbytes"}:
        raise ProtocolError("schema", f"{where} must be a frame descriptor")
    nbytes = desc["nbytes"]
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= MAX_FRAME_BYTES:
        raise ProtocolError("schema", f"{where}.nbytes must be 0 to {MAX_FRAME_BYTES}")
    if start >= len(frames):
        raise ProtocolError("frames", f"{where}: its frame is missing")
    data = _frame_bytes(frames[start])
    if data.nbytes != nbytes:
        raise ProtocolError("frames", f"{where}: {data.nbytes} bytes, {nbytes} announced")
    return data, start + 1


_URL_FORBIDDEN = frozenset('\\"\'<>?#`{}|^')


def check_blob_mirror(url: Any, where: str) -> str:
    """A mirror's base URL from the network or the command line: data, never more. http(s)
    only, a host, printable ASCII without spaces, quotes or a query; ProtocolError otherwise."""
    if not isinstance(url, str) or not 0 < len(url) <= MAX_URL:
        raise ProtocolError("schema", f"{where}: a mirror URL of 1 to {MAX_URL} characters")
    scheme, sep, rest = url.partition("://")
    if (scheme not in ("http", "https") or not sep or not rest or rest.startswith("/")
            or not all(33 <= ord(c) < 127 and c not in _URL_FORBIDDEN for c in url)):
        raise ProtocolError("schema", f"{where}: {url[:60]!r} is not an http:// or https:// "
                                      "URL of a host (without query or fragment)")
    return url


def is_sha256(name: Any) -> bool:
    return (isinstance(name, str) and len(name) == 64
            and all(c in "0123456789abcdef" for c in name))


def check_job_identity(identity: dict, where: str) -> None:
    """ProtocolError unless `identity` is a job's identity as common/job.py makes it: `name`,
    `params` and `buffers` ([name, shape, dtype] each, at most MAX_IDENTITY_TENSORS), `train`
    and `test` (sample counts), `data` (manifest hashes of `train` and `test`, or None),
    `random_block` (the micro-batch of a job that draws randomness)."""
    def fail(what: str):
        raise ProtocolError("schema", f"{where}: {what}")

    def short(v) -> bool:
        return isinstance(v, str) and len(v) <= MAX_NAME and v.isprintable()

    if not set(identity) <= {"name", "params", "buffers", "train", "test", "data",
                             "random_block"}:
        fail("keys among name, params, buffers, train, test, data, random_block")
    if not short(identity.get("name", "")):
        fail(f"name: a printable string of at most {MAX_NAME} characters")
    for key in ("params", "buffers"):
        entries = identity.get(key, [])
        if not isinstance(entries, list) or len(entries) > MAX_IDENTITY_TENSORS:
            fail(f"{key}: a list of at most {MAX_IDENTITY_TENSORS}")
        for e in entries:
            if not (isinstance(e, list) and len(e) == 3 and short(e[0]) and short(e[2])
                    and isinstance(e[1], list) and len(e[1]) <= MAX_TENSOR_DIMS
                    and all(type(d) is int and 0 <= d < 2**62 for d in e[1])):
                fail(f"{key}: entries [name, shape, dtype]")
    for key in ("train", "test"):
        if not (type(identity.get(key, 0)) is int and 0 <= identity.get(key, 0) < 2**62):
            fail(f"{key}: a sample count")
    if not (type(identity.get("random_block", 1)) is int
            and 1 <= identity.get("random_block", 1) < 2**31):
        fail("random_block: a sample count")
    data = identity.get("data", {})
    if not (isinstance(data, dict) and set(data) <= {"train", "test"}
            and all(v is None or short(v) for v in data.values())):
        fail("data: manifest hashes of train and test")


def job_identity_or_none(identity: dict) -> Optional[dict]:
    """`identity` if it fits the wire (a model of more tensors than the bound does not)."""
    try:
        check_job_identity(identity, "job_identity")
    except ProtocolError:
        return None
    return identity


def check_job_args(args: dict, where: str) -> None:
    """ProtocolError unless `args` are at most MAX_JOB_ARGS short ASCII identifiers, each naming
    a bool, a 64-bit int, a finite float or a string of at most MAX_JOB_ARG_STR characters."""
    if len(args) > MAX_JOB_ARGS:
        raise ProtocolError("schema", f"{where}: {len(args)} arguments, at most {MAX_JOB_ARGS}")
    for name, value in args.items():
        if not (isinstance(name, str) and len(name) <= MAX_JOB_ARG_NAME and name.isascii()
                and name.isidentifier()):
            raise ProtocolError("schema", f"{where}: argument name {str(name)[:40]!r} is not an "
                                          f"identifier of at most {MAX_JOB_ARG_NAME} characters")
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            if not -(2**63) <= value < 2**63:
                raise ProtocolError("schema", f"{where}.{name}: int out of range")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ProtocolError("schema", f"{where}.{name}: float must be finite")
        elif isinstance(value, str):
            if len(value) > MAX_JOB_ARG_STR:
                raise ProtocolError("schema", f"{where}.{name}: string over {MAX_JOB_ARG_STR} "
                                              "characters")
        else:
            raise ProtocolError("schema", f"{where}.{name} must be a bool, int, float or string, "
                                          f"got {type(value).__name__}")


def _semantic_checks(msg: Message) -> None:
    """Range checks the type hints cannot say."""
    def non_negative(*names):
        for n in names:
            if getattr(msg, n) < 0:
                raise ProtocolError("schema", f"{msg.TYPE}.{n} must be >= 0")

    def shard_list(name: str, limit: int):
        shards = getattr(msg, name)
        if shards is not None and (len(shards) > limit or any(k < 0 for k in shards)):
            raise ProtocolError("schema", f"{msg.TYPE}.{name}: at most {limit} shard indices "
                                          ">= 0")

    if isinstance(msg, Heartbeat):
        if msg.state not in Heartbeat.STATES:
            raise ProtocolError("schema", f"heartbeat.state {msg.state[:20]!r} unknown")
        shard_list("shards", MAX_HELD_SHARDS)
        if msg.cache is not None and (
                not set(msg.cache) <= CACHE_COUNTERS
                or any(not 0 <= v < 2**62 for v in msg.cache.values())):
            raise ProtocolError("schema", f"heartbeat.cache: counters of {sorted(CACHE_COUNTERS)}, "
                                          "each a non-negative int")
    elif isinstance(msg, Fetch):
        non_negative("request", "offset")
        if not is_sha256(msg.sha256):
            raise ProtocolError("schema", "fetch.sha256 must be 64 lowercase hex digits")
        if not 1 <= msg.length <= MAX_CHUNK_BYTES:
            raise ProtocolError("schema", f"fetch.length must be 1 to {MAX_CHUNK_BYTES}")
    elif isinstance(msg, Chunk):
        non_negative("request", "offset", "total")
        if not is_sha256(msg.sha256):
            raise ProtocolError("schema", "chunk.sha256 must be 64 lowercase hex digits")
        if len(msg.error) > MAX_NAME:
            raise ProtocolError("schema", f"chunk.error over {MAX_NAME} characters")
        size = 0 if msg.data is None else memoryview(msg.data).nbytes
        if size > MAX_CHUNK_BYTES or msg.offset + size > msg.total:
            raise ProtocolError("schema", f"chunk: {size} bytes at {msg.offset} of a blob of "
                                          f"{msg.total} (chunks are at most {MAX_CHUNK_BYTES})")
    elif isinstance(msg, Hello):
        non_negative("cores", "threads", "memory_mb")
        if not 1 <= len(msg.worker_id) <= MAX_WORKER_ID:
            raise ProtocolError("schema", f"hello.worker_id must be 1 to {MAX_WORKER_ID} characters")
        for name in ("host", "device", "instance"):
            if len(getattr(msg, name) or "") > MAX_NAME:
                raise ProtocolError("schema", f"hello.{name} over {MAX_NAME} characters")
        if len(msg.versions) > MAX_VERSIONS or any(
                len(k) > MAX_NAME or len(v) > MAX_NAME for k, v in msg.versions.items()):
            raise ProtocolError("schema", f"hello.versions: at most {MAX_VERSIONS} short entries")
    elif isinstance(msg, Welcome):
        check_job_args(msg.job_args, "welcome.job_args")
        if not (1 <= len(msg.job) <= MAX_NAME and msg.job.isprintable()):
            raise ProtocolError("schema", f"welcome.job must be 1 to {MAX_NAME} printable characters")
        if len(msg.fingerprint) > MAX_NAME or len(msg.instance) > MAX_NAME:
            raise ProtocolError("schema", f"welcome.fingerprint and instance: at most {MAX_NAME}")
        if len(msg.blob_mirrors) > MAX_MIRRORS:
            raise ProtocolError("schema", f"welcome.blob_mirrors: at most {MAX_MIRRORS}")
        for url in msg.blob_mirrors:
            check_blob_mirror(url, "welcome.blob_mirrors")
        if not 0 <= msg.shuffle_window <= MAX_SHUFFLE_WINDOW:
            raise ProtocolError("schema", f"welcome.shuffle_window must be 0 to "
                                          f"{MAX_SHUFFLE_WINDOW}")
        if msg.job_identity is not None:
            check_job_identity(msg.job_identity, "welcome.job_identity")
        if msg.result_dtype not in Welcome.RESULT_DTYPES:
            raise ProtocolError("schema", f"welcome.result_dtype {msg.result_dtype[:20]!r} unknown")
        if not (HEARTBEAT_S_RANGE[0] <= msg.heartbeat_s <= HEARTBEAT_S_RANGE[1]
                and LIVENESS_RANGE[0] <= msg.liveness <= LIVENESS_RANGE[1]):
            raise ProtocolError("schema", f"welcome.heartbeat_s must be in {HEARTBEAT_S_RANGE} "
                                          f"and welcome.liveness in {LIVENESS_RANGE}")
    elif isinstance(msg, Ready):
        non_negative("credits")
        if msg.job_identity is not None:
            check_job_identity(msg.job_identity, "ready.job_identity")
        if msg.credits > 1024:
            raise ProtocolError("schema", "ready.credits over 1024")
    elif isinstance(msg, Result):
        non_negative("slot", "version", "samples", "compute_s", "waited_s")
        if msg.compute_s > MAX_REPORTED_S or msg.waited_s > MAX_REPORTED_S:
            raise ProtocolError("schema", f"result seconds over {MAX_REPORTED_S:g}")
    elif isinstance(msg, Task):
        non_negative("slot", "round", "version", "deadline_s", "steps")
        if len(msg.parts) != len(msg.coefficients) or not msg.parts:
            raise ProtocolError("schema", "task.parts and task.coefficients must match")
        for part in msg.parts:
            if len(part) != 3 or min(part) < 0:
                raise ProtocolError("schema", "task.parts items are [epoch, offset, count] >= 0")
        shard_list("prefetch", MAX_PREFETCH)
        if msg.kind not in Task.KINDS:
            raise ProtocolError("schema", f"task.kind {msg.kind[:20]!r} unknown")
        if msg.kind == "local" and (msg.steps < 1 or len(msg.parts) != 1):
            raise ProtocolError("schema", "a local task has steps >= 1 and exactly one part")
        if msg.kind == "eval" and len(msg.parts) != 1:
            raise ProtocolError("schema", "an eval task has exactly one part")
        non_negative("snapshot_bytes")
        if msg.snapshot is not None and (not is_sha256(msg.snapshot) or msg.model is not None
                                         or msg.buffers is not None):
            raise ProtocolError("schema", "task.snapshot is a sha256, sent without model frames")
    elif isinstance(msg, Handback):
        if len(msg.slots) > 1024 or any(s < 0 for s in msg.slots) or len(msg.reason) > MAX_NAME:
            raise ProtocolError("schema", "handback: at most 1024 slots >= 0, a short reason")
        if msg.error is not None and not (len(msg.error) <= MAX_NAME and msg.error.isprintable()):
            raise ProtocolError("schema", "handback.error: one short printable line")
    elif isinstance(msg, EvalResult):
        non_negative("slot", "version", "compute_s")
        if not msg.compute_s <= MAX_REPORTED_S:
            raise ProtocolError("schema", f"eval_result.compute_s over {MAX_REPORTED_S:g}")
        check_eval_sums(msg.sums)
    elif isinstance(msg, StatusRequest):
        non_negative("cursor")
    elif isinstance(msg, Control):
        if msg.action not in Control.ACTIONS:
            raise ProtocolError("schema", f"control.action {msg.action[:20]!r} unknown")
        if msg.action in Control.NEED_WORKER and not msg.worker:
            raise ProtocolError("schema", f"control.worker is required to {msg.action}")
        if msg.worker is not None and len(msg.worker) > MAX_WORKER_ID:
            raise ProtocolError("schema", f"control.worker over {MAX_WORKER_ID} characters")
        if msg.action == "revoke" and not _is_invitation_id(msg.invitation):
            raise ProtocolError("schema", "control.invitation must be 16 hex digits to revoke")
    elif isinstance(msg, CreditRequest):
        if msg.worker is not None and not 1 <= len(msg.worker) <= MAX_WORKER_ID:
            raise ProtocolError("schema", f"credit_request.worker: 1 to {MAX_WORKER_ID} "
                                          "characters")
    elif isinstance(msg, Credit):
        if set(msg.row) - Credit.FIELDS or any(v < 0 for v in msg.row.values()):
            raise ProtocolError("schema", "credit.row: only the credit fields, none negative")
        non_negative("identities")
        if len(msg.worker) > MAX_NAME or len(msg.reason) > MAX_NAME:
            raise ProtocolError("schema", f"credit.worker and reason: at most {MAX_NAME}")
    elif isinstance(msg, Invite):
        if not 1 <= msg.uses <= 1_000_000 or not 0 < msg.expires_s <= 10 * 365 * 86400:
            raise ProtocolError("schema", "invite.uses 1 to 1e6, invite.expires_s up to 10 years")
        if len(msg.address) > MAX_NAME or len(msg.name) > 64:
            raise ProtocolError("schema", f"invite.address over {MAX_NAME} or name over 64")
    elif isinstance(msg, Invited):
        if len(msg.token) > 1024 or len(msg.reason) > MAX_NAME or len(msg.invitation) > 16:
            raise ProtocolError("schema", "invited: token over 1024, reason over 256 or "
                                          "invitation over 16 characters")
    elif isinstance(msg, Enrol):
        if not _is_invitation_id(msg.invitation):
            raise ProtocolError("schema", "enrol.invitation must be 16 hex digits")
        if not (len(msg.secret) == 43 and all(c.isascii() and (c.isalnum() or c in "-_")
                                              for c in msg.secret)):
            raise ProtocolError("schema", "enrol.secret must be 43 base64url characters")
    elif isinstance(msg, Enrolled):
        if len(msg.name) > MAX_WORKER_ID or len(msg.reason) > MAX_NAME:
            raise ProtocolError("schema", f"enrolled.name over {MAX_WORKER_ID} or reason over "
                                          f"{MAX_NAME} characters")


def check_eval_sums(sums: dict) -> None:
    """ProtocolError unless `sums` names at most MAX_EVAL_METRICS metrics by short printable
    names, each [sum, count] of finite numbers with count >= 0."""
    if not 0 < len(sums) <= MAX_EVAL_METRICS:
        raise ProtocolError("schema", f"eval_result.sums: 1 to {MAX_EVAL_METRICS} metrics")
    for name, pair in sums.items():
        if not (0 < len(name) <= MAX_METRIC_NAME and name.isprintable()):
            raise ProtocolError("schema", f"eval_result.sums: a metric name is 1 to "
                                          f"{MAX_METRIC_NAME} printable characters")
        if (len(pair) != 2 or not all(math.isfinite(v) for v in pair) or pair[1] < 0
                or max(abs(v) for v in pair) > 1e300):
            raise ProtocolError("schema", "eval_result.sums: each metric is [sum, count], finite, "
                                          "count >= 0")


def _is_invitation_id(text: Optional[str]) -> bool:
    return text is not None and len(text) == 16 and all(c in "0123456789abcdef" for c in text)
