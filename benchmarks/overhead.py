"""What the coordinator costs per slot, against a bare ZeroMQ exchange of the same messages (issue 7).

One process plays a swarm of N lightweight simulated workers: N DEALER sockets, each says hello,
announces its credits and answers every task at once with a tiny gradient (it computes nothing).
The same swarm runs against two servers, side by side in one run (alternating order across runs,
since this machine is shared and noisy):

- `idlegrad`: a real coordinator process (`idlegrad coordinator`, job `synthetic` with a ~100
  parameter model, rounds of 64 samples cut into 8 slots of 8: every 8th answer decodes a round
  and steps the optimizer, and the next round's slots carry the model of the new version; many
  workers need rounds of several partitions, or rounds beyond `--max-staleness` are wasted);
- `ceiling`: a bare pyzmq ROUTER that answers a hello with a pre-encoded welcome and every ready and
  result with pre-encoded tasks of the same shape (header fields and model frame), decoding
  nothing: what the sockets, the swarm and the interpreter allow.

slots/s is counted in the swarm over a window after a warm-up: tasks answered, whatever became of
the answers. The ratio is idlegrad / ceiling. Over the same window it reads each server's CPU time
(psutil): microseconds per slot of its main thread, which bounds the slots/s one coordinator can
serve whatever the machine, and of its other threads (ZeroMQ's I/O thread).

An answered task is not progress: with many workers most rounds can come back staler than
`--max-staleness` and be replanned. So for idlegrad it also reports, over (about) the same window,
`applied/s`: slots of the rounds applied (model versions gained x 8 slots a round), read from the
coordinator's status just before the window opens and just after it closes (outside the CPU
window), and `stale%`: of the rounds decoded there, the share thrown away as too stale. The
coordinator is then stopped with SIGTERM and its final metrics record (`--metrics`: `counters`
and the scheduler's tallies, `scheduler`) gives the whole run's rounds applied, decoded, too stale
and replanned, and results used (in the JSON, `final`).

    python benchmarks/overhead.py --runs 3 --json

With `--json` its last line is {"ratio": ..., "slots_per_s": ..., "ceiling_per_s": ...,
"applied_slots_per_s": ..., "stale_share": ..., "main_us_per_slot": ...,
"by_workers": {"10": {...}, ...}} (top-level figures at 100 workers, medians; per count also
`runs_final`, each run's final-record tallies).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import zmq

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))
from harness import (Run, medians, paired_runs, read_metrics,  # noqa: E402
                     stopped_on_interrupt, windowed_output)
PARAMS = 100
SLOT = 8  # samples per slot
PARTITIONS = 8  # a round is a batch of PARTITIONS x SLOT samples


def model_numel() -> int:
    """The parameter count of the coordinator's model (`synthetic` rounds `params` to a width)."""
    from idlegrad.common.builtin_jobs import synthetic

    return sum(p.numel() for p in synthetic(params=PARAMS).build_model().parameters())


# the swarm ------------------------------------------------------------------------------------


def swarm(address: str, workers: int, warmup: float, window: float, credits: int) -> dict:
    from idlegrad.common import protocol as proto

    ctx = zmq.Context()
    socks = []
    poller = zmq.Poller()
    try:
        for i in range(workers):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IDENTITY, f"sim-{i:05d}".encode())
            s.connect(address)
            s.send_multipart(proto.encode(proto.Hello(
                worker_id=f"sim-{i:05d}", host="swarm", cores=1, threads=1, device="cpu",
                memory_mb=1, versions={})))
            poller.register(s, zmq.POLLIN)
            socks.append(s)
        gradient = proto.Blob("float32", model_numel(), (bytes(4 * model_numel()),))
        answered = 0
        # the window opens `warmup` seconds after the first task (the server may still be
        # starting when the swarm connects), and must open within a minute
        counting_from = end = time.monotonic() + 60
        counted = 0
        while True:
            now = time.monotonic()
            if now >= end:
                break
            for sock, _ in poller.poll(timeout=max(1, int((end - now) * 1000))):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    msg = proto.decode(frames)
                    if isinstance(msg, proto.Task):
                        if answered == 0:
                            counting_from = time.monotonic() + warmup
                            end = counting_from + window
                        sock.send_multipart(proto.encode(proto.Result(
                            slot=msg.slot, version=msg.version,
                            samples=sum(p[2] for p in msg.parts), loss=0.0, compute_s=1e-4,
                            gradient=gradient)), copy=False)
                        answered += 1
                        if msg.model is not None and msg.model.numel != gradient.numel:
                            raise SystemExit(f"the model has {msg.model.numel} parameters")
                        if time.monotonic() >= counting_from:
                            if not counted:
                                print("open", flush=True)  # the parent reads the server's CPU
                            counted += 1
                    elif isinstance(msg, proto.Welcome):
                        sock.send_multipart(proto.encode(proto.Ready(
                            credits=credits, fingerprint=msg.fingerprint)))
        print("closed", flush=True)
        return {"slots": counted, "seconds": window, "slots_per_s": counted / window,
                "answered": answered}
    finally:
        for s in socks:
            s.close(0)
        ctx.term()


