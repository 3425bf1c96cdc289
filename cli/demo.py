"""`idlegrad demo`: a coordinator and N workers on loopback, a real data set, a real accuracy.

The front end imports no torch: it starts the sides as processes, watches the coordinator's
status endpoint, and reaps every process it started, whatever happens.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..common.errors import IdlegradError
from ..common.job_loading import BUILTIN_JOBS
from ..coordinator.target import Target
from ..monitor.source import ZmqStatusSource
from .processes import free_port, spawn, stop


class DemoFailed(IdlegradError):
    pass


def run_demo(args) -> int:
    started = time.monotonic()
    target = Target.parse(args.target)
    job_args = []
    for item in args.job_arg:
        job_args += ["--job-arg", item]
    cores = os.cpu_count() or 1
    threads = max(1, cores // args.workers)
    workdir = args.keep or tempfile.mkdtemp(prefix="idlegrad-demo-")
    os.makedirs(workdir, exist_ok=True)
    address = f"tcp://127.0.0.1:{free_port()}"
    console = Console(stderr=True)
    processes, logs = [], []

    def log_file(name: str):
        fh = open(os.path.join(workdir, name), "w")
        logs.append(fh)
        return fh

    keys = None
    coordinator_keys, worker_keys = [], lambda i: []  # noqa: E731
    if getattr(args, "curve", False):
        keys, coordinator_keys, worker_keys = _demo_keys(workdir, args.workers)

    def on_term(signum, frame):  # `kill`, `timeout`, a closing terminal: as Ctrl-C
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        coordinator = spawn(
            ["coordinator", "--job", args.job, *job_args, "--bind", address,
             "--target", args.target, "--epochs", str(args.epochs), "--checkpoint-dir", workdir,
             "--threads", "1", "--heartbeat", "0.5", "--log-level", args.log_level,
             *coordinator_keys],
            log=log_file("coordinator.log"))
        processes.append(coordinator)
        worker_job = [] if args.job in BUILTIN_JOBS else ["--job", args.job]
        for i in range(args.workers):
            processes.append(spawn(
                ["worker", "--coordinator", address, *worker_job, "--threads", str(threads),
                 "--id", f"demo-{i + 1}", "--connect-timeout", "60", "--log-level", args.log_level,
                 "--no-idle-policy", *worker_keys(i + 1)],  # the demo keeps the CPU busy itself
                log=log_file(f"worker-{i + 1}.log")))
        console.print(f"[bold]idlegrad demo[/]: job [cyan]{args.job}[/], {args.workers} workers, "
                      f"target {target}, coordinator at {address}")
        if getattr(args, "tui", False):
            last = _watch_tui(coordinator, processes[1:], address, args.timeout, started, keys)
        else:
            last = _watch(coordinator, processes[1:], address, target, args.timeout, started,
                          console, keys)
        rc = coordinator.poll()
        stop(processes[1:], grace=5.0)  # they were told to go; this bounds the wait
        wall = time.monotonic() - started
        final = _final_metrics(os.path.join(workdir, "metrics.jsonl"))
        if rc != 0 or final is None:
            console.print(f"[red]the coordinator failed (exit {rc}); its log ends with:[/]")
            console.print(_tail(os.path.join(workdir, "coordinator.log")))
            return 1
        summary = {
            "test_accuracy": final["metrics"].get("accuracy"),
            "test_loss": final["metrics"].get("loss"),
            "metrics": final["metrics"],
            "target": str(target),
            "reached": target.reached(final["metrics"]),
            "reason": final.get("reason"),
            "updates": final["version"],
            "samples": final["samples"],
            "epochs": final["epoch"],
            "wall_s": round(wall, 3),
            "training_s": final["elapsed"],
            "workers": args.workers,
            "workers_seen": len(last.get("workers", [])) if last else None,
        }
        _print_summary(summary, args.json, args.keep and workdir)
        return 0 if summary["reached"] or summary["reason"] == "epochs" else 1
    except DemoFailed as exc:
        console.print(f"[red]demo failed: {exc}[/]")
        for name in sorted(os.listdir(workdir)):
            if name.endswith(".log"):
                console.print(f"[bold]{name}[/] ends with:\n{_tail(os.path.join(workdir, name), 5)}")
        return 1
    except KeyboardInterrupt:
        console.print("interrupted; stopping the demo's processes")
        return 130
    finally:
        stop(processes, grace=5.0)
        for fh in logs:
            fh.close()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)


def _watch(coordinator, workers, address: str, target: Target, timeout: float, started: float,
           console: Console, keys=None) -> dict:
    """Show progress until the coordinator exits. Returns the last snapshot seen."""
    last: dict = {}
    progress = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
        TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), console=console, transient=False)
    goal = target.value if target.higher_is_better and target.value > 0 else None
    with ZmqStatusSource(address, keys=keys) as source, progress:
        task = progress.add_task("starting", total=goal or 1.0, stats="")
        while coordinator.poll() is None:
            if time.monotonic() - started > timeout:
                raise DemoFailed(f"the demo did not finish within {timeout:g}s")
            codes = [w.poll() for w in workers]
            if None not in codes and any(codes):  # exit 0 means they were sent home: fine
                raise DemoFailed(f"every worker has exited (exit codes {codes})")
            snap = source.fetch(timeout=0.5)
            if snap is None:
                time.sleep(0.1)
                continue
            last = snap
            metrics = snap.get("metrics") or {}
            value = metrics.get(target.metric)
            stats = (f"v{snap['version']}  {snap['samples_per_s']:.0f} samples/s  "
                     f"loss {snap['loss'] or float('nan'):.3f}  "
                     f"{target.metric} {value if value is not None else float('nan'):.3f}  "
                     f"workers {len(snap['workers'])}")
            progress.update(task, description="training", stats=stats,
                            completed=min(goal, value) if goal and value is not None else 0)
            time.sleep(0.2)
        coordinator.wait(timeout=30)
    return last


def _demo_keys(workdir: str, workers: int):
    """CURVE key pairs for the demo's coordinator, workers and monitor; the monitor's is an
    operator's (the demo's terminal UI may pause and drain)."""
    from ..common.security import client_keys, generate

    keys, allow = os.path.join(workdir, "keys"), os.path.join(workdir, "allowed")
    operators = os.path.join(workdir, "operators")
    os.makedirs(allow, exist_ok=True)
    os.makedirs(operators, exist_ok=True)
    names = [f"demo-{i + 1}" for i in range(workers)]
    for name in ["coordinator", "monitor", *names]:
        generate(name, keys)
    for name in names:
        shutil.copy(os.path.join(keys, f"{name}.key"), allow)
    shutil.copy(os.path.join(keys, "monitor.key"), operators)
    public = os.path.join(keys, "coordinator.key")

    def worker_flags(i: int) -> list[str]:
        return ["--coordinator-key", public,
                "--secret-key", os.path.join(keys, f"demo-{i}.key_secret")]

    coordinator_flags = ["--secret-key", os.path.join(keys, "coordinator.key_secret"),
                         "--allow-keys", allow, "--operator-keys", operators]
    return (client_keys(public, os.path.join(keys, "monitor.key_secret")), coordinator_flags,
            worker_flags)


def _watch_tui(coordinator, workers, address: str, timeout: float, started: float,
               keys=None) -> dict:
    """The terminal UI until the coordinator exits (or the operator quits: KeyboardInterrupt)."""
    try:
        from ..monitor.app import MonitorApp
    except ImportError as exc:
        raise DemoFailed(f"the terminal UI needs textual ({exc})") from None

    def watch():
        if coordinator.poll() is not None:
            return "finished"
        if time.monotonic() - started > timeout:
            return "timeout"
        codes = [w.poll() for w in workers]
        if None not in codes and any(codes):
            return f"workers exited {codes}"
        return None

    with ZmqStatusSource(address, keys=keys) as source:
        app = MonitorApp(source, interval=0.5, timeout=0.5, watch=watch)
        app.run()
    ended = app.end_message
    if ended is None:  # q: the operator left before the end
        raise KeyboardInterrupt
    if ended == "timeout":
        raise DemoFailed(f"the demo did not finish within {timeout:g}s")
    if ended.startswith("workers exited"):
        raise DemoFailed(f"every worker has exited (exit codes {ended.split(' ', 2)[2]})")
    coordinator.wait(timeout=30)
    return app.snapshot or {}


def _final_metrics(path: str):
    try:
        with open(path) as fh:
            lines = [json.loads(line) for line in fh if line.strip()]
    except (OSError, ValueError):
        return None
    finals = [r for r in lines if r.get("final")]
    return finals[-1] if finals else None


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path) as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError:
        return "(no log)"


def _print_summary(summary: dict, as_json: bool, kept_in) -> None:
    out = Console()
    table = Table(title="idlegrad demo", show_header=False)
    rows = [
        ("target", f"{summary['target']} ({'reached' if summary['reached'] else 'not reached'})"),
        ("test accuracy", f"{summary['test_accuracy']:.4f}" if summary["test_accuracy"] is not None else "-"),
        ("test loss", f"{summary['test_loss']:.4f}" if summary["test_loss"] is not None else "-"),
        ("updates", str(summary["updates"])),
        ("samples", f"{summary['samples']} ({summary['epochs']:.2f} epochs)"),
        ("workers", str(summary["workers"])),
        ("wall time", f"{summary['wall_s']:.2f} s (training {summary['training_s']:.2f} s)"),
    ]
    if kept_in:
        rows.append(("files", kept_in))
    for key, value in rows:
        table.add_row(key, value)
    out.print(table)
    if as_json:
        print(json.dumps(summary), flush=True)
