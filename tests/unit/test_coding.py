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
    assert weights.get(0, 0) + weights.get(1, 0) == pytest.approx(1.0)  # either copy, or a mix
    assert weights[2] == pytest.approx(1.0)
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


# the redundancy codes (issue 3) ------------------------------------------------------------------


def float32_decode_matches(code: Code, weights: dict[int, float], rng) -> bool:
    """Workers compute in float32, the server combines in float32: within 1e-5 relative."""
    partials = rng.standard_normal((code.partitions, 64)).astype(np.float32)
    slot_results = (code.matrix.astype(np.float32) @ partials).astype(np.float32)
    total = np.zeros(64, dtype=np.float32)
    for i, w in weights.items():
        total += np.float32(w) * slot_results[i]
    plain = partials.astype(np.float64).sum(axis=0)
    return np.linalg.norm(total - plain) <= 1e-5 * np.linalg.norm(plain)


def spans_ones(code: Code, arrived) -> bool:
    """Independent check: does 1 lie in the row space of the arrived rows (rank test)?"""
    if not arrived:
        return False
    rows = code.matrix[sorted(arrived)]
    return np.linalg.matrix_rank(np.vstack([rows, np.ones(code.partitions)]), tol=1e-8) == \
        np.linalg.matrix_rank(rows, tol=1e-8)


def small_codes():
    for k in range(1, 9):
        yield coding.none(k)
        for r in (2, 3):
            if k * r <= 8:
                yield coding.replicate(k, r)
    for n in range(2, 9):
        for s in range(1, n):
            yield coding.cyclic(n, s)
    yield coding.heterogeneous([1.0, 2.0, 1.0, 4.0], 6)
    yield coding.heterogeneous([1.0, 2.0, 1.0, 4.0, 3.0, 0.5], 6, replicas=2)
    yield coding.heterogeneous([5.0, 1.0, 1.0, 2.0, 2.0, 1.0], 4, replicas=3)


@pytest.mark.parametrize("code", list(small_codes()),
                         ids=lambda c: f"{c.name}-{c.slots}x{c.partitions}")
def test_exhaustive_every_pattern(code):
    """n <= 8: every pattern of at most `tolerance` missing slots decodes to the plain sum (float32,
    1e-5 relative); any other pattern decodes exactly when 1 is in its span, and then correctly."""
    rng = np.random.default_rng(code.slots * 31 + code.partitions)
    assert code.slots <= 8
    for arrived in subsets(code.slots):
        weights = coding.decode(code, arrived)
        missing = code.slots - len(arrived)
        if missing <= code.tolerance:
            assert weights is not None, (code.name, arrived)
        assert (weights is not None) == spans_ones(code, arrived), (code.name, arrived)
        if weights is not None:
            assert set(weights) <= set(arrived)
            assert float32_decode_matches(code, weights, rng), (code.name, arrived)


def test_tolerance_is_tight_for_replicate_and_cyclic():
    # one more missing slot than the tolerance can fail: a whole group, or s+1 neighbours
    code = coding.replicate(3, 2)
    assert code.tolerance == 1 and code.slots == 6 and code.name == "replicate:2"
    assert coding.decode(code, [2, 3, 4, 5]) is None  # both copies of partition 0 missing
    cyc = coding.cyclic(5, 2)
    assert cyc.tolerance == 2 and cyc.name == "cyclic:2" and cyc.slots == cyc.partitions == 5
    assert all(len(cyc.row(i)) == 3 for i in range(5))
    assert [j for j, _ in cyc.row(4)] == [0, 1, 4]  # wraps around
    assert coding.decode(cyc, [0, 1]) is None


def test_heterogeneous_shares_follow_speed():
    code = coding.heterogeneous([1.0, 3.0], 8)
    assert code.name == "hetero" and code.tolerance == 0
    assert code.matrix.sum(axis=1).tolist() == [2.0, 6.0]
    assert code.matrix.sum(axis=0).tolist() == [1.0] * 8  # every partition exactly once
    two = coding.heterogeneous([4.0, 4.0, 1.0, 1.0], 5, replicas=2)
    assert two.tolerance == 1 and two.matrix.sum(axis=0).tolist() == [2.0] * 5
    with pytest.raises(ValueError):
        coding.heterogeneous([1.0, 0.0], 3)
    with pytest.raises(ValueError):
        coding.heterogeneous([1.0, 1.0, 1.0], 2)  # three slots cannot share two partitions
    with pytest.raises(ValueError):
        coding.heterogeneous([1.0], 2, replicas=2)


