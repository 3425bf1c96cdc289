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
appearances of samples (`duplicates`), the recovery after each injection, the slowdown against
the clean run (span from the first to the last step), the final accuracy and whether it reached
the target.

Recovery is the time from the fault (the first signal sent) to the first status snapshot showing
a model version strictly greater than the version at the fault, itself read from a status poll
made just before the fault (polled every 0.05 s: that, plus one status round trip, is the
resolution). For `restart` that is the version the killed process had reached: the new process
has recovered once it is past it (start-up, checkpoint loading and redoing the lost steps
included), not when it first answers. An injection after which no such version shows within
`--recovery-deadline` seconds (or before training ends) never recovered: a FAILURE, counted in
the table's `unrecovered` column (the median and max are over the others), listed on a FAILURE
line, and the exit status is 1. With --json the last line is
{"faults": {"<name>": {"lost": int, "duplicates": int, "reached": bool, "slowdown": float,
"recovery_s": max, "recovery_median_s": ..., "recoveries_s": [s or null, ...],
"unrecovered": int, ...}, ...}, "ok": bool, "failures": [str, ...]}.

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
    recovery_deadline: float = 60.0  # a fault not recovered from within this is a failure
    recoveries: list = field(default_factory=list)  # seconds, or None: never recovered
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
                     "--allow-keys", str(self.directory / "allow"),
                     "--monitor-keys", str(self.directory / "monitors")]
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
    monitors = run.directory / "monitors"
    allow.mkdir(parents=True)
    monitors.mkdir(parents=True)
    for name in ("coord", "monitor", "intruder", *(f"w{i}" for i in range(1, WORKERS + 1))):
        generate(name, str(keys))
    for name in (f"w{i}" for i in range(1, WORKERS + 1)):
        (allow / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    (monitors / "monitor.key").write_bytes((keys / "monitor.key").read_bytes())


class Watcher:
    """Polls the coordinator's status for its model version, so recoveries can be timed."""

    POLL_S = 0.05  # between polls while timing a recovery: the resolution of a recovery time

    def __init__(self, run: Run):
        self.run = run
        self.version = 0
        self.source = run.status()

    def poll(self) -> Optional[int]:
        snap = self.source.fetch(timeout=0.5)
        if snap is not None:
            self.version = int(snap.get("version", 0))
            return self.version
        return None

    def reconnect(self) -> None:
        self.source.close()
        self.source = self.run.status()

    def version_now(self, timeout: float = 120.0) -> Optional[int]:
        """A fresh reading of the version, taken now (never the last one seen, which may be
        seconds old): the caller injects its fault as soon as this returns. None: training ended
        (the coordinator exited) first. A coordinator still starting (restarted) is waited for."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.run.coordinator.poll() is not None:
                return None
            version = self.poll()
            if version is not None:
                return version
        raise RuntimeError(f"{self.run.fault}: no status from the coordinator within "
                           f"{timeout:g}s to time a fault by")

    def recovery(self, fault_t: float, fault_version: int, deadline: float,
                 tick=None) -> Optional[float]:
        """Seconds from the fault (`fault_t`, monotonic) to the first status showing a model
        version strictly greater than `fault_version` (the version polled just before the
        fault); None when none shows within `deadline` seconds, or the coordinator exits
        without having gone past it (a failure). `tick` is called between polls."""
        end = fault_t + deadline
        while True:
            if tick is not None:
                tick()
            if self.run.coordinator.poll() is not None:
                # Training ended meanwhile: it recovered if its final version is past the fault
                # (the time is then an upper bound: when the exit was noticed).
                final = _final_metrics(self.run.ckpt / "metrics.jsonl")
                if int(final.get("version", -1)) > fault_version:
                    return time.monotonic() - fault_t
                return None
            version = self.poll()
            if version is not None and version > fault_version:
                return time.monotonic() - fault_t
            if time.monotonic() >= end:
                return None
            time.sleep(self.POLL_S)

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
    """Drive the run's fault until training ends. Each injection appends its recovery to
    `run.recoveries`: seconds from the fault to the first model version past the one polled just
    before it, or None when training never got past it (within `run.recovery_deadline`)."""
    fault = run.fault
    honest = [f"w{i}" for i in range(1, WORKERS + 1)]
    victims = max(1, round(0.3 * WORKERS))
    deadline = run.recovery_deadline
    if fault == "kill9":
        while run.coordinator.poll() is None:
            if _sleep_or_end(run, 10.0 * run.pace):
                return
            names = rng.sample(honest, victims)
            before = watcher.version_now()
            if before is None:
                return
            t0 = time.monotonic()
            for name in names:
                os.kill(run.workers[name].pid, signal.SIGKILL)
            for name in names:
                run.workers[name].wait(timeout=10)
                run.start_worker(name)
            run.injections += 1
            run.recoveries.append(watcher.recovery(t0, before, deadline))
    elif fault == "sigstop":
        while run.coordinator.poll() is None:
            if _sleep_or_end(run, 3.0 * run.pace):
                return
            names = rng.sample(honest, victims)
            before = watcher.version_now()
            if before is None:
                return
            t0 = time.monotonic()
            for name in names:
                os.kill(run.workers[name].pid, signal.SIGSTOP)
            run.injections += 1
            stopped = set(names)

            def resume_when_due() -> None:  # stopped for 3 s, whether recovered or not
                if stopped and time.monotonic() - t0 >= 3.0:
                    for name in sorted(stopped):
                        os.kill(run.workers[name].pid, signal.SIGCONT)
                    stopped.clear()

            # Training should go on without them (the rest of the fleet carries it).
            recovered = watcher.recovery(t0, before, deadline, tick=resume_when_due)
            while stopped:
                time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))
                resume_when_due()
            run.recoveries.append(recovered)
    elif fault == "restart":
        for _ in range(3):
            if _sleep_or_end(run, 8.0 * run.pace):
                return
            # The version at the kill; the new process resumes from its last checkpoint, at or
            # below it, and has recovered once its version is strictly past it: start-up,
            # loading and redoing the lost steps all count.
            before = watcher.version_now()
            if before is None:
                return
            t0 = time.monotonic()
            os.kill(run.coordinator.pid, signal.SIGKILL)
            run.coordinator.wait(timeout=10)
            run.start_coordinator()
            watcher.reconnect()
            run.injections += 1
            run.recoveries.append(watcher.recovery(t0, before, deadline))
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
            seed: int, timeout: float, pace: float = 1.0, recovery_deadline: float = 60.0) -> dict:
    run = Run(fault, root / fault, job, epochs, curve=fault == "unknown_key", pace=pace,
              recovery_deadline=recovery_deadline)
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
        "recoveries": list(run.recoveries),  # None: never recovered (a failure)
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
    parser.add_argument("--recovery-deadline", type=float, default=60.0, metavar="S",
                        help="a fault after which the model version has not moved within S "
                             "seconds never recovered: a failure (default: 60)")
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
                                 args.pace, args.recovery_deadline)
        r = results[fault]
        print(f"[{fault}] {json.dumps(r, default=str)}", file=sys.stderr, flush=True)
    clean_span = results["clean"]["span_s"]
    summary = {}
    failures = []
    print(f"{'fault':<12} {'lost':>5} {'dup':>4} {'recovery s (median/max)':>24} {'unrecovered':>11} "
          f"{'slowdown':>8} {'accuracy':>8} {'reached':>7}  notes")
    for fault in ["clean", *faults]:
        r = results[fault]
        a = r["account"]
        recov = [t for t in r["recoveries"] if t is not None]
        unrecovered = sum(t is None for t in r["recoveries"])
        recovery = (f"{statistics.median(recov):.2f}/{max(recov):.2f}" if recov else "-")
        failed = f"FAIL {unrecovered}/{len(r['recoveries'])}" if unrecovered else (
            f"0/{len(r['recoveries'])}" if r["recoveries"] else "-")
        if unrecovered:
            failures.append(f"{fault}: {unrecovered} of {len(r['recoveries'])} injections never "
                            f"recovered (no model version past the fault's within "
                            f"{args.recovery_deadline:g}s or before training ended)")
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
        print(f"{fault:<12} {a['lost']:>5} {a['duplicates']:>4} {recovery:>24} {failed:>11} "
              f"{slowdown:>8.2f} {(r['accuracy'] or 0):>8.4f} {str(reached):>7}  {'; '.join(notes)}")
        if fault != "clean":
            summary[fault] = {"lost": a["lost"], "duplicates": a["duplicates"], "reached": reached,
                              "slowdown": round(slowdown, 3),
                              # over the injections that recovered; `unrecovered` counts the rest
                              "recovery_s": round(max(recov), 3) if recov else None,
                              "recovery_median_s": round(statistics.median(recov), 3)
                              if recov else None,
                              "recoveries_s": [None if t is None else round(t, 3)
                                               for t in r["recoveries"]],
                              "unrecovered": unrecovered,
                              "accuracy": r["accuracy"], "clean_accuracy": results["clean"]["accuracy"],
                              "acknowledged": a["acknowledged"], "sent": a["sent"],
                              "applied_rounds": a["applied_rounds"],
                              "injections": r["injections"], "banned": bool(r["banned"]),
                              "intruder_joined": r["intruder_joined"],
                              "tracebacks": r["tracebacks"]}
    for line in failures:  # on stderr too: a caller that shows only stderr sees why
        print(f"FAILURE: {line}")
        print(f"FAILURE: {line}", file=sys.stderr)
    print(f"logs and ledgers in {root}", file=sys.stderr)
    if args.json:
        print(json.dumps({"faults": summary, "ok": not failures, "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
