"""The reference point for the demo: synchronous torch DDP (gloo) training digits on this machine.

The same job as idlegrad's coordinator builds it: the built-in `digits` job with `--hidden` and
`--lr` (its MLP and its Adam), the model initialised from `--seed` as the coordinator does, and
the same data plan: each step takes the next `--batch` samples (the global batch) of the epoch's
seeded permutation (common/permutation.py), a batch never spanning two epochs (the last one of an
epoch is smaller), and rank r computes its contiguous share of it; the loss is scaled so that the
averaged gradient is the mean over the whole global batch, as idlegrad's decoded round is. Each
rank uses `--threads` torch threads. Rank 0 evaluates (the job's own evaluation, on the test set)
every `--eval-every` seconds of training, and all ranks stop once the test accuracy reaches
`--target`, or after `--epochs`. Prints one JSON line: steps, samples, test_accuracy, train_s,
evaluations.

Run it through benchmarks/demo_vs_ddp.py, which times it start-up included.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def share(count: int, world: int, rank: int) -> tuple[int, int]:
    """(offset, count) of rank's contiguous share of a batch of `count` (sizes differ by <= 1)."""
    base, extra = divmod(count, world)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


def rank_main(rank: int, args, port: int, out: str) -> None:
    from idlegrad.common.builtin_jobs import digits
    from idlegrad.common.job import build, evaluate, part_batch

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.world)
    job = digits(hidden=args.hidden, lr=args.lr, batch_size=args.batch)
    built = build(job, seed=args.seed)  # the coordinator's initial model
    module = built.model.module
    model = torch.nn.parallel.DistributedDataParallel(module)
    opt = job.build_optimizer(model.parameters())
    n = len(built.train)
    dist.barrier()
    t0 = time.perf_counter()
    last_eval = t0
    steps = samples = evaluations = 0
    acc = 0.0
    stop = torch.zeros(1)
    epoch = offset = 0
    while epoch < args.epochs:
        count = min(args.batch, n - offset)
        start, mine = share(count, args.world, rank)
        if mine:
            batch = part_batch(built.train, args.seed, epoch, offset + start, mine)
            # mean over the global batch once DDP averages over the ranks
            loss = job.loss(model, batch) * (mine * args.world / count)
        else:  # a last batch smaller than the world: this rank adds a zero gradient (it must
            # still go through DDP's forward and backward, which the reduction waits for)
            loss = job.loss(model, part_batch(built.train, args.seed, epoch, offset, 1)) * 0.0
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        samples += count
        offset += count
        if offset >= n:
            epoch, offset = epoch + 1, 0
        if rank == 0:
            now = time.perf_counter()
            if now - last_eval >= args.eval_every or epoch >= args.epochs:
                acc = evaluate(job, module, built.test)["accuracy"]
                evaluations += 1
                last_eval = time.perf_counter()
                stop[0] = 1.0 if acc >= args.target else 0.0
        dist.broadcast(stop, 0)
        if stop[0] > 0:
            break
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"steps": steps, "samples": samples, "test_accuracy": acc,
                       "reached": acc >= args.target, "train_s": time.perf_counter() - t0,
                       "evaluations": evaluations, "epochs": epoch + offset / n}, fh)
    dist.barrier()  # nobody tears gloo down while a peer still talks (that aborts the peer)
    dist.destroy_process_group()
    # gloo's threads sometimes abort the interpreter's teardown ("terminate called without an
    # active exception"); the work is done and written, so leave without it.
    os._exit(0)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--batch", type=int, default=96, help="global batch per step")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--eval-every", type=float, default=0.2, help="seconds")
    parser.add_argument("--epochs", type=int, default=50, help="stop after this many at most")
    parser.add_argument("--seed", type=int, default=0)
    # One rank per process, started by the caller (demo_vs_ddp.py: each stopped by its PID);
    # without --rank, all ranks are spawned here.
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args, args.port, args.out)
        return
    fd, out = tempfile.mkstemp(prefix="idlegrad-ddp-", suffix=".json")
    os.close(fd)
    try:
        mp.spawn(rank_main, args=(args, free_port(), out), nprocs=args.world, join=True)
        with open(out) as fh:
            print(fh.read())
    finally:
        os.unlink(out)


if __name__ == "__main__":
    main()
