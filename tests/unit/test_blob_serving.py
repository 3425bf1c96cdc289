"""The coordinator serving blobs (coordinator/blobserve.py) and the worker's cache fetching them
through `CoordinatorSource` (worker/cache.py): the messages' schema, what is served and in what
order, the window of chunks in flight, and the cache's fall-back from a mirror to the
coordinator. The coordinator's side is its real service and disk reads, run in a thread that
stands for the event loop (no sockets: the wire is tested in tests/integration)."""

from __future__ import annotations

import queue
import threading

import msgpack
import numpy as np
import pytest

from idlegrad.common import protocol as proto
from idlegrad.common.blobs import BlobFolder, pack_arrays, publish, sha256_file
from idlegrad.common.errors import ProtocolError
from idlegrad.coordinator.blobserve import BlobService
from idlegrad.coordinator.dataplane import read_chunk
from idlegrad.worker.cache import BlobCache, CoordinatorSource, HttpSource

from .blob_mirror import Mirror

SHA = "ab" * 32


@pytest.fixture
def pack(tmp_path):
    """A pack of 3 shards of 40,000 bytes (and a smaller last one)."""
    x = np.arange(12_000 * 9, dtype=np.float32).reshape(12_000, 9)
    manifest = pack_arrays(x, np.arange(12_000, dtype=np.int32), str(tmp_path / "pack"),
                           shard_mb=40_000 / 2**20)
    return manifest, BlobFolder(str(tmp_path / "pack"))


# the messages ------------------------------------------------------------------------------------


def test_fetch_and_chunk_travel_with_the_bytes_in_one_raw_frame():
    chunk = proto.Chunk(request=7, sha256=SHA, offset=10, total=20, data=b"0123456789")
    frames = proto.encode(chunk)
    assert len(frames) == 2 and frames[1] == b"0123456789"
    back = proto.decode(frames)
    assert (back.request, back.offset, back.total, bytes(back.data)) == (7, 10, 20, b"0123456789")
    fetch = proto.decode(proto.encode(proto.Fetch(request=1, sha256=SHA, offset=5, length=99)))
    assert (fetch.sha256, fetch.offset, fetch.length) == (SHA, 5, 99)


def header(**fields) -> bytes:
    return msgpack.packb({"v": proto.PROTOCOL_VERSION, **fields}, use_bin_type=True)


@pytest.mark.parametrize("frames", [
    [header(type="fetch", request=1, sha256="../../etc/passwd", offset=0, length=1)],
    [header(type="fetch", request=1, sha256=SHA.upper(), offset=0, length=1)],
    [header(type="fetch", request=1, sha256=SHA, offset=-1, length=1)],
    [header(type="fetch", request=1, sha256=SHA, offset=0, length=0)],
    [header(type="fetch", request=1, sha256=SHA, offset=0, length=proto.MAX_CHUNK_BYTES + 1)],
    # a chunk whose frame is not the announced length, is missing, or runs past the blob
    [header(type="chunk", request=1, sha256=SHA, offset=0, total=9, data={"nbytes": 4}), b"12345"],
    [header(type="chunk", request=1, sha256=SHA, offset=0, total=9, data={"nbytes": 4})],
    [header(type="chunk", request=1, sha256=SHA, offset=8, total=9, data={"nbytes": 2}), b"12"],
    [header(type="chunk", request=1, sha256=SHA, offset=0, total=9, data={"nbytes": 2, "x": 1}),
     b"12"],
    [header(type="heartbeat", state="idle", cache={"hits": -1})],
    [header(type="heartbeat", state="idle", cache={"rm -rf": 1})],
    [header(type="heartbeat", state="idle", cache={"hits": "many"})],
], ids=lambda f: msgpack.unpackb(f[0]).get("type") + str(id(f))[-3:])
def test_bad_data_plane_messages_are_refused(frames):
    with pytest.raises(ProtocolError):
        proto.decode(frames)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://host/x", "http://", "http:///x",
                                 "http://host/a b", "http://host/?q=1", "http://host/#x",
                                 "javascript:alert(1)", "http://h/" + "a" * proto.MAX_URL,
                                 'http://h/"><script>'])
def test_a_welcome_names_only_plain_http_mirrors(url):
    welcome = dict(type="welcome", job="packed", job_args={}, fingerprint="f", seed=0,
                   heartbeat_s=1.0, liveness=3, blob_mirrors=[url])
    with pytest.raises(ProtocolError):
        proto.decode([header(**welcome)])
    welcome["blob_mirrors"] = ["https://mirror.example.org:8443/data"]
    assert proto.decode([header(**welcome)]).blob_mirrors == welcome["blob_mirrors"]


