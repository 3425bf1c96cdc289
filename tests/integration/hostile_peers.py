"""Hostile peers of a real coordinator, shared by the integration tests and
benchmarks/hostile.py: raw ZeroMQ clients that speak the protocol wrongly on purpose, and a real
worker whose outgoing messages are rewritten to lie.

    python -m tests.integration.hostile_peers lie fake_eval -- worker --coordinator ADDR ...
    python -m tests.integration.hostile_peers flood ready --names 16 --coordinator ADDR ...
    python -m tests.integration.hostile_peers stranger --coordinator ADDR --server-key FILE

`lie`: the real worker (idlegrad.cli), with `protocol.encode` wrapped so that each message it
sends passes through one of `LIES` first (the daemon encodes every message through that module
attribute). `flood`: one key saying hello under several names, each asking for work
(`ready`: credits=1024 and never computing; `fetch`: chunk requests for a blob; `unheld`:
results of honest size for slot ids never dealt to it). `stranger`: idle TCP connections to both
endpoints and forged enrolments without a token. Each runs until SIGTERM (the caller reaps it by
PID) or --seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import sys
import time
from typing import Callable, Optional

import msgpack
import zmq

from idlegrad.common import protocol as proto
from idlegrad.common.security import client_keys, load_public


def packb(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def hello(worker_id: str) -> proto.Hello:
    return proto.Hello(worker_id=worker_id, host="nowhere", cores=1, threads=1, device="cpu",
                       memory_mb=1, versions={"protocol": str(proto.PROTOCOL_VERSION)})


def recv(sock: zmq.Socket, kind: type, timeout: float = 10.0) -> Optional[proto.Message]:
    """The next message of `kind` on `sock` within `timeout`, skipping others; None if none."""
    end = time.monotonic() + timeout
    while (left := end - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
            break
        msg = proto.decode(sock.recv_multipart())
        if isinstance(msg, kind):
            return msg
    return None


def two_free_ports() -> int:
    """A port whose successor (the enrolment endpoint) is free too."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise AssertionError("no two adjacent free ports")


def curve_dealer(ctx: zmq.Context, server_key: bytes, source: str, port: int) -> zmq.Socket:
    """A DEALER with a fresh key pair of its own, connected from `source` to 127.0.0.1:`port`;
    cut, it comes back (a flood that renews itself)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 500)
    public, secret = zmq.curve_keypair()
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_key, public, secret
    sock.connect(f"tcp://{source}:0;127.0.0.1:{port}")
    return sock


# a real worker that lies ------------------------------------------------------------------------


def _fake_eval(msg: proto.Message) -> proto.Message:
    """Evaluation sums of honest shape saying the model is perfect: every sample right, no loss."""
    if not isinstance(msg, proto.EvalResult):
        return msg
    sums = {name: [float(count) if name == "accuracy" else 0.0, float(count)]
            for name, (_, count) in msg.sums.items()}
    return dataclasses.replace(msg, sums=sums)


def _eval_missing_metric(msg: proto.Message) -> proto.Message:
    """Evaluation sums without the target's metric (accuracy)."""
    if not isinstance(msg, proto.EvalResult):
        return msg
    return dataclasses.replace(msg, sums={k: v for k, v in msg.sums.items() if k != "accuracy"})


def _compute_s(msg: proto.Message) -> proto.Message:
    """Honest results claiming an hour of compute each (for the credits)."""
    if isinstance(msg, (proto.Result, proto.EvalResult)):
        return dataclasses.replace(msg, compute_s=3600.0 + 1000.0 * msg.compute_s)
    return msg


LIES: dict[str, Callable[[proto.Message], proto.Message]] = {
    "fake_eval": _fake_eval, "eval_missing_metric": _eval_missing_metric, "compute_s": _compute_s}


def lying_worker(lie: str, argv: list[str]) -> int:
    """The real `idlegrad worker ARGV...` in this process, every message it sends rewritten by
    `LIES[lie]` on its way to the wire."""
    from idlegrad.cli.main import main

    rewrite, honest_encode = LIES[lie], proto.encode
    proto.encode = lambda msg, *a, **kw: honest_encode(rewrite(msg), *a, **kw)  # type: ignore
    return main(argv)


# raw peers --------------------------------------------------------------------------------------


class _Stop:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.stopped = False
        signal.signal(signal.SIGTERM, self._on)
        signal.signal(signal.SIGINT, self._on)

    def _on(self, *_):
        self.stopped = True

    def __bool__(self) -> bool:
        return self.stopped or time.monotonic() > self.end


