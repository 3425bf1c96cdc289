"""Chaos: train with faults injected and account for every sample.

A real coordinator (digits, a fixed number of epochs, a ledger, checkpoints every second) and 5 real
worker processes on loopback, once clean and once per fault:

    kill9         kill -9 of 30% of the workers every 10 s (each replaced by a fresh process)
    sigstop       SIGSTOP of 30% of the workers for 3 s, every 6 s, then SIGCONT
    busy          one worker stays connected and heart-beating but never finishes a task
    restart       the coordinator killed -9 and restarted from its checkpoint every 8 s, 3 times
    nan           one worker sends NaN gradients
    scale         one worker sends gradients scaled x1000
    flip          one worker sends sign-flipped gradients (an honest norm: nothing refuses them)
    unknown_key   CURVE on; a sixth worker has a key the coordinator does not list

Per fault it prints, from the coordinator's ledger (coordinator/ledger.py): samples the final model
never saw (`lost`: an acknowledged result whose samples vanished would show here), extra
appearances of samples (`duplicates`), the recovery seconds after each injection (until the model
version moves past where it was), the slowdown against the clean run (span from the first to the
last step), the final accuracy and whether it reached the target. With --json the last line is
{"faults": {"<name>": {"lost": int, "duplicates": int, "reached": bool, "slowdown": float}, ...}}.

    python benchmarks/chaos.py [--faults kill9,restart] [--epochs 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from idlegrad.cli.processes import free_port, spawn, stop
from idlegrad.common.security import client_keys, generate
from idlegrad.coordinator.ledger import audit, read
from idlegrad.monitor.source import ZmqStatusSource

FAULTS = ("kill9", "sigstop", "busy", "restart", "nan", "scale", "flip", "unknown_key")
WORKERS = 5
COORDINATOR_ARGS = ("--threads", "1", "--heartbeat", "0.5", "--task-timeout", "5",
                    "--checkpoint-every", "1", "--log-level", "info")
WORKER_ARGS = ("--threads", "1", "--device", "cpu", "--no-idle-policy", "--connect-timeout", "120",
               "--log-level", "info")


@dataclass
class Run:
    fault: str
    directory: Path
    job: tuple[str, ...]
    epochs: int
    curve: bool = False
    address: str = field(default_factory=lambda: f"tcp://127.0.0.1:{free_port()}")
    procs: list = field(default_factory=list)
    coordinator: Optional[subprocess.Popen] = None
    workers: dict = field(default_factory=dict)  # name -> Popen (the live one)
    pace: float = 1.0  # fault intervals are multiplied by this
    recoveries: list = field(default_factory=list)
    injections: int = 0
    _logs: list = field(default_factory=list)

    @property
    def ckpt(self) -> Path:
        return self.directory / "ckpt"

    @property
    def ledger(self) -> Path:
        return self.directory / "ledger.jsonl"

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.directory / f"{name}.log", "a")
        self._logs.append(log)
        proc = spawn(args, log=log)
        self.procs.append(proc)
        return proc

    def keys(self, name: str) -> list[str]:
        if not self.curve:
            return []
        return ["--coordinator-key", str(self.directory / "keys" / "coord.key"),
                "--secret-key", str(self.directory / "keys" / f"{name}.key_secret")]

    def start_coordinator(self) -> None:
        args = ["coordinator", "--bind", self.address, *self.job, "--epochs", str(self.epochs),
                "--checkpoint-dir", str(self.ckpt), "--ledger", str(self.ledger),
                *COORDINATOR_ARGS]
        if self.curve:
            args += ["--secret-key", str(self.directory / "keys" / "coord.key_secret"),
                     "--allow-keys", str(self.directory / "allow")]
        self.coordinator = self._spawn("coordinator", args)

    def start_worker(self, name: str, *extra: str) -> None:
        self.workers[name] = self._spawn(name, [
            "worker", "--coordinator", self.address, "--id", name, *WORKER_ARGS,
            *self.keys(name), *extra])

    def status(self) -> ZmqStatusSource:
        keys = None
        if self.curve:
            keys = client_keys(str(self.directory / "keys" / "coord.key"),
                               str(self.directory / "keys" / "monitor.key_secret"))
        return ZmqStatusSource(self.address, keys=keys)

    def close(self) -> None:
        stop(self.procs, grace=5.0)
        for log in self._logs:
            log.close()


def prepare_keys(run: Run) -> None:
    keys, allow = run.directory / "keys", run.directory / "allow"
    allow.mkdir(parents=True)
    for name in ("coord", "monitor", "intruder", *(f"w{i}" for i in range(1, WORKERS + 1))):
        generate(name, str(keys))
    for name in ("monitor", *(f"w{i}" for i in range(1, WORKERS + 1))):
        (allow / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())


class Watcher:
    """Polls the coordinator's version, so recoveries can be timed."""

    def __init__(self, run: Run):
        self.run = run
        self.version = 0
        self.source = run.status()
        self.lock = threading.Lock()

    def poll(self) -> Optional[int]:
        snap = self.source.fetch(timeout=0.5)
        if snap is not None:
            self.version = int(snap.get("version", 0))
            return self.version
        return None

    def reconnect(self) -> None:
        self.source.close()
        self.source = self.run.status()

    def recovery(self, since: float, past: int, deadline: float = 120.0) -> Optional[float]:
        """Seconds from `since` until the version passes `past` (None: training ended first)."""
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            if self.run.coordinator.poll() is not None:
                return None
            version = self.poll()
            if version is not None and version > past:
                return time.monotonic() - since
            time.sleep(0.1)
        return None

    def close(self) -> None:
        self.source.close()


