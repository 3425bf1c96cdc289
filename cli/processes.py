"""Starting idlegrad processes and reaping them by PID, with bounded waits.

Used by the demo and by the integration tests, so both clean up the same way.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import IO, Optional, Sequence


def idlegrad_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "idlegrad.cli", *args]


def spawn(args: Sequence[str], log: Optional[IO] = None, env: Optional[dict] = None) -> subprocess.Popen:
    """Start `idlegrad ARGS...` in its own process group, output to `log` (or discarded)."""
    out = log if log is not None else subprocess.DEVNULL
    return subprocess.Popen(idlegrad_command(*args), stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)


def stop(processes: Sequence[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM, wait up to `grace` seconds, then SIGKILL whatever is left, and reap all."""
    for proc in processes:
        if proc.poll() is None:
            _signal(proc, signal.SIGTERM)
    end = time.monotonic() + grace
    for proc in processes:
        try:
            proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in processes:
        if proc.poll() is None:
            _signal(proc, signal.SIGKILL)
            proc.wait(timeout=10)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
