"""Flat torch tensors <-> wire blobs, zero-copy where the buffer allows.

Only flat (1-D) tensors travel: models and gradients are sent as one flat parameter vector, whose
layout both sides derive from the job (see `common.job.FlatModel`).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .errors import ProtocolError
from .protocol import DTYPE_SIZES, MAX_FRAME_BYTES, Blob

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def to_blob(tensor: torch.Tensor, frame_bytes: int = MAX_FRAME_BYTES) -> Blob:
    """A flat CPU tensor as a blob whose frames view its memory (no copy).

    The caller must keep the tensor unchanged until the frames are sent.
    """
    if tensor.dim() != 1:
        raise ValueError("only flat tensors travel")
    if tensor.dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {tensor.dtype} cannot travel")
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    raw = memoryview(tensor.view(torch.uint8).numpy())
    # Frames of near-equal size: no small last frame, which ZeroMQ would copy and whose (done)
    # tracker would then vouch for the big zero-copy frames before it (see BufferPool).
    item = tensor.element_size()
    count = max(1, -(-raw.nbytes // frame_bytes))
    size = max(item, min(-(-raw.nbytes // (count * item)) * item, frame_bytes // item * item))
    frames = tuple(raw[i:i + size] for i in range(0, raw.nbytes, size))
    return Blob(DTYPE_NAMES[tensor.dtype], tensor.numel(), frames)


def from_blob(blob: Blob, expect_numel: int | None = None,
              expect_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A blob as a flat tensor: a view of the frame when there is one frame, else one copy."""
    if expect_numel is not None and blob.numel != expect_numel:
        raise ProtocolError("tensor", f"{blob.numel} elements, expected {expect_numel}")
    dtype = TORCH_DTYPES[blob.dtype]
    if expect_dtype is not None and dtype != expect_dtype:
        raise ProtocolError("tensor", f"dtype {blob.dtype}, expected {DTYPE_NAMES[expect_dtype]}")
    if blob.numel == 0:
        return torch.empty(0, dtype=dtype)
    if len(blob.frames) == 1:
        return torch.frombuffer(blob.frames[0], dtype=dtype)
    out = torch.empty(blob.numel, dtype=dtype)
    raw = out.view(torch.uint8)
    offset = 0
    for frame in blob.frames:
        n = memoryview(frame).nbytes
        if n == 0:
            continue  # decode() accepts empty frames; torch.frombuffer refuses them
        raw[offset:offset + n] = torch.frombuffer(frame, dtype=torch.uint8)
        offset += n
    return out


