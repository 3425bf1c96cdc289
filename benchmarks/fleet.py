"""The default mode on heterogeneous fleets (issue 26): idlegrad's default (auto), `--sync` and
`--async` against torch DDP, real processes on this machine over loopback.

Fleets (each worker slowed with the worker's `--slowdown X`: every task takes X times its
compute, counted as CPU time; each DDP rank by the same factor, benchmarks/job_ddp.py
`--slowdown`):

- spread: slowdowns 1, 2, 4, 8;
- one_fast: 1, 8, 8, 8;
- lognormal: 6 workers, slowdowns max(1, lognormal(0, `--sigma`)) drawn from `--fleet-seed`;
- churn: the spread's four speeds, w2 (2x) killed with SIGKILL and started again (same `--id`),
  w3 (4x) stopped with SIGSTOP for a while and then continued (SIGCONT), w4 (8x) joining late
  (the job's CHURN times, seconds of training). DDP cannot survive a killed rank (its collective
  fails and the job restarts from a checkpoint), so DDP runs this fleet without the churn: its
  best case.

Each fleet's slowdowns are relative: they are scaled by the least factor k >= 1 under which the
fleet's workers, all computing, fit in `--worker-cores` cores (default: all but one, which the
coordinator and this script keep). A slowed slot (a DDP step) computes and then sleeps until it
has lasted X times its CPU time, so an emulated machine is a share of a real core; a fleet that
needs more cores than this machine has would measure its workers (and DDP's ranks) queueing for
the same cores rather than the fleet. On 2 cores spread becomes 1.88, 3.75, 7.5, 15 (k = 1.875)
and lognormal's six workers k = 5.

`--fleets equal` (four equal workers; not in the default list) is the control: the slot
spread of sized rounds where there is nothing to size, the floor this machine's shared cores
and per-slot overheads put under the others.

Jobs: `digits` (built-in; a 4,096-wide hidden layer, batch 1,024, Adam at 5e-4, so that a
worker's slot is mostly compute rather than per-task overheads; to test accuracy 0.95) and `lm` (benchmarks/real_jobs.py's lm: its recipe and its
target, bits per byte 2.5); `--jobs digits` runs one.

Every candidate trains the same job from the same initial model (run i: seed i for all) with the
same global batch (the job's `batch_size`: a sync round, a DDP step), one torch thread per
worker and per rank (`--threads`), the coordinator one more, and evaluates every `eval_every`
seconds of training. Time to target: the coordinator's `elapsed` at the first evaluation that
reached the target (from its bind: the workers, started first, are already knocking); DDP's from
its ranks' barrier after building the job. Samples to target: the samples applied up to that
evaluation. slot_spread: the coordinator's last metrics record's `slot_spread`, the median over
recent rounds of (p90 - p10 of the round's slot finish times) / the round's time (async rounds
report one too).

The candidates run alternately (harness.side_by_side), `--repeats` times per fleet and job;
medians over the runs that reached the target. It prints each run, a table, writes
`--plot` (a PNG of the metric against training time, one panel per fleet and job, the first run
of each candidate; skipped with a note when matplotlib is missing) and, with `--json`, one last
line {"fleets": {"FLEET/JOB": {"idlegrad_s": ..., "sync_s": ..., "async_s": ..., "ddp_s": ...,
"ratio_vs_ddp": ..., "samples": {...}, "samples_vs_sync": ..., "slot_spread": ...,
"criteria": {...}}}}: the job is part of the name, after a slash.

    python benchmarks/fleet.py --repeats 3 --jobs digits --plot fleet.png --json

Acceptance (issue 26): on every fleet the default reaches the target in at most 0.5x DDP's time,
with at most 1.2x the samples of --sync, and its slot spread is under 0.2; `criteria` says
which held. Every process it starts is stopped and reaped by PID (harness.Run), also on Ctrl-C
and failure; every run is bounded by the job's budget.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import Run, fmt, med, read_metrics, side_by_side, stopped_on_interrupt  # noqa: E402
from real_jobs import JOBS as REAL_JOBS  # noqa: E402

JOB_DDP = os.path.join(HERE, "job_ddp.py")

# digits: the demo's MLP and Adam (benchmarks/demo_vs_ddp.py) with a batch of 1,024 and a wider
# hidden layer, so that a worker's task is tens of ms of compute (a slowdown then costs time
# rather than vanishing in per-task overheads); lm: real_jobs.py's. churn: (kill at, restart
# after, stop at, stopped for, late join at), seconds of training.
JOBS = {
    "digits": {"args": ["hidden=4096", "lr=0.0005", "batch_size=1024"], "target": "accuracy=0.95",
               "eval_every": 0.25, "budget": 120.0, "churn": (1.0, 1.5, 2.0, 2.0, 3.0)},
    "lm": {**REAL_JOBS["lm"], "budget": 400.0, "churn": (10.0, 10.0, 20.0, 15.0, 30.0)},
}
CANDIDATES = {"idlegrad": [], "sync": ["--sync"], "async": ["--async"], "ddp": None}
KILLED, STOPPED, LATE = "w2", "w3", "w4"  # the churn fleet's


def fleets(sigma: float, seed: int) -> dict[str, list[float]]:
    """Each fleet's relative slowdowns, worker w1 first."""
    rng = random.Random(seed)
    lognormal = [round(max(1.0, rng.lognormvariate(0.0, sigma)), 2) for _ in range(6)]
    return {"spread": [1, 2, 4, 8], "one_fast": [1, 8, 8, 8], "lognormal": lognormal,
            "churn": [1, 2, 4, 8], "equal": [1, 1, 1, 1]}


