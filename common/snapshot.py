"""A model snapshot as a blob: the model at one version, named by the sha256 of its bytes.

A large model goes to workers by name (task.snapshot) instead of in every task's frames: a
worker fetches it once per version through its blob cache, from mirrors first, and checks it by
its hash like any blob (docs/protocol.md, "Model snapshots").

Layout, little-endian throughout:

    MAGIC (8 bytes) | header length (uint32) | header (canonical JSON, padded with spaces)
    | the parts' bytes, each at its header offset

The header names each part: `{"format": FORMAT, "version": V, "parts": [{"name", "dtype",
"numel", "offset"}, ...]}`. "params" (the flat parameter vector, the model's dtype) is always
there; "buffers" (persistent buffers as float64, FlatModel's order) when the model has any. A
reader ignores parts it does not know, so a later part (optimizer moments, say) is one more entry.
The header area is padded to HEADER_ALIGN bytes, so every snapshot of one model has one size.

Pure, no torch: parts come and go as `protocol.Blob`s (one frame each), the form the wire's
checks (`common.tensors.blob_chunks`, `buffer_vector`) already take.
"""

from __future__ import annotations

import json
import struct
from typing import Iterator, Optional, Sequence

from .blobs import BlobError
from .protocol import DTYPE_SIZES, Blob

FORMAT = "idlegrad-snapshot/1"
MAGIC = b"IGSNAP1\n"
HEADER_ALIGN = 4096  # the header area: one page, so parts start page-aligned
PART_ALIGN = 64
MAX_HEADER_BYTES = 64 << 10  # a header from a mirror is untrusted: bounded before it is parsed
MAX_PARTS = 64
MAX_PART_NAME = 64


def _aligned(n: int, to: int) -> int:
    return -(-n // to) * to


def layout(parts: Sequence[tuple[str, Blob]], version: int) -> tuple[bytes, list[int], int]:
    """(header area bytes, each part's offset, total size) for `parts` (name, one-frame blob)."""
    offsets, entries = [], []
    # the header's own size decides where the parts begin: the page it fits in
    start = HEADER_ALIGN
    while True:
        position = start
        offsets.clear()
        entries.clear()
        for name, blob in parts:
            offsets.append(position)
            entries.append({"name": name, "dtype": blob.dtype, "numel": blob.numel,
                            "offset": position})
            position = _aligned(position + blob.nbytes, PART_ALIGN)
        doc = json.dumps({"format": FORMAT, "version": version, "parts": entries},
                         sort_keys=True, separators=(",", ":")).encode("ascii")
        need = len(MAGIC) + 4 + len(doc)
        if need <= start:
            break
        start = _aligned(need, HEADER_ALIGN)
    if len(doc) > MAX_HEADER_BYTES:
        raise BlobError(f"a snapshot header of {len(doc)} bytes (at most {MAX_HEADER_BYTES})")
    header = MAGIC + struct.pack("<I", len(doc)) + doc
    header += b" " * (start - len(header))
    end = offsets[-1] + parts[-1][1].nbytes if parts else start
    return header, offsets, end


def chunks(parts: Sequence[tuple[str, Blob]], version: int) -> Iterator[memoryview]:
    """The snapshot's bytes in order (header, padding, each part's frame): what to hash and
    write, without joining them in memory."""
    header, offsets, _ = layout(parts, version)
    yield memoryview(header)
    position = len(header)
    for (_, blob), offset in zip(parts, offsets):
        if offset > position:
            yield memoryview(bytes(offset - position))
        for frame in blob.frames:
            yield memoryview(frame).cast("B")
        position = offset + blob.nbytes


def parse(data: memoryview) -> tuple[int, dict[str, Blob]]:
    """(version, {name: Blob viewing `data`}) of a snapshot's bytes; BlobError when they are not
    one (bad magic, a header too long or malformed, a part outside the bytes or over another)."""
    data = memoryview(data).cast("B")
    if data.nbytes < len(MAGIC) + 4 or bytes(data[:len(MAGIC)]) != MAGIC:
        raise BlobError("not a model snapshot (bad magic)")
    (length,) = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])
    start = len(MAGIC) + 4
    if length > MAX_HEADER_BYTES or start + length > data.nbytes:
        raise BlobError(f"a snapshot header of {length} bytes in {data.nbytes}")
    try:
        doc = json.loads(bytes(data[start:start + length]).decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BlobError(f"a snapshot header that is not JSON: {exc}"[:200]) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BlobError(f"a snapshot of another format (expected {FORMAT})")
    version, entries = doc.get("version"), doc.get("parts")
    if type(version) is not int or version < 0:
        raise BlobError("a snapshot without a version")
    if not isinstance(entries, list) or len(entries) > MAX_PARTS:
        raise BlobError(f"a snapshot's parts: a list of at most {MAX_PARTS}")
    out: dict[str, Blob] = {}
    spans = []
    for entry in entries:
        if not isinstance(entry, dict):
            raise BlobError("a snapshot part that is not a map")
        name, dtype = entry.get("name"), entry.get("dtype")
        numel, offset = entry.get("numel"), entry.get("offset")
        if not (isinstance(name, str) and 0 < len(name) <= MAX_PART_NAME) or name in out:
            raise BlobError("a snapshot part with a bad or repeated name")
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise BlobError(f"snapshot part {name[:20]!r}: dtype {str(dtype)[:20]!r} not allowed")
        if type(numel) is not int or type(offset) is not int or numel < 0 or offset < start + length:
            raise BlobError(f"snapshot part {name[:20]!r}: bad numel or offset")
        end = offset + numel * DTYPE_SIZES[dtype]
        if end > data.nbytes:
            raise BlobError(f"snapshot part {name[:20]!r} ends past the snapshot's bytes")
        spans.append((offset, end))
        out[name] = Blob(dtype, numel, (data[offset:end],))
    spans.sort()
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        raise BlobError("snapshot parts overlap")
    return version, out


def parts_of(params: Blob, buffers: Optional[Blob]) -> list[tuple[str, Blob]]:
    """The parts of a model's snapshot: its parameters, and its buffers when it has any."""
    return [("params", params)] + ([("buffers", buffers)] if buffers is not None else [])
