"""Delay compensation against plain staleness weighting (issue 26 item 4), on the real coordinator.

Asynchronous rounds on a small fleet: the digits job (its Adam at lr 0.01, batch 32), rounds of one
partition (`--partitions 1`) and as many open as the workers ask for (`--open-rounds 0`), so with
W workers each holding `--credits` slots a round is applied about W x credits - 1 versions after
it was planned. Each candidate is its own coordinator and W workers on loopback (`--threads 1
--no-idle-policy`), started as benchmarks/stragglers.py does (the workers first, released onto
the coordinator's bind together), one candidate after another in alternating order across
`--runs`:

- `plain`: the staleness weight alone (`--staleness inverse`, the default),
- `dc[:L]`, `dc-a[:L]`: the same plus `--delay-compensation dc[:L]` / `dc-a[:L]`
  (coordinator/compensation.py).

Each run evaluates the test accuracy every `--eval-every` seconds and stops at the first
evaluation at or above `--target`; samples-to-target is the samples applied by then (rounds
stepped, weighted or not), time-to-target the seconds since the coordinator's bind. Medians over
the runs, each candidate's ratio to plain's (below 1: fewer samples / less time than plain), and
the median of the per-run ratios of samples ("paired": run i of each candidate side by side).
The last snapshot of the coordinator's status gives the rounds compensated, those whose model
was no longer kept, those too stale, and the workers' mean staleness.

    PYTHONPATH=. python3 benchmarks/staleness.py --runs 3 --json
    PYTHONPATH=. python3 benchmarks/staleness.py --job synthetic --target 0.8 --runs 3
    PYTHONPATH=. python3 benchmarks/staleness.py --simulated --runs 5 --workers 8 --json

`--simulated` runs the same fleet in virtual time instead (the fleet simulator with real gradients:
the real round core, scheduler and aggregator, no processes), where a run is a function of its
seed and the CPU's load does not enter: run i uses seed i for every candidate.

With `--json` the last line is one JSON object: {"candidates": {name: {medians, ratios}}, ...}.
Every process it starts is stopped and reaped by PID, also on Ctrl-C; every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import Run, fmt, med, read_metrics, side_by_side, stopped_on_interrupt  # noqa: E402

JOB_ARGS = {"digits": [], "synthetic": ["params=20000", "batch_size=64", "lr=0.02"]}


def coordinator_args(candidate: str, args, address: str, ckpt: Path) -> list[str]:
    out = ["coordinator", "--bind", address, "--job", args.job,
           "--target", f"accuracy={args.target}", "--epochs", "1000", "--seed", str(args.seed),
           "--eval-every", str(args.eval_every), "--eval-on", "coordinator",
           "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3600", "--threads", "1",
           "--heartbeat", "0.5", "--log-level", "warning", "--async", "--partitions", "1",
           "--open-rounds", "0", "--max-staleness", str(args.max_staleness)]
    for job_arg in JOB_ARGS[args.job]:
        out += ["--job-arg", job_arg]
    if candidate != "plain":
        out += ["--delay-compensation", candidate]
    return out


def worker_args(name: str, address: str, args) -> list[str]:
    return ["worker", "--coordinator", address, "--id", name, "--threads", "1", "--device", "cpu",
            "--no-idle-policy", "--credits", str(args.credits), "--connect-timeout", "30",
            "--log-level", "warning"]


def run_candidate(candidate: str, args, directory: Path) -> dict:
    from idlegrad.cli.processes import free_port, wait_for_hellos
    from idlegrad.monitor.source import ZmqStatusSource

    ckpt = directory / "ckpt"
    address = f"tcp://127.0.0.1:{free_port()}"
    names = [f"w{i + 1}" for i in range(args.workers)]
    last, source = None, None
    with Run(directory) as run:
        workers = [run.spawn_idlegrad(n, worker_args(n, address, args)) for n in names]
        wait_for_hellos(address, names, workers, timeout=120)
        coordinator = run.spawn_idlegrad("coordinator",
                                         coordinator_args(candidate, args, address, ckpt))
        source = ZmqStatusSource(address)
        try:
            end = time.monotonic() + args.max_wall + 60
            while coordinator.poll() is None and time.monotonic() < end:
                snap = source.fetch(timeout=0.3)
                if snap is not None:
                    last = snap
                    if float(snap.get("elapsed_s", 0.0)) > args.max_wall:
                        break
                time.sleep(0.2)
        finally:
            source.close()
    return summarize(read_metrics(ckpt / "metrics.jsonl"), args.target, last)


def summarize(records: list[dict], target: float, last) -> dict:
    reached = next((r for r in records
                    if ((r.get("metrics") or {}).get("accuracy") or 0.0) >= target), None)
    final = records[-1] if records else {}
    red = (last or {}).get("redundancy", {})
    workers = (last or {}).get("workers", [])
    done = sum(int(w.get("done", 0)) for w in workers)
    out = {"reached": reached is not None,
           "samples_to_target": reached["samples"] if reached else None,
           "time_to_target_s": float(reached["elapsed"]) if reached else None,
           "accuracy": ((reached or final).get("metrics") or {}).get("accuracy"),
           "samples": final.get("samples"),
           "rounds_compensated": red.get("rounds_compensated"),
           "rounds_uncompensated": red.get("rounds_uncompensated"),
           "rounds_too_stale": red.get("rounds_too_stale"),
           # the workers' mean staleness, weighted by their slots done (status.py worker_row)
           "mean_staleness": (sum(float(w.get("staleness", 0.0)) * int(w.get("done", 0))
                                  for w in workers) / done) if done else None}
    return out


def run_simulated(candidate: str, args, run_index: int) -> dict:
    """The same fleet in virtual time (coordinator/simulator.py with real gradients: the real
    round core, scheduler and aggregator, each slot computed in this process with the workers'
    kernel on the snapshot of its version): no CPU noise, so a run is a function of its seed;
    run i uses seed `--seed` + i for both candidates. Workers of `--sim-s-per-sample` with a
    lognormal jitter of 0.3 a task, so their rounds finish in changing orders."""
    import math

    from idlegrad.common.job_loading import parse_job_args
    from idlegrad.coordinator import simulator as sim
    from idlegrad.coordinator.sim_backends import RealGradients
    from idlegrad.coordinator.staleness import StalenessRule, parse_delay_compensation
    from idlegrad.coordinator.target import Target

    seed = args.seed + run_index
    fleet = [sim.WorkerSpec(f"w{i}", args.sim_s_per_sample, credits=args.credits, latency_s=0.0,
                            bandwidth=math.inf, jitter=0.3) for i in range(args.workers)]
    config = sim.SimConfig(duration_s=args.sim_duration, partitions=1, open_rounds=0,
                           eval_every_s=args.sim_eval_every, seed=seed,
                           max_staleness=args.max_staleness,
                           costs=sim.CoordinatorCosts(0.0, math.inf))
    setting = parse_delay_compensation("off" if candidate == "plain" else candidate)
    job_args = parse_job_args(JOB_ARGS[args.job])
    gradients = RealGradients(args.job, job_args, seed, StalenessRule(max_staleness=args.max_staleness),
                              compensation=setting)
    simulation = sim.Simulation(fleet, config, "none", gradients=gradients,
                                target=Target.parse(f"accuracy={args.target}"))
    result = simulation.run()
    reached = result.stopped == "target"
    compensator = gradients.aggregator.compensator
    return {"reached": reached,
            "samples_to_target": result.samples_applied if reached else None,
            "time_to_target_s": result.time_to_target_s if reached else None,
            "accuracy": result.metrics.get("accuracy"), "samples": result.samples_applied,
            "rounds_compensated": compensator.compensated,
            "rounds_uncompensated": compensator.without_snapshot,
            "rounds_too_stale": result.rounds_replanned, "mean_staleness": result.mean_staleness}


def aggregate(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for candidate, rs in runs.items():
        keys = ("samples_to_target", "time_to_target_s", "mean_staleness", "rounds_compensated",
                "rounds_uncompensated", "rounds_too_stale")
        out[candidate] = {k: med([r[k] for r in rs]) for k in keys}
        out[candidate]["reached"] = sum(r["reached"] for r in rs)
        out[candidate]["runs"] = len(rs)
        out[candidate]["runs_samples_to_target"] = [r["samples_to_target"] for r in rs]
        out[candidate]["runs_time_to_target_s"] = [r["time_to_target_s"] for r in rs]
    plain = out.get("plain", {})
    for candidate, m in out.items():
        # run i of every candidate shares its seed (and, on loopback, its neighbourhood in
        # time): the median of the per-run ratios pairs them
        pairs = [r["samples_to_target"] / p["samples_to_target"]
                 for r, p in zip(runs[candidate], runs.get("plain", []))
                 if r["samples_to_target"] and p["samples_to_target"]]
        m["paired_samples_ratio"] = med(pairs)
    for m in out.values():
        for key, ratio in (("samples_to_target", "samples_ratio"),
                           ("time_to_target_s", "time_ratio")):
            base = plain.get(key)
            m[ratio] = (m[key] / base) if (m[key] is not None and base) else None
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs per candidate (medians)")
    parser.add_argument("--candidates", default="plain,dc,dc-a",
                        help="comma-separated: plain, dc[:L], dc-a[:L] (default: plain,dc,dc-a)")
    parser.add_argument("--job", choices=sorted(JOB_ARGS), default="digits")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--credits", type=int, default=2,
                        help="slots each worker holds (default 2, the worker's own default)")
    parser.add_argument("--target", type=float, default=0.93, help="test accuracy to reach")
    parser.add_argument("--eval-every", type=float, default=0.25)
    parser.add_argument("--max-staleness", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-wall", type=float, default=60.0,
                        help="give a run up after this many seconds of training")
    parser.add_argument("--simulated", action="store_true",
                        help="the fleet in virtual time (the simulator with real gradients) "
                             "instead of processes on loopback; time is virtual seconds")
    parser.add_argument("--sim-s-per-sample", type=float, default=0.001)
    parser.add_argument("--sim-eval-every", type=float, default=0.1, help="virtual seconds")
    parser.add_argument("--sim-duration", type=float, default=600.0, help="virtual seconds")
    parser.add_argument("--dir", default=None, help="keep logs and metrics here (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    candidates = [c for c in args.candidates.split(",") if c]
    if "plain" not in candidates:
        parser.error("the candidates must include plain (the ratios are to it)")
    from idlegrad.common.errors import ConfigError
    from idlegrad.coordinator.staleness import parse_delay_compensation

    for c in candidates:
        if c != "plain":
            try:
                parse_delay_compensation(c)
            except ConfigError as exc:
                parser.error(str(exc))
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="idlegrad-staleness-"))
    print(f"logs and metrics under {base}", flush=True)
    runs: dict[str, list[dict]] = {c: [] for c in candidates}
    header = (f"{'run':>3} {'candidate':<10} {'samples':>8} {'seconds':>8} {'tau':>5} "
              f"{'comp':>5} {'nosnap':>6} {'stale':>5}")
    print(header, flush=True)

    def measure(candidate: str, i: int) -> dict:
        if args.simulated:
            return run_simulated(candidate, args, i)
        return run_candidate(candidate, args, base / f"run{i + 1}" / candidate.replace(":", "_"))

    with stopped_on_interrupt():
        for i, candidate, r in side_by_side(candidates, args.runs, measure):
            runs[candidate].append(r)
            print(f"{i + 1:>3} {candidate:<10} {fmt(r['samples_to_target'], '.0f'):>8} "
                  f"{fmt(r['time_to_target_s']):>8} {fmt(r['mean_staleness']):>5} "
                  f"{fmt(r['rounds_compensated'], '.0f'):>5} "
                  f"{fmt(r['rounds_uncompensated'], '.0f'):>6} "
                  f"{fmt(r['rounds_too_stale'], '.0f'):>5}"
                  + ("" if r["reached"] else f"  (not reached: accuracy {fmt(r['accuracy'])})"),
                  flush=True)
    summary = aggregate(runs)
    where = "simulated (virtual seconds)" if args.simulated else "processes on loopback"
    print(f"\n{args.job}, {where}, {args.workers} workers x {args.credits} credits, target accuracy "
          f"{args.target}; medians of {args.runs} (ratio: candidate / plain)")
    print(f"{'candidate':<10} {'reached':>7} {'samples':>8} {'ratio':>6} {'paired':>6} "
          f"{'seconds':>8} {'ratio':>6} {'tau':>5}")
    for candidate, m in summary.items():
        print(f"{candidate:<10} {m['reached']:>4}/{m['runs']:<2} "
              f"{fmt(m['samples_to_target'], '.0f'):>8} {fmt(m['samples_ratio']):>6} "
              f"{fmt(m['paired_samples_ratio']):>6} "
              f"{fmt(m['time_to_target_s']):>8} {fmt(m['time_ratio']):>6} "
              f"{fmt(m['mean_staleness']):>5}")
    if args.json:
        print(json.dumps({"job": args.job, "simulated": args.simulated, "workers": args.workers, "credits": args.credits,
                          "target": {"accuracy": args.target}, "runs": args.runs,
                          "candidates": summary}))


if __name__ == "__main__":
    main()
