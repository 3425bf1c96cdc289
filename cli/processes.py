"""Starting idlegrad processes and reaping them by PID, with bounded waits.

Used by the demo and by the integration tests, so both clean up the same way.
"""

from __future__ import annotations

import errno
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


def wait_for_hellos(address: str, names: Sequence[str], processes: Sequence[subprocess.Popen],
                    timeout: float) -> None:
    """Hold a stand-in ROUTER on a coordinator's address until every named worker has said HELLO.

    Workers started first and released this way all join the real coordinator within a moment of
    its bind, instead of seconds apart (a short run could otherwise end before a late worker
    joins). A worker that said HELLO is in its reconnect loop and says it again to the real one.
    Raises RuntimeError when a worker exits first or the deadline passes.
    """
    import zmq

    from ..common import protocol as proto
    from ..common.errors import ProtocolError

    ctx = zmq.Context()
    door = ctx.socket(zmq.ROUTER)
    door.setsockopt(zmq.LINGER, 0)
    door.bind(address)
    try:
        knocking: set[str] = set()
        end = time.monotonic() + timeout
        while knocking != set(names):
            if time.monotonic() > end:
                raise RuntimeError(f"only {sorted(knocking)} of {list(names)} said hello "
                                   f"within {timeout:g}s")
            for proc in processes:
                if proc.poll() is not None:
                    raise RuntimeError(f"a worker (pid {proc.pid}) exited ({proc.returncode}) "
                                       "before saying hello")
            if door.poll(200, zmq.POLLIN):
                try:
                    msg = proto.decode(door.recv_multipart()[1:])
                except ProtocolError:
                    continue
                if isinstance(msg, proto.Hello):
                    knocking.add(msg.worker_id)
    finally:
        door.close(0)
        ctx.term()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_bindable(address: str, what: str) -> None:
    """ConfigError (one line) when a tcp:// `address` is already taken, before a process builds
    anything: a coordinator otherwise found out only when it bound, after building its job.
    Anything else (another transport, a name that does not resolve) is left to the bind."""
    from ..common.errors import ConfigError

    if not address.startswith("tcp://"):
        return
    host, _, port = address[len("tcp://"):].rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return
    host = "" if host in ("*", "") else host.strip("[]")
    try:
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except OSError:
        return
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"cannot bind {what}{address}: {exc.strerror} (is another "
                                  "coordinator running there? choose another port)") from None
