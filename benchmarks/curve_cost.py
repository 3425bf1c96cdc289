"""What CurveZMQ costs: gradient throughput over loopback with and without encryption.

A DEALER (the worker's side) sends RESULT messages with a gradient of `--numel` float32 values,
encoded by the real protocol, to a ROUTER (the coordinator's side) that decodes each one and
checks its tensor, as the coordinator does; the sender keeps `--window` messages in flight, each
answered by an ACK. Plain and CURVE (with the ZAP authenticator admitting the client's key) run
alternately, `--repeats` times each, in one process; the table gives the median gradients/s and
MB/s of each and the ratio CURVE / plain.

With --training it also runs `idlegrad demo` (3 workers, digits with a wider hidden layer, a fixed
number of epochs) with and without `--curve`, alternately, and compares training samples/s.

    python benchmarks/curve_cost.py [--numel 1000000] [--messages 200] [--repeats 5] [--training]
        [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import numpy as np
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from idlegrad.common import protocol as proto
from idlegrad.common.tensors import blob_chunks, finite_norm


def run_once(numel: int, messages: int, window: int, curve: bool) -> float:
    """Seconds to move `messages` gradients of `numel` float32 through ROUTER <- DEALER."""
    ctx = zmq.Context()
    auth = None
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    for sock in (router, dealer):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, proto.SOCKET_MAX_MSG_BYTES)
    if curve:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        auth = ThreadAuthenticator(ctx)
        auth.start()

        class Allow:
            def callback(self, domain, key):
                return key == client_public

        auth.configure_curve_callback("*", credentials_provider=Allow())
        router.curve_secretkey, router.curve_publickey, router.curve_server = (
            server_secret, server_public, True)
        dealer.curve_serverkey, dealer.curve_publickey, dealer.curve_secretkey = (
            server_public, client_public, client_secret)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    gradient = np.random.default_rng(0).standard_normal(numel).astype(np.float32)
    frames = proto.encode(proto.Result(
        slot=1, version=0, samples=32, loss=0.5, compute_s=0.1,
        gradient=proto.Blob("float32", numel, (gradient.data,))))
    ack = proto.encode(proto.Ack(slots=[1]))

    def serve():
        for _ in range(messages):
            parts = router.recv_multipart(copy=False)
            msg = proto.decode(parts[1:])
            finite_norm(blob_chunks(msg.gradient, numel))  # size and finiteness, as the coordinator
            router.send_multipart([parts[0].bytes, *ack])

    server = threading.Thread(target=serve)
    # The handshake (and the ZAP round trip) before the clock starts: one message each way.
    dealer.send_multipart(proto.encode(proto.Heartbeat()))
    parts = router.recv_multipart()
    router.send_multipart([parts[0], *ack])
    dealer.recv_multipart()
    server.start()
    t0 = time.perf_counter()
    in_flight = sent = 0
    while sent < messages or in_flight:
        while sent < messages and in_flight < window:
            dealer.send_multipart(frames, copy=False)
            sent += 1
            in_flight += 1
        dealer.recv_multipart()
        in_flight -= 1
    elapsed = time.perf_counter() - t0
    server.join()
    router.close(0)
    dealer.close(0)
    if auth is not None:
        auth.stop()
    ctx.term()
    return elapsed


def demo_rate(curve: bool, epochs: int, hidden: int) -> float:
    """Training samples/s of one `idlegrad demo` run (3 workers), from its JSON summary."""
    import subprocess

    args = [sys.executable, "-m", "idlegrad.cli", "demo", "--workers", "3", "--json",
            "--target", "accuracy=1.01", "--epochs", str(epochs), "--job-arg", f"hidden={hidden}",
            "--log-level", "warning"] + (["--curve"] if curve else [])
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    return summary["samples"] / summary["training_s"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=1_000_000, help="gradient size (float32)")
    parser.add_argument("--messages", type=int, default=200, help="gradients per measurement")
    parser.add_argument("--window", type=int, default=2, help="messages in flight (credits)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--training", action="store_true",
                        help="also compare end-to-end training throughput (idlegrad demo)")
    parser.add_argument("--epochs", type=int, default=20, help="with --training")
    parser.add_argument("--hidden", type=int, default=2048, help="with --training: digits' width")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    times = {"plain": [], "curve": []}
    for _ in range(args.repeats):  # alternate, so both see the same machine
        for mode in ("plain", "curve"):
            times[mode].append(run_once(args.numel, args.messages, args.window, mode == "curve"))
    mb = args.numel * 4 / 1e6
    rows = {}
    for mode, samples in times.items():
        rate = args.messages / statistics.median(samples)
        rows[mode] = {"gradients_per_s": round(rate, 2), "mb_per_s": round(rate * mb, 1),
                      "seconds": [round(s, 3) for s in samples]}
    ratio = rows["curve"]["gradients_per_s"] / rows["plain"]["gradients_per_s"]
    print(f"gradients of {args.numel} float32 ({mb:.1f} MB), {args.messages} per run, "
          f"{args.window} in flight, median of {args.repeats} alternating runs")
    print(f"{'':<6} {'gradients/s':>12} {'MB/s':>8}")
    for mode, row in rows.items():
        print(f"{mode:<6} {row['gradients_per_s']:>12.1f} {row['mb_per_s']:>8.1f}")
    print(f"CURVE / plain throughput: {ratio:.3f}")
    result = {"numel": args.numel, "plain": rows["plain"], "curve": rows["curve"],
              "ratio": round(ratio, 4)}
    if args.training:
        rates = {"plain": [], "curve": []}
        for _ in range(args.repeats):
            for mode in ("plain", "curve"):
                rates[mode].append(demo_rate(mode == "curve", args.epochs, args.hidden))
        medians = {m: statistics.median(r) for m, r in rates.items()}
        training_ratio = medians["curve"] / medians["plain"]
        print(f"training (demo, 3 workers, digits hidden={args.hidden}, {args.epochs} epochs): "
              f"plain {medians['plain']:.0f} samples/s, curve {medians['curve']:.0f} samples/s, "
              f"ratio {training_ratio:.3f}")
        result["training"] = {"plain_samples_per_s": [round(r, 1) for r in rates["plain"]],
                              "curve_samples_per_s": [round(r, 1) for r in rates["curve"]],
                              "ratio": round(training_ratio, 4)}
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
