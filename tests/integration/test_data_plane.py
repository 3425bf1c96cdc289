"""The data plane end to end: a real coordinator serving a packed data set (`--data DIR`), real
workers whose caches start empty fetching the shards they read (from the coordinator, or from a
real HTTP mirror on loopback first), and training on them. Faults: a mirror that lies or is down,
a shard corrupted in a worker's cache, a cache cap below one shard."""

from __future__ import annotations

import json

import numpy as np
import pytest

from idlegrad.cli.processes import wait_for_hellos
from idlegrad.common.blobs import BlobFolder, pack_arrays, publish, sha256_file
from tests.unit.blob_mirror import Mirror

from .harness import DEADLINE, final_metrics

pytestmark = pytest.mark.integration

PACKED = ("--job", "packed", "--job-arg", "features=16", "--job-arg", "classes=4",
          "--job-arg", "hidden=0")


@pytest.fixture
def pack(tmp_path):
    """A learnable classification set packed in 7 shards of at most 21 KB."""
    rng = np.random.RandomState(1)
    x = rng.standard_normal((1800, 16)).astype(np.float32)
    y = (x @ rng.standard_normal((16, 4))).argmax(axis=1).astype(np.int64)
    out = tmp_path / "pack"
    manifest = pack_arrays(x, y, str(out), shard_mb=0.02)
    assert len(manifest.shards) == 7  # six of 291 samples, one of 54
    return out, manifest


def cached(cache_dir, manifest) -> list[str]:
    """The manifest's shards whole and correct in a worker's cache."""
    folder = BlobFolder(str(cache_dir))
    return [s.sha256 for s in manifest.shards
            if folder.has(s.sha256) and sha256_file(folder.path_of(s.sha256)) == s.sha256]


def train(cluster, pack_dir, workers, *extra, worker_args=(), epochs=2):
    metrics = cluster.dir / "metrics.jsonl"
    coordinator, procs = cluster.start_together(
        [*PACKED, "--data", str(pack_dir), "--epochs", str(epochs), "--metrics", str(metrics),
         *extra], workers, worker_args)
    assert coordinator.wait(DEADLINE) == 0, coordinator.tail()
    for proc in procs:
        assert proc.wait(DEADLINE) == 0, proc.tail()
    return final_metrics(metrics)


def test_cold_workers_fetch_the_shards_from_the_coordinator_and_train(cluster, pack):
    pack_dir, manifest = pack
    caches = {name: cluster.dir / f"cache-{name}" for name in ("w1", "w2")}
    metrics = cluster.dir / "metrics.jsonl"
    procs = [cluster.worker(name, "--cache-dir", str(path)) for name, path in caches.items()]
    wait_for_hellos(cluster.address, list(caches), [p.popen for p in procs], DEADLINE)
    # a full shuffle (no locality): every worker reads every shard, so what the coordinator
    # serves is known exactly
    # (both in from the start, and epochs enough: one worker alone can finish three epochs
    # before the other has loaded the job, and would then have read no shard)
    coordinator = cluster.coordinator(*PACKED, "--data", str(pack_dir), "--epochs", "10",
                                      "--metrics", str(metrics), "--locality", "off",
                                      "--min-workers", "2")
    assert coordinator.wait(DEADLINE) == 0, coordinator.tail()
    for proc in procs:
        assert proc.wait(DEADLINE) == 0, proc.tail()
    final = final_metrics(metrics)
    assert final["metrics"]["accuracy"] > 0.6  # learnt from the fetched bytes (chance: 0.25)
    data = final["data"]
    assert data["manifest"] == manifest.sha256
    assert data["bytes"] == sum(s.size for s in manifest.shards)
    for name, path in caches.items():
        # every slot's samples are spread over the whole set: each worker read every shard
        assert cached(path, manifest) == [s.sha256 for s in manifest.shards], name
    # the coordinator served every worker every shard, and the manifest, nothing twice
    manifest_bytes = len(manifest.to_bytes())
    assert data["served_bytes"] == 2 * (data["bytes"] + manifest_bytes)
    assert data["refused"] == 0
    assert data["workers_reporting"] >= 1
    cluster.assert_no_tracebacks()


def test_a_mirror_serves_and_the_coordinator_serves_nothing(cluster, pack, tmp_path):
    pack_dir, manifest = pack
    publish(str(pack_dir), str(tmp_path / "www"))
    with Mirror(str(tmp_path / "www")) as mirror:
        final = train(cluster, pack_dir, ["w1"], "--blob-mirror", mirror.url,
                      worker_args=("--cache-dir", str(tmp_path / "cache")))
        assert final["data"]["served_bytes"] == 0
        assert len(cached(tmp_path / "cache", manifest)) == len(manifest.shards)
        # one whole GET per blob: the manifest and each shard
        assert sorted(p.rsplit("/", 1)[1] for p, _ in mirror.requests) == sorted(
            [manifest.sha256] + [s.sha256 for s in manifest.shards])
    cluster.assert_no_tracebacks()


