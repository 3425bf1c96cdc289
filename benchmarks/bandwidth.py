"""Volunteers on slow links (issue 9): gradient tasks against local-SGD tasks at 10 Mbit/s.

Four workers, each behind an emulated link of `--mbps` (10) Mbit/s each way (the worker's
`--link-mbps`: a token bucket per direction around its socket), train the built-in `synthetic`
job with a model of `--params` (1M: 4 MB of float32 per model or change, 3.2 s per transfer at
10 Mbit/s) and its SGD (lr 0.05, momentum 0.9, batch 64). Modes, each its own coordinator and
workers, run one after another (order alternating across `--runs`, the machine being shared):

- `gradient`: a slot is the coded gradient of a batch, the coordinator steps the job's optimizer:
  the old-style baseline, the job's batch of 64 per slot (so 64 samples per 8 MB exchange, where
  `local:H` moves 64*H) and the default unbounded open rounds (bounded only by the workers'
  credits; benchmarks/stragglers.py shows such staleness costing more than it buys);
- `gradient@H`: the fair baseline for `local:H`, the gradient-mode configuration a user would pick
  for that link: a batch of 64*H per slot (`--job-arg batch_size`; at most the training set,
  7,373 samples: the job allows no larger one), so a slot exchanges as many samples per model
  down and result up as a `local:H` slot does, and bounded open rounds (`--fair-open-rounds`, 4:
  one slot in flight per worker); the job's lr unless `--fair-lr`;
- `local:10`, `local:50`, `local:100`: a slot is H inner steps of the job's optimizer on a
  worker, the coordinator applies the outer optimizer to the change (`--task local:H`); any other
  `local:H` may be named in `--modes`, and `local:auto` is judged against the best fixed H that ran;
- `local:auto`: H sized per worker from its measured compute time per step and its measured link
  time per slot (model down, change up), so that a slot computes at least `--link-factor` (3)
  times as long as its transfers take; the benchmark does not tell it the link's speed. Its first
  slots, before any measurement, are 64 steps, and this benchmark's target falls within them
  (docs/architecture.md, "Local tasks").

Every mode runs the same `--epochs` (3: the same samples) with the coordinator's default
asynchronous rounds of one slot (open rounds unbounded but for `gradient@H`), `--no-speculate` (speculation predicts task times from compute
alone, so on slow links every task would look late and be duplicated), `--heartbeat 4` (a 4 MB
transfer holds the link for seconds, and heartbeats queue behind it) and 2 credits per worker. Time to target is the wall time (since the coordinator's bind,
process start-up excluded: the workers are already knocking) of the first evaluation at or above
`--target`; the final metric is the test accuracy after the last sample, the same sample count
for every mode. A mode is given up after `--max-wall` seconds of training (its time to target
is then unknown, and the ratio a bound). Bytes per sample: wire bytes, both ways, over samples
applied, from the coordinator's metrics at the target (or at the end).

It prints a table of medians (`x_gradient`: speed-up over the old-style `gradient`; `x_fair`:
over `local:H`'s own fair baseline `gradient@H`, and over the best gradient-mode run for
`local:auto`), writes a PNG of test accuracy against time (first run of each mode) and, with
`--json`, one JSON object last: {"modes": {"<mode>": {"time_to_target_s": ..., "reached": bool,
"bytes_per_sample": ..., "samples_per_exchange": ..., "speedup_vs_gradient": ...,
"speedup_vs_fair_gradient": ...}}, "best_gradient": "<mode>", ...}.

    nice -n 19 python benchmarks/bandwidth.py --runs 3 --plot bandwidth.png --json

Every process it starts is stopped and reaped by PID (idlegrad.cli.processes.stop, through
harness.Run), also on Ctrl-C and on failure; every wait is bounded.
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
from harness import (Run, curve, fmt, med, read_metrics, side_by_side,  # noqa: E402
                     stopped_on_interrupt)

from idlegrad.common.errors import ConfigError  # noqa: E402
from idlegrad.coordinator.local import parse_task  # noqa: E402

MODES = ["gradient", "gradient@10", "gradient@50", "gradient@100", "local:10", "local:50",
         "local:100", "local:auto"]
WORKERS = ["w1", "w2", "w3", "w4"]
JOB_BATCH = 64  # the synthetic job's batch: a gradient slot's samples, a local step's


def fair_h(mode: str):
    """H of a `gradient@H` mode, else None."""
    kind, sep, value = mode.partition("@")
    if kind != "gradient" or not sep:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{mode!r}: gradient@H takes a whole number of local steps H >= 1")
    return int(value)


def fair_batch(h: int, n_train: int) -> int:
    """The gradient batch that exchanges as many samples as a local:H slot, where the job allows:
    at most the training set."""
    return min(JOB_BATCH * h, n_train)


def samples_per_exchange(mode: str, n_train: int):
    """Samples a slot computes per model down and result up (None: chosen per worker)."""
    h = fair_h(mode)
    if h is not None:
        return fair_batch(h, n_train)
    if mode == "gradient":
        return JOB_BATCH
    steps = mode.partition(":")[2]
    return JOB_BATCH * int(steps) if steps.isdigit() else None


def train_size(params: int) -> int:
    from idlegrad.common.builtin_jobs import synthetic

    return len(synthetic(params=params).build_datasets()[0])


def coordinator_args(mode: str, args, address: str, ckpt: Path) -> list[str]:
    sizing = [] if args.slot_s is None else ["--local-slot-s", f"{args.slot_s:.3f}"]
    task, fair = mode, []
    h = fair_h(mode)
    if h is not None:
        task = "gradient"
        fair = ["--job-arg", f"batch_size={fair_batch(h, args.n_train)}",
                "--open-rounds", str(args.fair_open_rounds)]
        if args.fair_lr is not None:
            fair += ["--job-arg", f"lr={args.fair_lr:g}"]
    return ["coordinator", "--bind", address, "--job", "synthetic",
            "--job-arg", f"params={args.params}", *fair, "--task", task, *sizing,
            "--local-link-factor", f"{args.link_factor:g}", "--epochs", str(args.epochs),
            "--seed", str(args.seed), "--eval-every", str(args.eval_every),
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3600", "--threads", "1",
            # a 4 MB transfer holds a slow link for seconds, heartbeats queue behind it
            "--heartbeat", str(args.heartbeat), "--task-timeout", "120",
            # speculation predicts a task's time from compute alone; on a slow link every task
            # would look late and be duplicated, doubling the traffic the links cannot carry
            "--no-speculate", "--log-level", args.log_level]


def worker_args(name: str, address: str, args) -> list[str]:
    return ["worker", "--coordinator", address, "--id", name, "--threads", "1", "--device", "cpu",
            "--no-idle-policy", "--connect-timeout", "60", "--link-mbps", str(args.mbps),
            "--log-level", "warning"]


def run_mode(mode: str, args, directory: Path) -> dict:
    from idlegrad.cli.processes import free_port, wait_for_hellos

    directory.mkdir(parents=True, exist_ok=True)
    ckpt = directory / "ckpt"
    address = f"tcp://127.0.0.1:{free_port()}"
    run = Run(directory)
    note = ""
    try:
        workers = [run.spawn_idlegrad(n, worker_args(n, address, args)) for n in WORKERS]
        wait_for_hellos(address, WORKERS, workers, timeout=120)
        coordinator = run.spawn_idlegrad("coordinator", coordinator_args(mode, args, address, ckpt))
        end = time.monotonic() + args.max_wall + 60  # + start-up
        while coordinator.poll() is None and time.monotonic() < end:
            records = read_metrics(ckpt / "metrics.jsonl")
            if records and float(records[-1]["elapsed"]) > args.max_wall:
                note = f"stopped at the {args.max_wall:g}s cap"
                break
            time.sleep(1.0)
        if coordinator.poll() is None and not note:
            note = "stopped at the wall-clock limit"
    finally:
        run.close()
    return summarize(read_metrics(ckpt / "metrics.jsonl"), args.target, note)


def summarize(records: list[dict], target: float, note: str) -> dict:
    evals = [r for r in records if (r.get("metrics") or {}).get("accuracy") is not None]
    hit = next((r for r in evals if r["metrics"]["accuracy"] >= target), None)
    last = evals[-1] if evals else {}
    at = hit or last
    final = [r for r in records if r.get("final")]
    return {
        "reached": hit is not None,
        "time_to_target_s": float(hit["elapsed"]) if hit else None,
        "samples_to_target": hit["samples"] if hit else None,
        "bytes_per_sample": at.get("bytes_per_sample"),
        "final_accuracy": last.get("metrics", {}).get("accuracy"),
        "final_samples": last.get("samples"),
        "finished": bool(final and final[-1].get("reason") == "epochs"),
        "wall_s": float(last.get("elapsed", 0.0)) if last else None,
        "notes": note, "curve": curve(records),
        "samples_curve": [(r["samples"], r["metrics"]["accuracy"]) for r in evals],
    }


def accuracy_at(samples_curve: list, samples: float):
    """The accuracy of the evaluation nearest to `samples` samples. (The last one before it
    would be the untrained model's for a mode whose first slots, applied together, overshoot
    `samples`: local:100 jumps from 0 to 12,800 samples.)"""
    if not samples_curve:
        return None
    return min(samples_curve, key=lambda point: abs(point[0] - samples))[1]


def _speedup(m: dict, base: dict, key: str) -> None:
    """m[key]: base's time to target over m's; when base never reached it, a lower bound from its
    wall time in m[key + '_at_least']."""
    t, g = m["time_to_target_s"], base.get("time_to_target_s")
    m[key] = (g / t) if (t and g) else None
    if t and not g and base:
        m[key + "_at_least"] = med(base["runs_wall_s"]) / t


def aggregate(runs: dict[str, list[dict]], n_train: int = 0) -> dict:
    out = {}
    for mode, rs in runs.items():
        if not rs:
            continue
        reached = sum(r["reached"] for r in rs) * 2 > len(rs)  # a median exists
        times = sorted((r["time_to_target_s"] if r["reached"] else float("inf")) for r in rs)
        t = times[len(times) // 2]
        out[mode] = {
            "time_to_target_s": t if reached and t != float("inf") else None,
            "reached": reached,
            "samples_per_exchange": samples_per_exchange(mode, n_train) if n_train else None,
            "bytes_per_sample": med([r["bytes_per_sample"] for r in rs]),
            "final_accuracy": med([r["final_accuracy"] for r in rs]),
            "final_samples": med([r["final_samples"] for r in rs]),
            "runs_time_to_target_s": [r["time_to_target_s"] for r in rs],
            "runs_final_accuracy": [r["final_accuracy"] for r in rs],
            "runs_wall_s": [r["wall_s"] for r in rs],
        }
    grad = out.get("gradient", {})
    # the fastest gradient-mode configuration that ran, old-style or fair
    timed = [(m["time_to_target_s"], mode) for mode, m in out.items()
             if (mode == "gradient" or fair_h(mode)) and m["time_to_target_s"]]
    best = min(timed)[1] if timed else None
    for mode, m in out.items():
        _speedup(m, grad, "speedup_vs_gradient")
        if mode.startswith("local:"):
            steps = mode.partition(":")[2]
            fair = out.get(f"gradient@{steps}") if steps.isdigit() else None
            if fair is not None:
                _speedup(m, fair, "speedup_vs_fair_gradient")
            if best is not None:
                _speedup(m, out[best], "speedup_vs_best_gradient")
        # Accuracy at the same sample count: where gradient mode's median run ended.
        if grad.get("final_samples") and mode != "gradient":
            same = med([accuracy_at(r["samples_curve"], grad["final_samples"])
                        for r in runs[mode]])
            m["accuracy_at_gradient_samples"] = same
            m["gap_vs_gradient_points"] = (
                100 * (same - grad["final_accuracy"]) if same is not None
                and grad.get("final_accuracy") is not None else None)
    # Every fixed H that ran, not only the default two: auto is judged against the best of them.
    fixed = [m["time_to_target_s"] for mode, m in out.items()
             if mode.startswith("local:") and mode != "local:auto" and m["time_to_target_s"]]
    if "local:auto" in out and fixed and out["local:auto"]["time_to_target_s"]:
        out["local:auto"]["ratio_to_best_fixed"] = out["local:auto"]["time_to_target_s"] / min(fixed)
    if best is not None:
        out["_best_gradient"] = best
    return out


def _speed_text(m: dict, key: str) -> str:
    if m.get(key):
        return fmt(m[key], ".1f")
    if m.get(key + "_at_least"):
        return ">" + fmt(m[key + "_at_least"], ".1f")
    return "-"


def print_table(summary: dict, runs: int, modes: list[str]) -> None:
    print(f"\nmedians of {runs} run(s); times from the start of training (start-up excluded)")
    print(f"{'mode':<12} {'reached':>7} {'t_target_s':>10} {'x_gradient':>10} {'x_fair':>7} "
          f"{'samples/xchg':>12} {'KiB/sample':>10} {'final_acc':>9} {'samples':>8} "
          f"{'acc@grad_n':>10}")
    for mode in modes:
        m = summary.get(mode)
        if m is None:
            continue
        fair = ""
        if mode.startswith("local:"):
            fair = _speed_text(m, "speedup_vs_fair_gradient" if mode.partition(":")[2].isdigit()
                               else "speedup_vs_best_gradient")
        kib = m["bytes_per_sample"] / 1024 if m["bytes_per_sample"] is not None else None
        print(f"{mode:<12} {str(m['reached']):>7} {fmt(m['time_to_target_s'], '.1f'):>10} "
              f"{_speed_text(m, 'speedup_vs_gradient'):>10} {fair:>7} "
              f"{fmt(m.get('samples_per_exchange'), '.0f'):>12} {fmt(kib, '.1f'):>10} "
              f"{fmt(m['final_accuracy'], '.3f'):>9} {fmt(m['final_samples'], '.0f'):>8} "
              f"{fmt(m.get('accuracy_at_gradient_samples'), '.3f'):>10}")
    best = summary.get("_best_gradient")
    if best:
        print(f"best gradient-mode run: {best}; x_fair is local:H against gradient@H "
              f"(local:auto against {best})")
    auto = summary.get("local:auto", {}).get("ratio_to_best_fixed")
    if auto:
        print(f"local:auto / best fixed H: {auto:.2f}")


def plot(runs: dict[str, list[dict]], path: str, args, modes: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    for i, mode in enumerate(modes):
        rs = runs.get(mode)
        if not rs or not rs[0]["curve"]:
            continue
        xs, ys = zip(*rs[0]["curve"])
        t = rs[0]["time_to_target_s"]
        label = f"{mode} ({t:.1f} s)" if t is not None else f"{mode} (not reached)"
        ax.plot(xs, ys, f"C{i}-", label=label, linewidth=1.6)
    ax.axhline(args.target, color="grey", linewidth=0.8, linestyle="-.")
    ax.text(0.0, args.target, f" target {args.target:g}", va="bottom", color="grey")
    ax.set_xscale("log")
    ax.set_xlabel("wall time since training started (s, log scale)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"synthetic ~{args.params / 1e6:g}M params, {len(WORKERS)} workers behind "
                 f"emulated {args.mbps:g} Mbit/s links, {args.epochs} epochs\n"
                 "(first run of each mode)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1, help="runs per mode; medians are reported")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated --task values, and gradient@H for the fair "
                             "gradient baseline of local:H (default: " + ",".join(MODES) +
                             "); any local:H or gradient@H may be added, e.g. local:100")
    parser.add_argument("--mbps", type=float, default=10.0, help="each worker's link, each way")
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--epochs", type=int, default=3, help="samples every mode trains on")
    parser.add_argument("--target", type=float, default=0.75, help="test accuracy to reach")
    parser.add_argument("--slot-s", type=float, default=None,
                        help="local:auto's least compute seconds per slot (default: the "
                             "coordinator's, 5)")
    parser.add_argument("--link-factor", type=float, default=3.0,
                        help="local:auto computes at least this many times its measured link "
                             "time per slot (default: 3, the coordinator's)")
    parser.add_argument("--fair-open-rounds", type=int, default=len(WORKERS),
                        help="gradient@H: rounds open at once (default: one per worker)")
    parser.add_argument("--fair-lr", type=float, default=None,
                        help="gradient@H: the job's lr for the larger batch (default: the job's, "
                             "0.05)")
    parser.add_argument("--eval-every", type=float, default=1.0)
    parser.add_argument("--heartbeat", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-wall", type=float, default=300.0,
                        help="give a mode up after this many seconds of training")
    parser.add_argument("--log-level", default="warning",
                        help="the coordinator's (debug: each local slot's H and the measurements "
                             "behind it, in DIR/run*/<mode>/coordinator-*.log)")
    parser.add_argument("--plot", default="bandwidth.png")
    parser.add_argument("--dir", default=None, help="keep logs and metrics here (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        try:
            if fair_h(mode) is None:
                parse_task(mode)
        except (ConfigError, ValueError) as exc:
            parser.error(str(exc))
    if args.fair_open_rounds < 1:
        parser.error("--fair-open-rounds must be at least 1 (bounded)")
    args.n_train = train_size(args.params)

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="idlegrad-bandwidth-"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"logs and metrics under {base}", flush=True)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    print(f"{'run':>3} {'mode':<12} {'reached':>7} {'t_target_s':>10} {'KiB/sample':>10} "
          f"{'final_acc':>9} {'samples':>8} {'wall_s':>7}  notes", flush=True)

    def measure(mode: str, i: int) -> dict:
        return run_mode(mode, args, base / f"run{i + 1}" / mode.replace(":", "").replace("@", "-"))

    with stopped_on_interrupt():
        for i, mode, r in side_by_side(modes, args.runs, measure):
            runs[mode].append(r)
            kib = r["bytes_per_sample"] / 1024 if r["bytes_per_sample"] is not None else None
            print(f"{i + 1:>3} {mode:<12} {str(r['reached']):>7} "
                  f"{fmt(r['time_to_target_s'], '.1f'):>10} {fmt(kib, '.1f'):>10} "
                  f"{fmt(r['final_accuracy'], '.3f'):>9} {fmt(r['final_samples'], '.0f'):>8} "
                  f"{fmt(r['wall_s'], '.0f'):>7}  {r['notes']}", flush=True)
    summary = aggregate(runs, args.n_train)
    print_table(summary, args.runs, modes)
    if args.plot:
        plot(runs, args.plot, args, modes)
        print(f"plot: {os.path.abspath(args.plot)}")
    if args.json:
        print(json.dumps({"modes": {m: summary[m] for m in modes if m in summary},
                          "best_gradient": summary.get("_best_gradient"),
                          "fair_open_rounds": args.fair_open_rounds, "fair_lr": args.fair_lr,
                          "train_samples": args.n_train,
                          "target": {"accuracy": args.target}, "runs": args.runs,
                          "mbps": args.mbps, "params": args.params, "slot_s": args.slot_s,
                          "link_factor": args.link_factor}))


if __name__ == "__main__":
    main()