# the ceiling ----------------------------------------------------------------------------------


def bare_server(address: str) -> None:
    """Answer with pre-encoded messages of idlegrad's shapes, decoding nothing, until SIGTERM."""
    from idlegrad.common import protocol as proto

    welcome = proto.encode(proto.Welcome(job="synthetic", job_args={}, fingerprint="f" * 16,
                                         seed=0, heartbeat_s=60.0, liveness=3))
    model = proto.Blob("float32", model_numel(), (bytes(4 * model_numel()),))
    task = proto.encode(proto.Task(slot=123456, round=123455, version=4321,
                                   parts=[[0, 1024, SLOT]], coefficients=[1.0],
                                   deadline_s=30.0, model=model))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    seen: set[bytes] = set()
    try:
        while True:
            frames = sock.recv_multipart(copy=False)
            route = frames[0].bytes
            if route not in seen:  # its hello
                seen.add(route)
                sock.send_multipart([route, *welcome], copy=False)
            elif len(frames) == 2:  # its ready (a result has a gradient frame): two credits
                sock.send_multipart([route, *task], copy=False)
                sock.send_multipart([route, *task], copy=False)
            else:  # a result
                sock.send_multipart([route, *task], copy=False)
    finally:
        sock.close(0)
        ctx.term()


# runs -----------------------------------------------------------------------------------------


def thread_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of `pid`'s main thread and of its other threads."""
    import psutil

    threads = psutil.Process(pid).threads()
    main = sum(t.user_time + t.system_time for t in threads if t.id == pid)
    return main, sum(t.user_time + t.system_time for t in threads) - main


def status_point(source) -> Optional[dict]:
    """(when, model version, rounds too stale, rounds rejected) from one status snapshot."""
    snap = source.fetch(timeout=10.0)
    if snap is None:
        return None
    counters = snap.get("counters") or {}
    return {"t": time.monotonic(), "version": int(snap.get("version", 0)),
            "too_stale": int(counters.get("rounds_too_stale", 0)),
            "rejected": int(counters.get("rounds_rejected", 0))}


