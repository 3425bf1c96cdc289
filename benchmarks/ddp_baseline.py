"""The reference point for the demo: synchronous torch DDP (gloo) training digits on this machine.

3 processes, a 64-128-10 MLP, Adam lr 1e-2, 32 samples per rank per step, the same data split as
idlegrad's `digits` job. Rank 0 evaluates after every step and all ranks stop once test accuracy
reaches the target. Prints one JSON line: steps, samples, test_accuracy, train_s.
Run it through benchmarks/demo_vs_ddp.py, which times it start-up included.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from idlegrad.common.builtin_jobs import digits, mlp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, target: float, max_steps: int, out: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    job = digits()
    train, test = job.build_datasets()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(mlp([64, 128, 10]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = train.tensors
    tx, ty = test.tensors
    g = torch.Generator().manual_seed(rank)
    t0 = time.perf_counter()
    steps, acc = 0, 0.0
    stop = torch.zeros(1)
    while steps < max_steps:
        idx = torch.randint(len(x), (32,), generator=g)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        if rank == 0:
            with torch.no_grad():
                acc = float((model.module(tx).argmax(1) == ty).float().mean())
            stop[0] = 1.0 if acc >= target else 0.0
        dist.broadcast(stop, 0)
        if stop[0] > 0:
            break
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"steps": steps, "samples": steps * 32 * world, "test_accuracy": acc,
                       "train_s": time.perf_counter() - t0}, fh)
    dist.barrier()  # nobody tears gloo down while a peer still talks (that aborts the peer)
    dist.destroy_process_group()
    # gloo's threads sometimes abort the interpreter's teardown ("terminate called without an
    # active exception"); the work is done and written, so leave without it.
    os._exit(0)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--max-steps", type=int, default=5000)
    args = parser.parse_args()
    out = f"/tmp/idlegrad-ddp-{os.getpid()}.json"
    mp.spawn(rank_main, args=(args.world, free_port(), args.target, args.max_steps, out),
             nprocs=args.world, join=True)
    with open(out) as fh:
        print(fh.read())
    os.unlink(out)


if __name__ == "__main__":
    main()
