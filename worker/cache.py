"""The worker's blob cache: shards and manifests fetched from mirrors, kept on the owner's disk
under the owner's cap.

- Layout: ROOT/blobs/<sha[:2]>/<sha> (whole, checked blobs; the same as a mirror's), and
  ROOT/partial/<sha> (a download under way, resumed with an HTTP Range request).
- A blob's sha256 is checked when its download ends, and on its first hit in this process (a
  blob cached by an earlier run): a cached blob found corrupt then is dropped and fetched again.
  Later hits trust the file this process checked while its stat is unchanged (`_verified`:
  inode, size, modification and change times), so a hit costs no hashing, and a file written
  since is hashed again. A shard corrupted on disk under a run's memory map is caught where it is
  read: `ShardedDataset.corrupt_shards` (common/sharded.py), asked by the engine after each slot,
  drops it (`discard`) before what was computed on it is sent.
- Least recently used blobs go first when room is needed; a blob's last use is its file's
  modification time, so the order survives restarts without an index to keep consistent.
- At most one download per blob at a time (a lock per name); sources are tried in order (mirrors
  first, fetch.py); one that fails (refused, times out, announces a size not the blob's, goes
  slower than `DownloadPace` allows, serves bytes that do not hash to the name) is skipped for a
  while (`SourceHealth`), so a bad mirror costs at most one retry per blob.
- A partial file is only a hint: one a source refuses to resume (as long as the blob or longer)
  or that does not hash to the name once resumed is discarded and fetched from 0 from the same
  source before the source is blamed, so bytes a hostile mirror left never block a blob.
- The owner's network limits: a download rate cap and a daily transfer cap (UTC days), enforced
  here, per cache, in the fetching thread. Once the day's allowance is spent nothing is asked of
  any source (and nothing evicted) until the next UTC day: TransferCapReached at once.
- A download yields to the machine's owner: a thread fetching under `gated(gate)` (the engine's
  compute thread) stops between two blocks when `gate.stopping()`, closes the connection, waits in
  `gate.wait()` (which may raise to give the download up) and resumes from its partial file.

Synchronous and thread-safe: the daemon's asyncio loop calls `path_of` through a thread
(`asyncio.to_thread`). Names from the network are data: a name becomes part of a path only after
`check_sha256` says it is 64 hex digits. The pure parts (`RateLimiter`, `DailyAllowance`,
`SourceHealth`, `choose_evictions`) take the time as an argument.
"""

from __future__ import annotations

import errno
import http.client
import json
import logging
import os
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Protocol, Sequence

from ..common import atomic
from ..common.blobs import blob_relpath, check_sha256, sha256_file
from ..common.errors import ConfigError, IdlegradError
from ..common.text import shown
from .fetch import (CoordinatorSource, DownloadPace, HttpSource, ResumeRefused, Source,
                    SourceFailed)

try:
    import fcntl  # POSIX: a lock file shared by the worker processes of one machine
except ImportError:  # pragma: no cover - Windows: one process per cache
    fcntl = None

log = logging.getLogger("idlegrad.worker.cache")

CHUNK = 64 << 10
GB = 1 << 30
MIN_MIRROR_BYTES_PER_S = 16 << 10  # 128 kbit/s: a 64 MB shard within about 70 minutes


class CacheError(IdlegradError):
    """A blob that cannot be had now: no source has it, the disk is full, a cap is reached."""


class CacheTooSmall(ConfigError):
    """The owner's cap is below one blob: nothing can be cached until it is raised."""


class DiskFull(CacheError):
    """The disk under the cache is full: the worker says so and stops, rather than fail again."""


class TransferCapReached(CacheError):
    """Today's transfer allowance is spent; the partial download waits for tomorrow."""


class _BadPartial(SourceFailed):
    """The partial file cannot be made into the blob: discarded, and the blob fetched from 0."""


class _Interrupted(Exception):
    """The gate asked a download to stop between two blocks (kept inside this module)."""


