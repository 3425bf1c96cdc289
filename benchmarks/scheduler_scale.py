"""What one scheduler decision costs as the fleet grows (issue 8), and the coordinator's costs.

The real `Scheduler` is driven by the fleet simulator (coordinator/simulator.py, costless
gradients) at 1,000, 10,000 and 100,000 workers with the same round shape (64 partitions of 64
samples, lognormal speeds, median 0.5 s per sample: ~30 s per slot; heartbeat 10 s), for
`--slots` slots after a warm-up (every worker joined and known by its own results). It prints the wall time spent inside scheduler
calls per slot assigned (result, fill, tick, applied: everything but heartbeats; us/dec leaves
the ticks out, ms/tick is one tick), and per heartbeat (`seen`); wall time inside the calls, scaled by the share of the run the process was
on the CPU (this machine is shared: see the simulator's `run`). `--baseline REV` measures the scheduler of a git
revision side by side (its whole exported tree, in a subprocess, row by row, alternating which goes
first; e.g. the revision before an issue), at the fleet sizes it can finish.

The collector runs as in the coordinator process (`coordinator.server.tune_gc`: start-up frozen,
larger thresholds); `--default-gc` measures Python's defaults instead, whose passes over every
live object make the cost per slot grow with the fleet (at 10,000 workers, 55 us against 32 us
with the collector off, here), and `--no-gc` turns the collector off.

`--costs` measures the coordinator's per-message CPU and tensor throughput, the defaults of
`CoordinatorCosts`: encoding+decoding a heartbeat and a result header with the real protocol,
and taking in a gradient (frame views, a norm check, a weighted write) of `--params` float32 values.

    python benchmarks/scheduler_scale.py --workers 1000,10000,100000 --baseline a66f2d5 --json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from idlegrad.coordinator.scheduler import Scheduler
from idlegrad.coordinator.simulator import (CoordinatorCosts, SimConfig, lognormal_fleet,
                                            simulate)

PARTITIONS, SAMPLES_PER_SLOT, MEDIAN_S, SIGMA = 64, 64, 0.5, 0.5


def export_revision(rev: str) -> str:
    """The repository at git revision `rev`, exported to a temporary folder (its whole tree: the
    scheduler is several rooms, and it is measured with that revision's simulator)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder = tempfile.mkdtemp(prefix="idlegrad-baseline-")
    archive = subprocess.run(["git", "archive", rev], cwd=here, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    return folder


def baseline_row(tree: str, workers: int, slots: int, mode: str, repeats: int, seed: int,
                 gc_flags: list) -> dict:
    """One row measured by this script run in a subprocess over the exported tree `tree`."""
    command = [sys.executable, os.path.abspath(__file__), "--workers", str(workers),
               "--slots", str(slots), "--modes", mode, "--repeats", str(repeats),
               "--seed", str(seed), "--json", *gc_flags]
    done = subprocess.run(command, cwd=tree, env={**os.environ, "PYTHONPATH": tree},
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["rows"][0]


def one(workers: int, slots: int, mode: str, scheduler_class, seed: int) -> dict:
    fleet = lognormal_fleet(workers, MEDIAN_S, SIGMA, np.random.default_rng(seed))
    slot_s = MEDIAN_S * SAMPLES_PER_SLOT
    # Measured after a warm-up of three slot times (every worker has joined and answered a few
    # times: its own speed is known), for ~`slots` slots: each worker finishes one per ~slot_s.
    warmup = 3 * slot_s
    duration = warmup + slot_s * slots / workers
    # The coordinator's own costs are left out (free): this measures the scheduler alone.
    config = SimConfig(duration_s=duration, warmup_s=warmup, costs=CoordinatorCosts(0.0, math.inf), batch_size=PARTITIONS * SAMPLES_PER_SLOT,
                       partitions=PARTITIONS, heartbeat_s=10.0, max_staleness=10 ** 6,
                       model_bytes=400_000, train_samples=10 ** 8, seed=seed)
    r = simulate(fleet, config, mode, scheduler_class=scheduler_class)
    return {"workers": workers, "mode": mode, "slots": r.slots_measured,
            "us_per_slot": r.scheduler_us_per_slot, "us_per_decision": r.decision_us_per_slot,
            "ms_per_tick": r.tick_us / 1e3, "us_per_heartbeat": r.heartbeat_us,
            "wall_s": r.wall_s}


def median_of(repeats: int, *args) -> dict:
    rows = [one(*args) for _ in range(repeats)]
    out = dict(rows[0])
    for key in ("us_per_slot", "us_per_decision", "ms_per_tick", "us_per_heartbeat", "wall_s"):
        out[key] = statistics.median(r[key] for r in rows)
    out["runs_us_per_slot"] = [round(r["us_per_slot"], 1) for r in rows]
    return out


def costs(params: int, repeats: int = 50) -> dict:
    import torch

    from idlegrad.common import protocol as proto
    from idlegrad.common.tensors import blob_chunks, finite_norm, to_blob

    torch.set_num_threads(1)  # as the coordinator runs in the benchmarks (--threads 1)

    def per_call(fn, n):
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t0) / n)
        return statistics.median(times)

    grad = torch.randn(params)
    result = proto.encode(proto.Result(slot=1, version=2, samples=64, loss=0.5, compute_s=1.0,
                                       gradient=to_blob(grad)))
    header_s = per_call(lambda: proto.decode(proto.encode(proto.Heartbeat(state="working"))), 2000)
    total = torch.zeros(params)

    def take_gradient():  # as the coordinator does: frame views, a norm check, a weighted write
        chunks = blob_chunks(proto.decode(result).gradient, params, torch.float32)
        finite_norm(chunks)
        offset = 0
        for chunk in chunks:
            torch.mul(chunk, 0.5, out=total[offset:offset + chunk.numel()])
            offset += chunk.numel()

    gradient_s = per_call(take_gradient, repeats)
    return {"per_message_s": header_s, "gradient_s": gradient_s,
            "bytes_per_s": params * 4 / gradient_s, "params": params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1000,10000,100000")
    parser.add_argument("--slots", type=int, default=20000, help="slots per measurement")
    parser.add_argument("--modes", default="none,replicate:2")
    parser.add_argument("--baseline", metavar="REV",
                        help="also measure the scheduler (and simulator) of this git revision, "
                             "row by row beside this tree's, alternating which goes first")
    parser.add_argument("--baseline-max-workers", type=int, default=10000)
    parser.add_argument("--costs", action="store_true", help="measure the coordinator's costs")
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="runs per row; medians printed")
    parser.add_argument("--no-gc", action="store_true",
                        help="Python's cyclic garbage collector off while measuring: what is left "
                             "is the scheduler's own work (the collector's cost grows with the "
                             "objects alive, i.e. with the fleet)")
    parser.add_argument("--default-gc", action="store_true",
                        help="Python's default collector settings, not the coordinator's "
                             "(coordinator.server.tune_gc, which the coordinator process uses)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.no_gc:
        import gc

        gc.disable()
    elif not args.default_gc:
        from idlegrad.coordinator.training import tune_gc

        tune_gc()
    out: dict = {"rows": []}
    if args.costs:
        c = costs(args.params)
        out["costs"] = c
        print(f"coordinator: {c['per_message_s'] * 1e6:.1f} us per message (encode+decode), "
              f"{c['gradient_s'] * 1e3:.2f} ms per gradient of {c['params']} float32 "
              f"-> {c['bytes_per_s'] / 1e9:.2f} GB/s")
    baseline = export_revision(args.baseline) if args.baseline else None
    gc_flags = ["--no-gc"] if args.no_gc else ["--default-gc"] if args.default_gc else []
    print(f"{'scheduler':<10} {'mode':<12} {'workers':>8} {'slots':>7} {'us/slot':>8} "
          f"{'us/dec':>7} {'ms/tick':>7} {'us/beat':>8} {'wall_s':>7}", flush=True)
    turn = 0
    for n in [int(x) for x in args.workers.split(",")]:
        for mode in args.modes.split(","):
            names = ["now"]
            if baseline is not None and n <= args.baseline_max_workers:
                names.append(args.baseline)
                turn += 1
            for name in names if turn % 2 else names[::-1]:
                if name == "now":
                    row = median_of(args.repeats, n, args.slots, mode, Scheduler, args.seed)
                else:
                    row = baseline_row(baseline, n, args.slots, mode, args.repeats, args.seed,
                                       gc_flags)
                row["scheduler"] = name
                out["rows"].append(row)
                print(f"{name:<10} {mode:<12} {n:>8} {row['slots']:>7} {row['us_per_slot']:>8.1f} "
                      f"{row['us_per_decision']:>7.1f} {row['ms_per_tick']:>7.2f} "
                      f"{row['us_per_heartbeat']:>8.2f} {row['wall_s']:>7.1f}", flush=True)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
