"""Link emulation, for tests and benchmarks only (the worker's `--link-mbps`, off by default).

A volunteer's home connection moves perhaps 10 Mbit/s; loopback moves gigabytes. To make slow
links reproducible on one machine, the worker can pass its socket traffic through two token
buckets, one per direction (links are full duplex): a message of n bytes is delivered once the
link has had time to carry it, after every message before it in that direction.

`LinkShaper` is the pure part: it says how long a message waits, given `now`. `ShapedSocket`
wraps the daemon's asyncio DEALER: `recv_multipart` holds an arrived message back for its
delay (the event loop runs on meanwhile), and `send_multipart` queues the message to a sender
task that releases it when due, so the worker computes while it "uploads". Emulation only:
ZeroMQ itself still moves the bytes at loopback speed.
"""

from __future__ import annotations

import asyncio
import math
from typing import Optional

# ZeroMQ/TCP framing and headers cost some bytes per message beyond its frames.
OVERHEAD_BYTES = 64


class LinkShaper:
    """One direction of a link of `mbps` megabits per second, with a burst of `burst_bytes`
    that passes at once (small messages: heartbeats, READY, headers)."""

    def __init__(self, mbps: float, burst_bytes: int = 16 * 1024):
        if not (mbps > 0 and math.isfinite(mbps)):
            raise ValueError(f"link speed must be a positive number of Mbit/s, got {mbps!r}")
        self.bytes_per_s = mbps * 1e6 / 8
        self.burst_s = burst_bytes / self.bytes_per_s
        self.busy_until = -math.inf  # when the link has carried everything given to it so far
        self.carried = 0

    def delay(self, nbytes: int, now: float) -> float:
        """Seconds from `now` until a message of `nbytes`, handed over now, has crossed."""
        start = max(now - self.burst_s, self.busy_until)  # an idle link has banked its burst
        self.busy_until = start + (nbytes + OVERHEAD_BYTES) / self.bytes_per_s
        self.carried += nbytes
        return max(0.0, self.busy_until - now)


def frames_bytes(frames) -> int:
    return sum(memoryview(getattr(f, "buffer", f)).nbytes for f in frames)


class DeferredTracker:
    """A MessageTracker for a send that has not happened yet."""

    def __init__(self):
        self._tracker = None
        self._sent = False

    def sent(self, tracker) -> None:
        self._tracker, self._sent = tracker, True

    @property
    def done(self) -> bool:
        return self._sent and (self._tracker is None or self._tracker.done)


class ShapedSocket:
    """An asyncio ZeroMQ socket behind an emulated link of `mbps` each way."""

    def __init__(self, sock, mbps: float):
        self.sock = sock
        self.up = LinkShaper(mbps)
        self.down = LinkShaper(mbps)
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._sender: Optional[asyncio.Task] = None

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    async def send_multipart(self, frames, copy: bool = False, track: bool = False):
        """Queue `frames` for when the link has carried them; with `track`, a tracker that is
        done once they were handed to ZeroMQ and ZeroMQ is done with them (zero-copy buffers
        must not be reused before)."""
        due = self._now() + self.up.delay(frames_bytes(frames), self._now())
        if self._sender is None:
            self._sender = asyncio.ensure_future(self._send_when_due())
        tracker = DeferredTracker() if track else None
        self._outbox.put_nowait((due, list(frames), copy, tracker))
        return tracker

    async def _send_when_due(self) -> None:
        while True:
            due, frames, copy, tracker = await self._outbox.get()
            wait = due - self._now()
            if wait > 0:
                await asyncio.sleep(wait)
            sent = await self.sock.send_multipart(frames, copy=copy, track=tracker is not None)
            if tracker is not None:
                tracker.sent(sent)

    async def recv_multipart(self, *args, **kwargs):
        frames = await self.sock.recv_multipart(*args, **kwargs)
        wait = self.down.delay(frames_bytes(frames), self._now())
        if wait > 0:
            await asyncio.sleep(wait)
        return frames

    async def poll(self, *args, **kwargs):
        return await self.sock.poll(*args, **kwargs)

    def close(self, linger: Optional[int] = None) -> None:
        if self._sender is not None:
            self._sender.cancel()
            self._sender = None
        self.sock.close(linger=linger)
