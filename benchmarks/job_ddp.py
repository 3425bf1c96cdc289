"""Any idlegrad job trained by synchronous torch DDP (gloo), or by one process (`--world 1`): the
reference points of benchmarks/real_jobs.py.

The job is built as idlegrad's coordinator builds it (its spec and job arguments, the model
initialised from `--seed`), and trained with the same data plan and recipe:
- each step takes the next `batch_size` samples of the epoch's order (common/job.py epoch_order:
  the seeded shuffle, or the shard-aware order with `--shuffle-window` for packed data, as the
  coordinator's default), never spanning two epochs; rank r computes its contiguous share and
  the loss is scaled so that the averaged gradient is the mean over the global batch, as
  idlegrad's decoded round is;
- the job's optimizer (named parameter groups included), its learning-rate schedule stepped once
  per step, its gradient clipping on the averaged gradient;
- BatchNorm statistics: DDP's own rule (rank 0's buffers broadcast before each forward).
`--slowdown X` makes this rank X times as slow as its compute, as the worker's `--slowdown`
does: a step's forward and backward last X times their CPU time in all (a sleep makes up the
rest; a wait for a core shared with the other ranks is part of it, not added), and only then
are the gradients all-reduced, so that the peers wait for the slowed rank as they would for a
slow machine. The backward then runs under DDP's `no_sync` and the sleep is followed by one
all-reduce of the flattened gradients, averaged: DDP's own reduction done after the sleep
(its hooks would start it during the backward, before the sleep).
The C allocator keeps freed memory for the next step, as in idlegrad's workers (worker/allocator.py).
Rank 0 evaluates (the job's evaluation) every `--eval-every` seconds of training and at the end;
all ranks stop at the first evaluation that reaches `--target`, at `--budget` seconds of
training, or after `--epochs`. Rank 0 writes one JSON object to `--out`: steps, samples,
metrics, reached, train_s, and the curve [[train_s, metric], ...] of `--target`'s metric.

Started rank by rank by benchmarks/real_jobs.py, which stops each by its PID.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist


def share(count: int, world: int, rank: int) -> tuple[int, int]:
    """(offset, count) of rank's contiguous share of a batch of `count` (sizes differ by <= 1)."""
    base, extra = divmod(count, world)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


def fastest_threads(job, module, train, order, batch: int) -> int:
    """On a shared machine more threads can be slower (OpenMP threads spin while the cores are
    busy elsewhere): time a forward and backward pass with each choice, the model left as it was."""
    from idlegrad.common.job import part_batch

    timings = {}
    data = part_batch(train, order, 0, 0, min(batch, len(train)), job.collate)
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        job.loss(module, data).backward()  # warm-up
        t0 = time.perf_counter()
        for _ in range(3):
            job.loss(module, data).backward()
        timings[threads] = time.perf_counter() - t0
    module.zero_grad(set_to_none=True)
    best = min(timings, key=timings.get)
    torch.set_num_threads(best)
    return best


def all_reduce_mean(module: torch.nn.Module, world: int) -> None:
    """The gradients averaged over the ranks in one all-reduce, as DDP's reducer averages them."""
    params = list(module.parameters())
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= world
    for p, g in zip(params, torch._utils._unflatten_dense_tensors(flat, grads)):
        p.grad = g


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", required=True)
    p.add_argument("--job-arg", action="append", default=[])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--target", required=True, help="METRIC=VALUE, as the coordinator's")
    p.add_argument("--threads", type=int, default=1, help="torch threads; 0: the faster of 1 and all")
    p.add_argument("--eval-every", type=float, default=2.0, help="seconds of training")
    p.add_argument("--budget", type=float, default=600.0, help="seconds of training at most")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shuffle-window", type=int, default=2)
    p.add_argument("--slowdown", type=float, default=1.0,
                   help="this rank's steps take X times its compute (fault injection)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from idlegrad.common.job import (build, build_schedule, epoch_order, evaluate, load_job,
                                     make_optimizer, parse_job_args, part_batch)
    from idlegrad.coordinator.target import Target
    from idlegrad.worker.allocator import keep_freed_memory

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # the C allocator as idlegrad's workers have it: equal machines
    distributed = args.world > 1
    if distributed:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=args.rank, world_size=args.world)
    target = Target.parse(args.target)
    job = load_job(args.job, parse_job_args(args.job_arg))
    built = build(job, seed=args.seed)
    module = built.model.module
    model = torch.nn.parallel.DistributedDataParallel(module) if distributed else module
    optimizer = make_optimizer(job, module)
    schedule = build_schedule(job, optimizer)
    order = epoch_order(built.train, args.seed, args.shuffle_window)
    n, batch = len(built.train), job.batch_size
    if args.threads == 0:  # the faster of one thread and every core, timed on a few batches
        args.threads = fastest_threads(job, module, built.train, order, batch)
    slowed = args.slowdown > 1
    if distributed:
        dist.barrier()
    t0 = time.perf_counter()
    last_eval = t0
    steps = samples = epoch = offset = 0
    metrics: dict = {}
    curve: list = []
    stop = torch.zeros(1)
    while epoch < args.epochs:
        count = min(batch, n - offset)
        start, mine = share(count, args.world, args.rank)
        module.train()
        w0, f0 = time.perf_counter(), time.thread_time()  # CPU time, as the worker's counts
        with model.no_sync() if slowed and distributed else contextlib.nullcontext():
            if mine:
                data = part_batch(built.train, order, epoch, offset + start, mine, job.collate)
                loss = job.loss(model, data) * (mine * args.world / count)
            else:  # a short last batch: this rank adds a zero gradient, the reduction waits for it
                loss = job.loss(model, part_batch(built.train, order, epoch, offset, 1,
                                                  job.collate)) * 0.0
            optimizer.zero_grad()
            loss.backward()
        if slowed:
            time.sleep(max(0.0, args.slowdown * (time.thread_time() - f0)
                           - (time.perf_counter() - w0)))
            if distributed:
                all_reduce_mean(module, args.world)
        if job.clip_norm:  # the global norm of the averaged gradient, as the coordinator's
            torch.nn.utils.clip_grad_norm_(module.parameters(), job.clip_norm)
        optimizer.step()
        if schedule is not None:
            schedule.step()
        steps += 1
        samples += count
        offset += count
        if offset >= n:
            epoch, offset = epoch + 1, 0
        if args.rank == 0:
            now = time.perf_counter()
            over = now - t0 >= args.budget or epoch >= args.epochs
            if now - last_eval >= args.eval_every or over:
                metrics = evaluate(job, module, built.test)
                last_eval = time.perf_counter()
                curve.append([round(last_eval - t0, 3), metrics.get(target.metric)])
                stop[0] = 1.0 if (target.reached(metrics) or over) else 0.0
        if distributed:
            dist.broadcast(stop, 0)
        if stop[0] > 0:
            break
    if args.rank == 0:
        with open(args.out, "w") as fh:
            json.dump({"steps": steps, "samples": samples, "metrics": metrics,
                       "reached": target.reached(metrics), "train_s": time.perf_counter() - t0,
                       "curve": curve, "params": sum(p.numel() for p in module.parameters()),
                       "threads": args.threads},
                      fh)
    if distributed:
        dist.barrier()  # nobody tears gloo down while a peer still talks
        dist.destroy_process_group()
    os._exit(0)  # gloo's threads sometimes abort the interpreter's teardown


if __name__ == "__main__":
    main()
