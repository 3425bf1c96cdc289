"""The data plane (issue 17): what workers with empty caches download, how soon a cold worker is
useful, and how much of the serving a single HTTP mirror takes off the coordinator.

A packed data set of `--mb` MB (random float32 inputs, teacher labels: a real, learnable
classification set) is generated at run time and packed (`idlegrad data pack`). A real
coordinator serves it (`--data DIR`), 4 real workers with empty caches train the built-in
`packed` job on it for one epoch; in one run the coordinator also names a real HTTP mirror on
loopback (`python -m http.server` over `idlegrad data publish`'s folder).

Figures (each worker's cache has a cap above the data, so it never evicts: what it holds is what
it downloaded):
- download ratio: the largest worker's bytes downloaded over its share (data size / workers);
  with the coordinator's `--locality on` (the locality scheduling, when this build has it) and
  `--locality off`. Without locality every slot's samples are spread over the whole set, so each
  worker downloads nearly everything: a ratio near the number of workers.
- cold start: seconds from a worker's join to its first result used (polled from the status
  endpoint every 0.1 s), the largest over the workers of the run without a mirror.
- mirror saving: 1 - (coordinator bytes sent with a mirror) / (without), bytes sent being the
  data served plus every other message (tasks, models, heartbeats).

    python benchmarks/data_plane.py --json

With `--json` its last line is {"download_ratio": ..., "download_ratio_no_locality": ...,
"cold_start_s": ..., "mirror_saving": ...}; download_ratio is null when the coordinator has no
`--locality` option (then `locality` says so).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))
from harness import Run, stopped_on_interrupt  # noqa: E402

WORKERS = 4
FEATURES, CLASSES = 256, 10


def make_pack(root: str, mb: float, shard_mb: float) -> tuple[str, dict]:
    import numpy as np

    from idlegrad.common.blobs import pack_arrays

    samples = int(mb * 1e6) // (FEATURES * 4 + 8) + 1
    rng = np.random.RandomState(0)
    x = rng.standard_normal((samples, FEATURES)).astype(np.float32)
    y = (x @ rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)).argmax(1).astype(np.int64)
    out = os.path.join(root, "pack")
    manifest = pack_arrays(x, y, out, shard_mb=shard_mb)
    return out, {"samples": manifest.samples, "shards": len(manifest.shards),
                 "bytes": sum(s.size for s in manifest.shards)}


def has_locality() -> bool:
    text = subprocess.run([sys.executable, "-m", "idlegrad.cli", "coordinator", "--help"],
                          capture_output=True, text=True).stdout
    return "--locality" in text


def blob_bytes(cache_dir: str) -> int:
    total = 0
    for base, _, names in os.walk(os.path.join(cache_dir, "blobs")):
        total += sum(os.path.getsize(os.path.join(base, n)) for n in names)
    return total


def one_run(root: str, name: str, pack: str, coordinator_extra: list, batch: int,
            timeout_s: float) -> dict:
    from idlegrad.cli.processes import free_port, wait_for_hellos
    from idlegrad.monitor.source import ZmqStatusSource

    run_dir = os.path.join(root, name)
    address = f"tcp://127.0.0.1:{free_port()}"
    metrics = os.path.join(run_dir, "metrics.jsonl")
    caches = [os.path.join(run_dir, f"cache-w{i}") for i in range(WORKERS)]
    with Run(run_dir) as run:
        names = [f"w{i}" for i in range(WORKERS)]
        workers = [run.spawn_idlegrad(n, [
            "worker", "--coordinator", address, "--id", n, "--threads", "1", "--device", "cpu",
            "--no-idle-policy", "--cache-dir", caches[i], "--cache-max-gb", "100"])
            for i, n in enumerate(names)]
        wait_for_hellos(address, names, workers, 120)
        started = time.monotonic()
        coordinator = run.spawn_idlegrad("coordinator", [
            "coordinator", "--bind", address, "--job", "packed", "--data", pack,
            "--job-arg", f"features={FEATURES}", "--job-arg", f"classes={CLASSES}",
            "--job-arg", "hidden=0", "--job-arg", f"batch_size={batch}", "--epochs", "1",
            "--threads", "1", "--metrics", metrics, *coordinator_extra])
        source = ZmqStatusSource(address)
        first_used: dict[str, float] = {}
        try:
            while coordinator.poll() is None:
                if time.monotonic() - started > timeout_s:
                    raise SystemExit(f"{name}: no end within {timeout_s:g} s (see {run_dir})")
                snap = source.fetch(timeout=0.3)
                for row in (snap or {}).get("workers", []):
                    if row.get("done", 0) >= 1 and row["id"] not in first_used:
                        first_used[row["id"]] = row["joined_s"]
                time.sleep(0.1)
        finally:
            source.close()
        elapsed = time.monotonic() - started
        for proc in workers:
            proc.wait(timeout=60)
    with open(metrics) as fh:
        final = [json.loads(line) for line in fh if line.strip()][-1]
    downloaded = [blob_bytes(c) for c in caches]
    data = final.get("data") or {}
    sent = final["counters"]["bytes_sent"] + data.get("served_bytes", 0)
    return {"run": name, "elapsed_s": round(elapsed, 2), "downloaded": downloaded,
            "coordinator_sent": sent, "served": data.get("served_bytes", 0),
            "metrics": final.get("metrics"),
            "cold_start_s": max(first_used.values()) if len(first_used) == WORKERS else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=210.0, help="packed data size in MB (default 210)")
    p.add_argument("--shard-mb", type=float, default=4.0,
                   help="shard size in MiB (default 4: some 50 shards, so that blocks of "
                        "--shuffle-window shards outnumber the workers, as with a data set of "
                        "many GB in 64 MiB shards)")
    p.add_argument("--shuffle-window", type=int, default=None,
                   help="the coordinator's --shuffle-window (default: the coordinator's)")
    p.add_argument("--batch", type=int, default=1024, help="the job's batch size (default 1024)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run at most")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    args = p.parse_args()
    with stopped_on_interrupt(), tempfile.TemporaryDirectory(prefix="idlegrad-data-") as root:
        t0 = time.monotonic()
        pack, info = make_pack(root, args.mb, args.shard_mb)
        print(f"packed {info['bytes'] / 1e6:.1f} MB: {info['samples']} samples in "
              f"{info['shards']} shards ({time.monotonic() - t0:.1f} s)", flush=True)
        www = os.path.join(root, "www")
        subprocess.run([sys.executable, "-m", "idlegrad.cli", "data", "publish", pack, "--to", www],
                       check=True, stdout=subprocess.DEVNULL)
        locality = has_locality()
        window = [] if args.shuffle_window is None else ["--shuffle-window", str(args.shuffle_window)]
        runs = {}
        plan = [("no-mirror", ["--locality", "off"] if locality else [])]
        if locality:
            plan.append(("locality", ["--locality", "on", *window]))
        from idlegrad.cli.processes import free_port

        port = free_port()
        mirror_args = ["--blob-mirror", f"http://127.0.0.1:{port}"] + (
            ["--locality", "on", *window] if locality else [])
        plan.append(("mirror", mirror_args))
        for name, extra in plan:
            mirror = None
            if name == "mirror":
                mirror = subprocess.Popen(
                    [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                     "--directory", www], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                runs[name] = one_run(root, name, pack, extra, args.batch, args.timeout)
            finally:
                if mirror is not None:
                    mirror.terminate()
                    mirror.wait(timeout=10)
            r = runs[name]
            print(f"{name:10s} {r['elapsed_s']:7.1f} s  downloaded per worker (MB): "
                  f"{', '.join(f'{d / 1e6:.1f}' for d in r['downloaded'])}  coordinator sent "
                  f"{r['coordinator_sent'] / 1e6:.1f} MB (data {r['served'] / 1e6:.1f} MB)  "
                  f"cold start {r['cold_start_s']} s  metrics {r['metrics']}", flush=True)
    share = info["bytes"] / WORKERS
    ratio = lambda r: round(max(r["downloaded"]) / share, 3)
    base, with_mirror = runs["no-mirror"], runs["mirror"]
    summary = {
        "download_ratio": ratio(runs["locality"]) if locality else None,
        "download_ratio_no_locality": ratio(base),
        "cold_start_s": (runs["locality"] if locality else base)["cold_start_s"],
        "cold_start_s_no_locality": base["cold_start_s"],
        "mirror_saving": round(1 - with_mirror["coordinator_sent"] / base["coordinator_sent"], 4),
    }
    if not locality:
        summary["locality"] = "this coordinator has no --locality option: not measured"
    print(f"data {info['bytes'] / 1e6:.1f} MB, share per worker {share / 1e6:.1f} MB; "
          + ", ".join(f"{k} {v}" for k, v in summary.items()))
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
