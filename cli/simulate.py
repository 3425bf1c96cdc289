"""`idlegrad simulate`: a fleet in virtual time (coordinator/simulator.py), its redundancy modes
side by side on the same fleet and seed: a table, a PNG, and a JSON line.

    idlegrad simulate --workers 10000 --churn exp:1800:600 --duration 3600 \\
        --partitions 256 --batch 16384 --heartbeat 10 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Callable

from ..common.errors import ConfigError

EXIT_OK, EXIT_FAILED = 0, 1


def add_simulate_parser(sub, add_common: Callable, positive: Callable,
                        non_negative: Callable) -> argparse.ArgumentParser:
    s = sub.add_parser(
        "simulate", help="simulate a fleet with the real scheduler in virtual time",
        description="Simulate a fleet of workers in virtual time with the real scheduler, codes "
                    "and staleness rule: throughput, wasted work, staleness and coordinator load "
                    "per redundancy mode, on the same fleet, churn and seed.")
    fleet = s.add_argument_group("fleet")
    fleet.add_argument("--workers", type=positive(int), default=100, metavar="N",
                       help="workers (default: 100)")
    fleet.add_argument("--speed", default="lognormal:0.005:0.5", metavar="SPEC",
                       help="seconds per sample: lognormal:MEDIAN:SIGMA, or mix (60%% small CPUs, "
                            "30%% fast CPUs, 10%% GPUs) (default: lognormal:0.005:0.5)")
    fleet.add_argument("--fleet", metavar="CSV",
                       help="the workers from a CSV: id,s_per_sample[,credits,latency_s,bandwidth,"
                            "slowdown,stall_p,stall_s,jitter] (overrides --workers and --speed; "
                            "absent columns take --credits, --latency, --bandwidth, --jitter)")
    fleet.add_argument("--churn", default="none", metavar="SPEC",
                       help="availability: none, exp:ON_S:OFF_S (exponential sessions) or "
                            "diurnal:ON_S:OFF_S:SWING (default: none)")
    fleet.add_argument("--trace", metavar="CSV",
                       help="availability from a trace: worker,start,end per session (overrides "
                            "--churn; workers not in it are always on)")
    fleet.add_argument("--bye-fraction", type=non_negative(float), default=0.0, metavar="F",
                       help="share of departures that say bye; the rest vanish (default: 0)")
    fleet.add_argument("--startup", type=non_negative(float), default=0.0, metavar="SECONDS",
                       help="from a session's start to its hello (process start-up) (default: 0)")
    fleet.add_argument("--credits", type=positive(int), default=2, metavar="N",
                       help="slots a worker holds at once (default: 2)")
    fleet.add_argument("--latency", type=non_negative(float), default=0.02, metavar="SECONDS",
                       help="one-way network latency (default: 0.02)")
    fleet.add_argument("--bandwidth", type=positive(float), default=100.0, metavar="MBIT",
                       help="each worker's bandwidth each way, Mbit/s (default: 100)")
    fleet.add_argument("--jitter", type=non_negative(float), default=0.1, metavar="SIGMA",
                       help="lognormal spread of each task's time (default: 0.1)")

    run = s.add_argument_group("training")
    run.add_argument("--modes", default="none,replicate:2,cyclic:1", metavar="LIST",
                     help="comma-separated: sync, none, replicate:R, cyclic:S, adaptive "
                          "(default: none,replicate:2,cyclic:1)")
    run.add_argument("--duration", type=positive(float), default=3600.0, metavar="SECONDS",
                     help="virtual seconds to simulate (default: 3600)")
    run.add_argument("--batch", type=positive(int), default=1024, metavar="N",
                     help="samples per round, costless gradients (default: 1024)")
    run.add_argument("--partitions", type=positive(int), default=8, metavar="K",
                     help="partitions per round (default: 8)")
    run.add_argument("--open-rounds", type=non_negative(int), default=0, metavar="N",
                     help="rounds open at once; 0: as many as the workers ask for, at most twice what their credits hold plus two (default)")
    run.add_argument("--heartbeat", type=positive(float), default=1.0, metavar="SECONDS",
                     help="heartbeat interval; silent for 3 beats is evicted (default: 1)")
    run.add_argument("--task-timeout", type=positive(float), default=30.0, metavar="SECONDS",
                     help="least time before a slow task is handed to another (default: 30)")
    run.add_argument("--staleness", choices=["inverse", "sqrt", "constant"], default="inverse")
    run.add_argument("--max-staleness", type=non_negative(int), default=32, metavar="TAU",
                     help="rounds staler than this are replanned (default: 32)")
    run.add_argument("--no-speculate", dest="speculate", action="store_false",
                     help="do not duplicate late tasks to free workers")
    run.add_argument("--task", default="gradient", metavar="KIND",
                     help="what a slot computes, as the coordinator's --task: gradient, local:H "
                          "or local:auto (default: gradient)")
    run.add_argument("--verify-replicas", action="store_true",
                     help="a replicated row counts once copies from two workers agree, as the "
                          "coordinator's --verify-replicas (every mode must be replicate:R, R >= 2)")
    run.add_argument("--params", type=positive(int), default=1_000_000, metavar="N",
                     help="model parameters, float32, costless gradients (default: 1000000)")
    run.add_argument("--train-samples", type=positive(int), default=60_000, metavar="N",
                     help="training set size, costless gradients (default: 60000)")
    run.add_argument("--target-samples", type=positive(int), metavar="N",
                     help="stop a mode once this many samples are applied (time to target)")
    run.add_argument("--job", metavar="SPEC",
                     help="real gradients: a small job computed in this process (e.g. digits)")
    run.add_argument("--job-arg", action="append", default=[], metavar="KEY=VALUE")
    run.add_argument("--target", metavar="METRIC=VALUE",
                     help="real gradients: stop a mode when the test metric reaches VALUE")
    run.add_argument("--eval-every", type=positive(float), metavar="SECONDS",
                     help="virtual seconds between evaluations, on the workers' evaluation slots "
                          "through the run core (default: 0.5 with --job; none with costless "
                          "gradients, whose one metric is the evaluated version)")
    run.add_argument("--test-samples", type=positive(int), default=10_000, metavar="N",
                     help="test set size, costless gradients: what an evaluation covers "
                          "(default: 10000)")

    data = s.add_argument_group("sharded data (bytes each worker downloads)")
    data.add_argument("--shards", type=non_negative(int), default=0, metavar="N",
                      help="the training set in N equal shards that workers fetch, over their "
                           "--bandwidth, before computing on them; 0: every worker has the data "
                           "(default)")
    data.add_argument("--shard-mb", type=positive(float), default=64.0, metavar="MB",
                      help="bytes of one shard (default: 64)")
    data.add_argument("--locality", choices=["on", "off", "compare"], default="on",
                      help="the shard-aware order and the scheduler's preference for a worker's "
                           "shards; compare: each mode with and without (default: on)")
    data.add_argument("--shuffle-window", type=positive(int), default=4, metavar="W",
                      help="shards whose samples are shuffled together (default: 4)")
    data.add_argument("--cache-shards", type=positive(int), metavar="N",
                      help="shards a worker's cache keeps (default: no limit)")

    coord = s.add_argument_group("coordinator costs")
    coord.add_argument("--coord-message-us", type=non_negative(float), default=60.0, metavar="US",
                       help="CPU per message taken in (default: 60)")
    coord.add_argument("--coord-gbps", type=positive(float), default=1.5, metavar="GB/S",
                       help="tensor throughput: gradients in, models out, sums (default: 1.5)")

    out = s.add_argument_group("output")
    out.add_argument("--seed", type=non_negative(int), default=0)
    out.add_argument("--plot", metavar="PNG", help="write a plot (needs the extra idlegrad[plot])")
    out.add_argument("--json", action="store_true",
                     help='print {"modes": ..., "scheduler_us_per_slot": ..., "workers": N} last')
    add_common(s)
    s.set_defaults(func=run_simulate, log_level="warning")
    return s


def _fleet(args, rng):
    from ..coordinator import simulator as sim

    spec = dict(credits=args.credits, latency_s=args.latency, bandwidth=args.bandwidth * 1e6 / 8,
                jitter=args.jitter)
    if args.fleet:
        fleet = sim.fleet_from_csv(args.fleet, **spec)
    elif args.speed.strip().lower() == "mix":
        fleet = sim.mixed_fleet(args.workers, rng, **spec)
    else:
        kind, _, rest = args.speed.strip().lower().partition(":")
        try:
            median, sigma = (float(x) for x in rest.split(":"))
        except ValueError:
            median = sigma = None
        if kind != "lognormal" or median is None or not median > 0 or not sigma >= 0:
            raise ConfigError(f"--speed {args.speed!r}: expected lognormal:MEDIAN_S:SIGMA "
                              "(e.g. lognormal:0.005:0.5) or mix")
        fleet = sim.lognormal_fleet(args.workers, median, sigma, rng, **spec)
    if args.trace:
        sessions = sim.sessions_from_trace(args.trace)
        unknown = set(sessions) - {w.id for w in fleet}
        if unknown:
            raise ConfigError(f"the trace names workers not in the fleet: {sorted(unknown)[:5]}")
        for w in fleet:
            w.sessions = sessions.get(w.id)
    else:
        churn = sim.parse_churn(args.churn)
        if churn is not None:
            for w in fleet:
                w.sessions = churn.sessions(args.duration, rng)
    return fleet


def run_simulate(args) -> int:
    import numpy as np

    from ..common.coding import parse_redundancy
    from ..coordinator import simulator as sim
    from ..coordinator.local import check_redundancy, parse_task
    from ..coordinator.staleness import StalenessRule
    from ..coordinator.target import Target

    try:
        modes = [sim.check_mode(m) for m in args.modes.split(",") if m.strip()]
    except ConfigError as exc:  # parse_redundancy speaks of --redundancy, the coordinator's flag
        raise ConfigError(f"--modes: {str(exc).removeprefix('--redundancy ')}") from None
    if not modes:
        raise ConfigError("--modes names no mode")
    task_mode = parse_task(args.task)
    for mode in modes:  # what local tasks cannot decode, before any mode runs
        check_redundancy(task_mode, parse_redundancy("none" if mode == "sync" else mode),
                         mode == "sync")
    if args.verify_replicas:  # the scheduler's rule, for every mode before any runs
        from ..coordinator.scheduler import SchedulerConfig

        for mode in modes:
            sync = mode == "sync"
            SchedulerConfig(batch_size=1, redundancy=parse_redundancy("none" if sync else mode),
                            sync=sync, verify_replicas=True)
    if args.bye_fraction > 1:
        raise ConfigError("--bye-fraction must be at most 1")
    if args.target and not args.job:
        raise ConfigError("--target needs --job (real gradients); use --target-samples otherwise")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            print(f"idlegrad simulate: error: --plot needs matplotlib ({exc}): "
                  "pip install 'idlegrad[plot]'", file=sys.stderr)
            return EXIT_FAILED
    target = Target.parse(args.target) if args.target else None
    fleet = _fleet(args, np.random.default_rng(args.seed))
    config = sim.SimConfig(
        duration_s=args.duration, batch_size=args.batch, partitions=args.partitions,
        open_rounds=args.open_rounds, speculate=args.speculate, heartbeat_s=args.heartbeat,
        verify_replicas=args.verify_replicas, task=args.task,
        task_timeout_s=args.task_timeout, staleness=args.staleness,
        max_staleness=args.max_staleness, model_bytes=4 * args.params,
        train_samples=args.train_samples,
        costs=sim.CoordinatorCosts(args.coord_message_us * 1e-6, args.coord_gbps * 1e9),
        target_samples=args.target_samples, test_samples=args.test_samples,
        eval_every_s=args.eval_every if args.eval_every is not None else (
            0.5 if args.job else None),
        bye_fraction=args.bye_fraction, startup_s=args.startup, seed=args.seed,
        shards=args.shards, shard_bytes=int(args.shard_mb * 2**20),
        locality=args.locality != "off", shuffle_window=args.shuffle_window,
        cache_shards=args.cache_shards)
    make_gradients = None
    if args.job:
        from ..common.job_loading import parse_job_args

        job_args = parse_job_args(args.job_arg)
        rule = StalenessRule(args.staleness, args.max_staleness)

        def make_gradients():
            return sim.RealGradients(args.job, job_args, args.seed, rule, local=task_mode.local)

        probe = make_gradients()  # bad job specs fail here, once, before any mode runs
        config.model_bytes = probe.aggregator.model.numel * probe.aggregator.model.params.element_size()
    if not args.job and args.batch > args.train_samples:
        print(f"note: a round never spans two epochs: --batch {args.batch} is cut to the "
              f"{args.train_samples} samples of --train-samples", file=sys.stderr)
    print(f"{len(fleet)} workers, {args.duration:g} virtual s, modes {', '.join(modes)}",
          file=sys.stderr, flush=True)
    runs = [(mode, config) for mode in modes]
    if args.locality == "compare" and args.shards:
        runs += [(mode, dataclasses.replace(config, locality=False)) for mode in modes]
    results = {}
    with _progress(len(runs)) as advance:
        for mode, run_config in runs:
            (r,) = sim.compare(fleet, run_config, [mode], make_gradients,
                               target, progress=advance).values()
            if not run_config.locality and config.locality:
                r.mode = f"{mode}/no-locality"
            results[r.mode] = r
    print_table(results, target)
    if args.plot:
        plot(results, args.plot, f"{len(fleet)} workers, seed {args.seed}")
        print(f"plot: {args.plot}")
    if args.json:
        print(json.dumps({"modes": {m: r.summary() for m, r in results.items()},
                          "scheduler_us_per_slot": round(max(r.scheduler_us_per_slot
                                                             for r in results.values()), 2),
                          "workers": len(fleet)}))
    return EXIT_OK


class _progress:
    """A bar over the modes on a terminal (stderr), else one line per mode as it ends."""

    def __init__(self, runs: int):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.runs = runs
        console = Console(stderr=True)
        self.bar = (Progress(TextColumn("{task.description}"), BarColumn(),
                             TextColumn("{task.completed}/{task.total} modes"),
                             TimeElapsedColumn(), console=console, transient=True)
                    if console.is_terminal else None)

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
            self.task = self.bar.add_task("simulating", total=self.runs)
        return self.advance

    def advance(self, r) -> None:
        if self.bar is None:
            print(f"  {r.mode}: {r.wall_s:.1f} s wall", file=sys.stderr, flush=True)
        else:
            self.bar.update(self.task, advance=1, description=f"simulated {r.mode}")

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()


def _fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def _quantile(hist: dict[int, int], q: float):
    total = sum(hist.values())
    if not total:
        return None
    seen = 0
    for tau in sorted(hist):
        seen += hist[tau]
        if seen >= q * total:
            return tau
    return max(hist)


def print_table(results, target=None) -> None:
    print(f"{'mode':<12} {'samples/s':>10} {'rounds':>7} {'replan':>6} {'wasted':>7} "
          f"{'tau':>5} {'tau90':>5} {'coord':>6} {'t_target':>9} {'us/slot':>7} {'us/dec':>6} "
          f"{'ms/tick':>7} {'wall_s':>6}")
    for mode, r in results.items():
        print(f"{mode:<12} {r.samples_per_s:>10.1f} {r.rounds_applied:>7} "
              f"{r.rounds_replanned:>6} {100 * r.wasted_fraction:>6.1f}% "
              f"{r.mean_staleness:>5.1f} {_fmt(_quantile(r.staleness, 0.9), 'd'):>5} "
              f"{100 * r.coordinator_load:>5.0f}% {_fmt(r.time_to_target_s, '.2f'):>9} "
              f"{r.scheduler_us_per_slot:>7.1f} {r.decision_us_per_slot:>6.1f} "
              f"{r.tick_us / 1e3:>7.2f} {r.wall_s:>6.1f}")
    for mode, r in results.items():
        causes = ", ".join(f"{k} {100 * v:.0f}%" for k, v in
                           sorted(r.coordinator_by.items(), key=lambda kv: -kv[1]) if v >= 0.005)
        print(f"  {mode}: coordinator busy with {causes or 'nothing'}; {r.slots_assigned} slots "
              f"handed out, {r.slots_cancelled} cancelled")
        if r.evaluations or r.eval_slots:
            print(f"  {mode}: {_evaluations(r, target)}")
        if r.downloaded:
            print(f"  {mode}: workers downloaded {sum(r.downloaded.values()) / 2**20:,.0f} MB "
                  f"of shards ({r.data_bytes / 2**20:,.0f} MB of data); the most any one did is "
                  f"{r.download_ratio:.2f} x its share")
    for mode, r in results.items():
        if r.wasted_fraction >= 0.05:
            print(f"  {mode}: wasted {100 * r.wasted_fraction:.0f}%: {_waste_causes(r)}")
    for line in LEGEND:
        print(line)


LEGEND = (
    "mode       the redundancy code: none, replicate:R (R copies of each slot), cyclic:S (any S "
    "slots of a round may straggle), sync",
    "samples/s  training samples applied per virtual second (to the target, when one was reached)",
    "rounds     optimizer steps taken; replan: rounds dropped as too stale (older than "
    "--max-staleness) and planned again",
    "wasted     worker compute that went into no applied step: spare copies, replanned rounds, "
    "work lost with workers that left",
    "tau        mean staleness of the applied rounds (versions behind the model); tau90: its 90th "
    "percentile",
    "coord      share of the time the coordinator was busy (near 100%: it is the bottleneck)",
    "t_target   virtual seconds to --target or --target-samples (-: not reached)",
    "us/slot    the scheduler's CPU per slot handed out, ticks included (us/dec: without them; "
    "ms/tick: per tick)",
    "wall_s     real seconds this mode took to simulate",
)


def _waste_causes(r) -> str:
    """Where the wasted compute went, in the counts the simulation keeps."""
    causes = []
    if r.slots_cancelled:
        causes.append(f"{r.slots_cancelled:,} of {r.slots_assigned:,} slots cancelled (copies not "
                      "needed once their row was in: replicas, coded spares, speculative "
                      "duplicates; or their worker left)")
    if r.rounds_replanned:
        causes.append(f"{r.rounds_replanned:,} rounds replanned as too stale (many rounds open "
                      "at once: cap --open-rounds, or raise --batch)")
    return "; ".join(causes) or "results lost with workers that left or missed their deadline"


def _evaluations(r, target) -> str:
    """What a mode's evaluations (the run core's) did, in a line."""
    plural = lambda n: f"{n} evaluation{'' if n == 1 else 's'}"  # noqa: E731
    if r.eval_on == "workers":
        text = (f"{plural(r.evaluations - r.evaluations_here)} on the workers' evaluation slots "
                f"({r.eval_slots} slots, {100 * r.eval_compute_fraction:.1f}% of the workers' "
                "compute)")
        if r.evaluations_here:
            text += f", {r.evaluations_here} on the coordinator confirming a target"
    else:
        text = f"{plural(r.evaluations)} on the coordinator (the job's evaluate returns means)"
    if r.metrics:
        text += "; last " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(r.metrics.items()))
    if r.stopped == "target":
        text += f"; stopped at {r.time_to_target_s:.2f} s: target {target} met"
    elif r.stopped == "bad target":
        text += f"; stopped: the evaluations report no {target.metric!r}"
    return text


def plot(results, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax_rate, ax_tau, ax_load, ax_metric = axes.flat
    for i, (mode, r) in enumerate(results.items()):
        color = f"C{i}"
        points = [p for p in r.series if "samples_per_s" in p]
        if points:
            ax_rate.plot([p["t"] for p in points], [p["samples_per_s"] for p in points],
                         color=color, label=mode)
            ax_load.plot([p["t"] for p in points], [100 * p["coordinator_load"] for p in points],
                         color=color, label=f"{mode} coordinator %")
        if r.staleness:
            taus = sorted(r.staleness)
            ax_tau.step(taus, [r.staleness[t] for t in taus], where="mid", color=color,
                        label=f"{mode} (mean {r.mean_staleness:.1f})")
        evals = [p for p in r.series if "metrics" in p and p["metrics"]]
        if evals:
            name = "accuracy" if "accuracy" in evals[0]["metrics"] else sorted(evals[0]["metrics"])[0]
            ax_metric.plot([p["t"] for p in evals], [p["metrics"][name] for p in evals],
                           color=color, label=f"{mode} {name}")
        else:
            ax_metric.plot([p["t"] for p in points], [p["samples"] for p in points], color=color,
                           label=f"{mode} samples applied")
    first = next(iter(results.values()))
    points = [p for p in first.series if "online" in p]
    if points:
        twin = ax_load.twinx()
        twin.plot([p["t"] for p in points], [p["online"] for p in points], "k:", label="online")
        twin.set_ylabel("workers online")
    ax_rate.set(title="samples/s applied", xlabel="virtual s")
    ax_tau.set(title="staleness of applied rounds", xlabel="tau (versions)", ylabel="rounds")
    ax_load.set(title="coordinator load", xlabel="virtual s", ylabel="% busy")
    ax_metric.set(title="progress", xlabel="virtual s")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"idlegrad simulate: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

