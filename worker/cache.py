"""The worker's blob cache: shards and manifests fetched from mirrors, kept on the owner's disk
under the owner's cap.

- Layout: ROOT/blobs/<sha[:2]>/<sha> (whole, checked blobs; the same as a mirror's), and
  ROOT/partial/<sha> (a download under way, resumed with an HTTP Range request).
- A blob's sha256 is checked when its download ends, and on its first hit in this process (a
  blob cached by an earlier run): a cached blob found corrupt then is dropped and fetched again.
  Later hits trust the file this process checked (`_verified`: its inode and size), so a hit
  costs no hashing; a file corrupted in place after its check is read as it is (a separate
  issue: the verification is at download and first use).
- Least recently used blobs go first when room is needed; a blob's last use is its file's
  modification time, so the order survives restarts without an index to keep consistent.
- At most one download per blob at a time (a lock per name); sources are tried in order (mirrors
  first); one that fails (refused, times out, serves bytes that do not hash to the name) is
  skipped for a while (`SourceHealth`), so a bad mirror costs at most one retry per blob.
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
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Protocol, Sequence

from ..common import atomic
from ..common.blobs import blob_relpath, check_sha256, sha256_file
from ..common.errors import ConfigError, IdlegradError

try:
    import fcntl  # POSIX: a lock file shared by the worker processes of one machine
except ImportError:  # pragma: no cover - Windows: one process per cache
    fcntl = None

log = logging.getLogger("idlegrad.worker.cache")

CHUNK = 64 << 10
GB = 1 << 30


class CacheError(IdlegradError):
    """A blob that cannot be had now: no source has it, the disk is full, a cap is reached."""


class CacheTooSmall(ConfigError):
    """The owner's cap is below one blob: nothing can be cached until it is raised."""


class DiskFull(CacheError):
    """The disk under the cache is full: the worker says so and stops, rather than fail again."""


class TransferCapReached(CacheError):
    """Today's transfer allowance is spent; the partial download waits for tomorrow."""


class SourceFailed(Exception):
    """One source could not deliver one blob (kept inside this module)."""


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


# sources -----------------------------------------------------------------------------------------


class Source(Protocol):
    name: str

    def open(self, sha256: str, offset: int):
        """A response to read the blob from `offset` on: (stream, start, total or None), where
        `start` is where the stream begins (0 when the source ignored the range)."""


