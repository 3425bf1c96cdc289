"""Where the worker's blob cache (cache.py) fetches from: static HTTP mirrors and the
coordinator, each read like a response body, and what a download asks of a source's pace.

A mirror is untrusted, as every network peer is: its headers are checked before a byte of the
body is read (a `Content-Length` that is not the blob's size, a range that is not the one asked
for: `SourceFailed`), a refused resume says so (`ResumeRefused`: the partial file is discarded,
not the mirror blamed), and `DownloadPace` gives each download an overall deadline and a
minimum rate, so that a mirror dripping a byte every few seconds is left for the next source
instead of holding the worker forever. The bytes themselves are checked by the cache (sha256).
"""

from __future__ import annotations

import os
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from ..common.blobs import blob_relpath, check_sha256
from ..common.errors import ConfigError


class SourceFailed(Exception):
    """One source could not deliver one blob (kept inside the cache)."""


class ResumeRefused(SourceFailed):
    """The source refused a resume (HTTP 416): the partial file is as long as the blob or longer,
    left by an earlier source; the download starts again from 0."""


@dataclass
class DownloadPace:
    """One download's pace against its deadline and minimum rate. Pure: the caller passes the
    time. Within `grace_s` of its start a download may go at any pace (a connection warming up,
    a pause of the owner's rate cap); after that its average rate must stay at `min_bytes_per_s`
    or more, and it must end within `grace_s + expected / min_bytes_per_s` (what it would take at
    that rate), `expected` being the bytes it still has to fetch."""

    started: float
    expected: int
    min_bytes_per_s: float
    grace_s: float

    @property
    def deadline(self) -> float:
        return self.started + self.grace_s + self.expected / self.min_bytes_per_s

    def too_slow(self, now: float, received: int) -> Optional[str]:
        """Why the download is to be given up now, or None while it keeps pace."""
        elapsed = now - self.started
        if elapsed <= self.grace_s:
            return None
        if now > self.deadline:
            return (f"too slow: {received} of {self.expected} bytes in {elapsed:.0f} s, past the "
                    f"deadline of {self.deadline - self.started:.0f} s")
        rate = received / elapsed
        if rate < self.min_bytes_per_s:
            return (f"too slow: {rate:.0f} B/s over {elapsed:.0f} s, below the minimum of "
                    f"{self.min_bytes_per_s:.0f} B/s")
        return None


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
                raise ResumeRefused(f"HTTP 416 for a resume at {offset}") from None
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
            if total is not None and length is not None and length != total - start:
                response.close()  # headers that disagree: no body of theirs is read
                raise SourceFailed(f"Content-Length {length} for bytes {start} to {total}")
            if total is None and length is not None:
                total = start + length
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