def test_speculate_appends_a_duplicate_row():
    code = coding.cyclic(3, 1)
    spec = coding.speculate(code, 1)
    assert spec.slots == 4 and spec.name == code.name and spec.tolerance == code.tolerance
    assert np.array_equal(spec.matrix[3], code.matrix[1])
    assert code.slots == 3  # the original is unchanged
    none2 = coding.speculate(coding.none(2), 0)
    assert coding.decode(none2, [1, 2]) == pytest.approx({1: 1.0, 2: 1.0})  # the copy stands in
    assert coding.decode(none2, [0, 2]) is None
    with pytest.raises(ValueError):
        coding.speculate(code, 3)


def test_constructors_refuse_bad_sizes():
    with pytest.raises(ValueError):
        coding.replicate(0, 2)
    with pytest.raises(ValueError):
        coding.replicate(2, 0)
    with pytest.raises(ValueError):
        coding.cyclic(3, 3)
    assert coding.replicate(3, 1).name == "none" and coding.cyclic(4, 0).name == "none"


@pytest.mark.parametrize("text,kind,level,name", [
    ("none", "none", 0, "none"), (" Adaptive ", "adaptive", 0, "adaptive"),
    ("replicate:2", "replicate", 2, "replicate:2"), ("cyclic:1", "cyclic", 1, "cyclic:1"),
    ("cyclic:7", "cyclic", 7, "cyclic:7")])
def test_parse_redundancy(text, kind, level, name):
    policy = coding.parse_redundancy(text)
    assert (policy.kind, policy.level, str(policy)) == (kind, level, name)


@pytest.mark.parametrize("text", ["", "replicate", "replicate:1", "replicate:x", "cyclic:0",
                                  "cyclic:9", "mds:2", "none:1", "cyclic:1.5"])
def test_parse_redundancy_refuses_bad_text_in_one_line(text):
    from idlegrad.common.errors import ConfigError
    with pytest.raises(ConfigError) as info:
        coding.parse_redundancy(text)
    assert "\n" not in str(info.value) and "--redundancy" in str(info.value)


def test_build_caps_cyclic_at_k_minus_one():
    assert coding.build(coding.parse_redundancy("cyclic:3"), 2).name == "cyclic:1"
    assert coding.build(coding.parse_redundancy("cyclic:3"), 1).name == "none"
    assert coding.build(coding.parse_redundancy("replicate:2"), 3).slots == 6
    with pytest.raises(ValueError):
        coding.build(coding.parse_redundancy("adaptive"), 3)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["replicate", "cyclic", "hetero"]), st.integers(1, 12), st.integers(1, 4),
       st.lists(st.floats(0.1, 10.0), min_size=1, max_size=12), st.integers(0, 2**32 - 1))
def test_random_codes_property(kind, k, level, speeds, seed):
    """Random codes and speeds: a random pattern within the tolerance decodes to the plain sum;
    a random pattern beyond it is decoded only when it truly determines the sum."""
    if kind == "replicate":
        code = coding.replicate(k, level + 1)
    elif kind == "cyclic":
        if k < 2:
            return
        code = coding.cyclic(k, min(level, k - 1))
    else:
        speeds = speeds[:k]
        replicas = min(level, len(speeds))
        if -(-len(speeds) // replicas) > k:
            return
        code = coding.heterogeneous(speeds, k, replicas=replicas)
    rng = np.random.default_rng(seed)
    order = [int(i) for i in rng.permutation(code.slots)]
    arrived = order[:code.slots - code.tolerance]
    weights = coding.decode(code, arrived)
    assert weights is not None
    assert float32_decode_matches(code, weights, rng)
    fewer = order[:int(rng.integers(0, code.slots - code.tolerance))]
    weights = coding.decode(code, fewer)
    assert (weights is not None) == spans_ones(code, fewer)
    if weights is not None:
        assert float32_decode_matches(code, weights, rng)
