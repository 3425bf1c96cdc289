"""The integration tests' harness: real coordinator and worker processes on loopback.

Every process is started through `idlegrad.cli.processes.spawn` (`python -m idlegrad.cli ...`),
logs to its own file under the test's tmp_path, and is stopped and reaped by PID in the
`cluster` fixture's finalizer (`idlegrad.cli.processes.stop`: SIGTERM, bounded grace, SIGKILL),
whatever the test did. When a test fails, the tail of every process's log is attached to the
failure report. Every wait is a bounded loop against a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from idlegrad.cli.processes import free_port, spawn, stop, wait_for_hellos
from idlegrad.monitor.source import ZmqStatusSource

# Generous deadlines: the suite runs on 2 shared cores, where starting a process (importing torch)
# alone can take several seconds. Expected runtimes are far shorter.
DEADLINE = float(os.environ.get("IDLEGRAD_IT_DEADLINE", "120"))
POLL_S = 0.15
TAIL_LINES = 40

# What every process gets: one torch thread, quick liveness on the coordinator.
COORDINATOR_DEFAULTS = ("--threads", "1", "--heartbeat", "0.5")
# The idle policy is off (the machine is busy with the test's own processes): test_yield.py
# turns it on for the workers it tests.
WORKER_DEFAULTS = ("--threads", "1", "--device", "cpu", "--no-idle-policy")


# A line of idlegrad's logging (cli.main._setup_logging): "HH:MM:SS[.mmm] idlegrad.x LEVEL text".
LOG_RECORD = re.compile(r"^\d\d:\d\d:\d\d(\.\d+)? \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


class Proc:
    """One idlegrad process and its log file."""

    def __init__(self, name: str, args: list[str], log_path: Path, env: Optional[dict] = None):
        self.name = name
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.popen: subprocess.Popen = spawn(args, log=self._log, env=env)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> Optional[int]:
        return self.popen.poll()

    def running(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def lines(self) -> list[str]:
        return [line for line in self.output().splitlines() if line.strip()]

    def said(self) -> list[str]:
        """What it printed apart from its log records (timestamped lines): errors, summaries."""
        return [line for line in self.lines() if not LOG_RECORD.match(line)]

    def tail(self, n: int = TAIL_LINES) -> str:
        return "\n".join(self.output().splitlines()[-n:])

    def wait(self, timeout: float = DEADLINE) -> int:
        """The exit status, waiting at most `timeout` seconds (the process is left running)."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} (pid {self.pid}) did not exit within {timeout:g}s; "
                                 f"its log ends with:\n{self.tail(15)}") from None

    def kill9(self) -> None:
        """SIGKILL, and reap it."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=10)

    def close_log(self) -> None:
        self._log.close()


class Status:
    """A coordinator's status endpoint, polled; keeps every event seen across snapshots.

    Make a new one per coordinator process: event ids restart with the process.
    """

    def __init__(self, address: str, keys=None):
        self.address = address
        self.source = ZmqStatusSource(address, keys=keys)
        self.events: list[dict] = []
        self.last: Optional[dict] = None
        self.first: Optional[dict] = None

    def fetch(self, timeout: float = 1.0) -> Optional[dict]:
        snap = self.source.fetch(timeout=timeout)
        if snap is not None:
            self.events.extend(snap.get("events", []))
            self.last = snap
            if self.first is None:
                self.first = snap
        return snap

    def wait_for(self, predicate: Callable[[dict], bool], what: str, timeout: float = DEADLINE,
                 alive: Iterable[Proc] = ()) -> dict:
        """Poll until a snapshot satisfies `predicate`; fail at the deadline or when one of the
        `alive` processes exits first."""
        alive = list(alive)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            snap = self.fetch(timeout=0.5)
            if snap is not None and predicate(snap):
                return snap
            for proc in alive:
                if not proc.running():
                    raise AssertionError(f"{proc.name} exited ({proc.returncode}) while waiting "
                                         f"for {what}; last status: {summarize(self.last)}")
            time.sleep(POLL_S)
        raise AssertionError(f"no {what} within {timeout:g}s; last status: {summarize(self.last)}")

    def follow(self, proc: Proc, timeout: float = DEADLINE,
               each: Optional[Callable[[dict], None]] = None) -> int:
        """Keep polling (to see events up to the end) until `proc` exits; its exit status.
        `each` is called with every snapshot on the way."""
        end = time.monotonic() + timeout
        while proc.running():
            if time.monotonic() > end:
                raise AssertionError(f"{proc.name} did not exit within {timeout:g}s; last status: "
                                     f"{summarize(self.last)}")
            snap = self.fetch(timeout=0.3)
            if snap is not None and each is not None:
                each(snap)
            time.sleep(POLL_S)
        return proc.wait(timeout=10)

    def events_of(self, kind: str, worker: Optional[str] = None) -> list[dict]:
        return [e for e in self.events
                if e.get("kind") == kind and (worker is None or e.get("worker") == worker)]

    def close(self) -> None:
        self.source.close()


def until(predicate: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    """Poll until `predicate()` holds (a line in a log, a process gone); fail at the deadline.
    The wait for a condition that a fixed sleep would only hope for."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"no {what} within {timeout:g}s")
        time.sleep(POLL_S)


