"""Codes and decoding: a decoded combination is exactly the plain sum of the partitions."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idlegrad.common import coding
from idlegrad.common.coding import Code


def subsets(k):
    for r in range(k + 1):
        yield from itertools.combinations(range(k), r)


def combine(code: Code, weights: dict[int, float], partials: np.ndarray) -> np.ndarray:
    """What the coordinator does: each slot's coded gradient, weighted by its decoding weight."""
    slot_results = code.matrix @ partials  # f_i = sum_j E[i, j] g_j
    return sum(w * slot_results[i] for i, w in weights.items())


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_none_decodes_only_with_every_slot(k):
    code = coding.none(k)
    assert code.name == "none" and code.slots == k and code.partitions == k
    assert code.matrix.dtype == np.float64
    for arrived in subsets(k):
        weights = coding.decode(code, arrived)
        if len(arrived) == k:
            assert weights == {i: 1.0 for i in range(k)}
        else:
            assert weights is None


def test_none_rows():
    code = coding.none(3)
    assert [code.row(i) for i in range(3)] == [[(0, 1.0)], [(1, 1.0)], [(2, 1.0)]]


def test_none_needs_a_partition():
    with pytest.raises(ValueError):
        coding.none(0)


def test_decode_nothing_and_repeats():
    code = coding.none(2)
    assert coding.decode(code, []) is None
    assert coding.decode(code, [1, 0, 1, 0]) == {0: 1.0, 1: 1.0}
    assert coding.decode(code, iter([0, 1])) == {0: 1.0, 1: 1.0}


REPLICATION = Code("replicate", np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]))
# Tandon et al. 2017, n=3 slots, s=1 straggler: any two slots decode.
CYCLIC = Code("cyclic", np.array([[0.5, 1.0, 0.0], [0.0, 1.0, -1.0], [0.5, 0.0, 1.0]]))


def test_replication_matrix():
    assert coding.decode(REPLICATION, {0, 2}) == pytest.approx({0: 1.0, 2: 1.0})
    assert coding.decode(REPLICATION, {1, 2}) == pytest.approx({1: 1.0, 2: 1.0})
    assert coding.decode(REPLICATION, {0, 1}) is None  # partition 1 is nobody's
    assert coding.decode(REPLICATION, {2}) is None
    weights = coding.decode(REPLICATION, {0, 1, 2})
    assert weights is not None
    assert weights[0] + weights[1] == pytest.approx(1.0) and weights[2] == pytest.approx(1.0)
    assert REPLICATION.row(1) == [(0, 1.0)]


def test_cyclic_any_two_decode():
    for arrived in subsets(3):
        weights = coding.decode(CYCLIC, arrived)
        if len(arrived) >= 2:
            assert weights is not None, arrived
            rows = CYCLIC.matrix[list(weights)]
            assert np.allclose(np.array(list(weights.values())) @ rows, np.ones(3))
        else:
            assert weights is None, arrived
    assert CYCLIC.row(1) == [(1, 1.0), (2, -1.0)]


def test_covered_but_not_spanning_does_not_decode():
    # every partition is covered, yet no combination gives all-ones: the residual check refuses
    code = Code("bad", np.array([[1.0, 2.0], [2.0, 4.0]]))
    assert coding.decode(code, {0, 1}) is None
    code = Code("bad", np.array([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]]))
    assert coding.decode(code, {0, 1}) is None


@pytest.mark.parametrize("code", [coding.none(4), REPLICATION, CYCLIC], ids=lambda c: c.name)
def test_every_decodable_pattern_gives_the_plain_sum(code):
    rng = np.random.default_rng(0)
    partials = rng.standard_normal((code.partitions, 50))  # g_j: summed gradient of partition j
    plain = partials.sum(axis=0)
    decoded = 0
    for arrived in subsets(code.slots):
        weights = coding.decode(code, arrived)
        if weights is None:
            continue
        assert set(weights) <= set(arrived)
        assert np.allclose(combine(code, weights, partials), plain, rtol=0, atol=1e-9)
        decoded += 1
    assert decoded >= 1


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3), st.integers(0, 2**32 - 1))
def test_random_replication_property(k, r, seed):
    """k groups of r identical rows: any one per group decodes to the plain sum; missing a group
    never decodes."""
    matrix = np.repeat(np.eye(k), r, axis=0)
    code = Code("replicate", matrix)
    rng = np.random.default_rng(seed)
    partials = rng.standard_normal((k, 7))
    arrived = [g * r + int(rng.integers(r)) for g in range(k)]
    extra = [int(i) for i in rng.choice(code.slots, size=int(rng.integers(0, code.slots + 1)))]
    weights = coding.decode(code, arrived + extra)
    assert weights is not None
    assert np.allclose(combine(code, weights, partials), partials.sum(axis=0), atol=1e-9)
    if k > 1:
        missing = int(rng.integers(k))
        partial = [s for s in arrived + extra if s // r != missing]
        assert coding.decode(code, partial) is None
