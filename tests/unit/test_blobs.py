"""Packing data sets into content-addressed shards and reading them back (common/blobs.py,
common/sharded.py): round trips equal to the source, names that are the bytes' sha256."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import torch

from idlegrad.common import blobs
from idlegrad.common.blobs import (BlobError, BlobFolder, DataError, Manifest, check_sha256,
                                   pack_arrays, pack_corpus, pack_dataset, publish)
from idlegrad.common.sharded import ShardedDataset


def every_blob_matches_its_name(root: str) -> int:
    folder = BlobFolder(root)
    names = list(folder.names())
    for name in names:
        assert blobs.sha256_file(folder.path_of(name)) == name
    return len(names)


def test_corpus_round_trip_is_the_concatenated_files_cut_into_windows(tmp_path):
    src = tmp_path / "corpus"
    (src / "b").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"hello world, " * 50)
    (src / "b" / "c.txt").write_bytes(bytes(range(256)) * 3)
    (src / ".hidden").write_bytes(b"not data")
    text = (src / "a.txt").read_bytes() + (src / "b" / "c.txt").read_bytes()
    manifest = pack_corpus(str(src), str(tmp_path / "out"), window=17, shard_mb=200 / 2**20)
    assert len(manifest.shards) > 3  # small shards: reading crosses shard borders
    ds = ShardedDataset(str(tmp_path / "out" / "manifest.json"))
    assert len(ds) == len(text) // 17
    got = b"".join(bytes(ds[i].numpy()) for i in range(len(ds)))
    assert got == text[:len(ds) * 17]
    assert ds[0].dtype == torch.uint8 and ds[0].shape == (17,)
    assert manifest.decode["dropped_tail_bytes"] == len(text) % 17
    assert every_blob_matches_its_name(str(tmp_path / "out")) == len(manifest.shards) + 1


def test_arrays_round_trip_and_the_manifest_names_itself(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((103, 3, 4)).astype(np.float32)
    y = rng.integers(0, 10, 103).astype(np.int64)
    manifest = pack_arrays(x, y, str(tmp_path / "out"), shard_mb=500 / 2**20)
    data = (tmp_path / "out" / "manifest.json").read_bytes()
    assert hashlib.sha256(data).hexdigest() == manifest.sha256
    doc = json.loads(data)
    assert doc["format"] == "idlegrad-shards/1" and doc["samples"] == 103
    assert doc["fields"] == [{"name": "inputs", "dtype": "float32", "shape": [3, 4]},
                             {"name": "targets", "dtype": "int64", "shape": []}]
    start = 0
    for shard in doc["shards"]:
        path = BlobFolder(str(tmp_path / "out")).path_of(shard["sha256"])
        assert os.path.getsize(path) == shard["size"]
        # the layout other tools may read: field by field, raw little-endian
        end = start + shard["samples"]
        assert open(path, "rb").read() == x[start:end].astype("<f4").tobytes() + y[start:end].astype("<i8").tobytes()
        start = end
    ds = ShardedDataset(str(tmp_path / "out" / "manifest.json"))
    assert ds.manifest_sha256 == manifest.sha256
    xs, ys = zip(*(ds[i] for i in range(len(ds))))
    assert np.array_equal(torch.stack(xs).numpy(), x) and np.array_equal(torch.stack(ys).numpy(), y)
    assert torch.equal(ds[-1][0], torch.from_numpy(x[-1]))
    with pytest.raises(IndexError):
        ds[103]


def test_a_reader_opens_only_the_shards_it_reads(tmp_path):
    x = np.arange(100, dtype=np.int32).reshape(100, 1)
    pack_arrays(x, x[:, 0], str(tmp_path / "out"), shard_mb=80 / 2**20)  # 10 samples a shard
    ds = ShardedDataset(str(tmp_path / "out" / "manifest.json"))
    assert int(ds[55][1]) == 55 and int(ds[9][0][0]) == 9
    assert ds.opened_shards() == [0, 5]


def test_a_job_train_set_round_trips_and_packing_is_deterministic(tmp_path):
    from idlegrad.common.job import load_job

    train, _ = load_job("synthetic", {"samples": 300}).build_datasets()
    first = pack_dataset(train, str(tmp_path / "a"), shard_mb=0.001)
    again = pack_dataset(train, str(tmp_path / "b"), shard_mb=0.001)
    assert first.sha256 == again.sha256  # same data, same name, on every machine
    ds = ShardedDataset(str(tmp_path / "a" / "manifest.json"))
    assert len(ds) == len(train)
    for i in (0, 17, len(train) - 1):
        assert all(torch.equal(a, b) for a, b in zip(ds[i], train[i]))


def test_the_fingerprint_folds_in_the_manifest_and_is_unchanged_without_one(tmp_path):
    from idlegrad.common.job import Job, build, load_job

    plain = load_job("synthetic", {"samples": 300, "params": 500})
    fingerprint = build(plain).fingerprint
    assert fingerprint == "2536fc6d6149c86b"  # what it was before manifests existed
    train, test = plain.build_datasets()
    prints = []
    for scale in (1.0, 2.0):  # same sizes, different bytes
        out = tmp_path / str(scale)
        pack_arrays(train.tensors[0].numpy() * scale, train.tensors[1].numpy(), str(out))
        sharded = ShardedDataset(str(out / "manifest.json"))
        job = Job(**{**plain.__dict__, "build_datasets": lambda s=sharded: (s, test)})
        prints.append(build(job).fingerprint)
    assert prints[0] != prints[1] and fingerprint not in prints


def test_a_manifest_from_elsewhere_is_checked(tmp_path):
    x = np.zeros((4, 2), np.float32)
    manifest = pack_arrays(x, x, str(tmp_path / "out"))
    data = manifest.to_bytes()
    with pytest.raises(BlobError, match="hash"):
        Manifest.from_bytes(data, "0" * 64)
    evil = json.loads(data)
    evil["shards"][0]["sha256"] = "../../etc/passwd"
    with pytest.raises(BlobError, match="not a blob name"):
        Manifest.from_bytes(json.dumps(evil).encode())
    evil = json.loads(data)
    evil["fields"][0]["dtype"] = "object"
    with pytest.raises(BlobError, match="field"):
        Manifest.from_bytes(json.dumps(evil).encode())
    evil = json.loads(data)
    evil["shards"][0]["size"] += 1
    with pytest.raises(BlobError, match="not 4 samples"):
        Manifest.from_bytes(json.dumps(evil).encode())
    for bad in ("A" * 64, "0" * 63, "0" * 64 + "\n", None, "../" + "0" * 61):
        with pytest.raises(BlobError):
            check_sha256(bad)


def test_publish_lays_out_a_mirror_and_refuses_a_damaged_pack(tmp_path):
    x = np.arange(60, dtype=np.float64).reshape(30, 2)
    manifest = pack_arrays(x, x[:, 0], str(tmp_path / "pack"), shard_mb=160 / 2**20)
    m, copied, present = publish(str(tmp_path / "pack"), str(tmp_path / "mirror"))
    assert (copied, present) == (len(manifest.shards) + 1, 0)
    sha = manifest.sha256
    assert (tmp_path / "mirror" / "blobs" / sha[:2] / sha).read_bytes() == manifest.to_bytes()
    assert every_blob_matches_its_name(str(tmp_path / "mirror")) == copied
    assert publish(str(tmp_path / "pack"), str(tmp_path / "mirror"))[1:] == (0, copied)
    ds = ShardedDataset(manifest, BlobFolder(str(tmp_path / "mirror")))
    assert np.array_equal(ds[29][0].numpy(), x[29])
    shard = BlobFolder(str(tmp_path / "pack")).path_of(manifest.shards[1].sha256)
    with open(shard, "r+b") as fh:
        fh.write(b"\x01")
    with pytest.raises(DataError, match="damaged"):
        publish(str(tmp_path / "pack"), str(tmp_path / "mirror2"))


def test_bad_sources_are_one_clear_error(tmp_path):
    with pytest.raises(DataError, match="not a folder"):
        pack_corpus(str(tmp_path / "none"), str(tmp_path / "o"), window=4)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "t.txt").write_bytes(b"abc")
    with pytest.raises(DataError, match="fewer than"):
        pack_corpus(str(tmp_path / "tiny"), str(tmp_path / "o"), window=4)
    with pytest.raises(DataError, match="same first dimension"):
        pack_arrays(np.zeros((3, 1)), np.zeros(4), str(tmp_path / "o"))
    with pytest.raises(DataError, match="cannot be packed"):
        pack_arrays(np.array([object()] * 2), np.zeros(2), str(tmp_path / "o"))
