"""Coordinator memory and descriptors under churn (issue 7): they must stay flat.

A real coordinator (job `synthetic`, a small model) is fed by one swarm process of simulated
workers (DEALER sockets that say hello, announce credits, heart-beat and answer every task at once
with a gradient). Every `--period` seconds a fraction of them leaves, each in one of the ways real
workers leave: a BYE, a silent vanish (the coordinator evicts it after its liveness window), or a
reconnect under the same id from a new socket; as many new workers (fresh ids) join. This goes on
for `--minutes`; the coordinator's RSS and open descriptors are sampled every `--sample-every`
seconds.

    python benchmarks/churn.py --minutes 10 --json

It prints the samples and, comparing the median of the first and the last fifth of the run (after
a warm-up minute), the growth of RSS and descriptors. With `--json` its last line is
{"rss_mb": [...], "fds": [...], "rss_growth_mb": ..., "fds_growth": ..., "joins": ..., ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
PARAMS = 20_000


def model_numel() -> int:
    """The coordinator's model size (`synthetic` rounds `params` to a width): a gradient of any
    other size is malformed, and repeated offences get a worker banned."""
    from idlegrad.common.builtin_jobs import synthetic

    return sum(p.numel() for p in synthetic(params=PARAMS).build_model().parameters())


def swarm(address: str, workers: int, seconds: float, period: float, fraction: float,
          seed: int, task_s: float) -> dict:
    import heapq
    import itertools

    import zmq

    from idlegrad.common import protocol as proto

    rng = random.Random(seed)
    ctx = zmq.Context()
    poller = zmq.Poller()
    live: dict[str, zmq.Socket] = {}
    owner: dict[zmq.Socket, str] = {}
    counts = {"joins": 0, "byes": 0, "vanished": 0, "reconnects": 0, "results": 0}
    serial = 0
    numel = model_numel()
    gradient = proto.Blob("float32", numel, (bytes(4 * numel),))
    beat = proto.encode(proto.Heartbeat(state="working"))
    order = itertools.count()  # ties in `due` never compare sockets
    due: list = []  # (when, serial, socket, result frames): answers wait `task_s` (a slot's work)

    def join(worker_id: str) -> None:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(address)
        s.send_multipart(proto.encode(proto.Hello(
            worker_id=worker_id, host="swarm", cores=1, threads=1, device="cpu", memory_mb=1,
            versions={})))
        poller.register(s, zmq.POLLIN)
        live[worker_id] = s
        owner[s] = worker_id
        counts["joins"] += 1

    def drop(worker_id: str, bye: bool) -> None:
        s = live.pop(worker_id)
        del owner[s]
        if bye:
            s.send_multipart(proto.encode(proto.Bye(reason="churn")))
        poller.unregister(s)
        s.close(100 if bye else 0)

    try:
        for _ in range(workers):
            serial += 1
            join(f"churn-{serial:06d}")
        end = time.monotonic() + seconds
        next_churn = time.monotonic() + period
        next_beat = time.monotonic()
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_beat:
                for s in live.values():
                    s.send_multipart(beat)
                next_beat = now + 0.5
            if now >= next_churn:
                for worker_id in rng.sample(sorted(live), max(1, int(len(live) * fraction))):
                    way = rng.choice(("bye", "vanish", "reconnect"))
                    drop(worker_id, bye=way == "bye")
                    if way == "reconnect":
                        counts["reconnects"] += 1
                        join(worker_id)
                    else:
                        counts["byes" if way == "bye" else "vanished"] += 1
                        serial += 1
                        join(f"churn-{serial:06d}")
                next_churn = now + period
            while due and due[0][0] <= now:
                _, _, sock, frames = heapq.heappop(due)
                if sock in owner:  # it may have left meanwhile
                    sock.send_multipart(frames, copy=False)
                    counts["results"] += 1
            wait = 100 if not due else max(0, min(100, int((due[0][0] - now) * 1000)))
            for sock, _ in poller.poll(timeout=wait):
                while sock in owner:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    msg = proto.decode(frames)
                    if isinstance(msg, proto.Welcome):
                        sock.send_multipart(proto.encode(proto.Ready(
                            credits=2, fingerprint=msg.fingerprint)))
                    elif isinstance(msg, proto.Task):
                        heapq.heappush(due, (time.monotonic() + task_s * rng.uniform(0.5, 1.5),
                                             next(order), sock, proto.encode(proto.Result(
                                                 slot=msg.slot, version=msg.version,
                                                 samples=sum(p[2] for p in msg.parts), loss=0.0,
                                                 compute_s=task_s, gradient=gradient))))
                    elif isinstance(msg, proto.Reject):  # evicted while it was silent: rejoin
                        worker_id = owner[sock]
                        drop(worker_id, bye=False)
                        join(worker_id)
        return counts
    finally:
        for s in list(live.values()):
            s.close(0)
        ctx.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=50, help="simulated workers at any time")
    parser.add_argument("--period", type=float, default=1.0, help="seconds between churn steps")
    parser.add_argument("--fraction", type=float, default=0.1, help="share that leaves per step")
    parser.add_argument("--task-s", type=float, default=0.1, help="seconds a worker takes per slot")
    parser.add_argument("--sample-every", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds left out of growth")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--swarm", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    seconds = args.minutes * 60
    if args.swarm:
        print(json.dumps(swarm(args.swarm, args.workers, seconds, args.period, args.fraction, 0,
                               args.task_s)))
        return

    import psutil

    from idlegrad.cli.processes import free_port, spawn, stop

    address = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="idlegrad-churn-") as tmp:
        log = open(os.path.join(tmp, "coordinator.log"), "w")
        coordinator = spawn(["coordinator", "--bind", address, "--job", "synthetic",
                             "--job-arg", f"params={PARAMS}", "--job-arg", "batch_size=8",
                             "--epochs", "1000000", "--eval-every", "30", "--heartbeat", "0.5",
                             "--checkpoint-dir", os.path.join(tmp, "ckpt"),
                             "--checkpoint-every", "30", "--threads", "1",
                             "--log-level", "warning"], log=log)
        swarm_proc = subprocess.Popen(
            [sys.executable, HERE, "--swarm", address, "--workers", str(args.workers),
             "--minutes", str(args.minutes), "--period", str(args.period), "--fraction",
             str(args.fraction), "--task-s", str(args.task_s)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
            start_new_session=True)
        samples = []
        try:
            proc = psutil.Process(coordinator.pid)
            start = time.monotonic()
            print(f"{'t_s':>6} {'rss_mb':>8} {'fds':>5}", flush=True)
            while swarm_proc.poll() is None and time.monotonic() - start < seconds + 60:
                t = time.monotonic() - start
                rss = proc.memory_info().rss / 2**20
                fds = proc.num_fds()
                samples.append((t, rss, fds))
                print(f"{t:>6.0f} {rss:>8.1f} {fds:>5}", flush=True)
                time.sleep(args.sample_every)
            out, _ = swarm_proc.communicate(timeout=60)
            counts = json.loads(out.strip().splitlines()[-1])
        finally:
            stop([swarm_proc, coordinator], grace=5.0)
            log.close()
    kept = [s for s in samples if s[0] >= args.warmup] or samples
    fifth = max(1, len(kept) // 5)
    first, last = kept[:fifth], kept[-fifth:]
    rss_growth = statistics.median(s[1] for s in last) - statistics.median(s[1] for s in first)
    fds_growth = statistics.median(s[2] for s in last) - statistics.median(s[2] for s in first)
    print(f"\n{counts['joins']} joins ({counts['byes']} byes, {counts['vanished']} vanished, "
          f"{counts['reconnects']} reconnects), {counts['results']} results in "
          f"{args.minutes:g} min; after the first {args.warmup:g} s: RSS "
          f"{rss_growth:+.1f} MB, descriptors {fds_growth:+.0f} (median of the last fifth minus "
          "the first)")
    if args.json:
        print(json.dumps({"rss_mb": [round(s[1], 1) for s in samples],
                          "fds": [s[2] for s in samples], "t_s": [round(s[0]) for s in samples],
                          "rss_growth_mb": round(rss_growth, 2), "fds_growth": fds_growth,
                          **counts}))


if __name__ == "__main__":
    main()
