"""Side by side: the demo's idlegrad processes against synchronous torch DDP, the same job to the
same test accuracy.

Both sides run the same job, the built-in `digits` (its 64-`--hidden`-10 MLP and Adam at `--lr`),
with:

- the same global batch per optimizer step, `--batch` (96): idlegrad's rounds are batches of that
  many samples (`--job-arg batch_size`), DDP's steps take that many samples over all ranks
  (benchmarks/ddp_baseline.py: the same seeded epoch permutations, each rank its share);
- the same optimizer (the job's Adam: the coordinator steps it, every DDP rank steps its copy);
- the same torch threads per computing process, `--threads` (default as the demo picks them:
  cores // workers, at least 1); the coordinator, which DDP does not have, gets 1 as in the demo;
- the same evaluation cadence: the test set every `--eval-every` seconds (0.2; the coordinator's
  `--eval-every`, DDP's rank 0 on its clock), stopping at the first evaluation at `--target`.

The idlegrad side is what `idlegrad demo --workers N` starts (a coordinator and N workers on
loopback, the demo's flags), launched here so that the batch and the evaluation cadence can be
set (`idlegrad demo` has no --eval-every). Wall time is from launch to exit, start-up included
for both; training time is the coordinator's `elapsed` at its final record (since its bind, its
workers joining included) and DDP's time from its ranks' first barrier. The two run alternately
(harness.side_by_side: this machine is shared and noisy, and each side sees as much of its
drift first as last); it prints each run, the medians and their ratios. `--json` adds one JSON
line last: {"idlegrad_wall_s": median, "ddp_wall_s": median, "ratio": idlegrad/ddp (wall),
"training_ratio": ..., "settings": {...}, "runs": {...}}.

    python benchmarks/demo_vs_ddp.py --runs 3 --workers 3

Every process it starts is stopped and reaped by PID (harness.Run), also on Ctrl-C and failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import Run, fmt, med, paired_runs, read_metrics, stopped_on_interrupt  # noqa: E402

DDP = os.path.join(HERE, "ddp_baseline.py")


def wait_all(procs, timeout: float) -> None:
    """Wait for every process to exit, `timeout` seconds at most in all."""
    end = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.01, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"pid {proc.pid} not finished within {timeout:g}s") from None


def measure_idlegrad(args, directory: Path) -> dict:
    from idlegrad.cli.processes import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    ckpt = directory / "ckpt"
    t0 = time.perf_counter()
    with Run(directory) as run:
        # the demo's processes and flags (cli/demo.py), plus the batch and the cadence
        coordinator = run.spawn_idlegrad("coordinator", [
            "coordinator", "--job", "digits", "--job-arg", f"hidden={args.hidden}",
            "--job-arg", f"lr={args.lr}", "--job-arg", f"batch_size={args.batch}",
            "--bind", address, "--target", f"accuracy={args.target}", "--epochs", str(args.epochs),
            "--checkpoint-dir", str(ckpt), "--threads", "1", "--heartbeat", "0.5",
            "--eval-every", str(args.eval_every), "--seed", str(args.seed),
            "--log-level", "warning"])
        for i in range(args.workers):
            run.spawn_idlegrad(f"worker-{i + 1}", [
                "worker", "--coordinator", address, "--threads", str(args.threads),
                "--id", f"demo-{i + 1}", "--connect-timeout", "60", "--log-level", "warning",
                "--no-idle-policy"])
        wait_all([coordinator], args.timeout)
        wall = time.perf_counter() - t0
        rc = coordinator.returncode
    records = read_metrics(ckpt / "metrics.jsonl")
    final = next((r for r in reversed(records) if r.get("final")), None)
    if rc != 0 or final is None:
        raise RuntimeError(f"the coordinator failed (exit {rc}); see {directory}")
    return {"wall_s": wall, "training_s": float(final["elapsed"]), "updates": final["version"],
            "samples": final["samples"], "accuracy": final["metrics"].get("accuracy"),
            "reached": final.get("reason") == "target",
            "evaluations": sum(1 for r in records if r.get("metrics"))}


def measure_ddp(args, directory: Path) -> dict:
    from idlegrad.cli.processes import free_port

    out = directory / "ddp.json"
    common = ["--world", args.workers, "--target", args.target, "--batch", args.batch,
              "--hidden", args.hidden, "--lr", args.lr, "--threads", args.threads,
              "--eval-every", args.eval_every, "--epochs", args.epochs, "--seed", args.seed,
              "--port", free_port(), "--out", out]
    t0 = time.perf_counter()
    with Run(directory) as run:
        ranks = [run.spawn_python(f"ddp-rank{r}", [DDP, "--rank", r, *common])
                 for r in range(args.workers)]
        wait_all(ranks, args.timeout)
        wall = time.perf_counter() - t0
        codes = [p.returncode for p in ranks]
    if any(codes) or not out.exists():
        raise RuntimeError(f"ddp failed (exit codes {codes}); see {directory}")
    got = json.loads(out.read_text())
    return {"wall_s": wall, "training_s": got["train_s"], "updates": got["steps"],
            "samples": got["samples"], "accuracy": got["test_accuracy"],
            "reached": got["reached"], "evaluations": got["evaluations"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=3, help="idlegrad workers = DDP ranks")
    parser.add_argument("--target", type=float, default=0.95, help="test accuracy")
    parser.add_argument("--batch", type=int, default=96, help="global batch per optimizer step")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-2, help="the job's Adam")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per worker and per rank (default: as the demo, "
                             "cores // workers, at least 1)")
    parser.add_argument("--eval-every", type=float, default=0.2,
                        help="seconds, both sides (default: 0.2, the coordinator's adaptive floor)")
    parser.add_argument("--epochs", type=int, default=50, help="both stop after this many")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per run and side")
    parser.add_argument("--dir", default=None, help="keep logs here (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.workers)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="idlegrad-demo-vs-ddp-"))
    settings = {k: getattr(args, k) for k in ("workers", "target", "batch", "hidden", "lr",
                                              "threads", "eval_every", "epochs")}
    print(f"logs under {base}; {json.dumps(settings)}", flush=True)

    def measure(system: str, i: int) -> dict:
        directory = base / f"run{i + 1}" / system
        directory.mkdir(parents=True, exist_ok=True)
        return (measure_idlegrad if system == "idlegrad" else measure_ddp)(args, directory)

    rows = {"idlegrad": [], "ddp": []}
    print(f"{'run':>3} {'system':<9} {'wall_s':>7} {'train_s':>7} {'updates':>8} {'samples':>8} "
          f"{'evals':>5} {'accuracy':>8} {'reached':>7}", flush=True)
    with stopped_on_interrupt():
        for i, got in paired_runs(["idlegrad", "ddp"], args.runs, measure):
            for name in ("idlegrad", "ddp"):
                r = got[name]
                rows[name].append(r)
                print(f"{i + 1:>3} {name:<9} {r['wall_s']:>7.2f} {r['training_s']:>7.2f} "
                      f"{r['updates']:>8} {r['samples']:>8} {r['evaluations']:>5} "
                      f"{fmt(r['accuracy'], '.4f'):>8} {str(r['reached']):>7}", flush=True)
    medians = {name: {k: med([r[k] for r in rs]) for k in ("wall_s", "training_s", "updates",
                                                           "samples")}
               for name, rs in rows.items()}
    ratio = medians["idlegrad"]["wall_s"] / medians["ddp"]["wall_s"]
    training_ratio = medians["idlegrad"]["training_s"] / medians["ddp"]["training_s"]
    unreached = {name: sum(not r["reached"] for r in rs) for name, rs in rows.items()}
    print(f"medians of {args.runs}: wall idlegrad {medians['idlegrad']['wall_s']:.2f} s, ddp "
          f"{medians['ddp']['wall_s']:.2f} s, ratio idlegrad/ddp {ratio:.2f}; training "
          f"{medians['idlegrad']['training_s']:.2f} s vs {medians['ddp']['training_s']:.2f} s, "
          f"ratio {training_ratio:.2f}; updates {medians['idlegrad']['updates']:.0f} vs "
          f"{medians['ddp']['updates']:.0f} of {args.batch} samples")
    if any(unreached.values()):
        print(f"runs that did not reach the target (times are then to the epoch limit): "
              f"{unreached}")
    if args.json:
        print(json.dumps({"idlegrad_wall_s": medians["idlegrad"]["wall_s"],
                          "ddp_wall_s": medians["ddp"]["wall_s"], "ratio": ratio,
                          "training_ratio": training_ratio, "medians": medians,
                          "unreached": unreached, "settings": settings, "runs": rows}))


if __name__ == "__main__":
    main()
