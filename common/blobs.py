"""Content-addressed data: blobs named by their sha256, data sets cut into shards plus a manifest.

A *blob* is an immutable run of bytes whose name is the hex sha256 of those bytes: whoever holds
the name can check the bytes, so a blob may come from any mirror. A data set is packed into
*shards* (blobs) and one *manifest* (a blob too: canonical JSON, its own sha256 is the data set's
name, and it goes into a job's fingerprint so every side trains on the same bytes).

Every sample of a packed data set is a fixed tuple of *fields*, each of one dtype and one shape,
stored as raw little-endian arrays: no pickle, nothing to execute. A shard of n samples holds, for
each field in manifest order, that field's n values back to back (field-major), so a field of a
shard is one contiguous array and a shard can be memory-mapped and sliced without parsing.

A blob folder (`BlobFolder`) lays blobs out as ROOT/blobs/<sha[:2]>/<sha>: the layout of a pack's
output, of a published mirror (served by any static HTTP server) and of a worker's cache.

No torch here: the reader, common/sharded.py, is where torch comes in.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from . import atomic
from .errors import ConfigError, IdlegradError

MANIFEST_FORMAT = "idlegrad-shards/1"
MANIFEST_FILE = "manifest.json"  # a pack's copy of its manifest, beside its blobs/ folder
DEFAULT_SHARD_MB = 64.0
_SHA256 = re.compile(r"[0-9a-f]{64}")
# dtypes a manifest may name: fixed-size numbers only (an object dtype would mean pickle)
DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64")
# bound what a manifest from the network can ask us to allocate or walk
MAX_MANIFEST_BYTES = 64 << 20
MAX_FIELDS = 64
MAX_DIMS = 8


class BlobError(IdlegradError):
    """A blob that is missing, corrupt, or a manifest that does not hold together."""


class DataError(ConfigError):
    """Data the person packing gave that cannot be packed (one line for the CLI)."""


def check_sha256(name: Any) -> str:
    """`name` if it is a blob name (64 lowercase hex digits), else BlobError: a name from the
    network or a manifest becomes part of a path only once it is known to be nothing but hex."""
    if not isinstance(name, str) or not _SHA256.fullmatch(name):
        raise BlobError(f"not a blob name (64 lowercase hex digits): {str(name)[:80]!r}")
    return name


def blob_relpath(sha256: str) -> str:
    sha256 = check_sha256(sha256)
    return os.path.join("blobs", sha256[:2], sha256)


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk)
            if not block:
                return digest.hexdigest()
            digest.update(block)


# manifests ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    name: str
    dtype: str  # one of DTYPES, stored little-endian
    shape: tuple[int, ...]  # of one sample

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype).newbyteorder("<")

    @property
    def sample_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.numpy_dtype.itemsize


@dataclass(frozen=True)
class Shard:
    sha256: str
    size: int
    samples: int


@dataclass(frozen=True)
class Manifest:
    fields: tuple[Field, ...]
    shards: tuple[Shard, ...]
    source: str  # "corpus", "arrays" or "job": how it was packed, for people
    decode: dict  # how a sample is read: {"sample": "tensor"|"tuple"}, plus the source's details

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def sample_bytes(self) -> int:
        return sum(f.sample_bytes for f in self.fields)

    def to_json(self) -> dict:
        return {
            "format": MANIFEST_FORMAT, "source": self.source, "decode": self.decode,
            "samples": self.samples,
            "samples_per_shard": self.shards[0].samples if self.shards else 0,
            "fields": [{"name": f.name, "dtype": f.dtype, "shape": list(f.shape)}
                       for f in self.fields],
            "shards": [{"sha256": s.sha256, "size": s.size, "samples": s.samples}
                       for s in self.shards],
        }

    def to_bytes(self) -> bytes:
        """The canonical bytes: the manifest's name is their sha256."""
        return (json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")) + "\n").encode()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @classmethod
    def from_bytes(cls, data: bytes, expected_sha256: Optional[str] = None) -> "Manifest":
        """Parse and check a manifest; with `expected_sha256`, the bytes must hash to it."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise BlobError(f"a manifest of {len(data)} bytes is over the {MAX_MANIFEST_BYTES} limit")
        if expected_sha256 is not None:
            actual = hashlib.sha256(data).hexdigest()
            if actual != check_sha256(expected_sha256):
                raise BlobError(f"manifest {expected_sha256[:12]}: its bytes hash to {actual[:12]}")
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BlobError(f"a manifest is not JSON: {exc}") from None
        return cls._from_json(doc)

    @classmethod
    def _from_json(cls, doc: Any) -> "Manifest":
        def need(cond: bool, what: str):
            if not cond:
                raise BlobError(f"manifest: {what}")

        need(isinstance(doc, dict), "must be a JSON object")
        need(doc.get("format") == MANIFEST_FORMAT, f"format must be {MANIFEST_FORMAT!r}, "
                                                   f"got {str(doc.get('format'))[:40]!r}")
        raw_fields, raw_shards = doc.get("fields"), doc.get("shards")
        need(isinstance(raw_fields, list) and 0 < len(raw_fields) <= MAX_FIELDS,
             f"fields must be a list of 1 to {MAX_FIELDS}")
        need(isinstance(raw_shards, list), "shards must be a list")
        fields = []
        for f in raw_fields:
            need(isinstance(f, dict) and isinstance(f.get("name"), str)
                 and f.get("dtype") in DTYPES and isinstance(f.get("shape"), list)
                 and len(f["shape"]) <= MAX_DIMS
                 and all(type(d) is int and 0 <= d < 2**31 for d in f["shape"]),
                 f"a field must be {{name, dtype in {DTYPES}, shape of ints}}")
            fields.append(Field(f["name"], f["dtype"], tuple(f["shape"])))
        shards = []
        for s in raw_shards:
            need(isinstance(s, dict) and type(s.get("size")) is int and type(s.get("samples")) is int
                 and s["size"] >= 0 and s["samples"] > 0, "a shard must be {sha256, size, samples}")
            shards.append(Shard(check_sha256(s.get("sha256")), s["size"], s["samples"]))
        manifest = cls(tuple(fields), tuple(shards), str(doc.get("source", "")),
                       doc.get("decode") if isinstance(doc.get("decode"), dict) else {})
        for s in manifest.shards:
            need(s.size == s.samples * manifest.sample_bytes,
                 f"shard {s.sha256[:12]}: {s.size} bytes is not {s.samples} samples of "
                 f"{manifest.sample_bytes}")
        return manifest


# a folder of blobs -------------------------------------------------------------------------------


class BlobFolder:
    """Blobs on disk at ROOT/blobs/<sha[:2]>/<sha>; `path_of` is what ShardedDataset asks of any
    store (the worker's cache answers it too, fetching first)."""

    def __init__(self, root: str):
        self.root = root

    def path_of(self, sha256: str, size: Optional[int] = None) -> str:
        path = os.path.join(self.root, blob_relpath(sha256))
        if not os.path.isfile(path):
            raise BlobError(f"blob {sha256[:12]} is not in {self.root}")
        if size is not None and os.path.getsize(path) != size:
            raise BlobError(f"blob {sha256[:12]} in {self.root} is {os.path.getsize(path)} bytes, "
                            f"not {size}")
        return path

    def has(self, sha256: str) -> bool:
        return os.path.isfile(os.path.join(self.root, blob_relpath(sha256)))

    def put_file(self, temp_path: str, sha256: str) -> str:
        """Move a finished temp file (in the same file system) into place: atomic, so a reader
        sees a whole blob or none."""
        dest = os.path.join(self.root, blob_relpath(sha256))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.replace(temp_path, dest)
        return dest

    def put_bytes(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        dest = os.path.join(self.root, blob_relpath(sha))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        atomic.write_bytes(dest, data)
        return sha

    def names(self) -> Iterator[str]:
        base = os.path.join(self.root, "blobs")
        if not os.path.isdir(base):
            return
        for prefix in sorted(os.listdir(base)):
            folder = os.path.join(base, prefix)
            if not os.path.isdir(folder):
                continue
            for name in sorted(os.listdir(folder)):
                if _SHA256.fullmatch(name) and name[:2] == prefix:
                    yield name


# packing -----------------------------------------------------------------------------------------


class ShardWriter:
    """Cuts samples, given in batches of per-field arrays, into shards of `samples_per_shard`
    samples written into `folder`; `finish()` writes the manifest and returns it."""

    def __init__(self, folder: BlobFolder, fields: Sequence[Field], samples_per_shard: int):
        self.folder = folder
        self.fields = tuple(fields)
        self.samples_per_shard = samples_per_shard
        self.shards: list[Shard] = []
        self._pending: list[list[np.ndarray]] = [[] for _ in fields]
        self._pending_count = 0
        os.makedirs(folder.root, exist_ok=True)

    @property
    def samples_written(self) -> int:
        return sum(s.samples for s in self.shards) + self._pending_count

    def add(self, columns: Sequence[np.ndarray]) -> None:
        """Append n samples: columns[k] holds field k's values, shape (n, *field.shape)."""
        n = len(columns[0])
        for column, field in zip(columns, self.fields):
            if len(column) != n or tuple(column.shape[1:]) != field.shape:
                raise DataError(f"field {field.name!r}: a batch of shape {tuple(column.shape)} "
                                f"is not (n, *{field.shape})")
        start = 0
        while start < n:
            take = min(n - start, self.samples_per_shard - self._pending_count)
            for k, column in enumerate(columns):
                self._pending[k].append(column[start:start + take])
            self._pending_count += take
            start += take
            if self._pending_count == self.samples_per_shard:
                self._flush()

    def _flush(self) -> None:
        if not self._pending_count:
            return
        digest = hashlib.sha256()
        fd, temp = tempfile.mkstemp(dir=self.folder.root, prefix=".shard-")
        size = 0
        with os.fdopen(fd, "wb") as fh:
            for field, parts in zip(self.fields, self._pending):
                for part in parts:
                    data = np.ascontiguousarray(part, dtype=field.numpy_dtype).tobytes()
                    digest.update(data)
                    fh.write(data)
                    size += len(data)
        sha = digest.hexdigest()
        self.folder.put_file(temp, sha)
        self.shards.append(Shard(sha, size, self._pending_count))
        self._pending = [[] for _ in self.fields]
        self._pending_count = 0

    def finish(self, source: str, decode: dict) -> Manifest:
        self._flush()
        if not self.shards:
            raise DataError("no samples to pack")
        manifest = Manifest(self.fields, tuple(self.shards), source, decode)
        data = manifest.to_bytes()
        self.folder.put_bytes(data)  # the manifest is a blob like the shards
        atomic.write_bytes(os.path.join(self.folder.root, MANIFEST_FILE), data)
        return manifest


def samples_per_shard(sample_bytes: int, shard_mb: float) -> int:
    return max(1, int(shard_mb * (1 << 20)) // max(1, sample_bytes))


def _field_for(name: str, array: np.ndarray, where: str) -> Field:
    dtype = array.dtype.newbyteorder("=").name if array.dtype.byteorder not in "=|<" else array.dtype.name
    if dtype not in DTYPES:
        raise DataError(f"{where}: dtype {array.dtype} cannot be packed; use one of {', '.join(DTYPES)}")
    return Field(name, dtype, tuple(int(d) for d in array.shape[1:]))


def pack_corpus(source: str, out: str, window: int, shard_mb: float = DEFAULT_SHARD_MB,
                include: Optional[Callable[[str], bool]] = None,
                held_out: Optional[Callable[[str], bool]] = None) -> Manifest:
    """A folder of text files, read in sorted relative-path order and concatenated, cut into
    windows of `window` bytes: each sample is one field `tokens` (uint8, byte-level tokens). The
    tail shorter than a window is dropped. `include(relative_path)` picks files (default: all).

    `held_out(relative_path)` picks files for a held-out set: they come last, after the others'
    tail is dropped (no window spans both), and the manifest's decode names how many samples
    they are (`held_out_samples`), so one pack holds a training and a test set."""
    if window < 1:
        raise DataError(f"--window must be at least 1, got {window}")
    if not os.path.isdir(source):
        raise DataError(f"{source}: not a folder of text files")
    files = []
    for base, dirs, names in os.walk(source):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            path = os.path.join(base, name)
            if not name.startswith(".") and os.path.isfile(path) and not os.path.islink(path):
                rel = os.path.relpath(path, source).replace(os.sep, "/")
                if include is None or include(rel):
                    files.append(rel)
    files.sort(key=lambda rel: (held_out is not None and held_out(rel), rel))
    if not files:
        raise DataError(f"{source}: no files in the folder")
    field = Field("tokens", "uint8", (window,))
    writer = ShardWriter(BlobFolder(out), [field], samples_per_shard(field.sample_bytes, shard_mb))
    carry = b""
    dropped = 0
    boundary = None  # samples before the first held-out file
    for rel in files:
        if boundary is None and held_out is not None and held_out(rel):
            dropped += len(carry)
            carry = b""
            boundary = writer.samples_written
        with open(os.path.join(source, rel), "rb") as fh:
            while True:
                block = fh.read(1 << 22)
                if not block:
                    break
                carry += block
                whole = len(carry) // window * window
                if whole:
                    writer.add([np.frombuffer(carry[:whole], np.uint8).reshape(-1, window)])
                    carry = carry[whole:]
    if writer._pending_count == 0 and not writer.shards:
        raise DataError(f"{source}: fewer than --window {window} bytes in all")
    decode = {"sample": "tensor", "window": window, "files": len(files),
              "dropped_tail_bytes": dropped + len(carry)}
    if held_out is not None:
        if boundary is None or writer.samples_written == boundary:
            raise DataError(f"{source}: no held-out window (too few or too small held-out files)")
        if boundary == 0:
            raise DataError(f"{source}: every file is held out: no training window")
        decode["held_out_samples"] = writer.samples_written - boundary
    return writer.finish("corpus", decode)


def pack_arrays(inputs: np.ndarray, targets: np.ndarray, out: str,
                shard_mb: float = DEFAULT_SHARD_MB, where: str = "arrays") -> Manifest:
    """Two arrays of the same length: each sample is (inputs[i], targets[i])."""
    if inputs.ndim < 1 or targets.ndim < 1 or len(inputs) != len(targets):
        raise DataError(f"{where}: inputs and targets must have the same first dimension, got "
                        f"{inputs.shape} and {targets.shape}")
    if len(inputs) == 0:
        raise DataError(f"{where}: no samples")
    fields = [_field_for("inputs", inputs, where), _field_for("targets", targets, where)]
    per = samples_per_shard(sum(f.sample_bytes for f in fields), shard_mb)
    writer = ShardWriter(BlobFolder(out), fields, per)
    for start in range(0, len(inputs), per):
        writer.add([np.asarray(inputs[start:start + per]), np.asarray(targets[start:start + per])])
    return writer.finish("arrays", {"sample": "tuple"})


def load_numpy_pair(source: str, targets: Optional[str]) -> tuple[np.ndarray, np.ndarray]:
    """`.npz` with `inputs` and `targets`, or an inputs `.npy` and a targets `.npy`; never
    pickle (allow_pickle=False: an object array is refused, not run)."""
    try:
        if source.endswith(".npz"):
            if targets is not None:
                raise DataError("--targets goes with an inputs .npy, not a .npz")
            with np.load(source, allow_pickle=False) as archive:
                missing = {"inputs", "targets"} - set(archive.files)
                if missing:
                    raise DataError(f"{source}: needs arrays named inputs and targets; it has "
                                    f"{', '.join(archive.files) or 'none'}")
                return archive["inputs"], archive["targets"]
        if targets is None:
            raise DataError(f"{source}: an inputs .npy needs --targets FILE.npy")
        return (np.load(source, mmap_mode="r", allow_pickle=False),
                np.load(targets, mmap_mode="r", allow_pickle=False))
    except DataError:
        raise
    except FileNotFoundError as exc:
        raise DataError(f"{exc.filename}: no such file") from None
    except (ValueError, OSError) as exc:
        raise DataError(f"{source}: cannot read numpy arrays: {exc}") from None


def pack_dataset(dataset: Any, out: str, shard_mb: float = DEFAULT_SHARD_MB,
                 where: str = "the data set") -> Manifest:
    """A map-style data set whose samples are a tensor or number, or a tuple/list of them, all
    of one dtype and shape per position: written as those raw arrays."""
    import torch

    n = len(dataset)
    if n == 0:
        raise DataError(f"{where} is empty")

    def as_columns(sample) -> tuple[list[np.ndarray], bool]:
        single = not isinstance(sample, (tuple, list))
        parts = [sample] if single else list(sample)
        out_parts = []
        for part in parts:
            if isinstance(part, torch.Tensor):
                out_parts.append(part.detach().cpu().numpy())
            elif isinstance(part, (int, float, bool, np.ndarray, np.generic)):
                out_parts.append(np.asarray(part))
            else:
                raise DataError(f"{where}: a sample holds a {type(part).__name__}; only tensors, "
                                "arrays and numbers can be packed")
        return out_parts, single

    first, single = as_columns(dataset[0])
    names = ["sample"] if single else (["inputs", "targets"] if len(first) == 2
                                       else [f"field{k}" for k in range(len(first))])
    fields = [_field_for(name, part[None], where) for name, part in zip(names, first)]
    per = samples_per_shard(sum(f.sample_bytes for f in fields), shard_mb)
    writer = ShardWriter(BlobFolder(out), fields, per)
    for start in range(0, n, per):
        batch = []
        for i in range(start, min(n, start + per)):
            parts, _ = as_columns(dataset[i])
            if len(parts) != len(fields) or any(
                    p.shape != f.shape or np.dtype(p.dtype).name != f.dtype
                    for p, f in zip(parts, fields)):
                raise DataError(f"{where}: sample {i} differs in fields, dtype or shape from "
                                "sample 0; every sample must have the same")
            batch.append(parts)
        writer.add([np.stack([b[k] for b in batch]) for k in range(len(fields))])
    return writer.finish("job", {"sample": "tensor" if single else "tuple"})


# publishing --------------------------------------------------------------------------------------


def publish(pack_dir: str, mirror: str) -> tuple[Manifest, int, int]:
    """Copy a pack's manifest and shards into a mirror's blob folder, each checked against its
    name first (a damaged pack is refused, not published). Returns (manifest, blobs copied,
    blobs already there). Blobs land atomically; a mirror may hold many data sets."""
    manifest_path = os.path.join(pack_dir, MANIFEST_FILE)
    try:
        with open(manifest_path, "rb") as fh:
            data = fh.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise DataError(f"{pack_dir}: no {MANIFEST_FILE} (is it the --out of idlegrad data pack?)") from None
    except OSError as exc:
        raise DataError(f"{manifest_path}: cannot read: {exc.strerror or exc}") from None
    try:
        manifest = Manifest.from_bytes(data)
    except BlobError as exc:
        raise DataError(f"{manifest_path}: {exc}") from None
    source, target = BlobFolder(pack_dir), BlobFolder(mirror)
    os.makedirs(mirror, exist_ok=True)
    copied = present = 0
    for shard in manifest.shards:
        try:
            path = source.path_of(shard.sha256, shard.size)
        except BlobError as exc:
            raise DataError(str(exc)) from None
        if sha256_file(path) != shard.sha256:
            raise DataError(f"{path}: its bytes do not hash to its name: the pack is damaged")
        if target.has(shard.sha256) and sha256_file(target.path_of(shard.sha256)) == shard.sha256:
            present += 1
            continue
        dest = os.path.join(mirror, blob_relpath(shard.sha256))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(path, "rb") as src, atomic.writing(dest, prefix=".incoming-") as out:
            while block := src.read(1 << 22):
                out.write(block)
        copied += 1
    if target.has(manifest.sha256):
        present += 1
    else:
        target.put_bytes(manifest.to_bytes())
        copied += 1
    return manifest, copied, present


# reading -----------------------------------------------------------------------------------------


def load_manifest(path: str) -> Manifest:
    try:
        with open(path, "rb") as fh:
            return Manifest.from_bytes(fh.read(MAX_MANIFEST_BYTES + 1))
    except FileNotFoundError:
        raise BlobError(f"{path}: no such manifest") from None


def dataset_fingerprint(dataset: Any) -> Optional[str]:
    """The manifest hash a data set declares (ShardedDataset's `manifest_sha256`), for a job's
    fingerprint; None for a data set that is not content-addressed."""
    value = getattr(dataset, "manifest_sha256", None)
    return value if isinstance(value, str) and _SHA256.fullmatch(value) else None
