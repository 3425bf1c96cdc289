"""How much of a worker's wall time goes to computing, for slots of 50 ms, 200 ms and 1 s (issue 7).

A real coordinator and one real worker (`--threads 1`, normal priority, credits 2: the next slot
and its model arrive while the current one computes) train the built-in `synthetic` job (about
1M parameters, so a new model of 4 MB comes with nearly every slot). The global batch is sized
from a calibration of this machine's seconds per sample so that one slot takes about the asked
time. Over a window after a warm-up, the fraction is the compute seconds the worker reports in
its results (from the coordinator's status: `compute_s`) over the wall seconds that passed.

    python benchmarks/utilisation.py --runs 3 --json

With `--json` its last line is {"fraction": {"0.05": ..., "0.2": ..., "1.0": ...}, "runs": {...}}
(medians).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Run, stopped_on_interrupt  # noqa: E402

PARAMS = 1_000_000


def seconds_per_sample() -> float:
    """Forward + backward time per sample of the job's model on one thread, measured here."""
    import torch

    from idlegrad.common.builtin_jobs import synthetic
    from idlegrad.common.job import build

    torch.set_num_threads(1)
    built = build(synthetic(params=PARAMS), need_test=False)
    x, y = built.train.tensors
    batch = 512
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        loss = built.job.loss(built.model.module, (x[:batch], y[:batch]))
        loss.backward()
        best = min(best, time.perf_counter() - t0)
    return best / batch


def measure(slot_s: float, s_per_sample: float, args) -> dict:
    from idlegrad.cli.processes import free_port, wait_for_hellos
    from idlegrad.monitor.source import ZmqStatusSource

    batch = max(1, round(slot_s / s_per_sample))
    address = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="idlegrad-utilisation-") as tmp, Run(tmp) as run:
        worker = run.spawn_idlegrad("worker", [
            "worker", "--coordinator", address, "--id", "w1", "--job", "synthetic",
            "--threads", "1", "--device", "cpu", "--no-idle-policy", "--no-low-priority",
            "--connect-timeout", "60", "--log-level", "warning"])
        wait_for_hellos(address, ["w1"], [worker], timeout=120)
        run.spawn_idlegrad("coordinator", [
            "coordinator", "--bind", address, "--job", "synthetic", "--job-arg",
            f"params={PARAMS}", "--job-arg", f"batch_size={batch}", "--epochs", "100000",
            "--eval-every", "3600", "--heartbeat", "2", "--threads", "1", "--log-level",
            "warning"])
        with contextlib.closing(ZmqStatusSource(address)) as source:
            def sample() -> tuple[float, float, int]:
                for _ in range(50):
                    snap = source.fetch(timeout=2.0)
                    if snap is not None and snap.get("workers"):
                        w = snap["workers"][0]
                        return time.monotonic(), float(w["compute_s"]), int(w["done"])
                    time.sleep(0.2)
                raise RuntimeError("no worker in the coordinator's status")

            t0, c0, d0 = sample()
            while d0 < 1:
                time.sleep(0.2)
                t0, c0, d0 = sample()
            time.sleep(args.warmup)
            t0, c0, d0 = sample()
            time.sleep(max(args.window, 10 * slot_s))
            t1, c1, d1 = sample()
    if d1 <= d0:
        raise RuntimeError("no slot finished in the window")
    return {"fraction": (c1 - c0) / (t1 - t0), "batch": batch,
            "slot_s": (c1 - c0) / (d1 - d0), "slots": d1 - d0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", default="0.05,0.2,1.0", help="slot durations to size for (s)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--window", type=float, default=8.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    s_per_sample = seconds_per_sample()
    print(f"calibration: {s_per_sample * 1e6:.1f} us per sample (forward + backward, 1 thread)")
    print(f"{'slot_s':>7} {'run':>4} {'batch':>6} {'measured_slot_s':>16} {'fraction':>9}",
          flush=True)
    runs: dict[str, list[float]] = {}
    with stopped_on_interrupt():
        for slot_s in [float(s) for s in args.slots.split(",")]:
            for i in range(args.runs):
                r = measure(slot_s, s_per_sample, args)
                runs.setdefault(str(slot_s), []).append(r["fraction"])
                print(f"{slot_s:>7g} {i + 1:>4} {r['batch']:>6} {r['slot_s']:>16.3f} "
                      f"{r['fraction']:>9.3f}", flush=True)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    print("\nmedian compute fraction: " + ", ".join(f"{k} s slots {v:.3f}"
                                                    for k, v in medians.items()))
    if args.json:
        print(json.dumps({"fraction": medians, "runs": runs}))


if __name__ == "__main__":
    main()
