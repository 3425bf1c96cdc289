"""Adaptive redundancy: choose a round's code from the fleet's recorded task times. Pure.

Each candidate (none, replicate:R, cyclic:S, bounded) is simulated on the recorded seconds per
sample: every slot draws a time from the record, scaled by the partitions it covers; the slots go
round-robin (in the scheduler's queue order) to the live workers, who run theirs one after another.
A round decodes at the first moment the finished slots determine the sum (none: all of them;
replicate R: one copy of each partition; cyclic S: any n-S). The predicted time per sample of a
candidate is the larger of its latency (time to decode, shared by the rounds that the fleet can
run side by side) and its cost in worker time (what the slots compute until the round decodes,
spread over the fleet), divided by the samples of a round. The cheapest wins; redundancy must beat
`none` by `margin` to be chosen, so a fleet without stragglers settles on `none`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..common.coding import Redundancy


def candidates(partitions: int, max_level: int = 2) -> list[Redundancy]:
    out = [Redundancy("none")]
    out += [Redundancy("replicate", r) for r in range(2, max_level + 1)]
    out += [Redundancy("cyclic", s) for s in range(1, min(max_level, partitions - 1) + 1)]
    return out


def predict(policy: Redundancy, times: np.ndarray, workers: int, partitions: int,
            trials: int, rng) -> float:
    """Predicted seconds per sample of `policy` (samples: 1 per partition)."""
    k, w = partitions, max(1, workers)
    if policy.kind == "replicate":
        r = policy.level
        n, width = k * r, 1
        # queue order is copy-major: every partition's first copy, then the second copies ...
        group = np.tile(np.arange(k), r)
    elif policy.kind == "cyclic":
        n, width, group = k, policy.level + 1, None
    else:
        n, width, group = k, 1, None
    draws = rng.choice(times, size=(trials, n)) * width
    finish = np.empty_like(draws)
    start = np.empty_like(draws)
    for worker in range(min(w, n)):
        cols = np.arange(worker, n, w)
        ends = np.cumsum(draws[:, cols], axis=1)
        finish[:, cols] = ends
        start[:, cols] = ends - draws[:, cols]
    if policy.kind == "replicate":
        per_partition = np.stack([finish[:, group == g].min(axis=1) for g in range(k)], axis=1)
        decode = per_partition.max(axis=1)
    elif policy.kind == "cyclic":
        decode = np.sort(finish, axis=1)[:, n - policy.level - 1]
    else:
        decode = finish.max(axis=1)
    busy = np.clip(np.minimum(finish, decode[:, None]) - start, 0, None).sum(axis=1)
    side_by_side = max(1.0, w / n)
    latency = float(decode.mean()) / side_by_side
    work = float(busy.mean()) / w
    return max(latency, work) / k


def choose(times: Sequence[float], workers: int, partitions: int, max_level: int = 2,
           trials: int = 256, seed: int = 0, margin: float = 0.05) -> tuple[Redundancy, dict]:
    """The candidate with the least predicted time per sample, and every candidate's prediction."""
    record = np.asarray([t for t in times if t > 0 and np.isfinite(t)], dtype=np.float64)
    if record.size == 0 or partitions < 1:
        return Redundancy("none"), {}
    costs = {}
    for policy in candidates(partitions, max_level):
        rng = np.random.default_rng(seed)  # common random numbers: candidates compared fairly
        costs[str(policy)] = predict(policy, record, workers, partitions, trials, rng)
    best = min(costs, key=costs.get)
    if best != "none" and costs[best] > (1 - margin) * costs["none"]:
        best = "none"
    chosen = next(p for p in candidates(partitions, max_level) if str(p) == best)
    return chosen, costs
