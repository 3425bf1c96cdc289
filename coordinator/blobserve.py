"""The coordinator serves the blobs of its job's data: what is served, to whom, in what order.

A worker asks for a blob chunk by chunk (`fetch`: name, offset, length); it keeps a few chunks
asked for at once (its window) and asks for the next as each arrives, so the bytes in flight to
one worker are bounded by its window. The coordinator queues what it is asked (a few requests per
worker, a few more per key however many worker names it holds, a bound overall) and answers in
passes of its event loop: each pass reads and sends at most `pass_bytes`, taking the keys in
turn (the owners: without keys, the workers), and the messages that arrived meanwhile (results,
heartbeats) are handled between two passes. Serving never holds the loop longer than one pass,
and 256 names of one key get the turns of one key.

Requests are untrusted: a name is answered only when it is a blob of the served pack (its
manifest or a shard), and an offset only inside that blob; anything else is answered with a
one-line error, and counted. Pure (no sockets, no clock, no disk): the pack's opening, the reads
and the sends are the data plane's (coordinator/dataplane.py).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Optional

from ..common import protocol as proto
from ..common.blobs import Manifest

PASS_BYTES = 4 << 20  # read and sent per pass of the loop, at most (plus one chunk)
QUEUE_PER_WORKER = 16  # requests waiting per worker; an honest worker's window is below it
QUEUE_PER_OWNER = 32  # requests waiting per key, all its worker names together (budgets.py)
QUEUE_TOTAL = 4096  # requests waiting, all workers together


@dataclass(frozen=True)
class Serve:
    """One chunk to read and send: `length` bytes of `sha256` from `offset`."""

    worker: str
    request: int
    sha256: str
    offset: int
    length: int
    total: int


class BlobService:
    """What the coordinator serves, and the queue of what it was asked (pure). The blobs of a
    pack (`manifest`, None without --data), and the model snapshots `add`ed while they are
    kept (coordinator/snapshots.py)."""

    def __init__(self, manifest: Optional[Manifest], pass_bytes: int = PASS_BYTES,
                 queue_per_worker: int = QUEUE_PER_WORKER, queue_total: int = QUEUE_TOTAL,
                 queue_per_owner: int = QUEUE_PER_OWNER):
        self.manifest = manifest
        self.sizes: dict[str, int] = {}
        if manifest is not None:
            self.sizes = {s.sha256: s.size for s in manifest.shards}
            self.sizes[manifest.sha256] = len(manifest.to_bytes())
        self.snapshots: set[str] = set()  # names added, served while kept
        # (worker, snapshot) -> bytes sent: a snapshot goes to a worker once, whatever its tasks
        self.snapshot_bytes_to: Counter[tuple[str, str]] = Counter()
        self.pass_bytes = pass_bytes
        self.queue_per_worker = queue_per_worker
        self.queue_total = queue_total
        self.queue_per_owner = queue_per_owner
        # owner (a key's identity, or a worker) -> its requests; in turn: the first is next
        self._queues: OrderedDict[str, deque[Serve]] = OrderedDict()
        self._waiting: Counter[str] = Counter()  # worker -> its requests queued
        self._owner: dict[str, str] = {}  # worker -> the owner it queued under
        self._queued = 0
        self.counters: Counter[str] = Counter()  # chunks_sent, bytes_sent, refused_*
        self.bytes_to: Counter[str] = Counter()  # worker -> bytes sent to it
        self.caches: dict[str, dict[str, int]] = {}  # worker -> its cache counters (heartbeats)

    @property
    def pending(self) -> bool:
        return self._queued > 0

    def known(self, sha256: str) -> bool:
        return sha256 in self.sizes

    def add(self, sha256: str, size: int) -> None:
        """Serve a model snapshot, from now until it is `remove`d."""
        self.sizes[sha256] = size
        self.snapshots.add(sha256)

    def remove(self, sha256: str) -> None:
        """A snapshot no open round names: asked for from now on, it is unknown here. (A
        request already queued finds its file gone, and is answered with an error.)"""
        if sha256 in self.snapshots:
            self.snapshots.discard(sha256)
            del self.sizes[sha256]
            for pair in [p for p in self.snapshot_bytes_to if p[1] == sha256]:
                del self.snapshot_bytes_to[pair]

    def request(self, worker: str, fetch: proto.Fetch,
                owner: Optional[str] = None) -> Optional[proto.Chunk]:
        """Queue a fetch of `worker` (held by `owner`, its key's identity; None: itself); or the
        refusal to send at once (a name not served, an offset outside the blob, too many
        requests waiting: of the worker, of its owner, or of everyone)."""
        owner = owner if owner is not None else worker
        total = self.sizes.get(fetch.sha256)
        refuse = None
        if total is None:
            refuse, reason = "unknown", "not a blob this coordinator serves (now)"
        elif fetch.offset >= total and total > 0:
            refuse, reason = "range", f"offset {fetch.offset} is past the end ({total} bytes)"
        else:
            queue = self._queues.get(owner)
            if (self._waiting[worker] >= self.queue_per_worker
                    or (queue is not None and len(queue) >= self.queue_per_owner)
                    or self._queued >= self.queue_total
                    or self._owner.get(worker, owner) != owner):
                refuse, reason = "busy", "busy: too many requests waiting; ask again"
        if refuse is not None:
            self.counters["refused_" + refuse] += 1
            return proto.Chunk(request=fetch.request, sha256=fetch.sha256, offset=fetch.offset,
                               total=total or 0, error=reason)
        assert total is not None  # an unknown blob is refused above
        length = min(fetch.length, total - fetch.offset)
        self._queues.setdefault(owner, deque()).append(
            Serve(worker, fetch.request, fetch.sha256, fetch.offset, length, total))
        self._queued += 1
        self._waiting[worker] += 1
        self._owner[worker] = owner
        return None

    def take(self) -> list[Serve]:
        """The chunks of one pass: owners in turn, one chunk each per turn, until `pass_bytes`
        are taken (at least one chunk, so a pass always makes progress)."""
        out: list[Serve] = []
        taken = 0
        while self._queues and (not out or taken < self.pass_bytes):
            owner, queue = next(iter(self._queues.items()))
            serve = queue.popleft()
            self._queued -= 1
            self._dequeued(serve.worker)
            if queue:
                self._queues.move_to_end(owner)  # its next chunk waits for the others' turn
            else:
                del self._queues[owner]
            out.append(serve)
            taken += serve.length
        return out

    def sent(self, serve: Serve) -> None:
        self.counters["chunks_sent"] += 1
        self.counters["bytes_sent"] += serve.length
        self.bytes_to[serve.worker] += serve.length
        if serve.sha256 in self.snapshots:
            self.counters["snapshot_bytes_sent"] += serve.length
            pair = (serve.worker, serve.sha256)
            before = self.snapshot_bytes_to[pair]
            self.snapshot_bytes_to[pair] = before + serve.length
            if before < serve.total <= before + serve.length:
                self.counters["snapshots_sent"] += 1  # a whole snapshot's worth, to one worker
            elif before >= serve.total:  # a worker asked again for one it had whole
                self.counters["snapshot_bytes_again"] += serve.length

    def failed(self, serve: Serve) -> proto.Chunk:
        """A read of the pack failed here (a file gone or damaged): the worker hears one line,
        and tries its other sources."""
        self.counters["read_errors"] += 1
        return proto.Chunk(request=serve.request, sha256=serve.sha256, offset=serve.offset,
                           total=serve.total, error="the coordinator cannot read this blob now")

    def report(self, worker: str, cache: dict[str, int]) -> None:
        """A worker's heartbeat told its cache counters (schema-checked: known names, ints)."""
        self.caches[worker] = dict(cache)

    def _dequeued(self, worker: str) -> None:
        self._waiting[worker] -= 1
        if self._waiting[worker] <= 0:
            del self._waiting[worker]
            self._owner.pop(worker, None)

    def forget(self, worker: str) -> None:
        owner = self._owner.get(worker)
        queue = self._queues.get(owner) if owner is not None else None
        if owner is not None and queue is not None:
            kept = deque(s for s in queue if s.worker != worker)
            self._queued -= len(queue) - len(kept)
            if kept:
                self._queues[owner] = kept
            else:
                del self._queues[owner]
        self._waiting.pop(worker, None)
        self._owner.pop(worker, None)
        self.caches.pop(worker, None)
        for pair in [p for p in self.snapshot_bytes_to if p[0] == worker]:
            del self.snapshot_bytes_to[pair]

    def summary(self) -> dict:
        """For the status snapshot and the metrics log: what was served here, and what the
        workers say of their caches (summed over the workers present)."""
        workers: Counter[str] = Counter()
        for cache in self.caches.values():
            workers.update(cache)
        pack = {} if self.manifest is None else {
            "manifest": self.manifest.sha256, "shards": len(self.manifest.shards),
            "bytes": sum(s.size for s in self.manifest.shards)}
        return {
            **pack,
            "served_bytes": self.counters["bytes_sent"],
            "snapshot_served_bytes": self.counters["snapshot_bytes_sent"],
            "snapshots_served": self.counters["snapshots_sent"],
            "snapshot_bytes_again": self.counters["snapshot_bytes_again"],
            "served_chunks": self.counters["chunks_sent"],
            "refused": sum(v for k, v in self.counters.items() if k.startswith("refused_")),
            "queued": self._queued,
            "workers_reporting": len(self.caches),
            "cache_hits": workers["hits"], "downloads": workers["downloads"],
            "downloads_in_flight": workers["in_flight"],
            "bytes_from_mirrors": workers["bytes_mirrors"],
            "bytes_from_coordinator": workers["bytes_coordinator"],
        }

