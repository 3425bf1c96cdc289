"""Disks that fail under a run: a shard corrupted under its memory map (common/sharded.py,
worker/engine.py), a full disk under the ledger, the metrics log and the checkpoint folder
(coordinator/ledger.py, records.py, training.py). Neither trains on bad bytes nor stops the
coordinator."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import threading

import numpy as np
import pytest
import torch

from idlegrad.common.blobs import pack_arrays, publish
from idlegrad.common.builtin_jobs import packed
from idlegrad.common.job import build
from idlegrad.coordinator import ledger as ledger_module
from idlegrad.coordinator.ledger import AppendFile, read
from idlegrad.coordinator.records import RunRecords
from idlegrad.worker.engine import Engine, Work

from .blob_mirror import Mirror
from .test_cache import SHARD, cache_for, publish_four_shards


@pytest.fixture
def published(tmp_path):
    return publish_four_shards(tmp_path)


def flip_a_byte(path: str, at: int) -> None:
    with open(path, "r+b") as fh:  # in place: the map made of the file shows it
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x40]))


def test_a_shard_corrupted_under_its_map_is_dropped_fetched_again_and_never_trained_on(
        tmp_path):
    x = np.arange(500, dtype=np.float32).reshape(500, 1) / 100
    manifest = pack_arrays(x, np.arange(500, dtype=np.int64) % 10, str(tmp_path / "pack"),
                           shard_mb=1500 / 2**20)  # 125 samples of 4 + 8 bytes a shard
    assert len(manifest.shards) == 4
    folder = str(tmp_path / "mirror")
    publish(str(tmp_path / "pack"), folder)
    with Mirror(folder) as mirror:
        cache = cache_for(tmp_path, [mirror])
        built = build(packed(data=manifest.sha256, features=1, classes=10, hidden=0,
                             batch_size=25, test_samples=10), store=cache)
        engine = Engine(built, seed=3, device=torch.device("cpu"))
        engine.store = cache
        params = 0.01 * torch.arange(built.model.numel, dtype=torch.float32)
        work = Work(1, 0, params, [[0, 0, 500]], [1.0])  # every sample: every shard read
        honest = engine.compute(work, threading.Event()).gradient.clone()
        shard = manifest.shards[1]
        flip_a_byte(cache.path_of(shard.sha256, shard.size), 3)  # a float's exponent
        asked = len(mirror.gets_of(shard.sha256))
        again = engine.compute(dataclasses.replace(work, slot=2), threading.Event())
        assert torch.allclose(again.gradient, honest, atol=1e-6)
        assert len(mirror.gets_of(shard.sha256)) == asked + 1  # dropped, and fetched again
        assert engine.built.train.corrupt_shards() == []


def test_a_shard_file_written_to_but_still_whole_is_hashed_again_and_kept(tmp_path, published):
    from idlegrad.common.sharded import ShardedDataset

    manifest, folder = published
    with Mirror(folder) as mirror:
        cache = cache_for(tmp_path, [mirror])
        data = ShardedDataset(manifest, cache)
        assert int(data[130][1]) == 130
        path = cache.path_of(manifest.shards[1].sha256, SHARD)
        flip_a_byte(path, 3)
        flip_a_byte(path, 3)  # back as it was: only its stat moved
        assert data.corrupt_shards() == [] and cache.has(manifest.shards[1].sha256)
        flip_a_byte(path, 3)
        assert data.corrupt_shards() == [manifest.shards[1].sha256]
        assert not cache.has(manifest.shards[1].sha256)
        assert int(data[130][1]) == 130  # fetched again on its next read


def full_disk_after(monkeypatch, path: str, working: list):
    """os.write to `path` fails with ENOSPC while `working` holds False."""
    real_write, fds = os.write, set()
    real_open = os.open

    def opening(name, flags, mode=0o777, **kw):
        fd = real_open(name, flags, mode, **kw)
        if os.path.abspath(name) == os.path.abspath(path):
            fds.add(fd)
        return fd

    def write(fd, data):
        if fd in fds and not working[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(ledger_module.os, "open", opening)
    monkeypatch.setattr(ledger_module.os, "write", write)


def test_a_full_disk_under_the_ledger_and_metrics_is_one_event_and_loses_no_line(tmp_path,
                                                                                 monkeypatch):
    ledger_path, metrics_path = str(tmp_path / "ledger.jsonl"), str(tmp_path / "metrics.jsonl")
    working = [True]
    events: list[tuple] = []
    full_disk_after(monkeypatch, ledger_path, working)
    records = RunRecords(metrics_path, ledger_path, "i1",
                         report=lambda kind, text, worker, level: events.append((kind, text, level)))
    records.open(version=0)
    working[0] = False
    for version in (1, 2, 3):
        records.write("applied", version=version, parts=[[0, version, 1]])
        records.sync()  # as before a checkpoint: never raises
    records.metrics({"version": 3})
    assert [(kind, level) for kind, _, level in events] == [("disk", logging.ERROR)]
    assert "No space left on device" in events[0][1] and "\n" not in events[0][1]
    working[0] = True
    records.write("applied", version=4, parts=[[0, 4, 1]])
    records.close()
    assert [r.get("version") for r in read(ledger_path)] == [0, 1, 2, 3, 4]
    assert events[-1][0] == "disk" and "written again" in events[-1][1]
    with open(metrics_path) as fh:
        assert [json.loads(line) for line in fh] == [{"version": 3}]


def test_a_write_cut_short_by_a_full_disk_leaves_one_torn_line_and_the_rest_whole(tmp_path,
                                                                                  monkeypatch):
    path = str(tmp_path / "ledger.jsonl")
    real_write = os.write
    cut = [True]

    def write(fd, data):
        if cut[0]:
            cut[0] = False
            return real_write(fd, data[:7])  # the disk took 7 bytes of the line
        return real_write(fd, data)

    appended = AppendFile(path, "the ledger")
    appended.write('{"event": "start", "version": 0}\n')
    monkeypatch.setattr(ledger_module.os, "write", write)
    appended.write('{"event": "applied", "version": 1, "parts": []}\n')
    assert appended.pending == 1 and appended.failing
    monkeypatch.undo()
    appended.write('{"event": "applied", "version": 2, "parts": []}\n')
    appended.close()
    assert [r["version"] for r in read(path)] == [0, 1, 2]
    with open(path) as fh:  # the torn piece on a line of its own, each record whole on its own
        lines = fh.read().splitlines()
    assert lines[1] == '{"event' and [json.loads(line)["version"] for line in lines[2:]] == [1, 2]


def test_a_full_disk_under_the_checkpoint_folder_is_an_event_and_training_goes_on(tmp_path,
                                                                                 monkeypatch):
    from idlegrad.coordinator import checkpoint

    from idlegrad.coordinator.server import CoordinatorConfig

    from .pair import Pair

    pair = Pair(CoordinatorConfig(job="synthetic", job_args={"params": 10, "batch_size": 16},
                                  epochs=1, checkpoint_dir=str(tmp_path / "ckpt")))
    try:
        def full(directory, state):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(checkpoint, "save", full)
        assert pair.coordinator.save_checkpoint() is None  # not raised: the run goes on
        texts = [e["text"] for e in pair.coordinator.training.events if e["kind"] == "disk"]
        assert len(texts) == 1 and "No space left on device" in texts[0]
        monkeypatch.undo()
        assert os.path.exists(pair.coordinator.save_checkpoint())  # the next save works
    finally:
        pair.close()
