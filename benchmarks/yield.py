"""How well does a worker yield? A real worker trains against a real coordinator; a CPU hog (a
Python busy loop) starts and stops several times. Measured, from the worker's own state log:

- pause latency: hog start (the hog's own first timestamp) -> the worker's "paused" record;
- CPU while paused: the worker process's CPU time over the paused stretch (from 1 s after the
  pause, when the engine has surely stopped, to the hog's end), in percent of one core;
- resume: hog end -> the worker's "running" record (the policy waits `--resume-after` seconds);
- the worker's RSS while paused.

    python benchmarks/yield.py [--cycles 5] [--resume-after 2] [--json]

With --json the last line is {"pause_latency_s": {"p50": ..., "p95": ...}, "paused_cpu_pct": ...,
"resume_s": ...} (plus a few more keys). Run it on a quiet machine: other load is "others" too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from idlegrad.cli.processes import free_port, spawn, stop


def percentile(values, q):
    values = sorted(values)
    if not values:
        return None
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def renice(pid: int, value: int = 10) -> None:
    """Every thread of `pid` (on Linux the nice value is per thread). The coordinator shares the
    worker's machine here, unlike in real life: niced, its CPU is not "others" to the worker."""
    task = f"/proc/{pid}/task"
    for tid in (os.listdir(task) if os.path.isdir(task) else [str(pid)]):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), value)
        except OSError:
            pass


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_record(path: Path, state: str, after: float, timeout: float) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for r in records(path):
            if r["state"] == state and r["time"] >= after:
                return r
        time.sleep(0.02)
    raise SystemExit(f"yield benchmark: no {state!r} record within {timeout:g}s (see {path})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--resume-after", type=float, default=2.0)
    ap.add_argument("--hold", type=float, default=4.0, help="seconds each hog runs")
    ap.add_argument("--sample-every", type=float, default=0.5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", metavar="DIR", help="keep logs here")
    args = ap.parse_args()

    cores = psutil.cpu_count() or 1
    one_hog = 100.0 / cores
    cpu_max = round(one_hog * 0.6, 1)  # one hog is unmistakable, a quiet machine well below
    workdir = Path(args.keep or tempfile.mkdtemp(prefix="idlegrad-yield-"))
    workdir.mkdir(parents=True, exist_ok=True)
    state_log = workdir / "state.jsonl"
    address = f"tcp://127.0.0.1:{free_port()}"
    logs = [open(workdir / name, "w") for name in ("coordinator.log", "worker.log")]
    procs = []
    hog = None
    latencies, resumes, cpu_pcts, rss = [], [], [], []
    try:
        procs.append(spawn(["coordinator", "--bind", address, "--job", "digits", "--job-arg",
                            "hidden=2048", "--epochs", "100000", "--threads", "1",
                            "--heartbeat", "0.5", "--pause-grace", "1"], log=logs[0]))
        procs.append(spawn(["worker", "--coordinator", address, "--id", "guest", "--threads", "1",
                            "--device", "cpu", "--cpu-max", str(cpu_max), "--resume-after",
                            str(args.resume_after), "--sample-every", str(args.sample_every),
                            "--user-idle", "off", "--memory-min", "off", "--battery", "run",
                            "--state-log", str(state_log)], log=logs[1]))
        renice(procs[0].pid)
        worker = psutil.Process(procs[1].pid)
        wait_record(state_log, "start", 0, 120)
        time.sleep(3)  # the worker joins and computes
        renice(procs[0].pid)
        for cycle in range(args.cycles):
            # Start each hog on a computing worker (other load on the machine may pause it too).
            while True:
                last = records(state_log)[-1]
                if last["state"] == "paused":
                    wait_record(state_log, "running", last["time"], 120)
                    continue
                time.sleep(1.0)
                if records(state_log)[-1]["time"] == last["time"]:
                    break
            hog = subprocess.Popen([sys.executable, "-c",
                                    "import time; print(time.time(), flush=True)\nwhile True: pass"],
                                   stdout=subprocess.PIPE, text=True)
            t_hog = float(hog.stdout.readline())
            paused = wait_record(state_log, "paused", t_hog, 30)
            latencies.append(paused["time"] - t_hog)
            time.sleep(1.0)  # the engine stops within a second
            cpu0, w0 = sum(worker.cpu_times()[:2]), time.monotonic()
            time.sleep(max(0.5, args.hold - 1.0))
            cpu1, w1 = sum(worker.cpu_times()[:2]), time.monotonic()
            rss.append(worker.memory_info().rss / 2**20)
            hog.kill()
            hog.wait(10)
            t_end = time.time()
            hog = None
            cpu_pcts.append(100.0 * (cpu1 - cpu0) / (w1 - w0))
            running = wait_record(state_log, "running", t_end, args.resume_after + 30)
            resumes.append(running["time"] - t_end)
            if not args.json:
                print(f"cycle {cycle + 1}: paused after {latencies[-1]:.3f}s, "
                      f"{cpu_pcts[-1]:.2f}% CPU while paused, RSS {rss[-1]:.0f} MiB, "
                      f"resumed {resumes[-1]:.2f}s after the hog ended")
    finally:
        if hog is not None:
            hog.kill()
            hog.wait(10)
        stop(procs)
        for fh in logs:
            fh.close()
    result = {
        "pause_latency_s": {"p50": round(percentile(latencies, 0.5), 3),
                            "p95": round(percentile(latencies, 0.95), 3)},
        "paused_cpu_pct": round(max(cpu_pcts), 3),
        "resume_s": round(max(resumes), 3),
        "resume_after_s": args.resume_after,
        "paused_rss_mb": round(statistics.median(rss), 1),
        "cycles": args.cycles, "cpu_max_pct": cpu_max, "cores": cores,
    }
    print(f"pause latency p50 {result['pause_latency_s']['p50']:.3f}s, "
          f"p95 {result['pause_latency_s']['p95']:.3f}s (target <= 1.0 s); CPU while paused "
          f"{result['paused_cpu_pct']:.2f}% of a core (max; target <= 1%); resume "
          f"{result['resume_s']:.2f}s after the hog (max; target <= {args.resume_after + 1:g}s); "
          f"RSS while paused {result['paused_rss_mb']:.0f} MiB; logs in {workdir}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