def wait_started(watcher: Watcher, run: Run, timeout: float = 180.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if run.coordinator.poll() is not None:
            raise RuntimeError(f"{run.fault}: the coordinator exited ({run.coordinator.returncode})")
        version = watcher.poll()
        if version is not None and version >= 5:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{run.fault}: training did not start within {timeout:g}s")


def inject(run: Run, watcher: Watcher, rng: random.Random) -> None:
    """Drive the run's fault until training ends."""
    fault = run.fault
    honest = [f"w{i}" for i in range(1, WORKERS + 1)]
    victims = max(1, round(0.3 * WORKERS))
    if fault == "kill9":
        while run.coordinator.poll() is None:
            if _sleep_or_end(run, 10.0 * run.pace):
                return
            before, t0 = watcher.version, time.monotonic()
            for name in rng.sample(honest, victims):
                os.kill(run.workers[name].pid, signal.SIGKILL)
                run.workers[name].wait(timeout=10)
                run.start_worker(name)
            run.injections += 1
            run.recoveries.append(watcher.recovery(t0, before))
    elif fault == "sigstop":
        while run.coordinator.poll() is None:
            if _sleep_or_end(run, 3.0 * run.pace):
                return
            names = rng.sample(honest, victims)
            before, t0 = watcher.version, time.monotonic()
            for name in names:
                os.kill(run.workers[name].pid, signal.SIGSTOP)
            run.injections += 1
            # Training goes on without them (the rest of the fleet carries it).
            recovered = watcher.recovery(t0, before, deadline=3.0)
            time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))
            for name in names:
                os.kill(run.workers[name].pid, signal.SIGCONT)
            run.recoveries.append(recovered)
    elif fault == "restart":
        for _ in range(3):
            if _sleep_or_end(run, 8.0 * run.pace):
                return
            before = watcher.version
            os.kill(run.coordinator.pid, signal.SIGKILL)
            run.coordinator.wait(timeout=10)
            t0 = time.monotonic()
            run.start_coordinator()
            watcher.reconnect()
            run.injections += 1
            # Progress again: past the version it resumed at (itself at most `before`).
            resumed = None
            while resumed is None and run.coordinator.poll() is None:
                resumed = watcher.poll()
                time.sleep(0.1)
            run.recoveries.append(watcher.recovery(t0, min(before, resumed or before)))
    # the other faults are in the workers themselves: nothing to drive


