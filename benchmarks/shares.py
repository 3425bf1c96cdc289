"""Resource shares: one worker, two coordinators listed as [[project]]s with shares A:B (3:1).

Phase 1 (the first half of --minutes): both coordinators up; the worker's compute splits between
them by share. Phase 2: coordinator B is stopped; A gets all the compute the worker gives.
Compute is measured at the coordinators: the compute-seconds the worker's results reported to
each (its row in their status), read at the start and end of each phase.

    python benchmarks/shares.py --minutes 5          # the acceptance run
    python benchmarks/shares.py --minutes 1.5        # a smoke run

Prints a table, then one JSON line (the last).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from idlegrad.cli.processes import free_port, spawn, stop
from idlegrad.monitor.source import ZmqStatusSource

COORDINATOR = ("--threads", "1", "--heartbeat", "0.5", "--epochs", "100000")
WORKER = ("--threads", "1", "--device", "cpu", "--no-idle-policy", "--id", "shared")


def compute_s(source: ZmqStatusSource, worker: str = "shared", timeout: float = 60.0) -> float:
    """The compute-seconds `worker` has reported to this coordinator (its status row)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        snap = source.fetch(timeout=1.0)
        rows = [w for w in (snap or {}).get("workers", []) if w["id"] == worker]
        if rows:
            return float(rows[0]["compute_s"])
        time.sleep(0.2)
    raise SystemExit(f"no status row for worker {worker!r} within {timeout:g}s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0, help="both phases together (default 5)")
    p.add_argument("--shares", default="3:1", help="A:B (default 3:1)")
    p.add_argument("--job-arg", action="append", default=["hidden=256"],
                   help="the digits job's arguments (default hidden=256)")
    p.add_argument("--slowdown", type=float, default=20.0,
                   help="the worker's tasks take X times as long (sleeping, counted as compute): "
                        "a worker busy all the time, as shares are about contention, without "
                        "loading this machine's cores (default 20; 1: the bare job)")
    args = p.parse_args()
    share_a, share_b = (float(x) for x in args.shares.split(":"))
    work = Path(tempfile.mkdtemp(prefix="idlegrad-shares-"))
    env = dict(os.environ, XDG_CONFIG_HOME=str(work / "xdg"))
    address = {name: f"tcp://127.0.0.1:{free_port()}" for name in "AB"}
    job = ["--job", "digits", *(x for a in args.job_arg for x in ("--job-arg", a))]
    (work / "worker.toml").write_text(
        f'[[project]]\nname = "A"\ncoordinator = "{address["A"]}"\nshare = {share_a}\n'
        f'[[project]]\nname = "B"\ncoordinator = "{address["B"]}"\nshare = {share_b}\n')
    logs = {name: open(work / f"{name}.log", "w") for name in ("A", "B", "worker")}
    procs = {name: spawn(["coordinator", "--bind", address[name], *COORDINATOR, *job],
                         log=logs[name], env=env) for name in "AB"}
    procs["worker"] = spawn(["worker", "--config", str(work / "worker.toml"), *WORKER,
                             "--slowdown", str(args.slowdown)],
                            log=logs["worker"], env=env)
    sources = {name: ZmqStatusSource(address[name]) for name in "AB"}
    phase_s = args.minutes * 60 / 2
    try:
        start = {name: compute_s(sources[name]) for name in "AB"}  # both joined
        time.sleep(5)  # past the first slots (building the job, sizing slots)
        t0, at0 = time.monotonic(), {name: compute_s(sources[name]) for name in "AB"}
        time.sleep(phase_s)
        t1, at1 = time.monotonic(), {name: compute_s(sources[name]) for name in "AB"}
        stop([procs.pop("B")], grace=5.0)  # B goes down mid-run
        time.sleep(phase_s)
        t2, a2 = time.monotonic(), compute_s(sources["A"])
    finally:
        stop(list(procs.values()), grace=5.0)
        for source in sources.values():
            source.close()
        for log in logs.values():
            log.close()
    del start
    d_a, d_b = at1["A"] - at0["A"], at1["B"] - at0["B"]
    split_a = d_a / (d_a + d_b) if d_a + d_b > 0 else 0.0
    busy_1 = (d_a + d_b) / (t1 - t0)  # the worker's compute per second, both up
    busy_2 = (a2 - at1["A"]) / (t2 - t1)  # ... A alone
    expected = share_a / (share_a + share_b)
    print(f"{'phase':<24}{'seconds':>9}{'A compute':>11}{'B compute':>11}{'A share':>9}{'busy':>7}")
    print(f"{'1: A and B up':<24}{t1 - t0:>9.0f}{d_a:>11.1f}{d_b:>11.1f}{split_a:>9.1%}"
          f"{busy_1:>7.2f}")
    print(f"{'2: B stopped':<24}{t2 - t1:>9.0f}{a2 - at1['A']:>11.1f}{0.0:>11.1f}{1.0:>9.1%}"
          f"{busy_2:>7.2f}")
    print(f"expected A share {expected:.0%} +- 10%; in phase 2 A's compute per second is "
          f"{busy_2 / busy_1 if busy_1 else 0:.0%} of both projects' together in phase 1 "
          f"(logs in {work})")
    print(json.dumps({"minutes": args.minutes, "shares": [share_a, share_b],
                      "slowdown": args.slowdown,
                      "phase1": {"seconds": round(t1 - t0, 1), "a_compute_s": round(d_a, 2),
                                 "b_compute_s": round(d_b, 2), "a_split": round(split_a, 4),
                                 "busy": round(busy_1, 3)},
                      "phase2": {"seconds": round(t2 - t1, 1),
                                 "a_compute_s": round(a2 - at1["A"], 2), "a_split": 1.0,
                                 "busy": round(busy_2, 3)},
                      "expected_a_split": expected,
                      "within_10pct": abs(split_a - expected) <= 0.10}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
