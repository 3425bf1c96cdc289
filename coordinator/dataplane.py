"""The coordinator's data plane, on its side of the socket: the pack it serves (opened and
checked at start), the model snapshots it publishes as blobs (coordinator/snapshots.py: which
models, the folder), and the serving itself: fetches queued in the blob service
(coordinator/blobserve.py, pure: what is served, to whom, in what order), and each pass of the
server's loop reading its chunks from disk and sending them. A task whose model goes by name is
given the snapshot's name here, the snapshot written on the version's first task; after a step,
the snapshots no open round names are deleted, from the folder and from what is served.

The server calls it from its one loop; the socket is the server's, lent as a `send` callable.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Awaitable, Callable, Mapping, Optional

from ..common import protocol as proto
from ..common.blobs import MANIFEST_FILE, BlobError, BlobFolder, Manifest, load_manifest
from ..common.errors import ConfigError, JobError
from . import snapshots
from .blobserve import BlobService, Serve

Pack = tuple[Manifest, BlobFolder]
# the server's send: (route, message, counted with the gradient traffic) -> when it is sent
Send = Callable[[bytes, proto.Message, bool], Awaitable]


def open_pack(data_dir: str, flag: str = "--data") -> Pack:
    """The pack a coordinator serves (`idlegrad data pack`'s --out): its manifest, checked, and
    its blob folder. ConfigError with one line when it is not one."""
    path = os.path.join(data_dir, MANIFEST_FILE)
    try:
        manifest = load_manifest(path)
    except BlobError as exc:
        raise ConfigError(f"{flag} {data_dir}: {exc} (give the --out folder of idlegrad data "
                          "pack)") from None
    except OSError as exc:
        raise ConfigError(f"{flag} {data_dir}: cannot read {MANIFEST_FILE}: "
                          f"{exc.strerror or exc}") from None
    folder = BlobFolder(data_dir)
    missing = [s.sha256[:12] for s in manifest.shards if not folder.has(s.sha256)]
    if missing:
        raise ConfigError(f"{flag} {data_dir}: {len(missing)} of its {len(manifest.shards)} "
                          f"shards are missing (first {missing[0]}): the pack is incomplete")
    if not folder.has(manifest.sha256):
        folder.put_bytes(manifest.to_bytes())  # a pack copied without its blobs/ copy of it
    return manifest, folder


def job_args_with_data(factory, job_args: dict, manifest: Manifest, flag: str = "--data") -> dict:
    """The job arguments with `data` set to the served manifest's hash, for a job factory that
    takes `data` (as the built-in `packed` does). A `data` given too must be the same."""
    given = job_args.get("data")
    if given is not None and given != manifest.sha256:
        raise JobError(f"--job-arg data={str(given)[:16]}... is not the manifest of {flag} "
                       f"({manifest.sha256[:16]}...): give one or the other")
    try:
        takes_data = "data" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_data = False
    if not takes_data:
        return job_args
    return {**job_args, "data": manifest.sha256}


def read_chunk(folder: BlobFolder, serve: Serve) -> bytes:
    """The chunk's bytes from its folder (OSError or BlobError when it cannot be read)."""
    path = folder.path_of(serve.sha256)
    with open(path, "rb") as fh:
        data = os.pread(fh.fileno(), serve.length, serve.offset)
    if len(data) != serve.length:
        raise BlobError(f"blob {serve.sha256[:12]}: {len(data)} bytes read, {serve.length} asked")
    return data


class DataPlane:
    """What this coordinator serves by name: its pack's blobs (`pack`, None without one) and,
    with `snapshot_folder`, its models' snapshots. Serves nothing with neither."""

    def __init__(self, pack: Optional[Pack] = None,
                 snapshot_folder: Optional[snapshots.SnapshotFolder] = None):
        self.pack = pack
        self.snapshots = snapshot_folder
        self.service = (BlobService(pack[0] if pack is not None else None)
                        if pack is not None or snapshot_folder is not None else None)

    @classmethod
    def for_run(cls, pack: Optional[Pack], param_bytes: int, min_mb: Optional[float],
                local_tasks: bool, mirrors: tuple, snapshot_dir: Optional[str],
                job_name: str) -> "DataPlane":
        """The data plane of a run: a model of `param_bytes` goes by name at or over the
        threshold (snapshots.py). A mirror with nothing to mirror is one line."""
        threshold = snapshots.min_mb_for(min_mb, local_tasks, bool(mirrors))
        by_name = snapshots.uses_snapshots(param_bytes, threshold)
        if mirrors and pack is None and not by_name:
            raise ConfigError(
                f"--blob-mirror: job {job_name!r} has no packed data to mirror (give --data DIR, "
                f"the --out of idlegrad data pack), and its model goes inline, not as snapshots "
                f"(its {param_bytes / 2**20:.3g} MB of parameters are under --snapshot-min-mb "
                f"{threshold:g})")
        return cls(pack, snapshots.SnapshotFolder(snapshot_dir) if by_name else None)

    @property
    def pending(self) -> bool:
        """Chunks asked for and not yet sent: the loop comes straight back for them."""
        return self.service is not None and self.service.pending

    # fetches and the passes that answer them ----------------------------------------------------

    def fetch(self, worker: str, msg: proto.Fetch,
              key: Optional[bytes] = None) -> Optional[proto.Chunk]:
        """Queue a worker's fetch (`key`: the worker's CURVE key, whose names' requests are
        bounded and served together; None: the worker's own); or the refusal to send it now."""
        if self.service is None:
            return proto.Chunk(request=msg.request, sha256=msg.sha256, offset=msg.offset,
                               total=0, error="this coordinator serves no data")
        return self.service.request(worker, msg, None if key is None else key.decode('ascii'))

    async def serve(self, routes: Mapping[str, bytes], send: Send,
                    event: Callable[..., None]) -> None:
        """One pass: at most the service's byte budget read and sent, so the messages that wait
        are handled before the next. `routes`: worker id -> route, of those connected."""
        service = self.service
        for serve in service.take():
            route = routes.get(serve.worker)
            if route is None:  # gone meanwhile
                service.forget(serve.worker)
                continue
            try:
                data = read_chunk(self._folder_of(serve.sha256), serve)
            except (OSError, BlobError) as exc:
                if service.known(serve.sha256):  # (not a snapshot pruned while it was queued)
                    event("data", f"cannot read blob {serve.sha256[:12]}: {exc}",
                          level=logging.WARNING)
                await send(route, service.failed(serve), True)
                continue
            # chunk bytes are the data plane's, counted here (not in the gradient traffic)
            await send(route, proto.Chunk(request=serve.request, sha256=serve.sha256,
                                          offset=serve.offset, total=serve.total, data=data),
                       False)
            service.sent(serve)

    def _folder_of(self, sha256: str) -> BlobFolder:
        """The folder a served blob is read from: the snapshots', or the pack's."""
        if self.pack is None or (self.snapshots is not None and self.snapshots.holds(sha256)):
            return self.snapshots.folder
        return self.pack[1]

    # model snapshots ----------------------------------------------------------------------------

    def by_name(self, version: int, model_state) -> Optional[tuple[str, int]]:
        """(sha256, size) of the snapshot a task of `version` names instead of carrying the
        model, written and served from now on; None when models go inline."""
        if self.snapshots is None:
            return None
        sha, size = self.snapshots.publish(version, model_state.blob(version),
                                           model_state.buffers_blob(version))
        self.service.add(sha, size)
        return sha, size

    def stepped(self, in_use: Callable[[int], bool], current: int) -> None:
        """After a step: the snapshots no open round names go (from the folder and the service)."""
        if self.snapshots is not None:
            for sha in self.snapshots.prune(in_use, current):
                self.service.remove(sha)

    # workers --------------------------------------------------------------------------------------

    def report(self, worker: str, cache: Optional[dict]) -> None:
        """A heartbeat's cache counters, when it has them."""
        if cache is not None and self.service is not None:
            self.service.report(worker, cache)

    def forget(self, worker: str) -> None:
        if self.service is not None:
            self.service.forget(worker)

    def summary(self) -> Optional[dict]:
        """What was served, and what workers say of their caches; None when nothing is."""
        return self.service.summary() if self.service is not None else None

    def snapshots_summary(self) -> Optional[dict]:
        return self.snapshots.summary() if self.snapshots is not None else None

    def close(self) -> None:
        if self.snapshots is not None:
            self.snapshots.close()
