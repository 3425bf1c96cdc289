"""Gradient bytes/s through idlegrad against a bare zero-copy ZeroMQ exchange (issue 7).

One real worker and a real coordinator exchange a model of `--params` float32 parameters (10M and
50M by default): the gradient goes up, is applied, and the model of the new version comes down with
the next task (each round advances the version, so every task carries the model). The job
(`make_job` below, loaded by both sides as `benchmarks/transfer.py:make_job`) is a tiny linear
classifier plus a payload vector that the loss touches lightly, so its gradient is as large as the
model while computing it is little more than writing it: what is measured is the data path.

The worker runs at normal priority (`--no-low-priority`), like the bare pair it is compared with.

The ceiling, in the same run (alternating order across runs): two bare pyzmq processes exchanging
the same bytes the same way, zero-copy from preallocated buffers in frames of at most 16 MiB:
the "worker" keeps two gradients in flight (idlegrad's default credits), the "coordinator" answers
each gradient it receives with a model of the same size. Nothing is decoded, copied or applied.

Over each window it also reads both processes' CPU time (psutil: user and system, all threads)
per step: the bare pair's is nearly all the kernel's copies through loopback TCP; what idlegrad
adds on top is its own passes over the tensors (sum, step, snapshot; load, gradient).

    python benchmarks/transfer.py --runs 3 --json

With `--json` its last line is {"ratio": ..., "gbps": ..., "ceiling_gbps": ..., "by_params": {...}}
(top-level figures for the largest model, medians; GB/s of gradient bytes, 1 GB = 1e9 bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))
from harness import Run, medians, paired_runs, stopped_on_interrupt, windowed_output  # noqa: E402
FRAME = 16 * 1024 * 1024


# the job ----------------------------------------------------------------------------------------


def make_job(params: int = 10_000_000, batch_size: int = 8, lr: float = 1e-3):
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from idlegrad.common.job import Job

    class Payload(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(8, 2)
            self.payload = nn.Parameter(torch.zeros(max(1, params - 18)))

        def forward(self, x):
            # The payload's gradient is dense (every element written) at the cost of a fill.
            return self.head(x) + self.payload.sum() * 0.0

    def datasets():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2048, 8, generator=g)
        y = (x[:, 0] > 0).long()
        return TensorDataset(x[:1536], y[:1536]), TensorDataset(x[1536:], y[1536:])

    def loss(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    return Job(name="transfer", build_model=Payload, build_datasets=datasets, loss=loss,
               build_optimizer=lambda p: torch.optim.SGD(p, lr=lr), batch_size=batch_size)


# the ceiling ------------------------------------------------------------------------------------


def bare_coordinator(address: str, nbytes: int) -> None:
    import zmq

    model = bytearray(nbytes)
    frames = [memoryview(model)[i:i + FRAME] for i in range(0, nbytes, FRAME)]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    try:
        while True:
            got = sock.recv_multipart(copy=False)
            sock.send_multipart([got[0], b"task", *frames], copy=False)
    finally:
        sock.close(0)
        ctx.term()


def bare_worker(address: str, nbytes: int, warmup: float, window: float) -> dict:
    import zmq

    grad = bytearray(nbytes)
    frames = [memoryview(grad)[i:i + FRAME] for i in range(0, nbytes, FRAME)]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        for _ in range(2):  # two credits in flight
            sock.send_multipart([b"result", *frames], copy=False)
        start = time.monotonic()
        counted, t_first = 0, None
        while True:
            sock.recv_multipart(copy=False)
            now = time.monotonic()
            if now - start >= warmup:
                if t_first is None:
                    t_first = now
                    print("open", flush=True)  # the parent reads both processes' CPU
                else:
                    counted += 1
                if now - t_first >= window:
                    print("closed", flush=True)
                    break
            sock.send_multipart([b"result", *frames], copy=False)
        return {"gbps": counted * nbytes / (now - t_first) / 1e9, "exchanges": counted}
    finally:
        sock.close(0)
        ctx.term()


# runs -------------------------------------------------------------------------------------------


def cpu_ms(pids: list[int]) -> tuple[float, float]:
    """User and system CPU milliseconds of these processes, all threads."""
    import psutil

    times = [psutil.Process(pid).cpu_times() for pid in pids]
    return sum(t.user for t in times) * 1e3, sum(t.system for t in times) * 1e3


def measure_ceiling(args, params: int) -> dict:
    from idlegrad.cli.processes import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="idlegrad-transfer-") as tmp, Run(tmp) as run:
        server = run.spawn_python("bare-coordinator", [HERE, "--bare-coordinator", address,
                                                       "--params", params])
        worker = subprocess.Popen([sys.executable, HERE, "--bare-worker", address, "--params",
                                   str(params), "--warmup", str(args.warmup), "--window",
                                   str(args.window)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True)
        cpu = {}

        def on_mark(mark: str) -> None:
            cpu[mark] = cpu_ms([server.pid, worker.pid])

        result = windowed_output(worker, on_mark, timeout=args.warmup + args.window + 120)
    steps = max(1, result["exchanges"])
    return {"gbps": result["gbps"],
            "user_ms": (cpu["closed"][0] - cpu["open"][0]) / steps,
            "system_ms": (cpu["closed"][1] - cpu["open"][1]) / steps}


def measure_idlegrad(args, params: int) -> dict:
    from idlegrad.cli.processes import free_port, wait_for_hellos
    from idlegrad.monitor.source import ZmqStatusSource

    address = f"tcp://127.0.0.1:{free_port()}"
    job = ["--job", f"{HERE}:make_job"]  # its arguments travel to the worker in WELCOME
    with tempfile.TemporaryDirectory(prefix="idlegrad-transfer-") as tmp, Run(tmp) as run:
        worker = run.spawn_idlegrad("worker", [
            "worker", "--coordinator", address, "--id", "w1", *job, "--threads", "1",
            "--device", "cpu", "--no-idle-policy",
            # the bare pair runs at normal priority: so does this worker
            "--no-low-priority", "--connect-timeout", "120", "--log-level", "warning"])
        wait_for_hellos(address, ["w1"], [worker], timeout=120)
        run.spawn_idlegrad("coordinator", [
            "coordinator", "--bind", address, *job, "--job-arg", f"params={params}",
            "--epochs", "100000", "--eval-every", "3600", "--heartbeat", "5", "--threads", "1",
            "--log-level", "warning"])
        with contextlib.closing(ZmqStatusSource(address)) as source:
            def version() -> tuple[float, int]:
                for _ in range(50):
                    snap = source.fetch(timeout=2.0)
                    if snap is not None:
                        return time.monotonic(), int(snap["version"])
                raise RuntimeError("the coordinator does not answer status requests")

            t0, v0 = version()
            while v0 < 1:  # the worker has joined and the first step is done
                time.sleep(0.2)
                t0, v0 = version()
            time.sleep(args.warmup)
            pids = [p.pid for p in run.procs]
            t0, v0 = version()
            cpu0 = cpu_ms(pids)
            time.sleep(args.window)
            t1, v1 = version()
            cpu1 = cpu_ms(pids)
        if v1 <= v0:
            raise RuntimeError(f"no progress in {args.window}s")
        return {"gbps": (v1 - v0) * params * 4 / (t1 - t0) / 1e9,
                "user_ms": (cpu1[0] - cpu0[0]) / (v1 - v0),
                "system_ms": (cpu1[1] - cpu0[1]) / (v1 - v0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000000,50000000", help="model sizes (parameters)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=10.0,
                        help="seconds after the first step before the window opens (buffers "
                             "and pages are first touched then)")
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--params", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--bare-coordinator", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--bare-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_coordinator:
        bare_coordinator(args.bare_coordinator, args.params * 4)
        return
    if args.bare_worker:
        print(json.dumps(bare_worker(args.bare_worker, args.params * 4, args.warmup, args.window)))
        return

    sizes = [int(s) for s in args.sizes.split(",")]
    by_params = {}
    print(f"{'params':>11} {'run':>4} {'idlegrad GB/s':>14} {'ceiling GB/s':>13} {'ratio':>6} "
          f"{'CPU ms/step user+sys':>21} {'(ceiling)':>13}", flush=True)
    measures = {"idlegrad": measure_idlegrad, "ceiling": measure_ceiling}
    with stopped_on_interrupt():
        for params in sizes:
            runs = []
            for i, got in paired_runs(list(measures), args.runs,
                                      lambda kind, i: measures[kind](args, params)):
                ours, bare = got["idlegrad"], got["ceiling"]
                runs.append({"gbps": ours["gbps"], "ceiling_gbps": bare["gbps"],
                             "ratio": ours["gbps"] / bare["gbps"],
                             "user_ms": ours["user_ms"], "system_ms": ours["system_ms"],
                             "ceiling_user_ms": bare["user_ms"],
                             "ceiling_system_ms": bare["system_ms"]})
                r = runs[-1]
                print(f"{params:>11} {i + 1:>4} {r['gbps']:>14.2f} {r['ceiling_gbps']:>13.2f} "
                      f"{r['ratio']:>6.2f} {r['user_ms']:>10.0f}+{r['system_ms']:<10.0f} "
                      f"({r['ceiling_user_ms']:.0f}+{r['ceiling_system_ms']:.0f})", flush=True)
            by_params[str(params)] = medians(runs)
            by_params[str(params)]["runs_ratio"] = [r["ratio"] for r in runs]
    print("\nmedians (CPU: both processes, all threads, per step)")
    for p, r in by_params.items():
        print(f"{int(p):>11,} params: idlegrad {r['gbps']:.2f} GB/s, ceiling "
              f"{r['ceiling_gbps']:.2f} GB/s, ratio {r['ratio']:.2f}; CPU ms per step user "
              f"{r['user_ms']:.0f} + system {r['system_ms']:.0f} (ceiling "
              f"{r['ceiling_user_ms']:.0f} + {r['ceiling_system_ms']:.0f})")
    if args.json:
        top = by_params[str(max(sizes))]
        print(json.dumps({"ratio": top["ratio"], "gbps": top["gbps"],
                          "ceiling_gbps": top["ceiling_gbps"], "by_params": by_params}))


if __name__ == "__main__":
    main()
