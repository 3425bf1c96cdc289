"""What a flood of results for slots their sender does not hold costs the coordinator (issue 27
item 5). No sockets: a real `Coordinator` (job `synthetic` of P parameters) is handed, as its
socket would hand them, a hello and a ready from one peer, then N results of honest size for
slot ids it was never dealt; the time per result is what such a flood takes from the loop.

    PYTHONPATH=. python3 benchmarks/unheld_results.py --params 1000000 --results 200
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from idlegrad.common import protocol as proto
from idlegrad.coordinator.server import Coordinator, CoordinatorConfig


class Discard:
    """The coordinator's transport, sending nowhere."""

    handling = False

    def __init__(self):
        self.sent = 0

    async def send(self, route: bytes, frames: list, track: bool):
        self.sent += 1


async def flood(c: Coordinator, results: int) -> float:
    params = c.training.model.model.numel  # about --params: the model's own count
    route = b"flooder"
    hello = proto.Hello(worker_id="flooder", host="here", cores=1, threads=1, device="cpu",
                        memory_mb=1, versions={})
    await c.handle([route, *proto.encode(hello)])
    ready = proto.Ready(credits=1, fingerprint=c.training.fingerprint)
    await c.handle([route, *proto.encode(ready)])
    gradient = np.random.default_rng(0).standard_normal(params).astype("<f4").tobytes()
    messages = [[route, *proto.encode(proto.Result(
        slot=10_000_000 + i, version=0, samples=16, loss=0.5, compute_s=0.01,
        gradient=proto.Blob("float32", params, (gradient,))))] for i in range(results)]
    start = time.perf_counter()
    for frames in messages:
        await c.handle(frames)
    return (time.perf_counter() - start) / results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--results", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    best = float("inf")
    for _ in range(args.repeat):
        c = Coordinator(CoordinatorConfig(job="synthetic", threads=1,
                                          job_args={"params": args.params, "batch_size": 16}))
        c.transport = Discard()
        c.open_logs()
        best = min(best, asyncio.run(flood(c, args.results)))
        c.records.close()
        c.training.close()
    print(f"{args.results} results for slots not held, {args.params:,} parameters "
          f"({args.params * 4 / 2**20:.1f} MiB each): {best * 1e6:.0f} us per result "
          f"(best of {args.repeat}), {1 / best:,.0f} results/s")


if __name__ == "__main__":
    main()