# the service -------------------------------------------------------------------------------------


def fetch(sha, offset=0, length=proto.MAX_CHUNK_BYTES, request=0):
    return proto.Fetch(request=request, sha256=sha, offset=offset, length=length)


def test_only_the_packs_blobs_within_their_bounds_are_served(pack):
    manifest, folder = pack
    service = BlobService(manifest)
    shard = manifest.shards[0]
    refusal = service.request("w", fetch(SHA))
    assert refusal.error and refusal.data is None
    assert service.request("w", fetch(shard.sha256, offset=shard.size)).error
    assert service.counters["refused_unknown"] == service.counters["refused_range"] == 1
    assert not service.pending
    # the length is clipped to the blob, and the manifest itself is served
    assert service.request("w", fetch(shard.sha256, offset=shard.size - 10)) is None
    assert service.request("w", fetch(manifest.sha256)) is None
    served = service.take()
    assert [(s.sha256, s.length) for s in served] == [
        (shard.sha256, 10), (manifest.sha256, len(manifest.to_bytes()))]
    assert read_chunk(folder, served[0]) == open(folder.path_of(shard.sha256), "rb").read()[-10:]


def test_requests_are_bounded_per_worker_and_served_in_turn_within_a_pass_budget(pack):
    manifest, _ = pack
    sha = manifest.shards[0].sha256
    service = BlobService(manifest, pass_bytes=21_500, queue_per_worker=3)
    for k in range(3):
        assert service.request("a", fetch(sha, 1000 * k, 1000, k)) is None
    assert service.request("a", fetch(sha, 5000, 1000, 9)).error.startswith("busy")
    assert service.request("b", fetch(sha, 0, 20_000, 1)) is None
    assert service.request("c", fetch(sha, 0, 1000, 1)) is None
    # a, b, c in turn, one chunk each; the pass ends once its budget (21,500 bytes) is spent
    assert [(s.worker, s.length) for s in service.take()] == [("a", 1000), ("b", 20_000),
                                                            ("c", 1000)]
    assert [s.worker for s in service.take()] == ["a", "a"]
    assert not service.pending
    service.request("a", fetch(sha, 0, 1000))
    service.forget("a")
    assert not service.pending and service.take() == []


def test_the_summary_adds_what_the_workers_report(pack):
    manifest, _ = pack
    service = BlobService(manifest)
    service.report("a", {"hits": 3, "bytes_mirrors": 10, "in_flight": 1})
    service.report("b", {"hits": 4, "bytes_coordinator": 7})
    service.report("a", {"hits": 5, "bytes_mirrors": 12})  # the latest count, not a sum
    summary = service.summary()
    assert (summary["cache_hits"], summary["bytes_from_mirrors"], summary["bytes_from_coordinator"],
            summary["downloads_in_flight"]) == (9, 12, 7, 0)
    service.forget("b")
    assert service.summary()["workers_reporting"] == 1


# the worker's cache fetching from the coordinator ---------------------------------------------------


class FakeLoop:
    """The coordinator's side in a thread: its real BlobService and disk reads, answering the
    requests the source sends, a few at a time (as a loop's passes would), and counting the
    requests in flight. `corrupt`: flip a byte of every chunk (a coordinator's disk gone bad)."""

    def __init__(self, source: CoordinatorSource, manifest, folder, corrupt=False):
        self.source, self.folder, self.corrupt = source, folder, corrupt
        self.service = BlobService(manifest)
        self.inbox: queue.Queue = queue.Queue()
        self.in_flight = self.most_in_flight = 0
        self.requests: list[proto.Fetch] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.run, daemon=True)
        source.attach(self.send)
        self.thread.start()

    def send(self, msg):
        with self.lock:
            self.requests.append(msg)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        self.inbox.put(msg)

    def run(self):
        while True:
            msg = self.inbox.get()
            if msg is None:
                return
            refusal = self.service.request("w", msg)
            answers = [refusal] if refusal is not None else []
            for serve in self.service.take():
                data = bytearray(read_chunk(self.folder, serve))
                if self.corrupt:
                    data[0] ^= 0xFF
                answers.append(proto.Chunk(request=serve.request, sha256=serve.sha256,
                                           offset=serve.offset, total=serve.total,
                                           data=bytes(data)))
            for answer in answers:
                with self.lock:
                    self.in_flight -= 1
                self.source.deliver(proto.decode(proto.encode(answer)))

    def stop(self):
        self.inbox.put(None)
        self.thread.join(5)