def fitted(slowdowns: list, worker_cores: float) -> list:
    """The slowdowns times the least factor k >= 1 under which the fleet's workers, computing
    without pause, need at most `worker_cores` of this machine's cores (sum of 1/slowdown). A
    slowed slot computes, then sleeps until it has lasted X times its CPU time, so each emulated
    machine is a share of a real core: a fleet that needs more cores than there are measures
    their contention (its workers and DDP's ranks queueing for the same cores), not the fleet.
    k scales every worker alike, so DDP's wait for its slowest rank, relative to the fleet, is
    the fleet's."""
    k = max(1.0, sum(1.0 / x for x in slowdowns) / worker_cores)
    return [round(x * k, 2) for x in slowdowns]


def worker_args(name: str, slowdown: float, address: str, threads: int) -> list:
    return ["worker", "--coordinator", address, "--id", name, "--threads", threads,
            "--device", "cpu", "--slowdown", slowdown, "--connect-timeout", "120",
            "--no-idle-policy", "--log-level", "warning"]


class Churn:
    """The churn fleet's events, each once, at its time of training (`step(t)`)."""

    def __init__(self, run: Run, workers: dict, spawn_worker, times: tuple):
        self.run, self.workers, self.spawn_worker = run, workers, spawn_worker
        self.kill_at, self.restart_after, self.stop_at, self.stop_for, self.join_at = times
        self.done: dict[str, float] = {}

    def _once(self, event: str, due: float, t: float) -> bool:
        if event in self.done or t < due:
            return False
        self.done[event] = round(t, 2)
        return True

    def step(self, t: float) -> None:
        if self._once("killed", self.kill_at, t):
            self.workers[KILLED].send_signal(signal.SIGKILL)
            self.workers[KILLED].wait(timeout=10)
        if "killed" in self.done and self._once("restarted", self.done["killed"]
                                                + self.restart_after, t):
            self.workers[KILLED] = self.spawn_worker(KILLED)
        if self._once("stopped", self.stop_at, t):
            os.kill(self.workers[STOPPED].pid, signal.SIGSTOP)
        if "stopped" in self.done and self._once("continued", self.done["stopped"]
                                                 + self.stop_for, t):
            os.kill(self.workers[STOPPED].pid, signal.SIGCONT)
        if self._once("joined", self.join_at, t):
            self.workers[LATE] = self.spawn_worker(LATE)

    def note(self) -> str:
        return ", ".join(f"{k} {v:g}s" for k, v in self.done.items()) or "no churn event"


