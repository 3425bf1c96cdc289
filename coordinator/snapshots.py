"""Model snapshots as blobs: which models go by name, and the folder of snapshot blobs.

A model over `--snapshot-min-mb` of parameters goes to a worker as the name of a blob instead of
in the task's frames. With local tasks and a mirror the default threshold is lower: a version
lives for a round of H inner steps, long enough for a mirror to have it, and without a mirror the
coordinator sends every byte either way (inline, a mid-sized model costs it less). The coordinator writes the blob of a version the first time a task
names it, into a folder laid out like a mirror's (FOLDER/blobs/<sha[:2]>/<sha>): its own blob
service serves it from there, and so can any web server pointed at the folder (or at a copy the
operator syncs), named to workers by --blob-mirror. Snapshots no open round can name are deleted
after each step; the names written are kept in an index beside them, so a restarted coordinator
deletes its predecessor's and nothing else in a folder it may share with a published pack.

`uses_snapshots` is pure; `SnapshotFolder` is the disk half, called from the server's loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import Callable, Optional

from ..common import atomic, snapshot
from ..common.blobs import BlobFolder, blob_relpath, check_sha256
from ..common.protocol import Blob

log = logging.getLogger("idlegrad.coordinator")

DEFAULT_MIN_MB = 8.0  # a model frame over this costs the coordinator's link more than a fetch
DEFAULT_MIN_MB_LOCAL = 1.0  # local tasks with a mirror: a version lives for a round of H steps
INDEX_FILE = "snapshot-index.json"


def min_mb_for(given: Optional[float], local_tasks: bool, mirrors: bool) -> float:
    """The threshold in effect: the one given, else the default for the kind of task (lower
    for local tasks when a mirror can take the snapshots' bytes off the coordinator)."""
    if given is not None:
        return given
    return DEFAULT_MIN_MB_LOCAL if local_tasks and mirrors else DEFAULT_MIN_MB


def uses_snapshots(param_bytes: int, min_mb: float) -> bool:
    """Whether a model of `param_bytes` goes to workers as a snapshot blob (at or over the
    threshold; 0 sends every model so)."""
    return param_bytes >= min_mb * 2**20


class SnapshotFolder:
    """Snapshot blobs of one run in `root` (a temporary folder of its own when None)."""

    def __init__(self, root: Optional[str] = None):
        self._owned = root is None
        self.root = root or tempfile.mkdtemp(prefix="idlegrad-snapshots-")
        os.makedirs(self.root, exist_ok=True)
        self.folder = BlobFolder(self.root)
        self.names: dict[int, tuple[str, int]] = {}  # version -> (sha256, size)
        self.published = 0
        self.pruned = 0
        self._forget_previous()

    def _index_path(self) -> str:
        return os.path.join(self.root, INDEX_FILE)

    def _forget_previous(self) -> None:
        """A previous run's snapshots (named in the index it left) are of no use now."""
        try:
            with open(self._index_path(), encoding="utf-8") as fh:
                names = json.load(fh)
        except (OSError, ValueError):
            return
        for name in names if isinstance(names, list) else ():
            try:
                os.unlink(os.path.join(self.root, blob_relpath(check_sha256(name))))
            except (OSError, ValueError):
                pass
        self._write_index()

    def _write_index(self) -> None:
        try:
            atomic.write_text(self._index_path(),
                              json.dumps(sorted(sha for sha, _ in self.names.values())))
        except OSError as exc:
            log.warning("cannot write %s: %s", self._index_path(), exc)

    def publish(self, version: int, params: Blob, buffers: Optional[Blob]) -> tuple[str, int]:
        """(sha256, size) of the snapshot of `version`, written now unless it was already.
        Written to a temporary file and renamed: a web server serving the folder never serves
        half a snapshot."""
        known = self.names.get(version)
        if known is not None:
            return known
        digest, size = hashlib.sha256(), 0
        fd, temp = tempfile.mkstemp(dir=self.root, prefix=".incoming-")
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in snapshot.chunks(snapshot.parts_of(params, buffers), version):
                    digest.update(chunk)
                    out.write(chunk)
                    size += chunk.nbytes
            sha = digest.hexdigest()
            self.folder.put_file(temp, sha)
        except BaseException:
            if os.path.exists(temp):
                os.unlink(temp)
            raise
        self.names[version] = (sha, size)
        self.published += 1
        self._write_index()
        return sha, size

    def prune(self, in_use: Callable[[int], bool], current: int) -> list[str]:
        """Delete the snapshots of versions no open round names (the current one stays: the
        next tasks name it). Returns the names deleted."""
        gone = []
        for version in [v for v in self.names if v != current and not in_use(v)]:
            sha, _ = self.names.pop(version)
            if sha in {s for s, _ in self.names.values()}:
                continue  # the same bytes at another version (a step that changed nothing)
            try:
                os.unlink(os.path.join(self.root, blob_relpath(sha)))
            except FileNotFoundError:
                pass
            gone.append(sha)
        if gone:
            self.pruned += len(gone)
            self._write_index()
        return gone

    def holds(self, sha256: str) -> bool:
        return any(sha == sha256 for sha, _ in self.names.values())

    def close(self) -> None:
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)

    def summary(self) -> dict:
        latest = self.names[max(self.names)] if self.names else None
        return {"dir": self.root, "published": self.published, "kept": len(self.names),
                "pruned": self.pruned, "bytes": latest[1] if latest else 0}
