"""The simulator against reality (issue 8): predict benchmarks/stragglers.py, compare with its
measured times to target.

The fleet is the straggler benchmark's (benchmarks/fleets/stragglers.csv and -trace.csv; the
CSV's seconds per sample are replaced by the calibrated value, which they record): six
workers with two credits each, w1 5x slow, w2 stalling 3 s with probability 0.2 per task, w3 gone
at 4.1 s and back at 9.2 s (killed at ~4 s, restarted ~3 s later, ~2 s of process start-up: the
worker count in the measured metrics logs shows it rejoining between 8.9 and 10.3 s). The job is
the same: `synthetic`, ~1M parameters, batch 1536 in 6 partitions, SGD lr 0.02, open rounds 1,
heartbeat 0.5 s, target test accuracy 0.85, evaluated every 0.5 s; gradients are real (computed
in this process at each slot's model version), so the rounds needed to reach the target come out
of training, not from the measurement.

One number is calibrated, not predicted: the seconds per sample of a worker, from the measured
`none-clean` time (`--clean-s`) and its rounds (`--clean-rounds`), by bisection on the simulated
time of that many clean rounds. It stands for the workers' real speed on this machine, six of
them sharing two cores with the coordinator. Every other mode is then predicted.

    python benchmarks/simulate_stragglers.py --clean-s 8.84 --clean-rounds 75 \\
        --measured none=40.7,replicate:2=14.83,cyclic:1=16.23,adaptive=11.63,sync=62.34
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ["none-clean", "none", "replicate:2", "cyclic:1", "adaptive", "sync", "adaptive-clean"]


def base_config(args, sim):
    return sim.SimConfig(
        duration_s=args.max_virtual, batch_size=args.batch, partitions=6, open_rounds=1,
        heartbeat_s=0.5, liveness=3, task_timeout_s=30.0, model_bytes=4 * args.params,
        costs=sim.CoordinatorCosts(args.coord_message_us * 1e-6, args.coord_gbps * 1e9),
        eval_every_s=0.5, seed=args.seed)


def fleet(args, sim, s_per_sample: float, faults: bool):
    workers = sim.fleet_from_csv(os.path.join(HERE, "fleets", "stragglers.csv"))
    trace = sim.sessions_from_trace(os.path.join(HERE, "fleets", "stragglers-trace.csv"))
    out = []
    for w in workers:
        w = replace(w, s_per_sample=s_per_sample, latency_s=args.latency,
                    bandwidth=args.bandwidth_gbps * 1e9)
        if faults:
            w.sessions = trace.get(w.id)
        else:
            w.slowdown, w.stall_p, w.stall_s = 1.0, 0.0, 0.0
        out.append(w)
    return out


def calibrate(args, sim) -> float:
    """Seconds per sample at which `clean_rounds` clean rounds take `clean_s` in the simulator."""
    config = replace(base_config(args, sim), train_samples=10 ** 6,
                     target_samples=args.clean_rounds * args.batch)

    def simulated(s: float) -> float:
        r = sim.simulate(fleet(args, sim, s, faults=False), config, "none")
        return r.time_to_target_s if r.time_to_target_s is not None else math.inf

    lo, hi = 1e-6, 1.0
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        if simulated(mid) < args.clean_s:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clean-s", type=float, required=True,
                        help="measured none-clean time to target (s), for calibration")
    parser.add_argument("--clean-rounds", type=int, default=75)
    parser.add_argument("--measured", default="",
                        help="MODE=SECONDS,... measured times to target to compare with")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=1536)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--latency", type=float, default=2e-4, help="one way, loopback")
    parser.add_argument("--bandwidth-gbps", type=float, default=2.0, help="loopback, GB/s")
    parser.add_argument("--coord-message-us", type=float, default=60.0)
    parser.add_argument("--coord-gbps", type=float, default=0.9,
                        help="coordinator tensor throughput (scheduler_scale.py --costs, 1 thread)")
    parser.add_argument("--max-virtual", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=9,
                        help="fault draws (stalls, jitter) per mode: the first trains for real, "
                             "the others replay its rounds with costless gradients; medians")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    from idlegrad.coordinator import simulator as sim
    from idlegrad.coordinator.staleness import StalenessRule
    from idlegrad.coordinator.target import Target

    torch.set_num_threads(1)
    measured = {}
    for item in filter(None, args.measured.split(",")):
        mode, _, seconds = item.partition("=")
        measured[mode.strip()] = float(seconds)
    measured.setdefault("none-clean", args.clean_s)
    s = calibrate(args, sim)
    print(f"calibrated: {s * 1e6:.1f} us per sample ({s * args.batch / 6 * 1e3:.1f} ms per "
          f"256-sample slot) from none-clean {args.clean_s:g} s for {args.clean_rounds} rounds",
          flush=True)
    target = Target.parse(f"accuracy={args.target}")
    job_args = {"params": args.params, "batch_size": args.batch, "lr": args.lr}
    rows = {}
    print(f"{'mode':<15} {'predicted_s':>11} {'range_s':>11} {'rounds':>6} {'measured_s':>10} "
          f"{'pred/meas':>9}", flush=True)
    for mode in [m for m in args.modes.split(",") if m]:
        faults = not mode.endswith("-clean")
        gradients = sim.RealGradients("synthetic", job_args, args.seed, StalenessRule())
        config = replace(base_config(args, sim), model_bytes=4 * gradients.aggregator.model.numel)
        r = sim.simulate(fleet(args, sim, s, faults), config, mode.replace("-clean", ""),
                         gradients, target)
        times = [r.time_to_target_s]
        if r.time_to_target_s is not None:
            # The same number of rounds under other draws of the faults: the measured runs
            # differ as much from one another as from a prediction with one draw.
            for seed in range(args.seed + 1, args.seed + args.seeds):
                replay = replace(config, seed=seed, train_samples=gradients.train_samples,
                                 target_samples=r.rounds_applied * args.batch)
                times.append(sim.simulate(fleet(args, sim, s, faults), replay,
                                          mode.replace("-clean", "")).time_to_target_s)
        done = [t for t in times if t is not None]
        predicted = statistics.median(done) if done else None
        m = measured.get(mode)
        ratio = predicted / m if (m and predicted) else None
        rows[mode] = {"predicted_s": predicted, "predicted_range_s": [min(done), max(done)]
                      if done else None, "first_draw_s": r.time_to_target_s,
                      "rounds": r.rounds_applied, "measured_s": m, "ratio": ratio,
                      "wasted_fraction": r.wasted_fraction, "wall_s": r.wall_s}
        spread = f"{min(done):.1f}-{max(done):.1f}" if done else "-"
        print(f"{mode:<15} {predicted if predicted else float('nan'):>11.2f} {spread:>11} "
              f"{r.rounds_applied:>6} {m if m else float('nan'):>10.2f} "
              f"{ratio if ratio else float('nan'):>9.2f}", flush=True)
    if args.json:
        print(json.dumps({"s_per_sample": s, "modes": rows}))


if __name__ == "__main__":
    main()