def test_a_blob_comes_from_the_coordinator_in_chunks_with_a_bounded_window(tmp_path, pack):
    manifest, folder = pack
    source = CoordinatorSource(chunk_bytes=4096, window=3, timeout_s=5)
    loop = FakeLoop(source, manifest, folder)
    try:
        cache = BlobCache(str(tmp_path / "cache"), 10**7, [source])
        shard = manifest.shards[1]
        path = cache.path_of(shard.sha256, shard.size)
        assert sha256_file(path) == shard.sha256
        assert len(loop.requests) == -(-shard.size // 4096)  # each chunk asked once
        assert 1 < loop.most_in_flight <= 3
        assert cache.counters()["bytes_coordinator"] == shard.size
        cache.path_of(shard.sha256, shard.size)
        assert cache.counters()["hits"] == 1 and len(loop.requests) == -(-shard.size // 4096)
    finally:
        loop.stop()


def test_a_mirror_that_lies_costs_one_try_then_the_coordinator_serves(tmp_path, pack):
    manifest, folder = pack
    publish(folder.root, str(tmp_path / "www"))
    source = CoordinatorSource(chunk_bytes=8192, window=2, timeout_s=5)
    loop = FakeLoop(source, manifest, folder)
    try:
        with Mirror(str(tmp_path / "www")) as mirror:
            mirror.lie = True
            cache = BlobCache(str(tmp_path / "cache"), 10**7, [HttpSource(mirror.url, 5), source])
            for shard in manifest.shards:
                assert sha256_file(cache.path_of(shard.sha256, shard.size)) == shard.sha256
            assert len(mirror.requests) == 1  # benched after its lie
        counters = cache.counters()
        assert counters["bytes_coordinator"] == sum(s.size for s in manifest.shards)
        assert counters["failures"] == 1 and counters["downloads"] == len(manifest.shards)
    finally:
        loop.stop()


def test_a_coordinator_serving_wrong_bytes_is_refused_and_asked_again_later(tmp_path, pack):
    manifest, folder = pack
    shard = manifest.shards[0]
    source = CoordinatorSource(chunk_bytes=8192, window=2, timeout_s=5)
    bad = FakeLoop(source, manifest, folder, corrupt=True)
    cache = BlobCache(str(tmp_path / "cache"), 10**7, [source])
    try:
        with pytest.raises(Exception, match="do not hash"):
            cache.path_of(shard.sha256, shard.size)
    finally:
        bad.stop()
    assert not cache.has(shard.sha256)
    good = FakeLoop(source, manifest, folder)  # never benched: the next try is served
    try:
        assert sha256_file(cache.path_of(shard.sha256, shard.size)) == shard.sha256
    finally:
        good.stop()


def test_a_session_that_ends_mid_blob_resumes_where_it_stopped(tmp_path, pack):
    manifest, folder = pack
    shard = manifest.shards[0]
    source = CoordinatorSource(chunk_bytes=4096, window=1, timeout_s=5)
    cache = BlobCache(str(tmp_path / "cache"), 10**7, [source])
    delivered = []

    def send(msg):  # answers three chunks, then the session ends
        if len(delivered) == 3:
            threading.Thread(target=source.detach).start()
            return
        data = read_chunk(folder, _serve(manifest, msg))
        delivered.append(msg.offset)
        threading.Thread(target=source.deliver, args=(proto.Chunk(
            request=msg.request, sha256=msg.sha256, offset=msg.offset, total=shard.size,
            data=data),)).start()

    source.attach(send)
    with pytest.raises(Exception, match="session with the coordinator ended"):
        cache.path_of(shard.sha256, shard.size)
    assert delivered == [0, 4096, 8192]
    loop = FakeLoop(source, manifest, folder)
    try:
        assert sha256_file(cache.path_of(shard.sha256, shard.size)) == shard.sha256
        assert loop.requests[0].offset == 3 * 4096  # resumed: the first 12 KiB were kept
    finally:
        loop.stop()


def _serve(manifest, msg):
    service = BlobService(manifest)
    assert service.request("w", msg) is None
    return service.take()[0]
