"""Fixed batch against `--batch adaptive` (sqrt learning-rate rule), side by side, to a target.

The fleet simulator with real gradients (the job computed in this process with the workers'
kernels, rounds applied through the real aggregator and round core): identical workers, one
synchronous round at a time, a part per worker. Each run measures both candidates, in
alternating order, with the run's seed; it prints the virtual time to the target, the samples
applied to it and the ratios adaptive / fixed, then the medians. `--json`: the last line is
{"runs": [...], "medians": {...}}.

    PYTHONPATH=. python3 benchmarks/adaptive_batch.py --job digits --target accuracy=0.95 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import med, paired_runs  # noqa: E402

CANDIDATES = ("fixed", "adaptive")


def measure(args, candidate: str, seed: int) -> dict:
    from idlegrad.coordinator import simulator as sim
    from idlegrad.coordinator.sim_backends import RealGradients
    from idlegrad.coordinator.staleness import StalenessRule
    from idlegrad.coordinator.target import Target

    fleet = [sim.WorkerSpec(f"w{i}", args.s_per_sample, latency_s=args.latency)
             for i in range(args.workers)]
    config = sim.SimConfig(duration_s=args.duration, seed=seed, batch=candidate,
                           batch_lr=args.lr_rule if candidate == "adaptive" else "auto",
                           model_bytes=args.model_bytes)
    gradients = RealGradients(args.job, {"seed": seed} if args.job == "digits" else {}, seed,
                              StalenessRule())
    simulation = sim.Simulation(fleet, config, "sync", gradients=gradients,
                                target=Target.parse(args.target))
    simulation.run()
    return {"time_s": simulation.time_to_target, "samples": simulation.samples_applied
            if simulation.time_to_target is not None else None,
            "steps": gradients.version, "batch": simulation.core.batching.batch}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default="digits")
    p.add_argument("--target", default="accuracy=0.95")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--s-per-sample", type=float, default=2e-4)
    p.add_argument("--latency", type=float, default=0.02, help="one way, seconds")
    p.add_argument("--model-bytes", type=int, default=40_000)
    p.add_argument("--duration", type=float, default=600.0, help="virtual seconds at most")
    p.add_argument("--lr-rule", default="sqrt")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    rows = []
    print(f"{'run':>3} {'fixed s':>8} {'adapt s':>8} {'ratio':>6} {'fixed n':>8} {'adapt n':>8} "
          f"{'ratio':>6} {'batch':>6}")
    for i, got in paired_runs(CANDIDATES, args.runs, lambda c, i: measure(args, c, i)):
        f, a = got["fixed"], got["adaptive"]
        row = {"fixed": f, "adaptive": a,
               "time_ratio": a["time_s"] / f["time_s"] if f["time_s"] and a["time_s"] else None,
               "samples_ratio": (a["samples"] / f["samples"]
                                 if f["samples"] and a["samples"] else None)}
        rows.append(row)
        print(f"{i:>3} {f['time_s'] or 0:>8.2f} {a['time_s'] or 0:>8.2f} "
              f"{row['time_ratio'] or 0:>6.2f} {f['samples'] or 0:>8} {a['samples'] or 0:>8} "
              f"{row['samples_ratio'] or 0:>6.2f} {a['batch']:>6}", flush=True)
    medians = {f"{c}_{k}": med(r[c][k] for r in rows) for c in CANDIDATES
               for k in ("time_s", "samples", "steps")}
    medians["time_ratio"] = med(r["time_ratio"] for r in rows)
    medians["samples_ratio"] = med(r["samples_ratio"] for r in rows)
    print("medians: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                  for k, v in medians.items()))
    if args.json:
        print(json.dumps({"job": args.job, "target": args.target, "runs": rows,
                          "medians": medians}))


if __name__ == "__main__":
    main()
