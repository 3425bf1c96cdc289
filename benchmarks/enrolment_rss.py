"""A coordinator's RSS (--enrolled) before and after 4 messages of 70,000 frames of 4000 bytes on
its enrolment port (issue 27 item 6: ZMQ_MAXMSGSIZE bounds a frame, not a message).

    PYTHONPATH=. python3 benchmarks/enrolment_rss.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

from idlegrad.common import security
from idlegrad.coordinator import enrolment
from tests.integration.hostile_peers import two_free_ports

MESSAGES, FRAMES, FRAME_BYTES = 4, 70_000, 4000


def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    return -1


def main() -> None:
    d = Path(tempfile.mkdtemp())
    port = two_free_ports()
    for sub in ("keys", "allow"):
        (d / sub).mkdir()
    security.generate("coord", str(d / "keys"))
    store = enrolment.Store(str(d / "enrolled")).prepare()
    server_key = security.load_keypair(str(d / "keys" / "coord.key_secret"))[0]
    proc = subprocess.Popen(
        [sys.executable, "-m", "idlegrad.cli", "coordinator", "--bind", f"tcp://127.0.0.1:{port}",
         "--threads", "1", "--job", "digits", "--epochs", "500",
         "--secret-key", str(d / "keys" / "coord.key_secret"), "--allow-keys", str(d / "allow"),
         "--enrolled", store.dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ctx = zmq.Context()
    try:
        time.sleep(12)  # started, torch imported
        before = rss_mib(proc.pid)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_key, public, secret
        sock.connect(f"tcp://127.0.0.1:{port + 1}")
        frame = b"x" * FRAME_BYTES
        started = time.monotonic()
        for _ in range(MESSAGES):
            for _ in range(FRAMES):
                sock.send(frame, zmq.SNDMORE)
            sock.send(b"end")
        time.sleep(5)
        print(f"sent {MESSAGES} x {FRAMES} frames of {FRAME_BYTES} B in "
              f"{time.monotonic() - started:.1f}s; coordinator RSS {before} MiB -> "
              f"{rss_mib(proc.pid)} MiB; alive={proc.poll() is None}")
        sock.close(0)
    finally:
        ctx.term()
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
