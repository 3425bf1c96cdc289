"""Model snapshots as blobs (issue 17, item 5): what the coordinator sends per worker-task for a
model above --snapshot-min-mb, inline (the model in the task's frames) against by snapshot
without a mirror and by snapshot with one HTTP mirror on loopback serving the --snapshot-dir.

A real coordinator trains the built-in digits job with `--hidden` units (32768: 2.46M parameters,
9.8 MB, over the 8 MB default) for one epoch on `--workers` real workers, three times:

- inline: --snapshot-min-mb 100000 (the model goes in tasks, as before snapshots)
- snapshot: the default threshold, the coordinator serves the snapshots itself
- mirror: the default threshold, --snapshot-dir served by `python -m http.server` and named
  with --blob-mirror

Bytes sent by the coordinator are every message it sent (tasks, inline models, heartbeats) plus
the blob chunks it served; a worker-task is one task sent (the ledger's "sent" records).

    python benchmarks/snapshots.py --json

With `--json` its last line is {"inline_per_task": ..., "snapshot_per_task": ...,
"mirror_per_task": ..., "mirror_saving": ...}, bytes per worker-task, and mirror_saving is 1 -
(coordinator bytes with a mirror) / (inline).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from harness import Run, stopped_on_interrupt  # noqa: E402


def one_run(root: str, name: str, hidden: int, workers: int, extra: list,
            timeout_s: float) -> dict:
    from idlegrad.cli.processes import free_port, wait_for_hellos

    run_dir = os.path.join(root, name)
    address = f"tcp://127.0.0.1:{free_port()}"
    metrics, ledger = os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "ledger.jsonl")
    with Run(run_dir) as run:
        names = [f"w{i}" for i in range(workers)]
        procs = [run.spawn_idlegrad(n, [
            "worker", "--coordinator", address, "--id", n, "--threads", "1", "--device", "cpu",
            "--no-idle-policy", "--cache-dir", os.path.join(run_dir, f"cache-{n}")])
            for n in names]
        wait_for_hellos(address, names, procs, 120)
        started = time.monotonic()
        coordinator = run.spawn_idlegrad("coordinator", [
            "coordinator", "--bind", address, "--job", "digits", "--job-arg", f"hidden={hidden}",
            "--epochs", "1", "--threads", "1", "--metrics", metrics, "--ledger", ledger, *extra])
        try:
            coordinator.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"{name}: no end within {timeout_s:g} s (see {run_dir})") from None
        elapsed = time.monotonic() - started
        for proc in procs:
            proc.wait(timeout=60)
        with open(metrics) as fh:
            final = [json.loads(line) for line in fh if line.strip()][-1]
        with open(ledger) as fh:
            tasks = sum(1 for line in fh if '"sent"' in line)
    data = final.get("data") or {}
    sent = final["counters"]["bytes_sent"] + data.get("served_bytes", 0)
    return {"run": name, "elapsed_s": round(elapsed, 2), "tasks": tasks, "coordinator_sent": sent,
            "served": data.get("served_bytes", 0), "per_task": round(sent / max(1, tasks)),
            "snapshots": (final.get("snapshots") or {}).get("published", 0),
            "accuracy": (final.get("metrics") or {}).get("accuracy")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=32768, help="digits' hidden units (32768)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run at most")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    args = p.parse_args()
    from idlegrad.cli.processes import free_port

    runs = {}
    with stopped_on_interrupt(), tempfile.TemporaryDirectory(prefix="idlegrad-snap-") as root:
        snaps = os.path.join(root, "www")
        os.makedirs(snaps)
        port = free_port()
        plan = [("inline", ["--snapshot-min-mb", "100000"]), ("snapshot", []),
                ("mirror", ["--snapshot-dir", snaps, "--blob-mirror", f"http://127.0.0.1:{port}"])]
        for name, extra in plan:
            mirror = None
            if name == "mirror":
                mirror = subprocess.Popen(
                    [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                     "--directory", snaps], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                runs[name] = r = one_run(root, name, args.hidden, args.workers, extra,
                                         args.timeout)
            finally:
                if mirror is not None:
                    mirror.terminate()
                    mirror.wait(timeout=10)
            print(f"{name:9s} {r['elapsed_s']:6.1f} s  {r['tasks']:4d} tasks  coordinator sent "
                  f"{r['coordinator_sent'] / 1e6:8.1f} MB (blobs {r['served'] / 1e6:.1f} MB)  "
                  f"{r['per_task'] / 1e6:7.3f} MB per worker-task  {r['snapshots']} snapshots  "
                  f"accuracy {r['accuracy']}", flush=True)
    summary = {"inline_per_task": runs["inline"]["per_task"],
               "snapshot_per_task": runs["snapshot"]["per_task"],
               "mirror_per_task": runs["mirror"]["per_task"],
               "mirror_saving": round(1 - runs["mirror"]["coordinator_sent"]
                                      / runs["inline"]["coordinator_sent"], 4)}
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
