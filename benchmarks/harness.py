"""What the side-by-side benchmarks share: their processes, the order of their runs, their medians.

A benchmark script imports it as `from harness import ...` (each script puts its own folder on
sys.path first): the benchmarks are scripts, not a package.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence


class Run:
    """The processes of one measurement, with their logs under `directory`; `close` stops and
    reaps every one by PID."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []
        # a user's worker config (~/.config/idlegrad) must not change what is measured
        self.env = dict(os.environ, XDG_CONFIG_HOME=str(self.dir / "xdg-config"))

    def spawn_idlegrad(self, name: str, args: list) -> subprocess.Popen:
        from idlegrad.cli.processes import spawn

        log = open(self.dir / f"{name}-{len(self.procs)}.log", "w")
        self.logs.append(log)
        proc = spawn([str(a) for a in args], log=log, env=self.env)
        self.procs.append(proc)
        return proc

    def spawn_python(self, name: str, args: list) -> subprocess.Popen:
        log = open(self.dir / f"{name}.log", "w")
        self.logs.append(log)
        proc = subprocess.Popen([sys.executable, *map(str, args)], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        from idlegrad.cli.processes import stop

        try:
            for proc in self.procs:  # a SIGSTOPped process would ignore SIGTERM
                if proc.poll() is None:
                    try:
                        os.kill(proc.pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
            stop(self.procs, grace=5.0)
        finally:
            for log in self.logs:
                log.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def side_by_side(candidates: Sequence[str], runs: int,
                 measure: Callable[[str, int], dict]) -> Iterator[tuple[int, str, dict]]:
    """(run index, candidate, its measurement), every candidate measured once per run.

    The order alternates from one run to the next: this machine's state drifts, and each
    candidate then sees as much of it first as last."""
    for i in range(runs):
        for candidate in (candidates if i % 2 == 0 else list(reversed(candidates))):
            yield i, candidate, measure(candidate, i)


def paired_runs(candidates: Sequence[str], runs: int,
                measure: Callable[[str, int], dict]) -> Iterator[tuple[int, dict[str, dict]]]:
    """`side_by_side`, one run at a time: (run index, {candidate: measurement})."""
    got: dict[str, dict] = {}
    for i, candidate, result in side_by_side(candidates, runs, measure):
        got[candidate] = result
        if len(got) == len(candidates):
            yield i, got
            got = {}


@contextlib.contextmanager
def stopped_on_interrupt() -> Iterator[None]:
    """Ctrl-C or SIGTERM ends the benchmark with one line and status 130. Each measurement stops
    its own processes on the way out (`Run.close` in a finally), so none is left behind."""
    def on_term(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    except KeyboardInterrupt:
        print("interrupted: every process started was stopped", file=sys.stderr)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)


def windowed_output(proc: subprocess.Popen, on_mark: Callable[[str], None],
                    timeout: float) -> dict:
    """Read a measuring child to its end and return the JSON of its last line.

    The child (started with text stdout and stderr pipes) prints "open" and "closed" at the edges
    of its counted window; `on_mark` is called with each, so the caller can read CPU counters
    there. Raises RuntimeError with the end of its stderr if it fails; the child is reaped."""
    lines = []
    try:
        for line in proc.stdout:  # ends when the child exits (its own loop is bounded)
            line = line.strip()
            if line in ("open", "closed"):
                on_mark(line)
            elif line:
                lines.append(line)
        if proc.wait(timeout=timeout) != 0 or not lines:
            raise RuntimeError(f"{proc.args[1:3]} failed: {proc.stderr.read()[-2000:]}")
        return json.loads(lines[-1])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()


def medians(rows: Sequence[dict], keys: Optional[Sequence[str]] = None) -> dict:
    """Per key, the median over `rows` (the keys of the first row by default)."""
    return {k: statistics.median(r[k] for r in rows) for k in (keys or rows[0])}


def read_metrics(path: Path) -> list[dict]:
    """The JSON lines of a coordinator's metrics file (a torn last line is skipped)."""
    if not path.exists():
        return []
    out = []
    with open(path) as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def curve(records: list[dict]) -> list[tuple[float, float]]:
    """(seconds since training started, test accuracy) of every evaluated record."""
    return [(float(r["elapsed"]), float(r["metrics"]["accuracy"])) for r in records
            if (r.get("metrics") or {}).get("accuracy") is not None]


def med(values):
    """The median of the values that are not None; None when there are none."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v, spec=".2f", none="-"):
    return none if v is None else format(v, spec)