def flood(mode: str, address: str, server_key: Optional[str], secret_key: Optional[str],
          names: list[str], rate: float, numel: int, seconds: float) -> dict:
    """One key (`secret_key`) under every name of `names`, each asking for work in `mode` at
    about `rate` messages a second in all; heartbeats keep every name alive. What it heard."""
    import numpy as np

    stop = _Stop(seconds)
    ctx = zmq.Context()
    keys = client_keys(server_key, secret_key)
    heard: dict[str, int] = {}
    socks: dict[str, zmq.Socket] = {}
    try:
        for name in names:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                keys.apply(sock)
            sock.connect(address)
            sock.send_multipart(proto.encode(hello(name)))
            socks[name] = sock
        welcomed: dict[str, proto.Welcome] = {}
        end = time.monotonic() + 30
        while len(welcomed) < len(socks) and time.monotonic() < end and not stop:
            for name, sock in socks.items():
                while name not in welcomed and sock.poll(0):
                    msg = proto.decode(sock.recv_multipart())
                    heard[type(msg).__name__] = heard.get(type(msg).__name__, 0) + 1
                    if isinstance(msg, proto.Welcome):
                        welcomed[name] = msg
            time.sleep(0.05)
        for name, welcome in welcomed.items():
            credits = 1024 if mode == "ready" else 1
            socks[name].send_multipart(proto.encode(proto.Ready(credits=credits,
                                                                fingerprint=welcome.fingerprint)))
        live = [socks[name] for name in welcomed]
        gradient = np.random.default_rng(0).standard_normal(numel).astype("<f4").tobytes()
        sent, next_beat, slot, started = 0, 0.0, 10_000_000, time.monotonic()
        while not stop and live:
            now = time.monotonic()
            if now >= next_beat:
                for sock in live:
                    sock.send_multipart(proto.encode(proto.Heartbeat(state="working")))
                next_beat = now + 0.3
            due = int((now - started) * rate) - sent if mode != "ready" else 0
            for _ in range(max(0, min(due, 50))):
                sock = live[sent % len(live)]
                if mode == "fetch":
                    msg: proto.Message = proto.Fetch(request=sent, sha256="0" * 64, offset=0,
                                                      length=1 << 20)
                else:
                    slot += 1
                    msg = proto.Result(slot=slot, version=0, samples=32, loss=0.5,
                                       compute_s=0.01,
                                       gradient=proto.Blob("float32", numel, (gradient,)))
                sock.send_multipart(proto.encode(msg), copy=False)
                sent += 1
            for sock in live:
                while sock.poll(0):
                    frames = sock.recv_multipart()
                    try:
                        kind = type(proto.decode(frames)).__name__
                    except Exception:
                        kind = "undecodable"
                    heard[kind] = heard.get(kind, 0) + 1
            time.sleep(0.01)
        return {"welcomed": len(welcomed), "sent": sent, "heard": heard}
    finally:
        ctx.destroy(linger=0)


def stranger(address: str, server_key_file: str, idle: int, forgers: int, seconds: float) -> dict:
    """No key the coordinator knows: `idle` TCP connections to the training endpoint and to the
    enrolment endpoint (port + 1) that never speak, and `forgers` CURVE peers sending forged
    enrolments (an invented invitation, a wrong secret) every second."""
    stop = _Stop(seconds)
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    server_key = load_public(server_key_file, "--coordinator-key")
    conns = []
    for i in range(idle):
        try:
            conns.append(socket.create_connection((host, int(port) + i % 2), timeout=5))
        except OSError:
            pass
    ctx = zmq.Context()
    sent = answered = 0
    try:
        socks = [curve_dealer(ctx, server_key, "127.0.0.1", int(port) + 1) for _ in range(forgers)]
        forged = proto.encode(proto.Enrol(invitation="0" * 16, secret="A" * 43))
        while not stop:
            for sock in socks:
                sock.send_multipart(forged)
                sent += 1
                while sock.poll(0):
                    sock.recv_multipart()
                    answered += 1
            for _ in range(10):
                if stop:
                    break
                time.sleep(0.1)
        return {"idle": len(conns), "forged": sent, "answered": answered}
    finally:
        ctx.destroy(linger=0)
        for conn in conns:
            conn.close()


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lie"]:
        if len(argv) < 3 or argv[1] not in LIES or argv[2] != "--":
            print(f"usage: lie {{{','.join(LIES)}}} -- worker ARGS...", file=sys.stderr)
            return 2
        return lying_worker(argv[1], argv[3:])
    parser = argparse.ArgumentParser(prog="hostile_peers")
    sub = parser.add_subparsers(dest="what", required=True)
    f = sub.add_parser("flood")
    f.add_argument("mode", choices=["ready", "fetch", "unheld"])
    f.add_argument("--names", type=int, default=16)
    f.add_argument("--name-prefix", default="flood")
    f.add_argument("--rate", type=float, default=100.0)
    f.add_argument("--numel", type=int, default=0)
    s = sub.add_parser("stranger")
    s.add_argument("--idle", type=int, default=100)
    s.add_argument("--forgers", type=int, default=8)
    for p in (f, s):
        p.add_argument("--coordinator", required=True)
        p.add_argument("--coordinator-key")
        p.add_argument("--seconds", type=float, default=600.0)
        p.add_argument("--nice", type=int, default=0, help="os.nice() first (an attacker's CPU)")
    f.add_argument("--secret-key")
    args = parser.parse_args(argv)
    if args.nice:
        os.nice(args.nice)
    if args.what == "flood":
        names = [f"{args.name_prefix}{i}" for i in range(args.names)]
        out = flood(args.mode, args.coordinator, args.coordinator_key, args.secret_key, names,
                    args.rate, args.numel, args.seconds)
    else:
        out = stranger(args.coordinator, args.coordinator_key, args.idle, args.forgers,
                       args.seconds)
    print(out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