def measure_idlegrad(flags: list, fleet: str, slowdowns: list, job: str, spec: dict, args,
                     directory: Path, seed: int) -> dict:
    from idlegrad.cli.processes import free_port, wait_for_hellos
    from idlegrad.coordinator.target import Target
    from idlegrad.monitor.source import ZmqStatusSource

    target = Target.parse(spec["target"])
    address = f"tcp://127.0.0.1:{free_port()}"
    names = [f"w{i + 1}" for i in range(len(slowdowns))]
    speed = dict(zip(names, slowdowns))
    churning = fleet == "churn"
    first = [n for n in names if not (churning and n == LATE)]
    job_args = [a for arg in spec["args"] for a in ("--job-arg", arg)]
    source = None
    churn = None
    with Run(directory) as run:
        def spawn_worker(name: str):
            return run.spawn_idlegrad(name, worker_args(name, speed[name], address, args.threads))

        workers = {n: spawn_worker(n) for n in first}
        wait_for_hellos(address, first, list(workers.values()), 120)
        coordinator = run.spawn_idlegrad("coordinator", [
            "coordinator", "--job", job, *job_args, "--bind", address, "--target",
            spec["target"], "--epochs", "1000", "--checkpoint-dir", directory / "ckpt",
            "--checkpoint-every", "3600", "--threads", "1", "--heartbeat", "0.5",
            "--seed", seed, "--eval-every", spec["eval_every"], "--log-level", "warning", *flags])
        if churning:
            churn = Churn(run, workers, spawn_worker, spec["churn"])
            source = ZmqStatusSource(address)
        end = time.monotonic() + spec["budget"] + 120  # its start-up, then the budget
        origin = None  # monotonic time of the coordinator's elapsed 0
        try:
            while coordinator.poll() is None and time.monotonic() < end:
                if source is not None:
                    snap = source.fetch(timeout=0.2)
                    if snap is not None and origin is None:
                        origin = time.monotonic() - float(snap.get("elapsed_s", 0.0))
                    if origin is not None and churn is not None:
                        churn.step(time.monotonic() - origin)
                if origin is not None and time.monotonic() - origin > spec["budget"]:
                    break
                if origin is None and source is None:
                    records = read_metrics(directory / "ckpt" / "metrics.jsonl")
                    if records:
                        origin = time.monotonic() - float(records[-1]["elapsed"])
                time.sleep(0.2)
        finally:
            if source is not None:
                source.close()
    records = read_metrics(directory / "ckpt" / "metrics.jsonl")
    evaluated = [r for r in records if (r.get("metrics") or {}).get(target.metric) is not None]
    met = next((r for r in evaluated if target.reached(r["metrics"])), None)
    final = records[-1] if records else {}
    return {"reached": met is not None, "time_s": float(met["elapsed"]) if met else None,
            "samples": met.get("samples") if met else final.get("samples"),
            "metric": evaluated[-1]["metrics"][target.metric] if evaluated else None,
            "slot_spread": final.get("slot_spread"), "mode": final.get("mode"),
            "notes": churn.note() if churn else "",
            "curve": [[r["elapsed"], r["metrics"][target.metric]] for r in evaluated]}


def measure_ddp(slowdowns: list, job: str, spec: dict, args, directory: Path, seed: int,
                note: str = "") -> dict:
    from idlegrad.cli.processes import free_port

    out = directory / "result.json"
    world = len(slowdowns)
    common = ["--job", job, *[a for arg in spec["args"] for a in ("--job-arg", arg)],
              "--world", world, "--port", free_port(), "--target", spec["target"],
              "--threads", args.threads, "--eval-every", spec["eval_every"],
              "--budget", spec["budget"], "--epochs", 1000, "--seed", seed, "--out", out]
    with Run(directory) as run:
        ranks = [run.spawn_python(f"rank{r}", [JOB_DDP, "--rank", r, "--slowdown", slowdowns[r],
                                               *common]) for r in range(world)]
        end = time.monotonic() + spec["budget"] + 180
        while time.monotonic() < end and any(p.poll() is None for p in ranks):
            if any(p.poll() not in (None, 0) for p in ranks):
                break  # a rank failed: the others would wait in their collective
            time.sleep(0.2)
        codes = [p.poll() for p in ranks]
    if any(codes) or not out.exists():
        raise RuntimeError(f"ddp failed (exit codes {codes}); see {directory}")
    got = json.loads(out.read_text())
    return {"reached": got["reached"], "time_s": got["train_s"] if got["reached"] else None,
            "samples": got["samples"], "metric": got["metrics"].get(spec["target"].split("=")[0]),
            "slot_spread": None, "mode": "ddp", "notes": note,
            "curve": got["curve"]}


