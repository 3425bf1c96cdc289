"""What bfloat16 results cost in accuracy, and save on the wire (issue 7, optional compression).

A real coordinator and `--workers` (3) real workers train the built-in digits job for `--epochs`
(20) epochs, the same samples in every run, once with float32 results and once with
`--result-dtype bfloat16` (workers round each result to bfloat16 and feed the rounding error back
into their next one: worker/compress.py), in alternating order across `--runs` (the machine is
shared). Training is asynchronous, so two runs of one setting differ a little too: the table
gives medians, and the paired difference of each run's final test accuracy.

    python benchmarks/compression.py --runs 3 --json

With `--json` the last line is {"float32": {"accuracy": ..., "bytes_per_sample": ..., "wall_s":
...}, "bfloat16": {...}, "accuracy_change": ..., "bytes_ratio": ...} (medians; the change is
bfloat16 minus float32, paired by run). Every process it starts is stopped and reaped by PID
(harness.Run), also on failure; every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Run, medians, paired_runs, read_metrics, stopped_on_interrupt  # noqa: E402

DTYPES = ("float32", "bfloat16")


def train(dtype: str, args, directory: Path) -> dict:
    from idlegrad.cli.processes import free_port, wait_for_hellos

    directory.mkdir(parents=True, exist_ok=True)
    address = f"tcp://127.0.0.1:{free_port()}"
    names = [f"w{i + 1}" for i in range(args.workers)]
    run = Run(directory)
    try:
        workers = [run.spawn_idlegrad(n, [
            "worker", "--coordinator", address, "--id", n, "--threads", "1", "--device", "cpu",
            "--no-idle-policy", "--connect-timeout", "30", "--log-level", "warning"])
            for n in names]
        wait_for_hellos(address, names, workers, timeout=120)
        started = time.monotonic()
        coordinator = run.spawn_idlegrad("coordinator", [
            "coordinator", "--bind", address, "--job", "digits", "--epochs", str(args.epochs),
            "--seed", str(args.seed), "--result-dtype", dtype, "--threads", "1",
            "--checkpoint-dir", str(directory / "ckpt"), "--log-level", "warning"])
        coordinator.wait(timeout=args.max_wall)
        wall = time.monotonic() - started
    finally:
        run.close()
    records = read_metrics(directory / "ckpt" / "metrics.jsonl")
    final = records[-1] if records else {}
    if not final.get("final"):
        raise RuntimeError(f"{dtype}: training did not finish; see {directory}")
    return {"accuracy": final["metrics"]["accuracy"], "bytes_per_sample": final["bytes_per_sample"],
            "samples": final["samples"], "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-wall", type=float, default=300.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    results: dict[str, list[dict]] = {d: [] for d in DTYPES}
    print(f"{'run':>4} {'results':>9} {'accuracy':>9} {'bytes/sample':>13} {'wall s':>7}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="idlegrad-compression-") as tmp, \
            stopped_on_interrupt():
        def measure(dtype: str, i: int) -> dict:
            return train(dtype, args, Path(tmp) / f"{dtype}-{i}")

        for i, got in paired_runs(DTYPES, args.runs, measure):
            for dtype in DTYPES:
                r = got[dtype]
                results[dtype].append(r)
                print(f"{i + 1:>4} {dtype:>9} {r['accuracy']:>9.4f} {r['bytes_per_sample']:>13.0f} "
                      f"{r['wall_s']:>7.1f}", flush=True)
    summary = {d: medians(results[d], ("accuracy", "bytes_per_sample", "wall_s")) for d in DTYPES}
    change = statistics.median(b["accuracy"] - f["accuracy"]
                               for f, b in zip(results["float32"], results["bfloat16"]))
    ratio = summary["bfloat16"]["bytes_per_sample"] / summary["float32"]["bytes_per_sample"]
    print("\nmedians")
    for d in DTYPES:
        s = summary[d]
        print(f"{d:>9}: accuracy {s['accuracy']:.4f}, {s['bytes_per_sample']:.0f} wire bytes per "
              f"sample (both ways), {s['wall_s']:.1f} s")
    print(f"bfloat16 - float32 accuracy, paired by run: {change:+.4f}; wire bytes x{ratio:.2f}")
    if args.json:
        print(json.dumps({**summary, "accuracy_change": change, "bytes_ratio": ratio}))


if __name__ == "__main__":
    main()
