"""The gradient noise scale a real job's rounds measure (coordinator/noise.py), as training goes on.

The fleet simulator with real gradients (a small job computed in this process with the workers'
kernels, rounds applied through the real aggregator): identical workers, one round open at a time
(fresh gradients), `--partitions` parts a round. After each stretch of virtual time it prints the
smoothed B_simple, |G|^2 and tr(Sigma), the rounds measured and the test metrics.

    PYTHONPATH=. python3 benchmarks/noise_scale.py --job digits --partitions 8 --stretches 4
"""

from __future__ import annotations

import argparse
import math


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default="digits")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--stretch", type=float, default=20.0, help="virtual seconds a stretch")
    parser.add_argument("--stretches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from idlegrad.coordinator import simulator as sim
    from idlegrad.coordinator.sim_backends import RealGradients
    from idlegrad.coordinator.staleness import StalenessRule

    fleet = [sim.WorkerSpec(f"w{i}", 0.001, latency_s=0.0, bandwidth=math.inf)
             for i in range(args.workers)]
    print(f"{'virtual s':>9} {'version':>7} {'rounds':>6} {'B_simple':>9} {'|G|^2':>10} "
          f"{'tr(Sigma)':>10}  metrics")
    for n in range(1, args.stretches + 1):
        # each stretch from the start again, longer: the estimator's state at that point of a run
        config = sim.SimConfig(duration_s=n * args.stretch, partitions=args.partitions,
                               open_rounds=1, eval_every_s=n * args.stretch, seed=args.seed,
                               costs=sim.CoordinatorCosts(0.0, math.inf))
        gradients = RealGradients(args.job, {}, args.seed, StalenessRule())
        simulation = sim.Simulation(fleet, config, "none", gradients=gradients)
        simulation.run()
        noise = simulation.core.noise.summary()
        metrics = gradients.evaluate()
        print(f"{n * args.stretch:>9.1f} {gradients.version:>7} {noise['rounds']:>6} "
              f"{noise['b_simple'] if noise['b_simple'] is not None else '-':>9} "
              f"{noise['gradient_sq'] or 0:>10.4g} {noise['trace'] or 0:>10.4g}  "
              + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()), flush=True)


if __name__ == "__main__":
    main()