def summarize(rows: dict[str, list[dict]]) -> dict:
    def reached(c: str, key: str):
        got = [r[key] for r in rows[c] if r["reached"] and r[key] is not None]
        return med(got) if got else None

    s = {f"{c}_s": reached(c, "time_s") for c in rows}
    samples = {c: reached(c, "samples") for c in rows}
    ratio = (s["idlegrad_s"] / s["ddp_s"]) if s.get("idlegrad_s") and s.get("ddp_s") else None
    vs_sync = (samples["idlegrad"] / samples["sync"]
               if samples.get("idlegrad") and samples.get("sync") else None)
    spread = med([r["slot_spread"] for r in rows.get("idlegrad", [])])
    return {**s, "ratio_vs_ddp": ratio, "samples": samples, "samples_vs_sync": vs_sync,
            "slot_spread": spread,
            "slot_spread_by_mode": {c: med([r["slot_spread"] for r in rows[c]])
                                    for c in rows if c != "ddp"},
            "reached": {c: sum(r["reached"] for r in rows[c]) for c in rows},
            "runs": len(next(iter(rows.values()))),
            "criteria": {"time_vs_ddp<=0.5": None if ratio is None else ratio <= 0.5,
                         "samples_vs_sync<=1.2": None if vs_sync is None else vs_sync <= 1.2,
                         "slot_spread<0.2": None if spread is None else spread < 0.2}}


def print_table(summary: dict) -> None:
    print(f"\n{'fleet/job':<18} {'idlegrad_s':>10} {'sync_s':>7} {'async_s':>7} {'ddp_s':>7} "
          f"{'vs_ddp':>6} {'smp_idle':>8} {'smp_sync':>8} {'smp_asyn':>8} {'smp_ddp':>8} "
          f"{'vs_sync':>7} {'spread':>6}  criteria met")
    for name, s in summary.items():
        smp = s["samples"]
        met = [k for k, v in s["criteria"].items() if v]
        print(f"{name:<18} {fmt(s.get('idlegrad_s')):>10} {fmt(s.get('sync_s')):>7} "
              f"{fmt(s.get('async_s')):>7} {fmt(s.get('ddp_s')):>7} "
              f"{fmt(s['ratio_vs_ddp']):>6} {fmt(smp.get('idlegrad'), '.0f'):>8} "
              f"{fmt(smp.get('sync'), '.0f'):>8} {fmt(smp.get('async'), '.0f'):>8} "
              f"{fmt(smp.get('ddp'), '.0f'):>8} {fmt(s['samples_vs_sync']):>7} "
              f"{fmt(s['slot_spread']):>6}  {len(met)}/3 {' '.join(met)}", flush=True)


