"""BatchNorm through idlegrad against one process (issue 18's acceptance): the digits MLP with a
BatchNorm1d (`--job-arg norm=batch`), trained by a coordinator and 4 workers and, for the same
samples in the same order, by a plain loop in one process; both evaluated in eval mode (running
statistics), idlegrad's from its own checkpoint. Also idlegrad's model evaluated with the
buffers it was built with, which is what evaluation used before buffers travelled.

    python benchmarks/batchnorm.py --seeds 3 [--epochs 6] [--mode sync|async] [--json]

Prints a row per seed and the medians; `--json` prints them as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import Run  # noqa: E402


def wait_all(procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))


def job_args(seed: int) -> list[str]:
    return ["--job", "digits", "--job-arg", "norm=batch", "--job-arg", f"seed={seed}"]


def idlegrad_run(directory: Path, seed: int, epochs: int, workers: int, mode: str) -> Path:
    from idlegrad.cli.processes import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    ckpt = directory / "ckpt"
    coding = ["--partitions", str(workers), "--open-rounds", "1"] if mode == "sync" else []
    with Run(directory) as run:
        procs = [run.spawn_idlegrad(f"worker-{i}", [
            "worker", "--coordinator", address, "--threads", "1", "--id", f"bn-{i}",
            "--connect-timeout", "60", "--no-idle-policy", "--log-level", "warning"])
            for i in range(workers)]
        coordinator = run.spawn_idlegrad("coordinator", [
            "coordinator", *job_args(seed), "--bind", address, "--epochs", str(epochs),
            "--seed", str(seed), "--checkpoint-dir", str(ckpt), "--threads", "1",
            "--heartbeat", "0.5", "--log-level", "warning", *coding])
        wait_all([coordinator, *procs], 600)
        if coordinator.returncode != 0:
            raise RuntimeError(f"the coordinator failed; see {directory}")
    return ckpt


def measure(seed: int, epochs: int, workers: int, mode: str, directory: Path) -> dict:
    from idlegrad.common.builtin_jobs import digits
    from idlegrad.common.job import (build, evaluate, make_optimizer, part_batch)
    from idlegrad.coordinator import checkpoint

    state = checkpoint.load(str(idlegrad_run(directory, seed, epochs, workers, mode)))
    job = digits(norm="batch", seed=seed)
    built = build(job, seed=seed)
    built.model.load(state["params"])
    no_buffers = evaluate(job, built.model.module, built.test)["accuracy"]
    built.model.load_buffer_state(state["buffers"])
    idlegrad_acc = evaluate(job, built.model.module, built.test)["accuracy"]

    alone = build(job, seed=seed)  # the same initial model: built from the same seed
    optimizer = make_optimizer(job, alone.model.module)
    n, samples, done, epoch = len(alone.train), int(state["samples"]), 0, 0
    alone.model.module.train()
    while done < samples:
        for offset in range(0, n, job.batch_size):
            count = min(job.batch_size, n - offset, samples - done)
            if count <= 0:
                break
            alone.model.grads.zero_()
            job.loss(alone.model.module, part_batch(alone.train, seed, epoch, offset, count)
                     ).backward()
            optimizer.step()
            done += count
        epoch += 1
    single = evaluate(job, alone.model.module, alone.test)["accuracy"]
    return {"seed": seed, "samples": samples, "idlegrad": idlegrad_acc, "single": single,
            "gap_points": 100 * (single - idlegrad_acc), "idlegrad_built_buffers": no_buffers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="idlegrad-bn-") as tmp:
        for seed in range(args.seeds):
            row = measure(seed, args.epochs, args.workers, args.mode, Path(tmp) / str(seed))
            rows.append(row)
            print(f"seed {seed}: {row['samples']} samples; accuracy idlegrad "
                  f"{row['idlegrad']:.4f} (with the built buffers {row['idlegrad_built_buffers']:.4f}),"
                  f" one process {row['single']:.4f}; gap {row['gap_points']:+.2f} points",
                  flush=True)
    summary = {k: statistics.median(r[k] for r in rows)
               for k in ("idlegrad", "single", "gap_points", "idlegrad_built_buffers")}
    print(f"median over {len(rows)} seeds ({args.mode}, {args.workers} workers, {args.epochs} "
          f"epochs): idlegrad {summary['idlegrad']:.4f}, one process {summary['single']:.4f}, gap "
          f"{summary['gap_points']:+.2f} points; built buffers {summary['idlegrad_built_buffers']:.4f}")
    if args.json:
        print(json.dumps({"mode": args.mode, "rows": rows, "median": summary}))


if __name__ == "__main__":
    main()
