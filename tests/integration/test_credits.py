"""Lasting credit across a crash: real coordinator and workers on loopback, the coordinator killed
-9 mid-run and restarted from its checkpoint. The credits saved in a checkpoint are exactly its
samples applied, and at the end they add up to the samples of the ledger's final lineage (each
sample of each epoch once), shared between the workers that did the work."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from idlegrad.coordinator import checkpoint, ledger

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

JOB = ("--job", "digits", "--job-arg", "hidden=1024")  # wide enough to outlast the checks


def credits_cli(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "idlegrad.cli", "credits", *args, "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["workers"]


def total(workers: dict) -> int:
    return sum(row["samples"] for row in workers.values())


def test_credits_survive_a_kill9_and_add_up_to_the_ledgers_samples(cluster, digits_train_size):
    epochs = 60  # ~25 s of training here: the kill lands mid-run
    ckpt, ledger_path = cluster.dir / "ckpt", cluster.dir / "ledger.jsonl"
    args = [*JOB, "--epochs", str(epochs), "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", "0.5", "--ledger", str(ledger_path)]
    coordinator, workers = cluster.start_together(args, ["w1", "w2"])
    status = cluster.status()
    snap = status.wait_for(lambda s: s["counters"].get("checkpoints", 0) >= 2
                           and s["epoch"] >= 3 and all(w["done"] for w in s["workers"]),
                           "two checkpoints and both workers computing",
                           alive=[coordinator, *workers])
    # live, in one snapshot: the credits are the samples applied, shared by name
    live = snap["credits"]["workers"]
    assert set(live) == {"w1", "w2"} and total(live) == snap["samples"], live
    assert all(row["samples"] > 0 and row["compute_s"] > 0 for row in live.values())
    assert set(credits_cli("--coordinator", cluster.address)) == {"w1", "w2"}

    coordinator.kill9()
    state = checkpoint.load(str(ckpt))
    saved = credits_cli("--checkpoint-dir", str(ckpt))
    assert total(saved) == state["samples"] > 0, (saved, state["samples"])

    restarted = cluster.coordinator(*args)
    status = cluster.status()
    assert status.follow(restarted, timeout=240) == 0
    for w in workers:
        assert w.wait(timeout=60) == 0
    final = credits_cli("--checkpoint-dir", str(ckpt))
    records = ledger.read(str(ledger_path))
    audit = ledger.audit(records, digits_train_size, epochs)
    assert audit.restarts == 1 and audit.lost == 0 and audit.duplicates == 0, audit
    assert total(final) == audit.samples == epochs * digits_train_size, (final, audit)
    assert set(final) == {"w1", "w2"} and all(row["samples"] > 0 for row in final.values())
    # the restart resumed exactly where the credits were saved: the lineage up to the
    # checkpoint's version holds as many samples as the credits it held
    (start,) = [r for r in records if r["event"] == "start"][1:]
    assert start["version"] == state["version"]
    lineage = ledger.audit([r for r in records if r["event"] == "applied"
                            and r["version"] <= state["version"]], digits_train_size, None)
    assert lineage.samples == total(saved)
    print(f"killed at version {state['version']} with {total(saved)} samples credited "
          f"{ {n: r['samples'] for n, r in saved.items()} }; final credits "
          f"{ {n: r['samples'] for n, r in final.items()} } = {total(final)}; ledger "
          f"{audit.as_dict()}")
    cluster.assert_no_tracebacks()
