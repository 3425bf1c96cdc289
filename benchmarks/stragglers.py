"""Stragglers cost nothing (issue 3): idlegrad's redundancy modes against sync SGD and torch DDP.

One job where compute dominates communication: the built-in `synthetic` job with a ~1M-parameter
MLP and a global batch of 1,536 samples (6 partitions of 256: ~20 ms of compute per task on one
core of this machine, against a few ms to move the 4 MB model and gradient), SGD momentum 0.9 at
`--lr 0.02` (until the scheduler planned each new round at the version its predecessor's step
created, every round, --sync included, ran one step stale and 0.05 diverged), non-sync modes with
`--open-rounds 1` (unbounded open rounds make gradients stale enough to cost more rounds than the
parallelism buys with momentum SGD). Six workers on
loopback, each `--threads 1 --no-idle-policy`, under the straggler profile:

- w1 `--slowdown 5` (every task takes 5x as long),
- w2 `--stall 0.2:3` (with probability 0.2 a task stalls 3 s),
- w3 killed (SIGKILL) `--kill-at` seconds into training and restarted (a new process, same
  `--id`) `--restart-after` seconds later,
- w4-w6 healthy.

Modes, each its own coordinator and workers, run one after another (alternating order across
`--runs`, since this machine is shared and noisy): `sync` (coordinator --sync), `none` (async,
code none), `replicate:2`, `cyclic:1`, `adaptive`; `none-clean` and `adaptive-clean` with no faults
injected; and `ddp`: torch.distributed (gloo, loopback) synchronous data parallel, the same job,
model, optimizer and global batch (256 samples per rank), rank 1 sleeping 4x its compute each step
and rank 2 stalling 3 s with probability 0.2 per step. DDP cannot survive a killed rank (the
collective fails and the whole job must be restarted from a checkpoint), so its run leaves the
kill out: that favours ddp.

Time to target is measured from the moment training can start, with process start-up (importing
torch, building the job) excluded for every mode: for idlegrad from the coordinator's bind
(`elapsed` in its metrics.jsonl; the six workers are already knocking at its address, so they join
within milliseconds), for ddp from the barrier after every rank has joined the process group and
built the job. Every mode evaluates the test accuracy every `--eval-every` seconds (0.5) and stops
at the first evaluation at or above `--target`. samples/s is the samples applied up to that
evaluation over its time. Rounds decoded and slots wasted (slots cancelled on workers + duplicate
results + slots requeued) come from the coordinator's last status snapshot (polled every 0.3 s).

It prints a table of medians, writes a PNG of test accuracy against time (the first run of each
mode) and, with `--json`, prints one JSON object last:
{"modes": {"<mode>": {"time_to_target_s": ..., "samples_per_s": ..., "reached": bool, ...}}}.

    python benchmarks/stragglers.py --runs 3 --plot stragglers.png --json

Every process it starts is stopped and reaped by PID (idlegrad.cli.processes.stop), also on
Ctrl-C and on failure; every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import (Run, curve, fmt, med, read_metrics, side_by_side,  # noqa: E402
                     stopped_on_interrupt)

IDLEGRAD_MODES = ["sync", "none", "replicate:2", "cyclic:1", "adaptive", "none-clean",
                  "adaptive-clean"]
ALL_MODES = ["sync", "none", "replicate:2", "cyclic:1", "adaptive", "ddp", "none-clean",
             "adaptive-clean"]
WORKERS = ["w1", "w2", "w3", "w4", "w5", "w6"]
SLOW, STALLING, KILLED = "w1", "w2", "w3"


# ddp: one rank per process, started by the parent as `stragglers.py --ddp-rank R ...` ----------


def ddp_rank(args) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from idlegrad.common.builtin_jobs import synthetic

    torch.set_num_threads(1)
    rank, world = args.ddp_rank, args.workers
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.ddp_port}", rank=rank,
                            world_size=world)
    job = synthetic(params=args.params, batch_size=args.batch, lr=args.lr)
    train, test = job.build_datasets()
    torch.manual_seed(args.seed)
    local = job.build_model()
    model = nn.parallel.DistributedDataParallel(local)
    opt = job.build_optimizer(model.parameters())
    x, y = train.tensors
    tx, ty = test.tensors
    per_rank = args.batch // world
    g = torch.Generator().manual_seed(1000 + rank)
    chance = random.Random(rank)
    slow = args.slowdown if (rank == 1 and args.faults) else 1.0
    stall = (args.stall_p, args.stall_s) if (rank == 2 and args.faults) else None
    # The slow rank sleeps (slowdown-1) x its compute. Under DDP backward includes the gradient
    # all-reduce (waiting for peers), so compute is estimated as forward time x the local
    # (forward+backward)/forward ratio measured on a plain copy before training.
    fb_ratio = 3.0
    if slow > 1:
        probe = job.build_model()
        fwd, full = [], []
        for _ in range(5):
            idx = torch.randint(len(x), (per_rank,), generator=g)
            t0 = time.perf_counter()
            loss = job.loss(probe, (x[idx], y[idx]))
            t1 = time.perf_counter()
            loss.backward()
            fwd.append(t1 - t0)
            full.append(time.perf_counter() - t0)
        fb_ratio = statistics.median(full) / max(1e-6, statistics.median(fwd))
    metrics = open(args.ddp_metrics, "w", buffering=1) if rank == 0 else None
    stop = torch.zeros(1)
    dist.barrier()
    t0 = time.perf_counter()
    steps, last_eval = 0, t0
    while True:
        idx = torch.randint(len(x), (per_rank,), generator=g)
        f0 = time.perf_counter()
        out = model(x[idx])
        forward_s = time.perf_counter() - f0
        loss = nn.functional.cross_entropy(out, y[idx])
        delay = (slow - 1.0) * forward_s * fb_ratio
        if stall is not None and chance.random() < stall[0]:
            delay += stall[1]
        if delay > 0:
            time.sleep(delay)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        if rank == 0:
            now = time.perf_counter()
            if now - last_eval >= args.eval_every:
                with torch.no_grad():
                    acc = float((local(tx).argmax(1) == ty).float().mean())
                elapsed = time.perf_counter() - t0
                last_eval = time.perf_counter()
                done = acc >= args.target or elapsed > args.max_wall
                metrics.write(json.dumps({"elapsed": round(elapsed, 4), "version": steps,
                                          "samples": steps * per_rank * world,
                                          "metrics": {"accuracy": acc}, "final": done}) + "\n")
                stop[0] = 1.0 if done else 0.0
        dist.broadcast(stop, 0)
        if stop[0] > 0:
            break
    dist.barrier()  # nobody tears gloo down while a peer still talks
    dist.destroy_process_group()


# idlegrad processes ------------------------------------------------------------------------------


def coordinator_args(mode: str, args, address: str, ckpt: Path) -> list[str]:
    out = ["coordinator", "--bind", address, "--job", "synthetic",
           "--job-arg", f"params={args.params}", "--job-arg", f"batch_size={args.batch}",
           "--job-arg", f"lr={args.lr}",
           "--target", f"accuracy={args.target}", "--epochs", "1000", "--seed", str(args.seed),
           "--eval-every", str(args.eval_every), "--checkpoint-dir", str(ckpt),
           "--checkpoint-every", "3600", "--threads", "1", "--heartbeat", "0.5",
           "--log-level", "warning"]
    code = mode.replace("-clean", "")
    if code == "sync":
        out.append("--sync")
    else:
        out += ["--partitions", str(args.workers), "--redundancy", code,
                "--open-rounds", str(args.open_rounds)]
    return out


def worker_args(name: str, address: str, faults: bool, args) -> list[str]:
    out = ["worker", "--coordinator", address, "--id", name, "--threads", "1", "--device", "cpu",
           "--no-idle-policy", "--connect-timeout", "30", "--log-level", "warning"]
    if faults and name == SLOW:
        out += ["--slowdown", str(args.slowdown)]
    if faults and name == STALLING:
        out += ["--stall", f"{args.stall_p}:{args.stall_s}"]
    return out


class Wasted:
    """Slots wasted, summed over snapshots: worker records vanish on eviction, so each worker's
    `cancelled` is accumulated across its records."""

    def __init__(self):
        self.cancelled_base: dict[str, int] = {}
        self.cancelled_last: dict[str, int] = {}

    def update(self, snap: dict) -> None:
        for w in snap.get("workers", []):
            wid, c = w["id"], int(w.get("cancelled", 0))
            if c < self.cancelled_last.get(wid, 0):  # a new record: the worker rejoined
                self.cancelled_base[wid] = self.cancelled_base.get(wid, 0) + self.cancelled_last[wid]
            self.cancelled_last[wid] = c

    def cancelled(self) -> int:
        return sum(self.cancelled_base.values()) + sum(self.cancelled_last.values())


def run_idlegrad(mode: str, args, directory: Path) -> dict:
    from idlegrad.cli.processes import free_port, wait_for_hellos
    from idlegrad.monitor.source import ZmqStatusSource

    faults = not mode.endswith("-clean")
    directory.mkdir(parents=True, exist_ok=True)
    ckpt = directory / "ckpt"
    address = f"tcp://127.0.0.1:{free_port()}"
    run = Run(directory)
    source = None
    notes: list[str] = []
    try:
        workers = {n: run.spawn_idlegrad(n, worker_args(n, address, faults, args)) for n in WORKERS}
        wait_for_hellos(address, WORKERS, list(workers.values()), timeout=120)
        coordinator = run.spawn_idlegrad("coordinator", coordinator_args(mode, args, address, ckpt))
        t_start = time.monotonic()  # ~ the coordinator's bind, give or take its start-up
        source = ZmqStatusSource(address)
        wasted, last, first_snap_at = Wasted(), None, None
        killed_at = restarted_at = None
        end = t_start + args.max_wall + 60
        while coordinator.poll() is None and time.monotonic() < end:
            snap = source.fetch(timeout=0.3)
            now = time.monotonic()
            if snap is not None:
                last = snap
                wasted.update(snap)
                if first_snap_at is None:
                    first_snap_at = now - float(snap.get("elapsed_s", 0.0))
                train_t = now - first_snap_at
                if faults and killed_at is None and train_t >= args.kill_at:
                    workers[KILLED].send_signal(signal.SIGKILL)
                    workers[KILLED].wait(timeout=10)
                    killed_at = train_t
                if (faults and killed_at is not None and restarted_at is None
                        and train_t >= killed_at + args.restart_after):
                    workers[KILLED] = run.spawn_idlegrad(
                        KILLED, worker_args(KILLED, address, faults, args))
                    restarted_at = train_t
                if train_t > args.max_wall:
                    notes.append(f"stopped at the {args.max_wall:g}s cap")
                    break
            time.sleep(0.3)
        if coordinator.poll() is None:
            run.close()  # stops the coordinator too; its metrics so far are kept
        if faults and killed_at is None:
            notes.append("finished before the kill")
        elif faults:
            notes.append(f"{KILLED} killed at {killed_at:.1f}s"
                         + (f", restarted at {restarted_at:.1f}s" if restarted_at else ""))
    finally:
        if source is not None:
            source.close()
        run.close()
    records = read_metrics(ckpt / "metrics.jsonl")
    result = summarize(records, args.target)
    rounds = (last or {}).get("rounds", {})
    result.update({
        "rounds_decoded": rounds.get("decoded"),
        "slots_wasted": (wasted.cancelled() + int(rounds.get("results_duplicate", 0))
                         + int(rounds.get("slots_requeued", 0))) if last else None,
        "codes": (last or {}).get("redundancy", {}).get("rounds_by_code"),
        "slots_speculated": (last or {}).get("redundancy", {}).get("slots_speculated"),
        "predicted_s_per_sample": (last or {}).get("redundancy", {}).get("predicted_s_per_sample"),
        "notes": "; ".join(notes), "curve": curve(records)})
    return result


def run_ddp(args, directory: Path) -> dict:
    from idlegrad.cli.processes import free_port

    directory.mkdir(parents=True, exist_ok=True)
    metrics = directory / "metrics.jsonl"
    port = free_port()
    run = Run(directory)
    try:
        common = [os.path.abspath(__file__), "--ddp-port", str(port), "--ddp-metrics", str(metrics),
                  "--workers", str(args.workers), "--params", str(args.params), "--batch",
                  str(args.batch), "--lr", str(args.lr), "--target", str(args.target), "--eval-every",
                  str(args.eval_every), "--max-wall", str(args.max_wall), "--seed", str(args.seed),
                  "--slowdown", str(args.slowdown), "--stall", f"{args.stall_p}:{args.stall_s}"]
        ranks = [run.spawn_python(f"rank{r}", [*common, "--ddp-rank", str(r)])
                 for r in range(args.workers)]
        end = time.monotonic() + args.max_wall + 120
        while time.monotonic() < end and any(p.poll() is None for p in ranks):
            if any(p.poll() not in (None, 0) for p in ranks):
                break  # a rank failed: the others would hang in their collective
            time.sleep(0.3)
    finally:
        run.close()
    records = read_metrics(metrics)
    result = summarize(records, args.target)
    result.update({"rounds_decoded": records[-1]["version"] if records else None,
                   "slots_wasted": 0, "codes": None, "slots_speculated": None,
                   "notes": f"no kill (a killed rank aborts DDP); ranks exit {[p.returncode for p in ranks]}",
                   "curve": curve(records)})
    return result


def summarize(records: list[dict], target: float) -> dict:
    for r in records:
        acc = (r.get("metrics") or {}).get("accuracy")
        if acc is not None and acc >= target:
            t = float(r["elapsed"])
            return {"reached": True, "time_to_target_s": t, "samples_per_s": r["samples"] / t,
                    "accuracy": acc}
    last = records[-1] if records else {}
    t = float(last.get("elapsed", 0.0))
    return {"reached": False, "time_to_target_s": None,
            "samples_per_s": (last.get("samples", 0) / t) if t > 0 else None,
            "accuracy": (last.get("metrics") or {}).get("accuracy")}


# report -----------------------------------------------------------------------------------------


def aggregate(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for mode in ALL_MODES:
        rs = runs.get(mode, [])
        if not rs:
            continue
        reached = all(r["reached"] for r in rs)
        out[mode] = {
            "time_to_target_s": med([r["time_to_target_s"] for r in rs]) if reached else None,
            "samples_per_s": med([r["samples_per_s"] for r in rs]),
            "reached": reached,
            "rounds_decoded": med([r["rounds_decoded"] for r in rs]),
            "slots_wasted": med([r["slots_wasted"] for r in rs]),
            "runs_time_to_target_s": [r["time_to_target_s"] for r in rs],
        }
    sync = out.get("sync", {}).get("time_to_target_s")
    for m in out.values():
        t = m["time_to_target_s"]
        m["ratio_to_sync"] = (t / sync) if (t and sync) else None
    return out


def print_table(summary: dict, runs: int) -> None:
    print(f"\nmedians of {runs} run(s); time from the start of training (process start-up "
          f"excluded); ratio = time / sync's time")
    print(f"{'mode':<15} {'reached':>7} {'t_target_s':>10} {'samples/s':>9} {'rounds':>7} "
          f"{'wasted':>7} {'t/sync':>7} {'sync/t':>7}")
    for mode in ALL_MODES:
        m = summary.get(mode)
        if m is None:
            continue
        r = m["ratio_to_sync"]
        print(f"{mode:<15} {str(m['reached']):>7} {fmt(m['time_to_target_s']):>10} "
              f"{fmt(m['samples_per_s'], '.0f'):>9} {fmt(m['rounds_decoded'], '.0f'):>7} "
              f"{fmt(m['slots_wasted'], '.0f'):>7} {fmt(r):>7} {fmt(1 / r if r else None):>7}")


def plot(runs: dict[str, list[dict]], path: str, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    styles = {"sync": "k-", "ddp": "k--", "none": "C0-", "replicate:2": "C1-", "cyclic:1": "C2-",
              "adaptive": "C3-", "none-clean": "C0:", "adaptive-clean": "C3:"}
    for mode in ALL_MODES:
        rs = runs.get(mode)
        if not rs or not rs[0]["curve"]:
            continue
        xs, ys = zip(*rs[0]["curve"])
        t = rs[0]["time_to_target_s"]
        label = f"{mode} ({t:.1f} s)" if t is not None else f"{mode} (not reached)"
        ax.plot(xs, ys, styles.get(mode, "-"), label=label, linewidth=1.6)
    ax.axhline(target, color="grey", linewidth=0.8, linestyle="-.")
    ax.text(0.0, target, f" target {target:g}", va="bottom", color="grey")
    ax.set_xlabel("wall time since training started (s)")
    ax.set_ylabel("test accuracy")
    ax.set_title("synthetic ~1M params, 6 workers: one 5x slow, one stalling 3 s (p=0.2), "
                 "one killed and restarted\n(first run of each mode; -clean: no faults; "
                 "ddp: no kill)", fontsize=10)
    ax.set_ylim(max(0.0, target - 0.5), min(1.0, target + 0.1))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1, help="runs per mode; medians are reported")
    parser.add_argument("--modes", default=",".join(ALL_MODES),
                        help="comma-separated subset of " + ",".join(ALL_MODES))
    parser.add_argument("--workers", type=int, default=6, help=argparse.SUPPRESS)
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=1536, help="global batch (a round)")
    parser.add_argument("--lr", type=float, default=0.02,
                        help="the synthetic job's SGD lr (its default 0.05 is unstable under idlegrad, see the note)")
    parser.add_argument("--target", type=float, default=0.85, help="test accuracy to reach")
    parser.add_argument("--eval-every", type=float, default=0.5)
    parser.add_argument("--open-rounds", type=int, default=1,
                        help="rounds in flight for the non-sync modes (0: as many as workers ask; "
                             "with momentum SGD the staleness that brings costs more than it buys)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slowdown", type=float, default=5.0)
    parser.add_argument("--stall", default="0.2:3", help="P:SECONDS")
    parser.add_argument("--kill-at", type=float, default=4.0,
                        help="seconds into training when w3 is killed")
    parser.add_argument("--restart-after", type=float, default=3.0)
    parser.add_argument("--max-wall", type=float, default=150.0,
                        help="give a mode up after this many seconds of training")
    parser.add_argument("--plot", default="stragglers.png")
    parser.add_argument("--dir", default=None, help="keep logs and metrics here (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--ddp-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ddp-port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ddp-metrics", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-faults", dest="faults", action="store_false", help=argparse.SUPPRESS)
    args = parser.parse_args()
    p, s = args.stall.split(":")
    args.stall_p, args.stall_s = float(p), float(s)
    if args.ddp_rank is not None:
        return ddp_rank(args)

    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(ALL_MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}")

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="idlegrad-stragglers-"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"logs and metrics under {base}", flush=True)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    print(f"{'run':>3} {'mode':<15} {'reached':>7} {'t_target_s':>10} {'samples/s':>9} "
          f"{'rounds':>7} {'wasted':>7}  notes", flush=True)

    def measure(mode: str, i: int) -> dict:
        directory = base / f"run{i + 1}" / mode.replace(":", "")
        return run_ddp(args, directory) if mode == "ddp" else run_idlegrad(mode, args, directory)

    with stopped_on_interrupt():
        for i, mode, r in side_by_side(modes, args.runs, measure):
            runs[mode].append(r)
            extra = f"codes {r['codes']}" if r.get("codes") else ""
            if r.get("predicted_s_per_sample"):
                extra += " predicted us/sample " + ", ".join(
                    f"{k} {v * 1e6:.0f}" for k, v in r["predicted_s_per_sample"].items())
            print(f"{i + 1:>3} {mode:<15} {str(r['reached']):>7} "
                  f"{fmt(r['time_to_target_s']):>10} {fmt(r['samples_per_s'], '.0f'):>9} "
                  f"{fmt(r['rounds_decoded'], '.0f'):>7} {fmt(r['slots_wasted'], '.0f'):>7}  "
                  f"{r['notes']} {extra}", flush=True)
    summary = aggregate(runs)
    print_table(summary, args.runs)
    if args.plot:
        plot(runs, args.plot, args.target)
        print(f"plot: {os.path.abspath(args.plot)}")
    if args.json:
        print(json.dumps({"modes": summary, "target": {"accuracy": args.target},
                          "runs": args.runs, "ddp_kill": "omitted: DDP cannot survive it"}))


if __name__ == "__main__":
    main()
