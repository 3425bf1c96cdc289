"""The coordinator's CPU with evaluations on workers against evaluations on the coordinator.

The built-in `lm` job (a byte transformer; `--size`, `--context`) is trained by a real
coordinator and `--workers` real workers on this machine for `--seconds` of training, once with
`--eval-on workers` and once with `--eval-on coordinator`, in alternating order over `--runs`
runs; both with the adaptive evaluation cadence (or `--eval-every`). Measured over the window
(after `--warmup` seconds of training, so that start-up, packing and the first model sends are
not counted): the coordinator process's CPU seconds (user + system, its threads included) per
wall second and per sample applied, the evaluations completed and the samples applied per
second. Last line JSON:
{"workers": {"cpu_share": ..., "cpu_ms_per_sample": ..., "evaluations": ..., "samples_per_s": ...},
 "coordinator": {...},
 "cpu_ratio": workers' cpu_share / coordinator's} with medians over the runs.

    python benchmarks/eval_cost.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Run, medians, read_metrics, side_by_side, stopped_on_interrupt  # noqa: E402


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def one_run(root: Path, where: str, index: int, args) -> dict:
    from idlegrad.cli.processes import free_port, wait_for_hellos
    from idlegrad.monitor.source import ZmqStatusSource

    run_dir = root / f"{where}-{index}"
    address = f"tcp://127.0.0.1:{free_port()}"
    metrics = run_dir / "metrics.jsonl"
    with Run(run_dir) as run:
        # the corpus's pack is made once, in the user's cache, and reused by every run
        run.env.pop("XDG_CACHE_HOME", None)
        names = [f"w{i}" for i in range(args.workers)]
        workers = [run.spawn_idlegrad(n, [
            "worker", "--coordinator", address, "--id", n, "--threads", "1", "--device", "cpu",
            "--no-idle-policy", "--cache-dir", run_dir / f"cache-{n}"]) for n in names]
        wait_for_hellos(address, names, workers, 300)
        extra = ["--eval-every", str(args.eval_every)] if args.eval_every else []
        coordinator = run.spawn_idlegrad("coordinator", [
            "coordinator", "--bind", address, "--job", "lm", "--job-arg", f"size={args.size}",
            "--job-arg", f"context={args.context}", "--epochs", "1", "--threads", "1",
            "--eval-on", where, "--metrics", metrics, *extra])
        proc = psutil.Process(coordinator.pid)
        source = ZmqStatusSource(address)
        try:
            started = None
            deadline = time.monotonic() + args.timeout
            while started is None:  # training has begun: samples are being applied
                if coordinator.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{where}: the coordinator did not start training (see "
                                     f"{run_dir})")
                snap = source.fetch(timeout=0.5)
                if snap is not None and snap.get("samples", 0) > 0:
                    started = time.monotonic()
                time.sleep(0.2)
            time.sleep(args.warmup)
            evaluated_before = len([r for r in read_metrics(metrics) if r.get("metrics")])
            snap = source.fetch(timeout=2.0) or {}
            samples_before = snap.get("samples", 0)
            cpu0, wall0 = cpu_seconds(proc), time.monotonic()
            time.sleep(args.seconds)
            cpu1, wall1 = cpu_seconds(proc), time.monotonic()
            snap = source.fetch(timeout=2.0) or {}
            samples_after = snap.get("samples", samples_before)
            evaluated = len([r for r in read_metrics(metrics) if r.get("metrics")])
            if coordinator.poll() is not None:
                raise SystemExit(f"{where}: the coordinator stopped within the window (see "
                                 f"{run_dir})")
        finally:
            source.close()
        records = [r for r in read_metrics(metrics) if r.get("metrics")]
    wall = wall1 - wall0
    applied = max(1, samples_after - samples_before)
    return {"cpu_share": round((cpu1 - cpu0) / wall, 4),
            # the coordinator's work per training sample (aggregation, sends): what its CPU
            # share is made of beside the evaluations
            "cpu_ms_per_sample": round(1000 * (cpu1 - cpu0) / applied, 4),
            "evaluations": evaluated - evaluated_before,
            "samples_per_s": round((samples_after - samples_before) / wall, 1),
            "eval_on": sorted({r.get("eval_on") for r in records if r.get("eval_on")}),
            "last_metrics": records[-1]["metrics"] if records else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="workers (default 2)")
    p.add_argument("--size", default="tiny", help="lm size (default tiny)")
    p.add_argument("--context", type=int, default=64, help="lm context (default 64)")
    p.add_argument("--seconds", type=float, default=40.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of training not counted")
    p.add_argument("--eval-every", type=float, default=None,
                   help="seconds between evaluations (default: the adaptive cadence)")
    p.add_argument("--runs", type=int, default=1, help="runs of each (default 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to start at most")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    args = p.parse_args()
    rows: dict[str, list[dict]] = {"workers": [], "coordinator": []}
    with stopped_on_interrupt(), tempfile.TemporaryDirectory(prefix="idlegrad-evalcost-") as root:
        for i, where, row in side_by_side(list(rows), args.runs,
                                          lambda where, i: one_run(Path(root), where, i, args)):
            rows[where].append(row)
            print(f"run {i} --eval-on {where:11s}: coordinator CPU {row['cpu_share']:.1%} of a "
                  f"core ({row['cpu_ms_per_sample']:.3f} ms per sample applied), "
                  f"{row['evaluations']} evaluations, {row['samples_per_s']:.0f} "
                  f"samples/s, evaluated on {row['eval_on']}, last {row['last_metrics']}",
                  flush=True)
    summary = {where: medians(r, ["cpu_share", "cpu_ms_per_sample", "evaluations",
                                  "samples_per_s"])
               for where, r in rows.items()}
    coordinator_share = summary["coordinator"]["cpu_share"]
    summary["cpu_ratio"] = (round(summary["workers"]["cpu_share"] / coordinator_share, 3)
                            if coordinator_share else None)
    summary["setup"] = {"job": "lm", "size": args.size, "context": args.context,
                        "workers": args.workers, "seconds": args.seconds, "runs": args.runs}
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
