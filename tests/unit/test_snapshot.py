"""Model snapshots as blobs: the format (common/snapshot.py), the coordinator's snapshot folder
(coordinator/snapshots.py), the worker reading one (engine.read_snapshot), and a download under
the engine's pause gate: stopped at the next block when the owner wants the machine back, and
resumed from its partial file."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading

import pytest
import torch

from idlegrad.common import protocol as proto
from idlegrad.common import snapshot
from idlegrad.common.blobs import BlobError, BlobFolder
from idlegrad.common.builtin_jobs import digits
from idlegrad.common.job import build
from idlegrad.common.tensors import to_blob
from idlegrad.coordinator.blobserve import BlobService, Serve
from idlegrad.coordinator.snapshots import (SnapshotFolder, min_mb_for, uses_snapshots)
from idlegrad.worker.cache import BlobCache, HttpSource
from idlegrad.worker.engine import Engine, SnapshotRef, Work, read_snapshot

from .blob_mirror import Mirror
from .test_engine_pause import in_thread, report_waiting, until


@pytest.fixture(scope="module")
def built():
    return build(digits())


@pytest.fixture(scope="module")
def built_bn():
    return build(digits(norm="batch"))


def params_of(b, seed=0):
    return 0.2 * torch.randn(b.model.numel, generator=torch.Generator().manual_seed(seed))


def test_which_models_go_by_snapshot():
    assert min_mb_for(None, local_tasks=False, mirrors=True) == 8.0
    assert min_mb_for(None, local_tasks=True, mirrors=False) == 8.0
    assert min_mb_for(None, local_tasks=True, mirrors=True) == 1.0
    assert min_mb_for(3.0, local_tasks=True, mirrors=True) == 3.0
    assert not uses_snapshots(8 * 2**20 - 1, 8.0)
    assert uses_snapshots(8 * 2**20, 8.0)
    assert uses_snapshots(1, 0.0)


def test_a_snapshot_round_trips_with_its_buffers_and_has_one_size_per_model(tmp_path, built_bn):
    model = built_bn.model
    folder = SnapshotFolder(str(tmp_path / "snaps"))
    params, buffers = params_of(built_bn), model.buffers_flat() + 2.0
    sha, size = folder.publish(7, to_blob(params), to_blob(buffers))
    path = BlobFolder(str(tmp_path / "snaps")).path_of(sha, size)
    assert hashlib.sha256(open(path, "rb").read()).hexdigest() == sha
    got_params, got_buffers = read_snapshot(path, model, 7)
    assert torch.equal(got_params, params) and torch.equal(got_buffers, buffers)
    assert folder.publish(7, to_blob(params), to_blob(buffers)) == (sha, size)  # written once
    _, other_size = folder.publish(123456, to_blob(params * 2), to_blob(buffers))
    assert other_size == size  # the header area is padded: every version the same size
    with pytest.raises(BlobError, match="version 7"):
        read_snapshot(path, model, 8)


def test_a_reader_takes_the_parts_it_knows_and_skips_new_ones(tmp_path, built):
    params = params_of(built)
    extra = torch.arange(10, dtype=torch.float64)
    parts = [("moments", to_blob(extra)), ("params", to_blob(params))]
    path = tmp_path / "snap"
    path.write_bytes(b"".join(bytes(c) for c in snapshot.chunks(parts, 3)))
    got, buffers = read_snapshot(str(path), built.model, 3)
    assert torch.equal(got, params) and buffers is None


def header_bytes(doc: dict, body: bytes = b"") -> bytes:
    raw = json.dumps(doc).encode()
    head = snapshot.MAGIC + struct.pack("<I", len(raw)) + raw
    return head + b" " * (snapshot.HEADER_ALIGN - len(head)) + body


GOOD_PART = {"name": "params", "dtype": "float32", "numel": 2, "offset": snapshot.HEADER_ALIGN}


@pytest.mark.parametrize("data", [
    b"",
    b"NOTSNAP!" + bytes(100),
    snapshot.MAGIC + struct.pack("<I", 10**9) + b"{}",  # a header longer than the bytes
    snapshot.MAGIC + struct.pack("<I", snapshot.MAX_HEADER_BYTES + 1) + bytes(2 * 2**16),
    header_bytes({"format": "other/1", "version": 0, "parts": []}),
    header_bytes({"format": snapshot.FORMAT, "version": -1, "parts": []}),
    header_bytes({"format": snapshot.FORMAT, "version": 0, "parts": {}}),
    header_bytes({"format": snapshot.FORMAT, "version": 0, "parts": [GOOD_PART]}),  # no bytes
    header_bytes({"format": snapshot.FORMAT, "version": 0,
                  "parts": [{**GOOD_PART, "dtype": "object"}]}, bytes(8)),
    header_bytes({"format": snapshot.FORMAT, "version": 0,
                  "parts": [{**GOOD_PART, "offset": 4}]}, bytes(8)),  # inside the header
    header_bytes({"format": snapshot.FORMAT, "version": 0,
                  "parts": [GOOD_PART, {**GOOD_PART, "name": "buffers", "offset":
                                        snapshot.HEADER_ALIGN + 4}]}, bytes(16)),  # overlap
    header_bytes({"format": snapshot.FORMAT, "version": 0, "parts": [GOOD_PART, GOOD_PART]},
                 bytes(8)),  # a name twice
])
def test_bytes_that_are_not_a_snapshot_are_refused(data):
    with pytest.raises(BlobError):
        snapshot.parse(memoryview(data))


def test_a_snapshot_of_another_model_is_refused(tmp_path, built, built_bn):
    folder = SnapshotFolder(str(tmp_path / "snaps"))
    sha, size = folder.publish(0, to_blob(params_of(built)), None)
    path = folder.folder.path_of(sha, size)
    with pytest.raises(BlobError, match="not this job's model"):
        read_snapshot(path, built_bn.model, 0)  # of the same size, but it has buffers


def test_old_snapshots_are_pruned_and_a_restart_deletes_only_its_predecessors(tmp_path, built):
    root = str(tmp_path / "www")
    os.makedirs(root)
    other = BlobFolder(root).put_bytes(b"a shard of a published pack")
    folder = SnapshotFolder(root)
    names = {v: folder.publish(v, to_blob(params_of(built, v)), None)[0] for v in range(4)}
    gone = folder.prune(in_use=lambda v: v == 1, current=3)
    assert sorted(gone) == sorted([names[0], names[2]])
    assert folder.holds(names[1]) and folder.holds(names[3]) and not folder.holds(names[0])
    for v, sha in names.items():
        assert BlobFolder(root).has(sha) == (v in (1, 3))
    restarted = SnapshotFolder(root)  # the index names the two left: they go, the shard stays
    assert not BlobFolder(root).has(names[1]) and not BlobFolder(root).has(names[3])
    assert BlobFolder(root).has(other)
    assert restarted.names == {}


def test_the_blob_service_serves_a_snapshot_while_kept_and_counts_a_second_sending(tmp_path):
    service = BlobService(None)
    sha = "ab" * 32
    fetch = proto.Fetch(request=1, sha256=sha, offset=0, length=100)
    assert service.request("w", fetch).error  # not added yet: unknown
    service.add(sha, 150)
    assert service.request("w", fetch) is None
    for offset, length in ((0, 100), (100, 50)):
        service.sent(Serve("w", 1, sha, offset, length, 150))
    assert service.summary()["snapshots_served"] == 1
    assert service.summary()["snapshot_bytes_again"] == 0
    service.sent(Serve("w", 2, sha, 0, 100, 150))  # the same worker, asking for it again
    assert service.summary()["snapshot_bytes_again"] == 100
    service.remove(sha)
    assert service.request("w", fetch).error
    assert "manifest" not in service.summary()


def test_a_pause_during_a_slow_snapshot_download_stops_it_and_it_resumes_where_it_stopped(
        tmp_path, built):
    """The owner's pause reaches a download in the compute thread at its next block (here a few
    KB), not when the download ends; the connection is dropped, and after the resume the rest
    comes with a range request from the partial file's end."""
    params = params_of(built)
    folder = SnapshotFolder(str(tmp_path / "www"))
    sha, size = folder.publish(0, to_blob(params), None)
    plain = Engine(built, seed=3, device=torch.device("cpu")).compute(
        Work(1, 0, params, [[0, 0, 40]], [1.0]), threading.Event())

    with Mirror(str(tmp_path / "www")) as mirror:
        mirror.rate_bytes_per_s = 16 << 10  # about 3 s for the snapshot's 42 KB
        cache = BlobCache(str(tmp_path / "cache"), 10**8, [HttpSource(mirror.url)])
        engine = Engine(built, seed=3, device=torch.device("cpu"))
        engine.store = cache
        waiting = report_waiting(engine)
        running = threading.Event()
        running.set()
        work = Work(1, 0, None, [[0, 0, 40]], [1.0], snapshot=SnapshotRef(sha, size))
        t, outcome = in_thread(lambda: engine.compute(work, threading.Event(), running))
        assert until(lambda: mirror.sent >= 8192)
        running.clear()  # the owner is back
        assert until(lambda: waiting.is_set() or not t.is_alive())
        partial = tmp_path / "cache" / "partial" / sha
        stopped_at = os.path.getsize(partial)
        assert t.is_alive() and waiting.is_set()
        assert 0 < stopped_at < size, "the download ran on past the pause"
        assert cache.interrupted == 1 and not cache.has(sha)
        running.set()
        t.join(30)
        assert not t.is_alive() and "error" not in outcome, outcome
    assert torch.allclose(outcome["value"].gradient, plain.gradient, atol=1e-6)
    assert mirror.gets_of(sha) == ["", f"bytes={stopped_at}-"]
    assert cache.has(sha)