def _sleep_or_end(run: Run, seconds: float) -> bool:
    """Sleep; True when the coordinator exited meanwhile."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if run.coordinator.poll() is not None:
            return True
        time.sleep(0.1)
    return run.coordinator.poll() is not None


def train_size(job: tuple[str, ...]) -> int:
    from idlegrad.common.job import build, load_job, parse_job_args

    args = [job[i + 1] for i in range(len(job) - 1) if job[i] == "--job-arg"]
    return len(build(load_job(job[job.index("--job") + 1], parse_job_args(args))).train)


def run_one(fault: str, root: Path, job: tuple[str, ...], epochs: int, n_train: int,
            seed: int, timeout: float, pace: float = 1.0) -> dict:
    run = Run(fault, root / fault, job, epochs, curve=fault == "unknown_key", pace=pace)
    run.directory.mkdir(parents=True)
    if run.curve:
        prepare_keys(run)
    rng = random.Random(seed)
    started = time.monotonic()
    watcher = None
    try:
        run.start_coordinator()
        for i in range(1, WORKERS + 1):
            extra: list[str] = []
            if i == WORKERS and fault in ("nan", "scale", "flip"):
                extra = ["--poison", {"nan": "nan", "scale": "scale:1000", "flip": "flip"}[fault]]
            if i == WORKERS and fault == "busy":
                extra = ["--stall", "1:3600"]
            run.start_worker(f"w{i}", *extra)
        if fault == "unknown_key":
            run.workers["intruder"] = run._spawn("intruder", [
                "worker", "--coordinator", run.address, "--id", "intruder", *WORKER_ARGS,
                "--coordinator-key", str(run.directory / "keys" / "coord.key"),
                "--secret-key", str(run.directory / "keys" / "intruder.key_secret")])
        watcher = Watcher(run)
        wait_started(watcher, run)
        inject(run, watcher, rng)
        end = started + timeout
        while run.coordinator.poll() is None:
            if time.monotonic() > end:
                raise RuntimeError(f"{fault}: not finished within {timeout:g}s")
            watcher.poll()
            time.sleep(0.2)
        final_status = run.coordinator.returncode
    finally:
        if watcher is not None:
            watcher.close()
        run.close()
    records = read(str(run.ledger))
    account = audit(records, n_train, epochs)
    applied_t = [r["t"] for r in records if r.get("event") == "applied" and "t" in r]
    metrics = _final_metrics(run.ckpt / "metrics.jsonl")
    logs = (run.directory / "coordinator.log").read_text(errors="replace")
    return {
        "fault": fault, "exit": final_status, "account": account.as_dict(),
        "span_s": (max(applied_t) - min(applied_t)) if len(applied_t) > 1 else math.nan,
        "wall_s": time.monotonic() - started,
        "accuracy": metrics.get("metrics", {}).get("accuracy"),
        "reason": metrics.get("reason"), "injections": run.injections,
        "recoveries": [r for r in run.recoveries if r is not None],
        "banned": logs.count("banned: "), "rejected": logs.count("rejected: "),
        "intruder_joined": "intruder joined" in logs,
        "tracebacks": sum((run.directory / f).read_text(errors="replace").count("Traceback")
                          for f in os.listdir(run.directory) if f.endswith(".log")),
    }


def _final_metrics(path: Path) -> dict:
    try:
        with open(path) as fh:
            lines = [json.loads(line) for line in fh if line.strip()]
    except (OSError, json.JSONDecodeError):
        return {}
    finals = [r for r in lines if r.get("final")]
    return finals[-1] if finals else (lines[-1] if lines else {})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"comma-separated, from {', '.join(FAULTS)} (default: all)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=4096, help="digits' hidden width")
    parser.add_argument("--target", type=float, default=0.95, help="test accuracy to reach")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per run")
    parser.add_argument("--pace", type=float, default=1.0,
                        help="multiply every fault interval by this (the tests' fast subset: <1)")
    parser.add_argument("--keep", metavar="DIR", help="keep logs and ledgers in DIR")
    parser.add_argument("--json", action="store_true", help="the summary as JSON on the last line")
    args = parser.parse_args(argv)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        parser.error(f"unknown faults {unknown}; choose from {', '.join(FAULTS)}")
    job = ("--job", "digits", "--job-arg", f"hidden={args.hidden}", "--job-arg", "lr=0.003")
    n_train = train_size(job)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="idlegrad-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    results = {}
    for i, fault in enumerate(["clean", *faults]):
        print(f"[{fault}] running ...", file=sys.stderr, flush=True)
        results[fault] = run_one(fault, root, job, args.epochs, n_train, args.seed + i, args.timeout,
                                 args.pace)
        r = results[fault]
        print(f"[{fault}] {json.dumps(r, default=str)}", file=sys.stderr, flush=True)
    clean_span = results["clean"]["span_s"]
    summary = {}
    print(f"{'fault':<12} {'lost':>5} {'dup':>4} {'recovery s (median/max)':>24} {'slowdown':>8} "
          f"{'accuracy':>8} {'reached':>7}  notes")
    for fault in ["clean", *faults]:
        r = results[fault]
        a = r["account"]
        recov = r["recoveries"]
        recovery = (f"{statistics.median(recov):.1f}/{max(recov):.1f}" if recov else "-")
        slowdown = r["span_s"] / clean_span if clean_span and clean_span > 0 else math.nan
        reached = (r["accuracy"] is not None and r["accuracy"] >= args.target
                   and r["reason"] == "epochs")
        notes = [f"{r['injections']} injections"] if r["injections"] else []
        if a["restarts"]:
            notes.append(f"{a['restarts']} restarts, {a['undone_rounds']} steps redone")
        if r["banned"]:
            notes.append("banned")
        if r["rejected"]:
            notes.append(f"{r['rejected']} rejected")
        if fault == "unknown_key":
            notes.append("intruder joined!" if r["intruder_joined"] else "intruder kept out")
        if r["tracebacks"]:
            notes.append(f"{r['tracebacks']} tracebacks")
        print(f"{fault:<12} {a['lost']:>5} {a['duplicates']:>4} {recovery:>24} {slowdown:>8.2f} "
              f"{(r['accuracy'] or 0):>8.4f} {str(reached):>7}  {'; '.join(notes)}")
        if fault != "clean":
            summary[fault] = {"lost": a["lost"], "duplicates": a["duplicates"], "reached": reached,
                              "slowdown": round(slowdown, 3),
                              "recovery_s": round(max(recov), 2) if recov else None,
                              "accuracy": r["accuracy"], "clean_accuracy": results["clean"]["accuracy"],
                              "acknowledged": a["acknowledged"], "sent": a["sent"],
                              "applied_rounds": a["applied_rounds"],
                              "injections": r["injections"], "banned": bool(r["banned"]),
                              "intruder_joined": r["intruder_joined"],
                              "tracebacks": r["tracebacks"]}
    print(f"logs and ledgers in {root}", file=sys.stderr)
    if args.json:
        print(json.dumps({"faults": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