def plot(path: str, rows: dict, specs: dict) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'idlegrad[plot]'): no plot written")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.6), squeeze=False)
    colours = {"idlegrad": "tab:blue", "sync": "tab:green", "async": "tab:red",
               "ddp": "tab:orange"}
    for ax, name in zip(axes[0], names):
        job = name.split("/")[1]
        for candidate, runs in rows[name].items():
            if runs and runs[0]["curve"]:
                xs, ys = zip(*runs[0]["curve"])
                ax.plot(xs, ys, color=colours[candidate], label=candidate, alpha=0.85)
        metric, _, value = specs[job]["target"].partition("=")
        ax.axhline(float(value), color="grey", linestyle=":")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("seconds of training")
        ax.set_ylabel(metric)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default="digits,lm", help="comma-separated, of " + ", ".join(JOBS))
    p.add_argument("--fleets", default="spread,one_fast,lognormal,churn")
    p.add_argument("--candidates", default=",".join(CANDIDATES))
    p.add_argument("--repeats", type=int, default=3, help="runs per candidate; medians")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker and rank")
    p.add_argument("--sigma", type=float, default=0.7, help="the lognormal fleet's sigma")
    p.add_argument("--fleet-seed", type=int, default=0, help="the lognormal fleet's draw")
    p.add_argument("--worker-cores", type=float, default=max(1, (os.cpu_count() or 2) - 1),
                   help="cores the emulated fleet may use (default: all but one, left to the "
                   "coordinator and this script): each fleet's slowdowns are scaled up "
                   "until its workers fit in them")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds of training per run at most (default: the job's)")
    p.add_argument("--dir", default=None, help="keep logs here (default: a temp dir)")
    p.add_argument("--plot", default=None, help="write the curves to this PNG")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    jobs = [j for j in args.jobs.split(",") if j]
    all_fleets = fleets(args.sigma, args.fleet_seed)
    if args.worker_cores <= 0:
        p.error("--worker-cores must be positive")
    all_fleets = {n: fitted(relative, args.worker_cores) for n, relative in all_fleets.items()}
    names = [f for f in args.fleets.split(",") if f]
    candidates = [c for c in args.candidates.split(",") if c]
    for what, got, known in (("job", jobs, JOBS), ("fleet", names, all_fleets),
                             ("candidate", candidates, CANDIDATES)):
        if not got or set(got) - set(known):
            p.error(f"--{what}s: choose among {', '.join(known)}")
    specs = {j: dict(JOBS[j]) for j in jobs}
    if args.budget:
        for spec in specs.values():
            spec["budget"] = args.budget
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="idlegrad-fleet-"))
    print(f"logs under {base}; fleets {json.dumps({n: all_fleets[n] for n in names})} "
          f"(fitted to {args.worker_cores:g} worker cores); threads {args.threads}", flush=True)
    rows: dict[str, dict[str, list[dict]]] = {}
    summary = {}
    with stopped_on_interrupt():
        for job in jobs:
            for fleet in names:
                spec = specs[job]
                name = f"{fleet}/{job}"
                slowdowns = all_fleets[fleet]
                rows[name] = {c: [] for c in candidates}
                print(f"== {name}: slowdowns {slowdowns}, {' '.join(spec['args'])}, target "
                      f"{spec['target']}", flush=True)

                def measure(candidate: str, i: int) -> dict:
                    directory = base / job / fleet / f"run{i + 1}" / candidate
                    directory.mkdir(parents=True, exist_ok=True)
                    if candidate == "ddp":
                        return measure_ddp(slowdowns, job, spec, args, directory, seed=i,
                                           note="without the churn (a killed rank ends DDP)"
                                           if fleet == "churn" else "")
                    return measure_idlegrad(CANDIDATES[candidate], fleet, slowdowns, job, spec,
                                            args, directory, seed=i)

                for i, candidate, r in side_by_side(candidates, args.repeats, measure):
                    rows[name][candidate].append(r)
                    print(f"  run {i + 1} {candidate:<9} reached {str(r['reached']):<5} "
                          f"t {fmt(r['time_s']):>7} s  samples {r['samples']}  metric "
                          f"{fmt(r['metric'], '.4f')}  spread {fmt(r['slot_spread'])}  "
                          f"{r['mode'] or ''} {r['notes']}", flush=True)
                summary[name] = summarize(rows[name])
    print_table(summary)
    if args.plot and plot(args.plot, rows, specs):
        print(f"curves in {args.plot}")
    if args.json:
        print(json.dumps({"fleets": summary, "slowdowns": {n: all_fleets[n] for n in names},
                          "worker_cores": args.worker_cores,
                          "targets": {j: specs[j]["target"] for j in jobs},
                          "repeats": args.repeats}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
