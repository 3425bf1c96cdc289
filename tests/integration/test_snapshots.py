"""Model snapshots as blobs end to end: a real coordinator training a model over
--snapshot-min-mb names each version's snapshot in its tasks instead of attaching the model; real
workers fetch each snapshot once through their caches, from a real HTTP mirror on loopback when
one serves the snapshot folder, and from the coordinator when the mirror is absent or lies."""

from __future__ import annotations

import os

import pytest

from tests.unit.blob_mirror import Mirror

from .harness import DEADLINE, final_metrics

pytestmark = pytest.mark.integration

# 0.6 MB of parameters (digits with 2048 hidden units), over a threshold of 0.5 MB
LARGE = ("--job", "digits", "--job-arg", "hidden=2048", "--snapshot-min-mb", "0.5")


def train(cluster, workers, *extra, worker_args=(), epochs=2):
    metrics = cluster.dir / "metrics.jsonl"
    coordinator, procs = cluster.start_together(
        [*LARGE, "--epochs", str(epochs), "--metrics", str(metrics), *extra], workers,
        worker_args)
    assert coordinator.wait(DEADLINE) == 0, coordinator.tail()
    for proc in procs:
        assert proc.wait(DEADLINE) == 0, proc.tail()
    return final_metrics(metrics)


def blobs_in(folder) -> list[str]:
    return [name for _, _, names in os.walk(os.path.join(folder, "blobs")) for name in names]


def test_a_large_model_goes_by_snapshot_each_fetched_once_per_worker(cluster, tmp_path):
    snaps = tmp_path / "snapshots"
    final = train(cluster, ["w1", "w2"], "--snapshot-dir", str(snaps))
    assert final["metrics"]["accuracy"] > 0.8  # it trained on the fetched models
    data, published = final["data"], final["snapshots"]
    size = published["bytes"] or data["snapshot_served_bytes"] // max(1, data["snapshots_served"])
    assert size > 0.5 * 2**20
    assert published["published"] >= 5  # a snapshot per version some task named
    # every byte served was a snapshot's, no worker was sent one it had whole, and both fetched
    assert data["served_bytes"] == data["snapshot_served_bytes"] > 0
    assert data["snapshot_bytes_again"] == 0
    assert data["snapshots_served"] >= published["published"]
    # no model went inline: the coordinator's messages are tasks, acks and heartbeats
    assert final["counters"]["bytes_sent"] < size
    # the versions no open round names were deleted as training went on
    assert published["pruned"] >= published["published"] - published["kept"]
    assert len(blobs_in(snaps)) == published["kept"]
    cluster.assert_no_tracebacks()


def test_a_mirror_of_the_snapshot_folder_serves_them_all(cluster, tmp_path):
    snaps = tmp_path / "snapshots"
    with Mirror(str(snaps)) as mirror:
        final = train(cluster, ["w1"], "--snapshot-dir", str(snaps), "--blob-mirror", mirror.url)
        fetched = {path.rsplit("/", 1)[1] for path, _ in mirror.requests}
    assert final["metrics"]["accuracy"] > 0.8
    assert final["data"]["snapshot_served_bytes"] == 0  # the coordinator served none
    assert len(fetched) == final["snapshots"]["published"] >= 5  # each once, from the mirror
    assert len(mirror.requests) == len(fetched)
    cluster.assert_no_tracebacks()


def test_a_mirror_serving_corrupt_snapshots_costs_a_retry_and_the_coordinator_serves(
        cluster, tmp_path):
    snaps = tmp_path / "snapshots"
    with Mirror(str(snaps)) as liar:
        liar.lie = True
        final = train(cluster, ["w1"], "--snapshot-dir", str(snaps), "--blob-mirror", liar.url,
                      epochs=1)
        asked = len(liar.requests)
    assert asked == 1  # refused by its hash once, then benched
    data = final["data"]
    assert data["snapshots_served"] == final["snapshots"]["published"]  # all from the coordinator
    assert data["snapshot_bytes_again"] == 0
    worker = next(p for p in cluster.procs if p.name == "w1")
    assert "do not hash to the blob's name" in worker.output()
    assert final["metrics"]["accuracy"] > 0.6
    cluster.assert_no_tracebacks()


def test_local_tasks_with_a_mirror_send_a_mid_sized_model_by_snapshot(cluster, tmp_path):
    """1.2 MB of parameters: inline by default, by snapshot with local tasks and a mirror."""
    snaps = tmp_path / "snapshots"
    metrics = cluster.dir / "metrics.jsonl"
    with Mirror(str(snaps)) as mirror:
        coordinator, (worker,) = cluster.start_together(
            ["--job", "digits", "--job-arg", "hidden=4096", "--task", "local:4", "--epochs", "3",
             "--snapshot-dir", str(snaps), "--blob-mirror", mirror.url, "--metrics",
             str(metrics), "--eval-on", "coordinator"], ["w1"])
        assert coordinator.wait(DEADLINE) == 0, coordinator.tail()
        assert worker.wait(DEADLINE) == 0, worker.tail()
    final = final_metrics(metrics)
    assert final["task"] == "local:4"
    assert final["snapshots"]["published"] >= 5
    assert len(mirror.requests) == final["snapshots"]["published"]
    assert final["data"]["snapshot_served_bytes"] == 0
    assert final["metrics"]["accuracy"] > 0.8
    cluster.assert_no_tracebacks()
