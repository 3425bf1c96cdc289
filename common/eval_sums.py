"""Evaluation as sums: a metric is the sum of its per-sample sums over the count of its counts,
so ranges of the test set evaluated apart (on workers, issue 18) add up to the whole. Pure."""

from __future__ import annotations

import math
from typing import Sequence


def combine_sums(parts: Sequence[dict[str, tuple[float, float]]]) -> dict[str, float]:
    """Metrics from the sums of an evaluation's pieces: each metric's sums over its counts, for
    the metrics every piece reports (a metric counted over nothing is left out)."""
    if not parts:
        return {}
    names = set(parts[0])
    for part in parts[1:]:
        names &= set(part)
    metrics = {}
    for name in sorted(names):
        count = math.fsum(float(p[name][1]) for p in parts)
        if count > 0:
            metrics[name] = math.fsum(float(p[name][0]) for p in parts) / count
    return metrics
