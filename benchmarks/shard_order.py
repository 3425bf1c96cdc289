"""The statistical cost of the shard-aware epoch order against a full shuffle, on digits.

The built-in `digits` job is trained in one process, plain minibatch SGD with the job's own
optimizer, for the same number of updates under each order: a full shuffle (what data that is not
sharded gets), and the shard-aware order (common/permutation.py: shards shuffled each epoch,
samples shuffled within blocks of W shards) over the training set cut into `--shards` equal
shards, for each W of `--windows`. Two layouts of the shards: `stored` (the training set in the
order the job builds it, already mixed) and `by-label` (sorted by class first: each shard holds
one or two classes, the worst case a packed folder of class subfolders gives). Medians over
`--seeds` seeds (the model's initialisation and the data order). Last line JSON:
{"epochs": E, "full": {...}, "by-label": {"W": {...}}, "stored": {...}} with the median test
accuracy and loss of each.

    python benchmarks/shard_order.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np
import torch
from torch.utils.data import TensorDataset

from idlegrad.common.job import build, evaluate, gather, load_job
from idlegrad.common.permutation import EpochOrder, ShardOrder, part_indices


def train(layout: str, order_of, seed: int, epochs: int, shards: int) -> dict:
    job = load_job("digits", {})
    built = build(job, seed=seed)
    x, y = built.train.tensors
    if layout == "by-label":  # shards of one or two classes each
        keep = torch.argsort(y, stable=True)
        x, y = x[keep], y[keep]
    train_set = TensorDataset(x, y)
    n = len(train_set)
    sizes = np.diff(np.linspace(0, n, shards + 1).round().astype(np.int64))
    order: EpochOrder = order_of(seed, tuple(int(s) for s in sizes))
    module = built.model.module
    optimizer = job.build_optimizer(module.parameters())
    module.train()
    for epoch in range(epochs):
        for offset in range(0, n, job.batch_size):
            count = min(job.batch_size, n - offset)
            batch = gather(train_set, part_indices(order, n, epoch, offset, count))
            optimizer.zero_grad()
            job.loss(module, batch).backward()
            optimizer.step()
    return evaluate(job, module, built.test)


def median_metrics(runs: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, nargs="+", default=[2, 10])
    parser.add_argument("--shards", type=int, default=32)
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seeds = range(args.seeds)
    out = {"shards": args.shards, "seeds": args.seeds, "by_epochs": {}}
    print(f"{'epochs':>6} {'layout':<9} {'order':<10} {'accuracy':>8} {'loss':>7}")
    for epochs in args.epochs:
        table = {}
        orders = [("full", lambda seed, sizes: seed)] + [
            (f"W={w}", lambda seed, sizes, w=w: ShardOrder(seed, sizes, w)) for w in args.windows]
        for layout in ("stored", "by-label"):
            for name, order_of in orders:
                if name == "full" and layout == "by-label":
                    continue  # a full shuffle does not see the layout
                runs = [train(layout, order_of, s, epochs, args.shards) for s in seeds]
                m = median_metrics(runs)
                key = "full" if name == "full" else f"{layout}/{name}"
                table[key] = m
                print(f"{epochs:>6} {layout if name != 'full' else '-':<9} {name:<10} "
                      f"{m.get('accuracy', float('nan')):>8.4f} {m['loss']:>7.4f}", flush=True)
        out["by_epochs"][str(epochs)] = table
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