class DownloadGate(Protocol):
    """What a download asks between two blocks, in the thread that fetches."""

    def stopping(self) -> bool:
        """Stop reading now (the owner wants the machine back, the work was cancelled)."""

    def wait(self) -> None:
        """Block until reading may go on; raise to give the download up."""


# pure parts --------------------------------------------------------------------------------------


class RateLimiter:
    """At most `bytes_per_s` on average: `delay(now, n)` is how long to wait before sending n
    more bytes. Pure: the caller passes the time and does the waiting."""

    def __init__(self, bytes_per_s: Optional[float]):
        self.bytes_per_s = bytes_per_s
        self._free_at = -float("inf")

    def delay(self, now: float, nbytes: int) -> float:
        if not self.bytes_per_s:
            return 0.0
        start = max(now, self._free_at)
        self._free_at = start + nbytes / self.bytes_per_s
        return start - now


@dataclass
class DailyAllowance:
    """Bytes fetched per UTC day against the owner's daily cap (None: no cap)."""

    limit: Optional[int]
    day: str = ""
    used: int = 0

    @staticmethod
    def day_of(now: float) -> str:
        return time.strftime("%Y-%m-%d", time.gmtime(now))

    def remaining(self, now: float) -> Optional[int]:
        if self.limit is None:
            return None
        return self.limit - (self.used if self.day_of(now) == self.day else 0)

    def spend(self, now: float, nbytes: int) -> None:
        today = self.day_of(now)
        if today != self.day:
            self.day, self.used = today, 0
        self.used += nbytes


@dataclass
class SourceHealth:
    """Which sources to skip: a failure benches a source for `retry_after_s`, doubling with each
    failure in a row up to `max_retry_after_s`; a success clears it."""

    retry_after_s: float = 60.0
    max_retry_after_s: float = 3600.0
    _benched_until: dict = field(default_factory=dict)
    _failures: dict = field(default_factory=dict)

    def usable(self, source: str, now: float) -> bool:
        return now >= self._benched_until.get(source, -float("inf"))

    def failed(self, source: str, now: float) -> float:
        count = self._failures.get(source, 0) + 1
        self._failures[source] = count
        wait = min(self.max_retry_after_s, self.retry_after_s * 2 ** (count - 1))
        self._benched_until[source] = now + wait
        return wait

    def succeeded(self, source: str) -> None:
        self._failures.pop(source, None)
        self._benched_until.pop(source, None)


def choose_evictions(entries: Iterable[tuple[str, int, float]], used: int, need: int,
                     cap: int, keep: frozenset = frozenset()) -> list[str]:
    """Names to delete, least recently used first, so that `need` more bytes fit under `cap`;
    entries are (name, size, last_used). Never one in `keep`."""
    out = []
    for name, size, _ in sorted(entries, key=lambda e: (e[2], e[0])):
        if used + need <= cap:
            break
        if name in keep:
            continue
        out.append(name)
        used -= size
    return out


# the cache ---------------------------------------------------------------------------------------