def test_an_evaluation_between_newer_training_versions_fetches_its_snapshot_once(tmp_path, built):
    """An evaluation's slots at one version interleave with training at each newer version; the
    engine keeps the snapshots it used last, so the evaluation's outlives the newer ones
    between its slots and comes once (first-loaded-first-dropped fetched it again)."""
    folder = SnapshotFolder(str(tmp_path / "www"))
    refs = [SnapshotRef(*folder.publish(v, to_blob(params_of(built, seed=v)), None))
            for v in range(Engine.SNAPSHOTS_KEPT + 3)]
    with Mirror(str(tmp_path / "www")) as mirror:
        engine = Engine(built, seed=3, device=torch.device("cpu"))
        engine.store = BlobCache(str(tmp_path / "cache"), 10**8, [HttpSource(mirror.url)])
        for version in range(1, len(refs)):
            evaluation = Work(100 + version, 0, None, [[0, 10 * version, 10]], [1.0], kind="eval",
                              snapshot=refs[0])
            training = Work(version, version, None, [[0, 0, 20]], [1.0], snapshot=refs[version])
            for work in (evaluation, training):
                assert engine.compute(work, threading.Event()).samples > 0
        assert mirror.gets_of(refs[0].sha256) == [""]
        assert [len(mirror.gets_of(ref.sha256)) for ref in refs[1:]] == [1] * (len(refs) - 1)
    # the older training versions went from the cache; the evaluation's stayed
    assert engine.store.has(refs[0].sha256) and engine.store.has(refs[-1].sha256)
    assert not engine.store.has(refs[1].sha256)