def summarize(snap: Optional[dict]) -> str:
    if snap is None:
        return "(none: the coordinator never answered)"
    keep = ("state", "version", "samples", "epoch", "metrics", "rounds", "counters", "bad_messages")
    brief = {k: snap.get(k) for k in keep}
    brief["workers"] = [(w["id"], w["done"], w["assigned"]) for w in snap.get("workers", [])]
    return json.dumps(brief, default=str)


class Cluster:
    """Starts idlegrad processes for one test and reaps them all at the end."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[Proc] = []
        self._statuses: list[Status] = []
        # No configuration file or cache of whoever runs the tests (~/.config/idlegrad/worker.toml).
        self.env = dict(os.environ, XDG_CONFIG_HOME=str(directory / "xdg-config"),
                        XDG_CACHE_HOME=str(directory / "xdg-cache"))

    def spawn(self, name: str, *args: str) -> Proc:
        taken = {p.name for p in self.procs}
        unique, n = name, 1
        while unique in taken:
            n += 1
            unique = f"{name}-{n}"
        proc = Proc(unique, [str(a) for a in args], self.dir / f"{unique}.log", env=self.env)
        self.procs.append(proc)
        return proc

    def coordinator(self, *args: str, name: str = "coordinator") -> Proc:
        return self.spawn(name, "coordinator", "--bind", self.address, *COORDINATOR_DEFAULTS, *args)

    def worker(self, name: str, *args: str, connect_timeout: float = 60) -> Proc:
        return self.spawn(name, "worker", "--coordinator", self.address, "--id", name,
                          "--connect-timeout", f"{connect_timeout:g}", *WORKER_DEFAULTS, *args)

    def start_together(self, coordinator_args: Iterable[str], worker_names: Iterable[str],
                       worker_args: Iterable[str] = (),
                       others: Iterable[tuple[str, Sequence[str]]] = ()) -> tuple[Proc, list[Proc]]:
        """Workers first, then the coordinator once every worker is knocking: so that they all
        join within a moment of each other, not seconds apart (a short training run could be
        over before a late worker joins, which would then wait for a coordinator that is gone).
        `others`: (name, args) of workers with arguments of their own (a hostile one), started
        with the rest and returned after them.

        A stand-in ROUTER on the coordinator's address receives (and ignores) the workers' HELLOs;
        a worker that said HELLO is in its reconnect loop and will send the next one to the real
        coordinator as soon as it listens.
        """
        worker_args = list(worker_args)
        started = [(name, worker_args) for name in worker_names] + list(others)
        names = [name for name, _ in started]
        workers = [self.worker(name, *args) for name, args in started]
        try:
            wait_for_hellos(self.address, names, [w.popen for w in workers], DEADLINE)
        except RuntimeError as exc:
            tails = "\n".join(f"{w.name}:\n{w.tail(15)}" for w in workers)
            raise AssertionError(f"{exc}\n{tails}") from None
        return self.coordinator(*coordinator_args), workers

    def status(self, address: Optional[str] = None, keys=None) -> Status:
        status = Status(address or self.address, keys=keys)
        self._statuses.append(status)
        return status

    def report(self) -> str:
        parts = [f"logs in {self.dir}"]
        for proc in self.procs:
            parts.append(f"----- {proc.name} (pid {proc.pid}, exit {proc.returncode}): "
                         f"{' '.join(proc.args[:2])} ... last {TAIL_LINES} lines -----")
            parts.append(proc.tail())
        return "\n".join(parts)

    def assert_no_tracebacks(self) -> None:
        for proc in self.procs:
            assert "Traceback" not in proc.output(), f"{proc.name} logged a traceback:\n{proc.tail()}"

    def close(self) -> None:
        try:
            stop([p.popen for p in self.procs], grace=5.0)
        finally:
            for proc in self.procs:
                proc.close_log()
            for status in self._statuses:
                status.close()


def read_metrics(path: Path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def final_metrics(path: Path) -> dict:
    records = read_metrics(path)
    assert records, f"{path} is empty"
    final = records[-1]
    assert final.get("final") is True, f"the last line of {path} is not final: {final}"
    return final

