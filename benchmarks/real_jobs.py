"""The real built-in jobs, `lm` and `resnet`, side by side: idlegrad (a coordinator and `--workers`
workers on this machine) against torch DDP (gloo, as many ranks) and one process.

All three train the same job from the same initial model with the same global batch (the job's
`batch_size`), optimizer and parameter groups, learning-rate schedule (stepped per applied
step), gradient clipping and data order (benchmarks/job_ddp.py builds the job as the coordinator
does), and evaluate on the same cadence (`--eval-every` seconds of training, the coordinator's
`--eval-every`). The single process uses the faster of one thread and one per core, timed on its
first batches (on a busy machine two threads ran the lm step 8x slower than one: OpenMP threads
spin while the cores are taken); each DDP rank and each idlegrad worker gets cores // workers (at least 1); the coordinator
gets 1. idlegrad runs with `--sync --partitions N` by default (`--idlegrad-flags` to change):
the mode an operator picks for equal machines on one site, and the one whose updates match
DDP's (asynchronous rounds on Adam take more samples to the same loss; see docs/scaling.md).
`--systems idlegrad,default` runs it against idlegrad with no mode flags at all (`default`: the
auto mode a user who sets nothing gets), `default_vs_idlegrad` the ratio of their medians.

Per job and system: seconds of training to the target (the coordinator's elapsed at the first
evaluation that reached it; DDP's and one process's from their first step), the target metric
when the run ended (at the target, or at `--budget` seconds), and wire bytes per sample
(idlegrad: what its coordinator sent and received, from its metrics; DDP: a ring all-reduce of
the float32 gradient per step, 2 (N-1)/N of it per rank). The systems run alternately, `--runs`
times (harness.side_by_side), run i with seed i for all three; medians. `--plot FILE.png`: the
metric against training time, every run. `--json`: the last line is {"jobs": {"lm":
{"idlegrad_s": ..., "ddp_s": ..., "single_s": ..., "ratio_vs_ddp": ..., "idlegrad_stopped_s":
...}, "resnet": {...}}} (seconds are medians over runs that reached the target; null when none
did; idlegrad_stopped_s: when its coordinator stopped, after confirming the target on the model
it trains on now). `--target lm:bits_per_byte=2.2` measures to another target than JOBS's.

    python benchmarks/real_jobs.py --runs 3 --plot real_jobs.png --json
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
from harness import Run, med, paired_runs, read_metrics, stopped_on_interrupt  # noqa: E402

JOB_DDP = os.path.join(HERE, "job_ddp.py")

# The jobs as measured: sizes whose steps take long enough for the fleet to matter on a small
# machine, and targets every system reaches within minutes.
JOBS = {
    "lm": {"args": ["size=tiny", "context=64", "batch_size=32", "lr=0.003", "warmup=20",
                    "steps=3000", "eval_windows=256"],
           "target": "bits_per_byte=2.5", "eval_every": 5.0},
    "resnet": {"args": ["width=32", "batch_size=128"], "target": "accuracy=0.99",
               "eval_every": 0.5},
}
# idlegrad: with --idlegrad-flags; default: with no mode flags at all (what a user who sets none
# gets: coordinator/mode.py), for `--systems idlegrad,default`
SYSTEMS = ("idlegrad", "default", "ddp", "single")


def wait_all(procs, timeout: float) -> None:
    end = time.monotonic() + timeout
    for proc in procs:
        proc.wait(timeout=max(0.01, end - time.monotonic()))


def measure_idlegrad(job: str, spec: dict, args, directory: Path, seed: int,
                     flags: str) -> dict:
    from idlegrad.cli.processes import free_port, wait_for_hellos
    from idlegrad.coordinator.target import Target

    address = f"tcp://127.0.0.1:{free_port()}"
    target = Target.parse(spec["target"])
    metric = target.metric
    job_args = [a for arg in spec["args"] for a in ("--job-arg", arg)]
    names = [f"w{i + 1}" for i in range(args.workers)]
    t0 = time.perf_counter()
    with Run(directory) as run:
        # The workers first, the coordinator once they all knock: its clock (the training time
        # reported) then starts with a fleet that is up, as DDP's starts after its ranks' barrier;
        # what the workers do after joining (the job's data from the coordinator) is counted.
        workers = [run.spawn_idlegrad(f"worker-{name}", [
            "worker", "--coordinator", address, "--threads", args.threads, "--id", name,
            "--connect-timeout", "120", "--log-level", "warning", "--no-idle-policy"])
            for name in names]
        wait_for_hellos(address, names, workers, 120)
        coordinator = run.spawn_idlegrad("coordinator", [
            "coordinator", "--job", job, *job_args, "--bind", address, "--target", spec["target"],
            "--epochs", "50", "--checkpoint-dir", directory / "ckpt", "--threads", "1",
            "--seed", seed,
            "--eval-every", spec["eval_every"], "--log-level", "warning",
            *flags.replace("N", str(args.workers)).split()])
        deadline = time.perf_counter() + args.budget + 120
        while coordinator.poll() is None:
            if time.perf_counter() > deadline:
                break  # the budget is spent: the coordinator is stopped with the rest
            time.sleep(0.2)
        wall = time.perf_counter() - t0
    records = read_metrics(directory / "ckpt" / "metrics.jsonl")
    evaluated = [r for r in records if r.get("metrics") and metric in r["metrics"]]
    final = records[-1] if records else {}
    reached = final.get("reason") == "target"
    stopped_s = float(final.get("elapsed", wall))
    # The coordinator stops only once the model it trains on now meets the target: an
    # evaluation of a version that training has moved past is confirmed on the current one
    # (coordinator/evaluation.py), and near a noisy plateau the confirmation can fail and the run
    # go on. DDP and one process stop at the evaluation that met it: the time compared is that
    # evaluation's, idlegrad's too; the stop is reported beside it.
    met = next((r["elapsed"] for r in evaluated if target.reached(r["metrics"])), None)
    return {"wall_s": wall, "train_s": float(met) if reached and met is not None else stopped_s,
            "stopped_s": stopped_s, "reached": reached,
            "metric": (evaluated[-1]["metrics"][metric] if evaluated else None),
            "steps": final.get("version"), "samples": final.get("samples"),
            "bytes_per_sample": next((r["bytes_per_sample"] for r in reversed(records)
                                      if r.get("bytes_per_sample")), None),
            "curve": [[r["elapsed"], r["metrics"][metric]] for r in evaluated if r["version"]]}


def measure_torch(job: str, spec: dict, args, directory: Path, world: int, seed: int) -> dict:
    from idlegrad.cli.processes import free_port

    out = directory / "result.json"
    threads = args.threads if world > 1 else 0  # one process: the faster thread count
    common = ["--job", job, *[a for arg in spec["args"] for a in ("--job-arg", arg)],
              "--world", world, "--port", free_port(), "--target", spec["target"],
              "--threads", threads, "--eval-every", spec["eval_every"], "--budget", args.budget,
              "--seed", seed, "--out", out]
    t0 = time.perf_counter()
    with Run(directory) as run:
        ranks = [run.spawn_python(f"rank{r}", [JOB_DDP, "--rank", r, *common]) for r in range(world)]
        wait_all(ranks, args.budget + 300)
        wall = time.perf_counter() - t0
        codes = [p.returncode for p in ranks]
    if any(codes) or not out.exists():
        raise RuntimeError(f"{'ddp' if world > 1 else 'single'} failed (exit codes {codes}); "
                           f"see {directory}")
    got = json.loads(out.read_text())
    metric = spec["target"].split("=")[0]
    # a ring all-reduce moves 2 (N-1)/N of the float32 gradient per rank per step
    wire = 8 * got["params"] * (world - 1) / (got["samples"] / max(1, got["steps"])) if world > 1 else 0
    return {"wall_s": wall, "train_s": got["train_s"], "reached": got["reached"],
            "metric": got["metrics"].get(metric), "steps": got["steps"], "samples": got["samples"],
            "bytes_per_sample": wire, "curve": got["curve"], "threads": got.get("threads")}


def plot(path: str, rows: dict, jobs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4), squeeze=False)
    colours = {"idlegrad": "tab:blue", "default": "tab:purple", "ddp": "tab:orange",
               "single": "tab:green"}
    for ax, (job, by_system) in zip(axes[0], rows.items()):
        for system, runs in by_system.items():
            for i, r in enumerate(runs):
                if r["curve"]:
                    xs, ys = zip(*r["curve"])
                    ax.plot(xs, ys, color=colours[system], alpha=0.8,
                            label=system if i == 0 else None)
        ax.axhline(float(jobs[job]["target"].split("=")[1]), color="grey", linestyle=":")
        ax.set_title(f"{job}: {jobs[job]['target']}")
        ax.set_xlabel("seconds of training")
        ax.set_ylabel(jobs[job]["target"].split("=")[0])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default="lm,resnet", help="comma-separated, of " + ", ".join(JOBS))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--target", action="append", default=[], metavar="JOB:METRIC=VALUE",
                   help="another target for a job, e.g. lm:bits_per_byte=2.2 (repeatable)")
    p.add_argument("--workers", type=int, default=4, help="idlegrad workers = DDP ranks")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per worker and rank (default cores // workers, >= 1)")
    p.add_argument("--budget", type=float, default=300.0, help="seconds of training at most")
    p.add_argument("--idlegrad-flags", default="--sync --partitions N",
                   help="coordinator flags (N: the number of workers)")
    p.add_argument("--systems", default="idlegrad,ddp,single",
                   help="comma-separated, of " + ", ".join(SYSTEMS) + " (default: idlegrad with "
                        "no mode flags, against --idlegrad-flags)")
    p.add_argument("--dir", default=None, help="keep logs here (default: a temp dir)")
    p.add_argument("--plot", default=None, help="write the curves to this PNG")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.workers)
    jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    unknown = [j for j in jobs if j not in JOBS]
    if unknown:
        p.error(f"unknown job(s) {unknown}: choose among {', '.join(JOBS)}")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or [s for s in systems if s not in SYSTEMS]:
        p.error(f"--systems {args.systems!r}: choose among {', '.join(SYSTEMS)}")
    specs = {job: dict(spec) for job, spec in JOBS.items()}
    for override in args.target:
        job, _, target = override.partition(":")
        metric, _, value = target.partition("=")
        try:
            float(value)
        except ValueError:
            value = ""
        if job not in specs or not metric or not value:
            p.error(f"--target {override!r}: expected JOB:METRIC=VALUE with JOB among "
                    f"{', '.join(JOBS)}, e.g. lm:bits_per_byte=2.2")
        specs[job]["target"] = f"{metric}={value}"
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="idlegrad-real-jobs-"))
    print(f"logs under {base}; workers {args.workers}, threads {args.threads}, budget "
          f"{args.budget:g} s, idlegrad {args.idlegrad_flags!r}", flush=True)
    rows = {job: {s: [] for s in systems} for job in jobs}
    summary = {}
    with stopped_on_interrupt():
        for job in jobs:
            spec = specs[job]

            def measure(system: str, i: int) -> dict:
                directory = base / job / f"run{i + 1}" / system
                directory.mkdir(parents=True, exist_ok=True)
                # run i: seed i for every system (the model's initialisation and the data order),
                # so that the medians span as many trajectories for each system; near the
                # plateau, time to a target varies with the trajectory more than with the system
                if system == "idlegrad":
                    return measure_idlegrad(job, spec, args, directory, seed=i,
                                            flags=args.idlegrad_flags)
                if system == "default":
                    return measure_idlegrad(job, spec, args, directory, seed=i, flags="")
                world = args.workers if system == "ddp" else 1
                return measure_torch(job, spec, args, directory, world, seed=i)

            print(f"== {job} ({' '.join(spec['args'])}), target {spec['target']}", flush=True)
            for i, got in paired_runs(systems, args.runs, measure):
                for system in systems:
                    r = got[system]
                    rows[job][system].append(r)
                    stop = (f" (stopped {r['stopped_s']:.1f} s)"
                            if r.get("stopped_s", r["train_s"]) != r["train_s"] else "")
                    print(f"  run {i + 1} {system:<9} train {r['train_s']:7.1f} s{stop}  wall "
                          f"{r['wall_s']:7.1f} s  reached {str(r['reached']):<5}  metric "
                          f"{r['metric']}  steps {r['steps']}  bytes/sample "
                          f"{r['bytes_per_sample'] and round(r['bytes_per_sample'])}", flush=True)
            times = {s: [r["train_s"] for r in rows[job][s] if r["reached"]] for s in systems}
            medians = {s: (med(times[s]) if times.get(s) else None) for s in SYSTEMS}

            def ratio(a: str, b: str):
                return medians[a] / medians[b] if medians[a] and medians[b] else None

            stops = [r["stopped_s"] for r in rows[job].get("idlegrad", []) if r["reached"]]
            summary[job] = {"idlegrad_s": medians["idlegrad"], "ddp_s": medians["ddp"],
                            "single_s": medians["single"], "ratio_vs_ddp": ratio("idlegrad", "ddp"),
                            "default_s": medians["default"],
                            "default_vs_idlegrad": ratio("default", "idlegrad"),
                            "idlegrad_stopped_s": med(stops) if stops else None,
                            "reached": {s: len(t) for s, t in times.items()},
                            "metric_at_end": {s: med([r["metric"] for r in rows[job][s]
                                                      if r["metric"] is not None] or [None])
                                              for s in systems},
                            "bytes_per_sample": {s: med([r["bytes_per_sample"] or 0
                                                         for r in rows[job][s]]) for s in systems}}
            print(f"  medians: {json.dumps(summary[job])}", flush=True)
    if args.plot:
        plot(args.plot, rows, specs)
        print(f"curves in {args.plot}")
    if args.json:
        print(json.dumps({"jobs": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
