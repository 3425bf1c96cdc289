"""`ShardedDataset`: a map-style torch data set over a packed manifest (common/blobs.py).

A job declares its data by manifest: `build_datasets` returns ShardedDataset(...), and the
manifest's hash goes into the job's fingerprint (common/job.py), so every side trains on the same
bytes.
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from .blobs import (MAX_MANIFEST_BYTES, BlobError, BlobFolder, Manifest, check_sha256,
                    load_manifest)


class BlobStore(Protocol):
    """What the reader needs of a store: a local path of a whole, checked blob. A BlobFolder
    answers from disk; the worker's cache (worker/cache.py) fetches first."""

    def path_of(self, sha256: str, size: Optional[int] = None) -> str: ...


class ShardedDataset(Dataset):
    """`ShardedDataset("pack/manifest.json")` (its blobs beside it) or
    `ShardedDataset(manifest, store)`. A shard is asked of the store, and memory-mapped, only when
    a sample in it is first read; `dataset[i]` is a tensor (one field, decode "tensor") or a tuple
    of tensors, copied out of the map (so writable, and the map may go)."""

    def __init__(self, manifest: "Manifest | str", store: Optional[BlobStore] = None,
                 first: int = 0, count: Optional[int] = None):
        if isinstance(manifest, str):
            path = manifest
            manifest = load_manifest(path)
            store = store or BlobFolder(os.path.dirname(os.path.abspath(path)))
        if store is None:
            raise BlobError("ShardedDataset(manifest, store): a Manifest needs a store")
        self.manifest = manifest
        self.store = store
        self.manifest_sha256 = manifest.sha256  # what the job's fingerprint folds in
        self._starts = np.cumsum([0] + [s.samples for s in manifest.shards])
        total = int(self._starts[-1])
        count = total - first if count is None else count
        if not (0 <= first and 0 <= count and first + count <= total):
            raise BlobError(f"samples {first} to {first + count} of a pack of {total}")
        self.first, self.count = first, count
        self._maps: dict[int, list[np.ndarray]] = {}
        # shard -> its map, and its file's stat when the store handed it out, checked
        self._marks: dict[int, tuple[np.memmap, str, Optional[tuple]]] = {}
        self._tuple = manifest.decode.get("sample") != "tensor" or len(manifest.fields) != 1

    @classmethod
    def from_store(cls, manifest_sha256: str, store: BlobStore) -> "ShardedDataset":
        """The data set a manifest hash names, its manifest too fetched from `store` (the
        worker's cache) and checked against that hash: how a job declares its data by name."""
        with open(store.path_of(check_sha256(manifest_sha256)), "rb") as fh:
            data = fh.read(MAX_MANIFEST_BYTES + 1)
        return cls(Manifest.from_bytes(data, manifest_sha256), store)

    def view(self, first: int, count: int) -> "ShardedDataset":
        """Samples first..first+count-1 of this one (e.g. a held-out tail), sharing its maps."""
        if not (0 <= first and 0 <= count and first + count <= self.count):
            raise BlobError(f"samples {first} to {first + count} of a data set of {self.count}")
        other = ShardedDataset(self.manifest, self.store, self.first + first, count)
        other._maps, other._marks = self._maps, self._marks
        return other

    def __len__(self) -> int:
        return self.count

    def shard_sizes(self) -> tuple[int, ...]:
        """Samples of this data set in each of the manifest's shards, numbered as the manifest
        numbers them (a view's shards past its end left out): the shard-aware order's input."""
        end = self.first + self.count
        sizes = [max(0, min(end, int(b)) - max(self.first, int(a)))
                 for a, b in zip(self._starts[:-1], self._starts[1:])]
        while sizes and sizes[-1] == 0:
            sizes.pop()
        return tuple(sizes)

    def shard_of(self, index: int) -> int:
        """The manifest's shard holding sample `index` of this data set."""
        return int(np.searchsorted(self._starts, self.first + index, side="right")) - 1

    def shards_of(self, indices) -> list[int]:
        """The manifest's shards holding samples `indices` of this data set, each once."""
        found = np.searchsorted(self._starts, self.first + np.asarray(indices, dtype=np.int64),
                                side="right") - 1
        return [int(k) for k in np.unique(found)]

    def opened_shards(self) -> list[int]:
        return sorted(self._maps)

    def _columns(self, k: int) -> list[np.ndarray]:
        columns = self._maps.get(k)
        if columns is None:
            shard = self.manifest.shards[k]
            path = self.store.path_of(shard.sha256, shard.size)
            raw = np.memmap(path, dtype=np.uint8, mode="r")
            if raw.size != shard.size:
                raise BlobError(f"shard {shard.sha256[:12]} is {raw.size} bytes, not {shard.size}")
            columns, offset = [], 0
            for f in self.manifest.fields:
                length = shard.samples * f.sample_bytes
                columns.append(raw[offset:offset + length].view(f.numpy_dtype)
                               .reshape((shard.samples, *f.shape)))
                offset += length
            self._maps[k] = columns
            self._marks[k] = (raw, path, _file_mark(path))
        return columns

    def corrupt_shards(self) -> list[str]:
        """The opened shards whose bytes no longer hash to their names, each dropped (its map
        forgotten, the store told to `discard` it: a cache fetches it again on the next read).
        A map shows what is written into its file after it was made: a shard checked when it
        came can be corrupted under a run, and a gradient computed on it is not to be sent. A
        shard is hashed again only when its file's stat changed (a write, a replacement), so
        this costs a stat per opened shard; what a stat cannot see (the disk's own rot) it
        misses."""
        bad = []
        for k, (raw, path, mark) in list(self._marks.items()):
            now = _file_mark(path)
            if now == mark:
                continue
            shard = self.manifest.shards[k]
            if hashlib.sha256(memoryview(raw)).hexdigest() == shard.sha256:  # what is read
                self._marks[k] = (raw, path, now)
                continue
            bad.append(shard.sha256)
            del self._maps[k], self._marks[k]
            discard = getattr(self.store, "discard", None)
            if discard is not None:
                discard(shard.sha256)
        return bad

    def __getitem__(self, index):
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        k = self.shard_of(index)
        row = self.first + index - int(self._starts[k])
        # np.array copies (and makes native byte order): torch wants writable memory
        values = [torch.from_numpy(np.array(column[row], dtype=column.dtype.newbyteorder("=")))
                  for column in self._columns(k)]
        return tuple(values) if self._tuple else values[0]

    def __getstate__(self):  # a copy in another process maps its own shards
        state = dict(self.__dict__)
        state["_maps"], state["_marks"] = {}, {}
        return state


def _file_mark(path: str) -> Optional[tuple]:
    """What changes with a file's bytes: its inode, size and change times (None: gone)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