class BlobCache:
    """`path_of(sha256, size)`: the local path of a whole, checked blob, fetched if need be.
    What ShardedDataset (common/sharded.py) asks of a store."""

    def __init__(self, root: str, max_bytes: int, sources: Sequence[Source] = (), *,
                 rate_bytes_per_s: Optional[float] = None, daily_bytes: Optional[int] = None,
                 health: Optional[SourceHealth] = None, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep,
                 min_bytes_per_s: float = MIN_MIRROR_BYTES_PER_S, pace_grace_s: float = 30.0):
        self.root = root
        self.max_bytes = int(max_bytes)
        self.sources = list(sources)
        self.health = health or SourceHealth()
        self.clock, self.sleep = clock, sleep
        self.rate = RateLimiter(rate_bytes_per_s)
        # a mirror slower than this on average, after the grace, is left for the next source
        self.min_bytes_per_s, self.pace_grace_s = min_bytes_per_s, pace_grace_s
        self.allowance = DailyAllowance(daily_bytes)
        self._lock = threading.Lock()  # guards the two dicts below and the byte count
        self._blob_locks: dict[str, threading.Lock] = {}
        self.downloads = 0  # finished downloads, for tests and status
        self.evicted = 0
        self.hits = 0  # blobs handed out from the cache, checked, without a download
        self.failures = 0  # a source that failed one blob once
        self.in_flight = 0  # downloads under way now
        self.bytes_from: dict[str, int] = {}  # source name -> bytes it delivered
        self.interrupted = 0  # downloads stopped by their gate, and resumed after
        self._gates = threading.local()  # the gate of the thread fetching, if any
        self._verified: dict[str, tuple] = {}  # sha256 -> its file's `_mark` when checked here
        os.makedirs(os.path.join(root, "blobs"), exist_ok=True)
        os.makedirs(os.path.join(root, "partial"), exist_ok=True)
        os.makedirs(os.path.join(root, "locks"), exist_ok=True)
        self._load_allowance()

    # paths and bookkeeping

    def _path(self, sha256: str) -> str:
        return os.path.join(self.root, blob_relpath(sha256))

    def _partial(self, sha256: str) -> str:
        return os.path.join(self.root, "partial", check_sha256(sha256))

    def _entries(self) -> list[tuple[str, int, float]]:
        """(path relative to the root, size, last use) of every whole blob and every partial
        download: an abandoned partial takes room too, and goes in its turn."""
        out = []
        folders = [os.path.join("blobs", p) for p in os.listdir(os.path.join(self.root, "blobs"))]
        for folder in folders + ["partial"]:
            full = os.path.join(self.root, folder)
            for name in os.listdir(full) if os.path.isdir(full) else ():
                try:
                    st = os.stat(os.path.join(full, name))
                except FileNotFoundError:
                    continue
                out.append((os.path.join(folder, name), st.st_size, st.st_mtime))
        return out

    def used_bytes(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def _make_room(self, sha256: str, need: int) -> None:
        if need > self.max_bytes:
            raise CacheTooSmall(
                f"the cache cap of {self.max_bytes / GB:.3g} GB (cache_max_gb) is below blob "
                f"{sha256[:12]} of {need / GB:.3g} GB: raise cache_max_gb in worker.toml")
        with self._lock:  # two downloads making room at once must not both count the same room
            partial = self._partial(sha256)
            have = os.path.getsize(partial) if os.path.exists(partial) else 0
            keep = frozenset({blob_relpath(sha256), os.path.join("partial", sha256)})
            doomed = choose_evictions(self._entries(), self.used_bytes(), need - have,
                                      self.max_bytes, keep=keep)
            for relpath in doomed:
                try:
                    os.unlink(os.path.join(self.root, relpath))  # a memory map keeps its pages
                    self.evicted += 1
                except FileNotFoundError:
                    pass
            if doomed:
                log.info("cache: evicted %d least recently used blobs for %s", len(doomed),
                         sha256[:12])

    @contextmanager
    def _blob_lock(self, sha256: str):
        """One holder per blob: a lock per name among this process's threads, and a lock file
        among the processes sharing this cache (several workers on one machine)."""
        with self._lock:
            lock = self._blob_locks.setdefault(sha256, threading.Lock())
        with lock:
            if fcntl is None:
                yield
                return
            with open(os.path.join(self.root, "locks", check_sha256(sha256)), "a") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes
                yield

    # the daily allowance survives restarts: a crash loop must not reset it

    def _allowance_path(self) -> str:
        return os.path.join(self.root, "transfer.json")

    def _load_allowance(self) -> None:
        try:
            with open(self._allowance_path(), encoding="utf-8") as fh:
                doc = json.load(fh)
            if isinstance(doc.get("day"), str) and type(doc.get("bytes")) is int:
                self.allowance.day, self.allowance.used = doc["day"], doc["bytes"]
        except (OSError, ValueError, AttributeError):
            pass

    def _save_allowance(self) -> None:
        try:
            atomic.write_text(self._allowance_path(),
                              json.dumps({"day": self.allowance.day, "bytes": self.allowance.used}))
        except OSError:
            pass  # only the count is lost; the cap then errs on the owner's side next day

    # the interface

    @contextmanager
    def gated(self, gate: DownloadGate):
        """Downloads made by this thread meanwhile stop and wait as `gate` says."""
        previous = getattr(self._gates, "gate", None)
        self._gates.gate = gate
        try:
            yield
        finally:
            self._gates.gate = previous

    def capped_until(self, now: float) -> Optional[float]:
        """When today's spent transfer allowance returns (the next UTC midnight), or None
        while some is left (or there is no cap)."""
        left = self.allowance.remaining(now)
        if left is None or left > 0:
            return None
        return (int(now) // 86400 + 1) * 86400.0

    def discard(self, sha256: str) -> None:
        """Delete a blob that is of no further use (an old model snapshot), rather than let it
        push the data's shards out in its turn."""
        with self._blob_lock(sha256):
            _remove(self._path(check_sha256(sha256)))

    def has(self, sha256: str) -> bool:
        return os.path.isfile(self._path(check_sha256(sha256)))

    def path_of(self, sha256: str, size: Optional[int] = None) -> str:
        """The path of blob `sha256` (of `size` bytes, when known), checked by this process."""
        check_sha256(sha256)
        with self._blob_lock(sha256):
            path = self._path(sha256)
            if os.path.isfile(path):
                st = os.stat(path)
                if (size is None or st.st_size == size) and (
                        self._verified.get(sha256) == _mark(st) or sha256_file(path) == sha256):
                    now = self.clock()
                    os.utime(path, (now, now))  # its last use, for LRU
                    self._verified[sha256] = _mark(os.stat(path))
                    self.hits += 1
                    return path
                log.warning("cache: blob %s is corrupt on disk: fetching it again", sha256[:12])
                self._verified.pop(sha256, None)
                os.unlink(path)
            if self.capped_until(self.clock()) is not None:  # before any eviction or request
                raise TransferCapReached(
                    f"blob {sha256[:12]}: today's transfer cap (daily_transfer_max_gb) is spent; "
                    "it is fetched after 00:00 UTC")
            if size is not None:
                self._make_room(sha256, size)
            with self._lock:
                self.in_flight += 1
            try:
                return self._download(sha256, size)
            finally:
                with self._lock:
                    self.in_flight -= 1

    def _download(self, sha256: str, size: Optional[int]) -> str:
        reasons = []
        for source in list(self.sources):
            # the coordinator is the source of last resort: never benched
            benchable = getattr(source, "benchable", True)
            if benchable and not self.health.usable(source.name, self.clock()):
                reasons.append(f"{source.name}: skipped after a recent failure")
                continue
            try:
                path = self._fetch_resuming(source, sha256, size)
            except SourceFailed as exc:
                self.failures += 1
                if not benchable:
                    log.warning("cache: %s failed for %s (%s)", source.name, sha256[:12],
                                shown(exc))
                    reasons.append(f"{source.name}: {shown(exc)}")
                    continue
                wait = self.health.failed(source.name, self.clock())
                log.warning("cache: %s failed for %s (%s); skipping it for %.0f s", source.name,
                            sha256[:12], shown(exc), wait)  # a mirror's text, in part
                reasons.append(f"{source.name}: {shown(exc)}")
                continue
            self.health.succeeded(source.name)
            self.downloads += 1
            return path
        raise CacheError(f"blob {sha256[:12]} could not be fetched: "
                         + ("; ".join(reasons) if reasons else "no sources configured"))

    def _fetch_resuming(self, source: Source, sha256: str, size: Optional[int]) -> str:
        """`_fetch_from` the source, stopping when the thread's gate says so and going on from
        the partial file once it lets the thread go on (its `wait` may raise instead)."""
        gate = getattr(self._gates, "gate", None)
        while True:
            if gate is not None and gate.stopping():  # not even a request while paused
                gate.wait()
            try:
                return self._fetch_from(source, sha256, size)
            except _Interrupted:
                with self._lock:
                    self.interrupted += 1
                gate.wait()

    def _fetch_from(self, source: Source, sha256: str, size: Optional[int]) -> str:
        """The blob from one source, resuming the partial file. A partial this source cannot
        make the blob of (a resume it refuses, bytes that do not hash to the name once resumed:
        an earlier source's, a hostile mirror's) is discarded and the blob fetched from 0, from
        the same source, before the source is blamed: a bad partial never blocks a blob."""
        try:
            return self._fetch_once(source, sha256, size)
        except _BadPartial as exc:
            log.warning("cache: the partial download of %s is bad (%s): fetching it from 0 from %s",
                        sha256[:12], exc, source.name)
            _remove(self._partial(sha256))
            return self._fetch_once(source, sha256, size)

    def _fetch_once(self, source: Source, sha256: str, size: Optional[int]) -> str:
        partial = self._partial(sha256)
        offset = os.path.getsize(partial) if os.path.exists(partial) else 0
        if size is not None and offset >= size:
            os.unlink(partial)  # as long as the blob yet not renamed: start afresh
            offset = 0
        try:
            stream, start, total = source.open(sha256, offset)
        except ResumeRefused as exc:
            raise _BadPartial(str(exc)) from None
        with stream:
            # what a source says of the size is checked before any of its body is read
            if size is not None and total is not None and total != size:
                raise SourceFailed(f"serves {total} bytes, the manifest says {size}")
            if size is None and total is not None and total > self.max_bytes and _is_mirror(source):
                # a mirror's word is not enough to call the owner's cap too small (CacheTooSmall
                # stops the worker); the coordinator's is
                raise SourceFailed(f"announces {total} bytes, over the cache's cap of "
                                   f"{self.max_bytes}")
            expected = size if size is not None else total
            if size is None and total is not None:
                self._make_room(sha256, total)
            try:
                with open(partial, "r+b" if start and os.path.exists(partial) else "wb") as out:
                    out.seek(start)
                    out.truncate()
                    self._copy(stream, out, sha256, start, expected, source)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    _remove(partial)  # frees what it took; the next try starts clean
                    free = shutil.disk_usage(self.root).free
                    raise DiskFull(
                        f"disk full writing the cache in {self.root} ({free >> 20} MiB free): "
                        "free space or lower cache_max_gb") from None
                raise
        if expected is not None and os.path.getsize(partial) != expected:
            raise SourceFailed(f"ended at {os.path.getsize(partial)} of {expected} bytes")
        if sha256_file(partial) != sha256:
            _remove(partial)  # which bytes lie is unknowable: the next try starts from 0
            if start:
                raise _BadPartial(f"resumed at {start}, its bytes do not hash to the blob's name")
            raise SourceFailed("its bytes do not hash to the blob's name")
        path = self._path(sha256)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.replace(partial, path)
        now = self.clock()
        os.utime(path, (now, now))
        self._verified[sha256] = _mark(os.stat(path))  # hashed just now: no more on a hit
        return path

    def _copy(self, stream, out, sha256: str, start: int, expected: Optional[int],
              source: Source) -> None:
        written = start
        pace = self._pace(source, (expected if expected is not None else self.max_bytes) - start)
        gate = getattr(self._gates, "gate", None)
        # a block as soon as some of it is there: a slow source must not hold a pause back
        read = getattr(stream, "read1", stream.read)
        try:
            while True:
                if gate is not None and gate.stopping():
                    raise _Interrupted()
                want = CHUNK
                left = self.allowance.remaining(self.clock())
                if left is not None and expected is not None and written == expected:
                    return  # whole, even with nothing left for a read of the end
                if left is not None:
                    if left <= 0:
                        self._save_allowance()
                        raise TransferCapReached(
                            f"blob {sha256[:12]}: today's transfer cap (daily_transfer_max_gb) is "
                            f"spent; {written} bytes kept, the rest after 00:00 UTC")
                    want = min(want, left)
                block = read(want)
                if not block:
                    return
                wait = self.rate.delay(self.clock(), len(block))
                if wait > 0:
                    self.sleep(wait)
                self._write(out, block)
                written += len(block)
                with self._lock:
                    self.bytes_from[source.name] = self.bytes_from.get(source.name, 0) + len(block)
                self.allowance.spend(self.clock(), len(block))
                if expected is not None and written > expected:
                    raise SourceFailed(f"sends more than the {expected} bytes of the blob")
                if expected is None and written > self.max_bytes:  # an endless body, unasked
                    raise SourceFailed(f"sends more than the cache's cap of {self.max_bytes} bytes")
                slow = pace.too_slow(self.clock(), written - start) if pace is not None else None
                if slow is not None:  # what came is kept: the next source resumes from it
                    raise SourceFailed(slow)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            # a timeout, a reset, a body cut short: the bytes so far are kept for a resume
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise SourceFailed(f"broke off after {written} bytes: {exc or type(exc).__name__}") from None
        finally:
            self._save_allowance()

    def _pace(self, source: Source, expected: int) -> Optional[DownloadPace]:
        """The deadline and minimum rate of a download from a mirror (the coordinator's chunks
        have a timeout each, and it is the source of last resort: not given up for its pace);
        never above half the owner's rate cap, which this download is paced by."""
        if not _is_mirror(source) or not self.min_bytes_per_s:
            return None
        floor = self.min_bytes_per_s
        if self.rate.bytes_per_s:
            floor = min(floor, self.rate.bytes_per_s / 2)
        return DownloadPace(self.clock(), max(expected, 0), floor, self.pace_grace_s)

    @staticmethod
    def _write(out, block: bytes) -> None:
        out.write(block)

    def counters(self) -> dict[str, int]:
        """What the worker's heartbeat says of its cache (protocol.CACHE_COUNTERS)."""
        with self._lock:
            from_coordinator = sum(n for name, n in self.bytes_from.items()
                                   if name == CoordinatorSource.name)
            total = sum(self.bytes_from.values())
            return {"hits": self.hits, "downloads": self.downloads, "in_flight": self.in_flight,
                    "failures": self.failures, "bytes_coordinator": from_coordinator,
                    "bytes_mirrors": total - from_coordinator}

    def held(self, names: Iterable[str]) -> list[str]:
        """Which of `names` are cached whole (a look at the folder, no hashing: cheap enough to
        ask per heartbeat; `path_of` still checks a blob before it is used)."""
        return [name for name in names if os.path.isfile(self._path(check_sha256(name)))]


def _mark(st: os.stat_result) -> tuple:
    """What changes with a file's bytes: inode, size, modification and change times (a write
    in place moves both times; only the owner's root could set them back)."""
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _is_mirror(source: Source) -> bool:
    """A mirror, untrusted and benched when it fails; not the coordinator (CoordinatorSource)."""
    return getattr(source, "benchable", True)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "idlegrad", "blobs")


def cache_from_settings(settings, extra_sources: Sequence[Source] = ()) -> BlobCache:
    """The cache a worker's settings (worker/config.py's [cache] section, or a WorkerConfig)
    describe; mirrors first, then `extra_sources` (the coordinator)."""
    mbps = settings.download_max_mbps
    daily = settings.daily_transfer_max_gb
    return BlobCache(
        settings.cache_dir or default_cache_dir(), int(settings.cache_max_gb * GB),
        [HttpSource(url) for url in settings.blob_mirrors] + list(extra_sources),
        rate_bytes_per_s=mbps * 1e6 / 8 if mbps else None,
        daily_bytes=int(daily * GB) if daily else None)
