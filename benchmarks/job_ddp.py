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
does: before each backward (the gradient all-reduce waits in it) it sleeps (X - 1) times the
step's compute, estimated as its forward's CPU time (the worker counts a slot's CPU time too: a
wait for a core shared with the other ranks is no compute) times the (forward + backward) /
forward ratio timed on the plain module before training (benchmarks/fleet.py's heterogeneous
fleets).
Rank 0 evaluates (the job's evaluation) every `--eval-every` seconds of training and at the end;
all ranks stop at the first evaluation that reaches `--target`, at `--budget` seconds of
training, or after `--epochs`. Rank 0 writes one JSON object to `--out`: steps, samples,
metrics, reached, train_s, and the curve [[train_s, metric], ...] of `--target`'s metric.

Started rank by rank by benchmarks/real_jobs.py, which stops each by its PID.
"""

from __future__ import annotations

import argparse
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


def compute_ratio(job, module, data) -> float:
    """(forward + backward) / forward seconds of one step on the plain module (no all-reduce in
    its backward), the median of a few; the gradients are cleared after."""
    import statistics

    ratios = []
    for _ in range(5):
        t0 = time.perf_counter()
        loss = job.loss(module, data)
        t1 = time.perf_counter()
        loss.backward()
        ratios.append((time.perf_counter() - t0) / max(1e-6, t1 - t0))
    module.zero_grad(set_to_none=True)
    return statistics.median(ratios)


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

    if args.threads > 0:
        torch.set_num_threads(args.threads)
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
    fb_ratio = 1.0
    if args.slowdown > 1:
        start, mine = share(min(batch, n), args.world, args.rank)
        fb_ratio = compute_ratio(job, module, part_batch(built.train, order, 0, start,
                                                         max(1, mine), job.collate))
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
        f0 = time.thread_time()  # CPU time, as the worker's --slowdown counts
        if mine:
            data = part_batch(built.train, order, epoch, offset + start, mine, job.collate)
            loss = job.loss(model, data) * (mine * args.world / count)
        else:  # a short last batch: this rank adds a zero gradient, DDP's reduction waits for it
            loss = job.loss(model, part_batch(built.train, order, epoch, offset, 1, job.collate)) * 0.0
        if args.slowdown > 1:  # before the backward, whose all-reduce the peers wait in
            time.sleep((args.slowdown - 1.0) * (time.thread_time() - f0) * fb_ratio)
        optimizer.zero_grad()
        loss.backward()
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