def blob_chunks(blob: Blob, expect_numel: int | None = None,
                expect_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """A blob as flat tensor views of its frames, in order: no copy, however many frames.

    A frame that does not hold whole elements (only a hostile or broken peer cuts one so) costs
    one copy of the blob instead."""
    if expect_numel is not None and blob.numel != expect_numel:
        raise ProtocolError("tensor", f"{blob.numel} elements, expected {expect_numel}")
    dtype = TORCH_DTYPES[blob.dtype]
    if expect_dtype is not None and dtype != expect_dtype:
        raise ProtocolError("tensor", f"dtype {blob.dtype}, expected {DTYPE_NAMES[expect_dtype]}")
    size = DTYPE_SIZES[blob.dtype]
    views = [memoryview(getattr(f, "buffer", f)) for f in blob.frames]
    if any(v.nbytes % size for v in views):
        return [from_blob(blob)]
    return [torch.frombuffer(v, dtype=dtype) for v in views if v.nbytes]


EXACT_INTEGER = 2.0 ** 53  # float64 holds every integer up to this exactly


def buffer_vector(blob: Blob, numel: int, counters: torch.Tensor) -> torch.Tensor:
    """A buffer frame (a model's persistent buffers, common/job.py's FlatModel) as a float64
    vector, checked: float64, `numel` values, all finite, and those where `counters` is true
    whole numbers of at most 2**53 in size. ProtocolError otherwise."""
    vector = from_blob(blob, numel, torch.float64)
    if not bool(torch.isfinite(vector).all()):
        raise ProtocolError("tensor", "buffers hold non-finite values")
    if counters.any():
        counted = vector[counters]
        if not (bool((counted == counted.round()).all())
                and float(counted.abs().max()) <= EXACT_INTEGER):
            raise ProtocolError("tensor", "buffer counters must be whole numbers under 2**53")
    return vector


def finite_norm(tensors: torch.Tensor | Sequence[torch.Tensor]) -> float:
    """The L2 norm, or inf/nan when a value is not finite: one BLAS pass, no temporary.

    Squares are summed in the tensors' own precision, so a chunk whose sum of squares overflows
    (values beyond ~1e19 in float32) also reads as non-finite: no usable gradient is that large."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    total = sum(sum_of_squares(t) for t in tensors)
    return math.sqrt(total) if math.isfinite(total) else total


def sum_of_squares(tensor: torch.Tensor) -> float:
    """`finite_norm`'s square for one tensor (inf or nan when a value is not finite)."""
    if not tensor.numel():
        return 0.0
    tensor = tensor.detach()
    if tensor.dtype not in (torch.float32, torch.float64):
        tensor = tensor.float()  # half types: no BLAS dot on every device
    return float(torch.dot(tensor, tensor))


def distance(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor],
             block: int = 1 << 18) -> float:
    """The L2 distance between two flat tensors, each given as its chunks (the frames it arrived
    in, cut anywhere): one pass over both, a block at a time, so that no copy of either is made
    (only a block-sized difference, which stays in cache). Blocks are summed in float64.

    Raises ValueError when the two do not hold the same number of elements."""
    total = 0.0
    ia = ib = 0  # the chunk of each being read
    oa = ob = 0  # the offset in it
    while True:
        while ia < len(a) and oa >= a[ia].numel():
            ia, oa = ia + 1, 0
        while ib < len(b) and ob >= b[ib].numel():
            ib, ob = ib + 1, 0
        if ia == len(a) or ib == len(b):
            break
        n = min(a[ia].numel() - oa, b[ib].numel() - ob, block)
        diff = a[ia].detach()[oa:oa + n] - b[ib].detach()[ob:ob + n].to(a[ia].device)
        total += sum_of_squares(diff)
        oa, ob = oa + n, ob + n
    if ia != len(a) or ib != len(b):
        raise ValueError("tensors of different sizes")
    return math.sqrt(total) if math.isfinite(total) else total


class BufferPool:
    """Flat buffers of one size and dtype, reused once ZeroMQ is done sending them.

    A fresh buffer of hundreds of MB costs more than the copy into it (the kernel maps and zeroes
    every page); a buffer sent zero-copy may be reused only when its send is complete, which its
    MessageTracker says. Pure bookkeeping: the caller sends and hands the trackers in."""

    def __init__(self, numel: int, dtype: torch.dtype, keep: int = 4):
        self.numel, self.dtype, self.keep = numel, dtype, keep
        self._free: list[tuple[torch.Tensor, list]] = []
        self.allocated = 0

    def take(self) -> torch.Tensor:
        for i, (buffer, trackers) in enumerate(self._free):
            if all(t.done for t in trackers):
                del self._free[i]
                return buffer
        self.allocated += 1
        return torch.empty(self.numel, dtype=self.dtype)

    def give(self, buffer: torch.Tensor, trackers: Sequence = ()) -> None:
        """Return `buffer`; it is reused once every tracker (of sends of it) is done."""
        if buffer.numel() == self.numel and buffer.dtype == self.dtype and buffer.is_contiguous():
            self._free.append((buffer, [t for t in trackers if t is not None]))
            del self._free[:-self.keep]


assert set(TORCH_DTYPES) == set(DTYPE_SIZES)
