"""Side by side: `idlegrad demo` against synchronous torch DDP, both to the same test accuracy.

Runs the two alternately (this machine is shared and noisy), each timed from launch to exit, so
start-up counts for both. Prints each run, the medians and their ratio; `--json` adds one JSON
line last: {"idlegrad_wall_s": median, "ddp_wall_s": median, "ratio": idlegrad/ddp, ...}.

    python benchmarks/demo_vs_ddp.py --runs 3 --workers 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def timed(cmd: list[str]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    demo = [sys.executable, "-m", "idlegrad.cli", "demo", "--workers", str(args.workers),
            "--target", f"accuracy={args.target}", "--json", "--log-level", "warning"]
    ddp = [sys.executable, os.path.join(HERE, "ddp_baseline.py"), "--world", str(args.workers),
           "--target", str(args.target)]
    rows = {"idlegrad": [], "ddp": []}
    print(f"{'run':>3} {'system':<9} {'wall_s':>7} {'updates':>8} {'samples':>8} {'accuracy':>8}")
    for i in range(args.runs):
        for name, cmd in (("idlegrad", demo), ("ddp", ddp)):
            wall, out = timed(cmd)
            updates = out.get("updates", out.get("steps"))
            rows[name].append({"wall_s": wall, "updates": updates, "samples": out["samples"],
                               "accuracy": out["test_accuracy"]})
            print(f"{i + 1:>3} {name:<9} {wall:>7.2f} {updates:>8} {out['samples']:>8} "
                  f"{out['test_accuracy']:>8.4f}", flush=True)
    med = {k: statistics.median(r["wall_s"] for r in v) for k, v in rows.items()}
    ratio = med["idlegrad"] / med["ddp"]
    print(f"median wall time: idlegrad {med['idlegrad']:.2f} s, ddp {med['ddp']:.2f} s, "
          f"ratio idlegrad/ddp {ratio:.2f}")
    if args.json:
        print(json.dumps({"idlegrad_wall_s": med["idlegrad"], "ddp_wall_s": med["ddp"],
                          "ratio": ratio, "runs": rows}))


if __name__ == "__main__":
    main()
