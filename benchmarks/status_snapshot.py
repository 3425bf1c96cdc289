"""What a status snapshot costs the coordinator with N registered workers (no sockets).

Builds a real `Coordinator` (job `synthetic`), registers N workers through its scheduler, lets half
of them answer a slot, fills the event ring and the curve, then times `snapshot()` plus encoding
the `status` message, best of R runs:

    python benchmarks/status_snapshot.py --workers 1000
"""

from __future__ import annotations

import argparse
import time

from idlegrad.common import protocol as proto
from idlegrad.coordinator.server import Coordinator, CoordinatorConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()

    c = Coordinator(CoordinatorConfig(job="synthetic", threads=1))
    s = c.scheduler
    now = time.monotonic()
    for i in range(args.workers):
        wid = f"worker-{i:05d}"
        s.join(wid, {"host": f"host-{i}", "cores": 8, "threads": 8, "device": "cpu",
                     "memory_mb": 16000, "versions": {}, "job": None}, now)
        c.training.event("join", f"{wid} joined from host-{i} (cpu, 8 threads)", worker=wid)
        s.ready(wid, 2, now)
    for i in range(0, args.workers, 2):
        w = s.workers[f"worker-{i:05d}"]
        if w.assigned:
            s.result(w.id, next(iter(w.assigned)), 0.5, now)
    for v in range(300):
        c.training.curve.append({"t": float(v), "version": v, "samples": v * 64, "loss": 1.0,
                        "metrics": {"accuracy": 0.5, "loss": 1.0}})
    times, size = [], 0
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        frames = proto.encode(proto.Status(snapshot=c.snapshot(cursor=0)))
        times.append(time.perf_counter() - t0)
        size = len(frames[0])
    times.sort()
    print(f"{args.workers} workers: snapshot + encode best {times[0] * 1e3:.2f} ms, "
          f"median {times[len(times) // 2] * 1e3:.2f} ms, {size / 1024:.0f} KiB "
          f"(header limit {proto.MAX_HEADER_BYTES // 1024} KiB)")


if __name__ == "__main__":
    main()