def test_a_lying_mirror_and_a_dead_one_cost_a_retry_and_the_coordinator_serves(cluster, pack,
                                                                              tmp_path):
    pack_dir, manifest = pack
    publish(str(pack_dir), str(tmp_path / "www"))
    with Mirror(str(tmp_path / "www")) as liar:
        liar.lie = True
        dead = Mirror(str(tmp_path / "www"))  # bound, then closed: its port refuses
        dead.server.server_close()
        final = train(cluster, pack_dir, ["w1"], "--blob-mirror", dead.url,
                      "--blob-mirror", liar.url,
                      worker_args=("--cache-dir", str(tmp_path / "cache")))
        # the liar was asked once (the manifest), failed the check, and was benched: every
        # byte then came from the coordinator, and the worker kept only correct blobs
        assert len(liar.requests) == 1
        assert len(cached(tmp_path / "cache", manifest)) == len(manifest.shards)
        assert final["data"]["served_bytes"] == (sum(s.size for s in manifest.shards)
                                                 + len(manifest.to_bytes()))
    worker = next(p for p in cluster.procs if p.name == "w1")
    assert "do not hash to the blob's name" in worker.output()
    assert final["metrics"]["accuracy"] > 0.5
    cluster.assert_no_tracebacks()


def test_a_shard_corrupted_in_the_cache_is_fetched_again(cluster, pack, tmp_path):
    pack_dir, manifest = pack
    cache = tmp_path / "cache"
    train(cluster, pack_dir, ["w1"], worker_args=("--cache-dir", str(cache)), epochs=1)
    victim = manifest.shards[2]
    path = BlobFolder(str(cache)).path_of(victim.sha256)
    with open(path, "r+b") as fh:  # same size, other bytes: only the hash can tell
        first = fh.read(1)
        fh.seek(0)
        fh.write(bytes([first[0] ^ 0xFF]))
    assert sha256_file(path) != victim.sha256
    final = train(cluster, pack_dir, ["w1"], worker_args=("--cache-dir", str(cache)), epochs=1)
    second_worker = [p for p in cluster.procs if p.name.startswith("w1")][-1]
    assert "corrupt on disk: fetching it again" in second_worker.output()
    assert sha256_file(path) == victim.sha256
    # only the corrupted shard came again (and the manifest was a cache hit)
    assert final["data"]["served_bytes"] == victim.size
    cluster.assert_no_tracebacks()


def test_a_cache_cap_below_one_shard_is_one_line(cluster, pack, tmp_path):
    pack_dir, manifest = pack
    coordinator = cluster.coordinator(*PACKED, "--data", str(pack_dir))
    worker = cluster.worker("w1", "--cache-dir", str(tmp_path / "cache"),
                            "--cache-max-gb", "0.00001")  # 10.7 KB, shards are about 20 KB
    assert worker.wait(DEADLINE) != 0
    said = worker.said()
    assert len(said) == 1, worker.output()
    assert "cache_max_gb" in said[0] and "below one shard" in said[0]
    assert coordinator.running()
    assert cached(tmp_path / "cache", manifest) == []
    cluster.assert_no_tracebacks()


def test_a_worker_whose_transfer_cap_is_spent_hands_its_slots_back_and_others_train(
        cluster, pack, tmp_path):
    """A cap of about three shards: the worker fetches them, then says "capped", asks for no
    slots, and gives back at once the slots that need shards it lacks; the other worker trains
    on. The capped worker never fetches past its cap."""
    pack_dir, manifest = pack
    cap_gb = 3 * manifest.shards[0].size / 2**30
    metrics = cluster.dir / "metrics.jsonl"
    capped = cluster.worker("capped", "--cache-dir", str(tmp_path / "capped"),
                            "--daily-transfer-max-gb", f"{cap_gb:.9f}")
    helper = cluster.worker("helper", "--cache-dir", str(tmp_path / "helper"))
    wait_for_hellos(cluster.address, ["capped", "helper"], [capped.popen, helper.popen], DEADLINE)
    # a full shuffle (no locality): every worker reads every shard, so what the coordinator
    # serves is known exactly
    # both in from the start, and epochs enough: the helper alone can finish three epochs (a
    # third of a second) before the capped worker has loaded the job
    coordinator = cluster.coordinator(*PACKED, "--data", str(pack_dir), "--epochs", "10",
                                      "--metrics", str(metrics), "--locality", "off",
                                      "--min-workers", "2")
    assert coordinator.wait(DEADLINE) == 0, coordinator.tail()
    for proc in (capped, helper):
        assert proc.wait(DEADLINE) == 0, proc.tail()
    final = final_metrics(metrics)
    assert final["scheduler"]["slots_handed_back"] >= 1
    assert final["metrics"]["accuracy"] > 0.6
    assert "worker_capped: capped capped" in coordinator.output()
    assert "asking for no slots that need data not cached here" in capped.output()
    with open(tmp_path / "capped" / "transfer.json") as fh:
        assert json.load(fh)["bytes"] <= cap_gb * 2**30
    assert len(cached(tmp_path / "helper", manifest)) == len(manifest.shards)
    cluster.assert_no_tracebacks()