class HttpSource:
    """A static HTTP mirror serving BASE/blobs/<sha[:2]>/<sha> (idlegrad data publish)."""

    def __init__(self, base_url: str, timeout_s: float = 20.0):
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"a blob mirror must be an http:// or https:// URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.name = self.base_url
        self.timeout_s = timeout_s

    def open(self, sha256: str, offset: int):
        url = f"{self.base_url}/{blob_relpath(sha256).replace(os.sep, '/')}"
        request = urllib.request.Request(url, headers={"User-Agent": "idlegrad-cache"})
        if offset:
            request.add_header("Range", f"bytes={offset}-")
        try:
            response = urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            if exc.code == 416 and offset:  # our partial is as long as the blob, or longer
                raise SourceFailed(f"HTTP 416 for a resume at {offset}") from None
            raise SourceFailed(f"HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise SourceFailed(f"{getattr(exc, 'reason', exc)}") from None
        length = response.headers.get("Content-Length")
        length = int(length) if length and length.isdigit() else None
        if response.status == 206:
            start, total = _content_range(response.headers.get("Content-Range", ""))
            if start != offset:
                response.close()
                raise SourceFailed(f"asked for bytes from {offset}, got from {start}")
            return response, start, total
        return response, 0, length


class CoordinatorSource:
    """The coordinator as a source (coordinator/blobserve.py): a blob asked for chunk by chunk
    over the worker's session, `window` chunks asked at once and the next asked as each arrives,
    so that at most `window` chunks are ever in flight to this worker.

    The session's event loop `attach`es a thread-safe `send(message)` while connected, and hands
    every `chunk` it receives to `deliver`; the cache reads in its own thread (the compute
    thread), blocking on the chunks it waits for. Never benched: it is the source of last
    resort, and a session that ends fails only the downloads under way (resumed later)."""

    name = "coordinator"
    benchable = False

    def __init__(self, chunk_bytes: int = 1 << 20, window: int = 4, timeout_s: float = 30.0):
        self.chunk_bytes, self.window, self.timeout_s = chunk_bytes, window, timeout_s
        self._lock = threading.Lock()
        self._send: Optional[Callable] = None
        self._waiting: dict[int, "_ChunkStream"] = {}  # request id -> the stream that asked
        self._next_request = 0

    def attach(self, send: Callable) -> None:
        with self._lock:
            self._send = send

    def detach(self) -> None:
        with self._lock:
            self._send = None
            streams = set(self._waiting.values())
            self._waiting.clear()
        for stream in streams:
            stream.put("the session with the coordinator ended")

    def deliver(self, chunk) -> None:
        """A `chunk` message (from the loop's thread): to the stream that asked, if any still
        waits (a late answer to a stream given up is dropped)."""
        with self._lock:
            stream = self._waiting.pop(chunk.request, None)
        if stream is not None:
            stream.put(chunk)

    def ask(self, stream: "_ChunkStream", offset: int) -> None:
        from ..common.protocol import Fetch

        with self._lock:
            send = self._send
            if send is None:
                raise ConnectionError("not connected to the coordinator")
            request = self._next_request
            self._next_request += 1
            self._waiting[request] = stream
        send(Fetch(request=request, sha256=stream.sha256, offset=offset, length=self.chunk_bytes))

    def forget(self, stream: "_ChunkStream") -> None:
        with self._lock:
            for request in [r for r, s in self._waiting.items() if s is stream]:
                del self._waiting[request]

    def open(self, sha256: str, offset: int):
        stream = _ChunkStream(self, check_sha256(sha256), offset)
        try:
            total = stream.start()
        except OSError as exc:
            stream.close()
            raise SourceFailed(str(exc)) from None
        return stream, offset, total


class _ChunkStream:
    """A blob from the coordinator from `offset` on, read like a response body."""

    def __init__(self, source: CoordinatorSource, sha256: str, offset: int):
        import queue

        self.source, self.sha256 = source, sha256
        self.position = offset  # of the next byte `read` returns
        self.asked = offset  # the end of what was asked for
        self.total: Optional[int] = None
        self._arrived: "queue.Queue" = queue.Queue()
        self._chunks: dict[int, memoryview] = {}  # offset -> bytes arrived ahead of `position`
        self._buffer = memoryview(b"")

    def put(self, item) -> None:
        self._arrived.put(item)

    def _ask_more(self) -> None:
        outstanding = (self.asked - self.position - len(self._buffer)
                       - sum(len(c) for c in self._chunks.values()))
        while self.asked < self.total and outstanding < self.source.window * self.source.chunk_bytes:
            self.source.ask(self, self.asked)
            self.asked += self.source.chunk_bytes
            outstanding += self.source.chunk_bytes

    def _take(self) -> None:
        import queue

        try:
            item = self._arrived.get(timeout=self.source.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no chunk from the coordinator within {self.source.timeout_s:g} s") from None
        if isinstance(item, str):
            raise ConnectionError(item)
        if item.error:
            raise ConnectionError(f"the coordinator says: {item.error}")
        if self.total is None:
            self.total = item.total
        data = memoryview(item.data if item.data is not None else b"")
        expected = min(self.source.chunk_bytes, self.total - item.offset)
        if (item.total != self.total or item.offset < self.position
                or item.offset >= self.asked or len(data) != expected):
            raise ConnectionError(f"a chunk at {item.offset} of {len(data)} bytes of a blob of "
                                  f"{item.total} was not asked for")
        self._chunks[item.offset] = data

    def start(self) -> int:
        """Ask for the first chunk (it tells the blob's size), then for the window."""
        self.source.ask(self, self.asked)
        self.asked += self.source.chunk_bytes
        self._take()
        self._ask_more()
        return self.total

    def read(self, n: int = -1) -> bytes:
        while not len(self._buffer):
            if self.position >= self.total:
                return b""
            if self.position in self._chunks:
                self._buffer = self._chunks.pop(self.position)
                self._ask_more()
            else:
                self._take()
        n = len(self._buffer) if n is None or n < 0 else n
        out = bytes(self._buffer[:n])
        self._buffer = self._buffer[n:]
        self.position += len(out)
        return out

    def close(self) -> None:
        self.source.forget(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _content_range(value: str) -> tuple[Optional[int], Optional[int]]:
    """'bytes START-END/TOTAL' -> (START, TOTAL); unknown parts None."""
    try:
        unit, _, spec = value.strip().partition(" ")
        span, _, total = spec.partition("/")
        start = int(span.partition("-")[0])
        return start, (int(total) if total.isdigit() else None)
    except ValueError:
        return None, None


# the cache ---------------------------------------------------------------------------------------


class BlobCache:
    """`path_of(sha256, size)`: the local path of a whole, checked blob, fetched if need be.
    What ShardedDataset (common/sharded.py) asks of a store."""

    def __init__(self, root: str, max_bytes: int, sources: Sequence[Source] = (), *,
                 rate_bytes_per_s: Optional[float] = None, daily_bytes: Optional[int] = None,
                 health: Optional[SourceHealth] = None, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep):
        self.root = root
        self.max_bytes = int(max_bytes)
        self.sources = list(sources)
        self.health = health or SourceHealth()
        self.clock, self.sleep = clock, sleep
        self.rate = RateLimiter(rate_bytes_per_s)
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
        self._verified: dict[str, tuple[int, int]] = {}  # sha256 -> (inode, size) checked here
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
                mark = (st.st_ino, st.st_size)
                if (size is None or st.st_size == size) and (
                        self._verified.get(sha256) == mark or sha256_file(path) == sha256):
                    self._verified[sha256] = mark
                    now = self.clock()
                    os.utime(path, (now, now))  # its last use, for LRU
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
                    log.warning("cache: %s failed for %s (%s)", source.name, sha256[:12], exc)
                    reasons.append(f"{source.name}: {exc}")
                    continue
                wait = self.health.failed(source.name, self.clock())
                log.warning("cache: %s failed for %s (%s); skipping it for %.0f s", source.name,
                            sha256[:12], exc, wait)
                reasons.append(f"{source.name}: {exc}")
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
        partial = self._partial(sha256)
        offset = os.path.getsize(partial) if os.path.exists(partial) else 0
        if size is not None and offset >= size:
            os.unlink(partial)  # as long as the blob yet not renamed: start afresh
            offset = 0
        stream, start, total = source.open(sha256, offset)
        with stream:
            if size is not None and total is not None and total != size:
                raise SourceFailed(f"serves {total} bytes, the manifest says {size}")
            expected = size if size is not None else total
            if size is None and total is not None:
                self._make_room(sha256, total)
            try:
                with open(partial, "r+b" if start and os.path.exists(partial) else "wb") as out:
                    out.seek(start)
                    out.truncate()
                    self._copy(stream, out, sha256, start, expected, source.name)
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
            _remove(partial)  # which bytes lie is unknowable: the next source starts from 0
            raise SourceFailed("its bytes do not hash to the blob's name")
        path = self._path(sha256)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.replace(partial, path)
        now = self.clock()
        os.utime(path, (now, now))
        st = os.stat(path)
        self._verified[sha256] = (st.st_ino, st.st_size)  # hashed just now: no more on a hit
        return path

    def _copy(self, stream, out, sha256: str, start: int, expected: Optional[int],
              source: str = "") -> None:
        written = start
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
                    self.bytes_from[source] = self.bytes_from.get(source, 0) + len(block)
                self.allowance.spend(self.clock(), len(block))
                if expected is not None and written > expected:
                    raise SourceFailed(f"sends more than the {expected} bytes of the blob")
                if expected is None and written > self.max_bytes:  # an endless body, unasked
                    raise SourceFailed(f"sends more than the cache's cap of {self.max_bytes} bytes")
        except (OSError, ValueError, http.client.HTTPException) as exc:
            # a timeout, a reset, a body cut short: the bytes so far are kept for a resume
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise SourceFailed(f"broke off after {written} bytes: {exc or type(exc).__name__}") from None
        finally:
            self._save_allowance()

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
