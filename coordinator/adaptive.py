"""Adaptive redundancy: choose a round's code from the live workers' recorded task times. Pure.

Each candidate (none, replicate:R, cyclic:S, bounded) is simulated the way the scheduler runs a
round: the slots wait in its queue order (first copies before second copies), and each goes to
the worker that is free first and has not computed that row already; a copy whose row has
arrived by then is dead and skipped (the scheduler cancels it). Every worker draws its slot
times from its own record of seconds per sample (a worker with too short a record draws from the
fleet's), scaled by the samples its slot covers, so a slow worker stays slow and a stalling one
stalls now and then. Speculation is modelled by capping a slot at its holder's speculation
threshold plus a typical slot time (a late slot is duplicated to a free worker).

A round decodes once every row but the code's tolerance has arrived. The predicted time per
sample is the larger of its latency (time to decode, shared by the rounds that may run side by
side) and its cost in worker time (what the slots compute until the round decodes, spread over
the fleet), over the samples of a round. The cheapest wins; redundancy must beat `none` by
`margin` (15%) to be chosen, so a fleet without stragglers settles on `none`: the model treats
workers as independent machines, and a redundant copy on a host shared with other workers (or
paid for in energy) costs more than it sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..common.coding import Redundancy


@dataclass(frozen=True)
class Speculation:
    """The scheduler's rule for a late slot: past mean + sd_factor * sd of its holder's seconds
    per sample (times its samples), plus floor_s."""

    sd_factor: float = 3.0
    floor_s: float = 0.5


def candidates(partitions: int, max_level: int = 2) -> list[Redundancy]:
    out = [Redundancy("none")]
    out += [Redundancy("replicate", r) for r in range(2, max_level + 1)]
    out += [Redundancy("cyclic", s) for s in range(1, min(max_level, partitions - 1) + 1)]
    return out


def _layout(policy: Redundancy, k: int) -> tuple[list[int], int, int]:
    """(row of each slot in queue order, partitions per slot, tolerance in rows)."""
    if policy.kind == "replicate":
        return [j for _ in range(policy.level) for j in range(k)], 1, 0
    if policy.kind == "cyclic":
        return list(range(k)), policy.level + 1, policy.level
    return list(range(k)), 1, 0


def predict(policy: Redundancy, records: Sequence[np.ndarray], partitions: int,
            samples_per_partition: float, trials: int, rng, open_rounds: int = 0,
            speculation: Optional[Speculation] = None) -> float:
    """Predicted seconds per sample of `policy` on workers with these per-sample time records."""
    k, w = partitions, len(records)
    order, width, tolerance = _layout(policy, k)
    n = len(order)
    slot_samples = samples_per_partition * width
    draws = np.stack([rng.choice(r, size=(trials, n)) for r in records], axis=1) * slot_samples
    if speculation is not None:
        typical = float(np.median(np.concatenate(records))) * slot_samples
        cap = np.array([(r.mean() + speculation.sd_factor * r.std()) * slot_samples
                        + speculation.floor_s + typical for r in records])
        draws = np.minimum(draws, cap[None, :, None])
    trial = np.arange(trials)
    free = np.zeros((trials, w))
    done = np.full((trials, k), np.inf)  # when each row first arrives
    did = np.zeros((trials, w, k), dtype=bool)
    starts = np.full((trials, n), np.nan)
    ends = np.full((trials, n), np.nan)
    for position, row in enumerate(order):
        ready = np.where(did[:, :, row], np.inf, free)
        holder = ready.argmin(axis=1)
        begin = ready[trial, holder]
        live = begin < done[:, row]  # a finite start before the row arrived: not dead
        end = begin + draws[trial, holder, position]
        t, h = trial[live], holder[live]
        free[t, h] = end[live]
        did[t, h, row] = True
        done[t, row] = np.minimum(done[t, row], end[live])
        starts[t, position] = begin[live]
        ends[t, position] = end[live]
    decode = np.sort(done, axis=1)[:, k - tolerance - 1]
    busy = np.nansum(np.clip(np.minimum(ends, decode[:, None]) - starts, 0, None), axis=1)
    side_by_side = max(1.0, w / k)
    if open_rounds:
        side_by_side = min(side_by_side, float(open_rounds))
    latency = float(decode.mean()) / side_by_side
    work = float(busy.mean()) / max(1, w)
    return max(latency, work) / (k * samples_per_partition)


def choose(records: Sequence[Sequence[float]], partitions: int, samples_per_partition: float = 1.0,
           max_level: int = 2, trials: int = 128, seed: int = 0, margin: float = 0.15,
           open_rounds: int = 0, speculation: Optional[Speculation] = None,
           min_record: int = 3) -> tuple[Redundancy, dict]:
    """The candidate with the least predicted time per sample, and every candidate's prediction.

    `records` holds one list of seconds per sample for each live worker; a worker whose list is
    shorter than `min_record` draws from all of them pooled."""
    clean = [np.asarray([t for t in r if t > 0 and np.isfinite(t)], dtype=np.float64)
             for r in records]
    pooled = np.concatenate(clean) if clean else np.empty(0)
    if pooled.size == 0 or partitions < 1:
        return Redundancy("none"), {}
    workers = [r if r.size >= min_record else pooled for r in clean]
    costs = {}
    for policy in candidates(partitions, max_level):
        rng = np.random.default_rng(seed)  # common random numbers: candidates compared fairly
        costs[str(policy)] = predict(policy, workers, partitions, samples_per_partition, trials,
                                     rng, open_rounds, speculation)
    best = min(costs, key=costs.__getitem__)
    if best != "none" and costs[best] > (1 - margin) * costs["none"]:
        best = "none"
    chosen = next(p for p in candidates(partitions, max_level) if str(p) == best)
    return chosen, costs