def run_swarm(address: str, args, workers: int, server_pid: int, source=None) -> dict:
    """The swarm's counts, and the server's CPU per slot over the swarm's counted window; with a
    status `source` (idlegrad), the rounds applied and thrown away as too stale around it."""
    swarm_proc = subprocess.Popen(
        [sys.executable, HERE, "--swarm", address, "--workers", str(workers),
         "--warmup", str(args.warmup), "--window", str(args.window)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    cpu, status = {}, {}

    def on_mark(mark: str) -> None:
        # the status requests stay outside the CPU window: before it opens, after it closes
        if mark == "open" and source is not None:
            status[mark] = status_point(source)
        cpu[mark] = thread_cpu(server_pid)
        if mark == "closed" and source is not None:
            status[mark] = status_point(source)

    result = windowed_output(swarm_proc, on_mark, timeout=args.warmup + args.window + 120)
    if "open" in cpu and "closed" in cpu and result["slots"]:
        result["main_us_per_slot"] = (cpu["closed"][0] - cpu["open"][0]) / result["slots"] * 1e6
        result["others_us_per_slot"] = (cpu["closed"][1] - cpu["open"][1]) / result["slots"] * 1e6
    a, b = status.get("open"), status.get("closed")
    if a and b and b["t"] > a["t"]:
        applied = b["version"] - a["version"]
        stale = b["too_stale"] - a["too_stale"]
        decoded = applied + stale + (b["rejected"] - a["rejected"])
        result["applied_slots_per_s"] = applied * PARTITIONS / (b["t"] - a["t"])
        result["applied_rounds"] = applied
        result["stale_rounds"] = stale
        result["stale_share"] = stale / decoded if decoded else 0.0
    return result


def final_tallies(path: Path) -> Optional[dict]:
    """The whole run's tallies from the coordinator's final metrics record."""
    final = next((r for r in reversed(read_metrics(path)) if r.get("final")), None)
    if final is None:
        return None
    counters, sched = final.get("counters") or {}, final.get("scheduler") or {}
    return {"rounds_applied": final.get("version"), "samples_applied": final.get("samples"),
            "rounds_decoded": sched.get("rounds_decoded", 0),
            "rounds_too_stale": counters.get("rounds_too_stale", 0),
            "rounds_replanned": sched.get("rounds_replanned", 0),
            "rounds_opened": sched.get("rounds_opened", 0),
            "results_used": sched.get("results_used", 0),
            "results_duplicate": sched.get("results_duplicate", 0),
            "slots_requeued": sched.get("slots_requeued", 0),
            "slots_speculated": sched.get("slots_speculated", 0)}


def measure(kind: str, args, workers: int) -> dict:
    from idlegrad.cli.processes import free_port
    from idlegrad.monitor.source import ZmqStatusSource

    address = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="idlegrad-overhead-") as tmp, Run(tmp) as run:
        if kind != "idlegrad":
            server = run.spawn_python("bare", [HERE, "--bare", address])
            return run_swarm(address, args, workers, server.pid)
        metrics = Path(tmp) / "metrics.jsonl"
        server = run.spawn_idlegrad("coordinator", [
            "coordinator", "--bind", address, "--job", "synthetic",
            "--job-arg", f"params={PARAMS}", "--job-arg", f"batch_size={SLOT * PARTITIONS}",
            "--partitions", str(PARTITIONS), "--epochs", "100000", "--heartbeat", "60",
            "--eval-every", "3600", "--metrics", str(metrics), "--threads", "1",
            "--log-level", "warning"])
        with ZmqStatusSource(address) as source:
            result = run_swarm(address, args, workers, server.pid, source)
        # a graceful stop writes the final record (Run.close would SIGKILL after 5 s)
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        result["final"] = final_tallies(metrics)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="10,100,1000", help="simulated worker counts")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--window", type=float, default=8.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--swarm", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--bare", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        bare_server(args.bare)
        return
    if args.swarm:
        print(json.dumps(swarm(args.swarm, int(args.workers), args.warmup, args.window, 2)))
        return

    counts = [int(w) for w in args.workers.split(",")]
    by_workers = {}
    print(f"{'workers':>8} {'run':>4} {'idlegrad/s':>11} {'applied/s':>10} {'stale%':>6} "
          f"{'ceiling/s':>10} {'ratio':>6} {'us/slot main (ceiling)':>23} {'other threads':>14}",
          flush=True)
    with stopped_on_interrupt():
        for n in counts:
            runs, finals = [], []
            for i, got in paired_runs(["idlegrad", "ceiling"], args.runs,
                                      lambda kind, i: measure(kind, args, n)):
                ours, bare = got["idlegrad"], got["ceiling"]
                runs.append({"slots_per_s": ours["slots_per_s"],
                             "applied_slots_per_s": ours.get("applied_slots_per_s", math.nan),
                             "stale_share": ours.get("stale_share", math.nan),
                             "ceiling_per_s": bare["slots_per_s"],
                             "ratio": ours["slots_per_s"] / max(1e-9, bare["slots_per_s"]),
                             "applied_ratio": ours.get("applied_slots_per_s", math.nan)
                             / max(1e-9, bare["slots_per_s"]),
                             "main_us_per_slot": ours.get("main_us_per_slot", math.nan),
                             "others_us_per_slot": ours.get("others_us_per_slot", math.nan),
                             "ceiling_main_us_per_slot": bare.get("main_us_per_slot", math.nan)})
                finals.append(ours.get("final"))
                r = runs[-1]
                print(f"{n:>8} {i + 1:>4} {r['slots_per_s']:>11.0f} "
                      f"{r['applied_slots_per_s']:>10.0f} {100 * r['stale_share']:>6.1f} "
                      f"{r['ceiling_per_s']:>10.0f} "
                      f"{r['ratio']:>6.2f} {r['main_us_per_slot']:>12.1f} "
                      f"({r['ceiling_main_us_per_slot']:>6.1f})   "
                      f"{r['others_us_per_slot']:>12.1f}", flush=True)
                f = finals[-1]
                if f:
                    print(f"{'':>13} whole run (final record): {f['rounds_applied']} rounds "
                          f"applied, {f['rounds_decoded']} decoded, {f['rounds_too_stale']} too "
                          f"stale ({f['rounds_replanned']} replanned), {f['results_used']} "
                          f"results used", flush=True)
                else:
                    print(f"{'':>13} whole run: no final metrics record (the coordinator did "
                          f"not stop gracefully)", flush=True)
            by_workers[str(n)] = medians(runs)
            by_workers[str(n)]["runs_ratio"] = [r["ratio"] for r in runs]
            by_workers[str(n)]["runs_final"] = finals
    print("\nmedians")
    for n, r in by_workers.items():
        print(f"{n:>8} workers: idlegrad {r['slots_per_s']:.0f} slots/s answered, "
              f"{r['applied_slots_per_s']:.0f} applied ({100 * r['stale_share']:.1f}% of decoded "
              f"rounds too stale), ceiling {r['ceiling_per_s']:.0f}/s, ratio {r['ratio']:.2f} "
              f"(applied {r['applied_ratio']:.2f}); coordinator main thread "
              f"{r['main_us_per_slot']:.1f} us/slot (bare server {r['ceiling_main_us_per_slot']:.1f})")
    if args.json:
        top = by_workers.get("100") or next(iter(by_workers.values()))
        print(json.dumps({"ratio": top["ratio"], "slots_per_s": top["slots_per_s"],
                          "ceiling_per_s": top["ceiling_per_s"],
                          "applied_slots_per_s": top["applied_slots_per_s"],
                          "stale_share": top["stale_share"],
                          "main_us_per_slot": top["main_us_per_slot"], "by_workers": by_workers}))


if __name__ == "__main__":
    main()
