"""The worker's data plane for one coordinator: the blob cache (made on first need: a job that
declares its data by manifest, a model snapshot), its sources in order (the owner's mirrors, the
coordinator's, the coordinator itself over the session's socket: `CoordinatorSource`, fed the
chunks the daemon receives), the manifest of the job's data, the prefetch hints, and what a slot
needs fetched.

A slot's shards are fetched before the job's code runs (`fetch_for`, in the compute thread under
the engine's pause gate), so that a spent transfer cap or a source that has nothing is the data
plane's answer (the daemon hands the slot back, or drops it), not an exception through the job's
data loader. While the cap is spent, `has_data` tells whether a slot can run from the cache alone
(a look at the folder, no hashing): the session hands back the ones that cannot before they start.
A blob is hashed when its download ends and once per process on a hit (cache.py), not per use.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

from ..common.blobs import MAX_MANIFEST_BYTES, BlobError, Manifest
from ..common.errors import Refused
from ..common.permutation import part_indices
from ..common.throttle import Throttle
from .cache import (BlobCache, CacheError, CacheTooSmall, CoordinatorSource, DiskFull, HttpSource,
                    TransferCapReached, cache_from_settings)
from .session import Capped, Fatal, NotComputed

log = logging.getLogger("idlegrad.worker")


class _PrefetchGate:
    """A prefetch yields to the owner too: it stops at the next block of a pause and is given
    up (its partial file kept); the slot that needs the shard fetches it under its own gate."""

    def __init__(self, running):
        self._running = running

    def stopping(self) -> bool:
        return not self._running.is_set()

    def wait(self) -> None:
        raise CacheError("the owner needs the machine: prefetch given up until a slot needs it")


class DataPlane:
    def __init__(self, config, running):
        """`config`: the WorkerConfig (its [cache] settings and mirrors); `running`: the guest's
        gate, which prefetches yield to."""
        self.config = config
        self._running = running
        self.cache: Optional[BlobCache] = None
        self.coordinator_source = CoordinatorSource()
        self.manifest: Optional[Manifest] = None  # of the job built, when it declares its data
        self._mirrors: list[str] = []  # the owner's and the coordinator's, in that order
        self._logged = Throttle()
        self._prefetch_told: list[int] = []
        self._prefetching: Optional[asyncio.Future] = None

    def welcomed(self, blob_mirrors) -> None:
        """A welcome: its mirrors after the owner's; hints are heard anew."""
        self._mirrors = list(dict.fromkeys([*self.config.blob_mirrors, *blob_mirrors]))
        self._prefetch_told = []
        if self.cache is not None:
            self.ensure_cache()  # this session's sources

    def ensure_cache(self) -> BlobCache:
        if self.cache is None:
            self.cache = cache_from_settings(self.config)
        self.cache.sources = [HttpSource(url) for url in self._mirrors] + [self.coordinator_source]
        return self.cache

    # the coordinator as a source, over the session's socket

    def attach(self, loop, send: Callable) -> None:
        """Chunks are asked for with `send(message)` (a coroutine function) on `loop`, from the
        cache's thread."""
        def send_threadsafe(msg) -> None:
            try:
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(send(msg)))
            except RuntimeError:  # the loop is closing
                raise ConnectionError("the worker is stopping") from None

        self.coordinator_source.attach(send_threadsafe)

    def detach(self) -> None:
        self.coordinator_source.detach()  # fetches under way fail, and resume later

    def deliver(self, chunk) -> None:
        self.coordinator_source.deliver(chunk)

    def failed(self, slot: int, exc: Exception, now: float):
        """What a slot that met `exc` (CacheError, BlobError) comes to, for the session."""
        if isinstance(exc, (CacheTooSmall, DiskFull)):  # no slot can be computed here until fixed
            return Fatal(str(exc))
        if self._logged.ready(now):
            log.warning("slot %d: %s", slot, exc)
        if isinstance(exc, TransferCapReached):  # handed back
            return Capped(self.capped_until(now) or now + 60.0)
        return NotComputed()  # no source has the blob now: the slot goes on elsewhere

    # readings for the session

    def capped_until(self, now: float) -> Optional[float]:
        """When the spent transfer allowance returns, on the clock of `now` (None: not spent)."""
        until = self.cache.capped_until(time.time()) if self.cache is not None else None
        return None if until is None else now + until - time.time()

    def counters(self) -> Optional[dict]:
        return self.cache.counters() if self.cache is not None else None

    def held_shards(self) -> Optional[list[int]]:
        """The indices of the current manifest's shards that the cache holds whole (a look at the
        folder, no hashing); None when that cannot be told now (locality is a preference)."""
        if self.cache is None or self.manifest is None:
            return []
        try:
            held = set(self.cache.held(s.sha256 for s in self.manifest.shards))
        except Exception as exc:  # noqa: BLE001 - the folder: work goes on without it
            if self._logged.ready(time.monotonic()):
                log.warning("could not list the shards held: %s", exc)
            return None
        return [k for k, s in enumerate(self.manifest.shards) if s.sha256 in held]

    # the job's data

    def fetch_manifest(self, job) -> Manifest:
        """The manifest of `job`'s data (in a thread: it may be downloaded), kept as current."""
        cache = self.ensure_cache()
        try:
            path = cache.path_of(job.data)
            with open(path, "rb") as fh:
                manifest = Manifest.from_bytes(fh.read(MAX_MANIFEST_BYTES + 1), job.data)
        except (CacheError, BlobError, OSError) as exc:
            raise Refused(f"cannot fetch the manifest of job {job.name!r}'s data: {exc}") from None
        biggest = max((s.size for s in manifest.shards), default=0)
        if biggest > cache.max_bytes:
            raise CacheTooSmall(
                f"the cache cap of {cache.max_bytes / 2**30:.3g} GB (cache_max_gb) is below "
                f"one shard of job {job.name!r}'s data ({biggest / 2**30:.3g} GB): raise "
                "cache_max_gb in worker.toml (or --cache-max-gb)")
        self.manifest = manifest
        return manifest

    def shards_for(self, built, order, work) -> list:
        """The manifest shards a slot's samples lie in ([] when its data set is not one of the
        manifest's `ShardedDataset`s: the job's loader then fetches on first use)."""
        dataset = built.test if work.kind == "eval" else built.train
        if self.manifest is None or getattr(dataset, "manifest", None) is None \
                or not hasattr(dataset, "shards_of"):
            return []
        indices = []
        for epoch, offset, count in work.parts:
            if work.kind == "eval":
                indices.extend(range(offset, offset + count))
            else:
                indices.extend(part_indices(order, len(dataset), epoch, offset, count))
        shards = dataset.manifest.shards
        return [shards[k] for k in dataset.shards_of(indices)]

    def fetch_for(self, engine, work) -> None:
        """Fetch what `work` reads (in the compute thread, under the engine's gate), before the
        job's code runs: CacheError (TransferCapReached among them) is the data plane's."""
        for shard in self.shards_for(engine.built, engine.seed, work):
            self.cache.path_of(shard.sha256, shard.size)

    def has_data(self, engine, work) -> bool:
        """Whether `work` can be computed from the cache alone (no hashing)."""
        if self.cache is None:
            return True
        names = [s.sha256 for s in self.shards_for(engine.built, engine.seed, work)]
        if work.snapshot is not None and engine.loaded_snapshot != work.snapshot.sha256:
            names.append(work.snapshot.sha256)
        return len(self.cache.held(names)) == len(names)

    # prefetch hints

    def prefetch(self, shards: list[int]) -> None:
        """The coordinator's hint of the shards this worker will need next: fetch the missing
        ones ahead, one fetch at a time, in a thread (as the compute thread fetches on first
        use; the cache downloads each blob once, whoever asks first)."""
        if not shards or shards == self._prefetch_told or self.cache is None or self.manifest is None:
            return
        self._prefetch_told = list(shards)
        if self._prefetching is not None and not self._prefetching.done():
            return  # a hint lost costs a later fetch on first use, no more
        wanted = [self.manifest.shards[k] for k in shards if 0 <= k < len(self.manifest.shards)]
        held = set(self.cache.held(s.sha256 for s in wanted))
        missing = [s for s in wanted if s.sha256 not in held]
        if missing:
            self._prefetching = asyncio.ensure_future(asyncio.to_thread(self._fetch_ahead, missing))

    def _fetch_ahead(self, shards) -> None:
        with self.cache.gated(_PrefetchGate(self._running)):
            for shard in shards:
                try:
                    self.cache.path_of(shard.sha256, shard.size)
                except Exception as exc:  # noqa: BLE001 - a guess: the slot that needs it fetches
                    log.info("prefetch of shard %s stopped: %s", shard.sha256[:12], exc)
                    return
