"""The lm job end to end: a real coordinator packs the corpus it is pointed at and serves it, real
workers with empty caches fetch the pack by its manifest and train the transformer on it."""

from __future__ import annotations

import os

import pytest

from idlegrad.common.blobs import load_manifest

from .harness import DEADLINE, final_metrics, read_metrics

pytestmark = pytest.mark.integration


def write_corpus(root) -> None:
    for k in range(60):
        path = os.path.join(root, f"pkg{k % 4}", f"mod{k}.py")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            for i in range(40):
                fh.write(f"def function_{k}_{i}(value):\n    return value * {i} + {k}\n\n")


def test_lm_workers_fetch_the_coordinators_pack_and_learn(cluster, tmp_path):
    corpus = tmp_path / "corpus"
    write_corpus(str(corpus))
    metrics = cluster.dir / "metrics.jsonl"
    coordinator, workers = cluster.start_together(
        ["--job", "lm", "--job-arg", f"corpus={corpus}", "--job-arg", "context=32",
         "--job-arg", "batch_size=16", "--job-arg", "warmup=5", "--job-arg", "steps=150",
         "--job-arg", "lr=0.005", "--epochs", "1", "--metrics", str(metrics)],
        ["w1", "w2"])
    assert coordinator.wait(DEADLINE) == 0, cluster.report()
    for proc in workers:
        assert proc.wait(DEADLINE) == 0, cluster.report()
    final_metrics(metrics)  # the run ended, and said so
    records = [r for r in read_metrics(metrics) if r.get("metrics")]
    first, last = records[0]["metrics"], records[-1]["metrics"]
    assert first["bits_per_byte"] > 7  # a byte model untrained: about log2(256)
    assert last["bits_per_byte"] < 0.6 * first["bits_per_byte"], (first, last)
    # the coordinator packed the corpus and served it: the workers trained on what they fetched
    packs = cluster.dir / "xdg-cache" / "idlegrad" / "packs"
    (pack,) = [p for p in packs.iterdir() if not p.name.startswith(".")]
    manifest = load_manifest(str(pack / "manifest.json"))
    data = records[-1]["data"]
    assert data["manifest"] == manifest.sha256
    assert data["served_bytes"] >= sum(s.size for s in manifest.shards)
    cluster.assert_no_tracebacks()
