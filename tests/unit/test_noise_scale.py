"""The gradient noise scale (coordinator/noise.py): the estimator against problems whose noise is
known, then measured by a real coordinator's round core and shown in its status and metrics log."""

from __future__ import annotations

import numpy as np
import pytest

from idlegrad.common import coding
from idlegrad.common.coding import Redundancy
from idlegrad.coordinator.noise import NoiseScale, round_estimate

from .known_noise import KnownNoise, drive

def plain_round(problem: KnownNoise, sizes: list[int]):
    """One round of plain partitions (code none): each slot's (|g_j|^2, row), and |mean|^2."""
    sums = [problem.partition_sum(b) for b in sizes]
    mean = sum(sums) / sum(sizes)
    return [(float(g @ g), ((j, 1.0),)) for j, g in enumerate(sums)], float(mean @ mean)


def test_equal_partitions_give_the_papers_two_batch_estimator():
    problem = KnownNoise(64.0)
    k, b = 6, 16
    slots, mean_square = plain_round(problem, [b] * k)
    estimate = round_estimate(slots, [b] * k, mean_square)
    assert estimate is not None
    s_small = np.mean([square / b**2 for square, _ in slots])  # |g_i|^2 of the means g_i
    s_big = mean_square
    assert estimate.gradient_sq == pytest.approx((k * s_big - s_small) / (k - 1), rel=1e-9)
    assert estimate.trace == pytest.approx((s_small - s_big) * k * b / (k - 1), rel=1e-9)
    assert (estimate.slots, estimate.samples) == (k, k * b)


def test_unequal_partitions_are_unbiased_and_b_simple_is_within_25_percent_of_the_truth():
    """Partitions of 3 to 70 samples: weighting each by its samples keeps both estimates
    unbiased (an unweighted mean of the small batches' squares overstates tr(Sigma) 2.3x here)."""
    sizes = [3, 9, 17, 31, 40, 64, 70, 22]
    problem = KnownNoise(64.0, seed=1)
    noise = NoiseScale()
    estimates = []
    for _ in range(400):
        slots, mean_square = plain_round(problem, sizes)
        estimate = round_estimate(slots, sizes, mean_square)
        assert estimate is not None
        estimates.append(estimate)
        noise.observe(estimate)
    trace = np.mean([e.trace for e in estimates])
    gradient_sq = np.mean([e.gradient_sq for e in estimates])
    assert trace == pytest.approx(problem.dim * problem.variance, rel=0.05)
    assert gradient_sq == pytest.approx(1.0, rel=0.05)
    assert noise.rounds == 400
    assert noise.b_simple == pytest.approx(problem.b_simple, rel=0.25)
    assert noise.summary()["batch"] == sum(sizes)


def test_coded_rows_are_observations_too():
    """A cyclic round decoded without one straggler: its slots are coded sums of overlapping
    partitions, and still give unbiased estimates."""
    k = 6
    sizes = [10, 11, 12, 13, 14, 15]
    code = coding.build(Redundancy("cyclic", 1), k)
    problem = KnownNoise(40.0, seed=2)
    noise = NoiseScale()
    traces = []
    for r in range(400):
        sums = [problem.partition_sum(b) for b in sizes]
        arrived = [row for row in range(code.slots) if row != r % code.slots]
        weights = coding.decode(code, arrived)
        assert weights is not None
        rows = {row: tuple((j, float(code.matrix[row, j]))
                           for j in np.nonzero(code.matrix[row])[0].tolist()) for row in arrived}
        results = {row: sum(c * sums[j] for j, c in rows[row]) for row in arrived}
        decoded = sum(w * results[row] for row, w in weights.items()) / sum(sizes)
        assert np.allclose(decoded * sum(sizes), sum(sums))  # the decode is the plain sum
        used = [row for row, w in weights.items() if w]
        estimate = round_estimate([(float(results[row] @ results[row]), rows[row])
                                   for row in used], sizes, float(decoded @ decoded))
        assert estimate is not None
        traces.append(estimate.trace)
        noise.observe(estimate)
    assert np.mean(traces) == pytest.approx(40.0, rel=0.08)
    assert noise.b_simple == pytest.approx(40.0, rel=0.25)


def test_rounds_that_cannot_tell_are_not_counted():
    problem = KnownNoise(10.0)
    slots, mean_square = plain_round(problem, [32])  # one partition: no small batch
    assert round_estimate(slots, [32], mean_square) is None
    # two copies of the one partition (replicas, both used): still nothing to split
    assert round_estimate(slots * 2, [32], mean_square) is None
    slots, mean_square = plain_round(problem, [8, 8])
    assert round_estimate(slots, [8, 8], float("nan")) is None
    assert round_estimate([(float("inf"), slots[0][1]), slots[1]], [8, 8], mean_square) is None
    noise = NoiseScale()
    noise.observe(None)
    assert noise.rounds == 0 and noise.b_simple is None
    assert noise.summary() == {"b_simple": None, "gradient_sq": None, "trace": None,
                               "rounds": 0, "batch": None}


def test_b_simple_is_none_while_the_smoothed_gradient_is_not_positive():
    from idlegrad.coordinator.noise import RoundNoise

    noise = NoiseScale()
    noise.observe(RoundNoise(gradient_sq=-0.5, trace=10.0, slots=4, samples=64))
    assert noise.rounds == 1 and noise.b_simple is None
    noise.observe(RoundNoise(gradient_sq=2.5, trace=10.0, slots=4, samples=64))
    # bias-corrected EMAs: (0.05 * -0.5 * 0.95 + 0.05 * 2.5) / (1 - 0.95^2)
    expected_g = (0.95 * 0.05 * -0.5 + 0.05 * 2.5) / (1 - 0.95**2)
    assert noise.gradient_sq == pytest.approx(expected_g)
    assert noise.trace == pytest.approx(10.0)
    assert noise.b_simple == pytest.approx(10.0 / expected_g)


def test_a_coordinator_measures_it_and_its_status_and_metrics_log_show_it():
    """The real round core, model state and status of a digits coordinator, fed results whose
    gradients are drawn with a known noise scale (the model's own gradients have an unknown one):
    4 partitions of a batch of 30 (7 and 8 samples; fewer at an epoch's end)."""
    from idlegrad.coordinator.config import CoordinatorConfig, check
    from idlegrad.coordinator.status import coordinator_snapshot
    from idlegrad.coordinator.training import Training
    from idlegrad.monitor import view

    config = CoordinatorConfig(job="digits", partitions=4, max_batch=30)
    training = Training(config, check(config))
    problem = KnownNoise(150.0, seed=3, dim=training.model.model.numel)
    training.started = 100.0
    driven = drive(training, problem, 120)
    now = driven.now
    assert driven.kinds == {"gradient"}
    assert {7, 8} <= driven.slot_sizes
    snap = coordinator_snapshot(training, now)
    noise = snap["noise"]
    assert noise["rounds"] >= 120 and noise["batch"] <= 30
    assert noise["b_simple"] == pytest.approx(problem.b_simple, rel=0.25)
    assert training.metrics_record(now)["noise"] == noise
    row = dict(view.summary_rows(snap))["noise scale"]
    assert row.startswith(f"B_simple {view.number(noise['b_simple'], 1)} samples (batch {noise['batch']}")
    assert f"noise scale {view.number(noise['b_simple'], 1)}" in view.header(snap).plain
