"""Epoch permutations and the data plan: every sample once per epoch, identical on every side."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from idlegrad.common.job import gather, part_batch
from idlegrad.common.permutation import epoch_permutation, part_indices
from idlegrad.coordinator.sampler import Sampler, _cuts

# permutations --------------------------------------------------------------------------------

_MASK = 2**64 - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def reference_permutation(seed: int, epoch: int, n: int) -> list[int]:
    """The documented construction in plain Python integers: sort indices by a splitmix64 hash."""
    key = _splitmix64(_splitmix64(seed) ^ epoch)
    hashes = [_splitmix64(i ^ key) for i in range(n)]
    return sorted(range(n), key=lambda i: (hashes[i], i))


@pytest.mark.parametrize("seed,epoch,n", [(0, 0, 0), (0, 0, 1), (0, 0, 10), (3, 1, 97),
                                          (2**63, 5, 64), (2**64 - 1, 2**64 - 1, 8)])
def test_is_a_permutation(seed, epoch, n):
    perm = epoch_permutation(seed, epoch, n)
    assert perm.dtype == np.int64
    assert perm.shape == (n,)
    assert sorted(perm.tolist()) == list(range(n))


def test_deterministic_and_read_only():
    a = epoch_permutation(5, 2, 50)
    epoch_permutation.cache_clear()
    b = epoch_permutation(5, 2, 50)
    assert a is not b
    assert np.array_equal(a, b)
    with pytest.raises(ValueError):
        b[0] = 1  # cached and shared: nobody may change it


def test_frozen_values():
    # Computed once; a change here means workers of different versions disagree on the data.
    assert epoch_permutation(0, 0, 10).tolist() == [0, 9, 1, 6, 3, 5, 4, 2, 8, 7]
    assert epoch_permutation(0, 1, 10).tolist() == [8, 3, 0, 1, 5, 2, 7, 4, 9, 6]
    assert epoch_permutation(7, 3, 16).tolist() == [2, 9, 1, 7, 6, 14, 3, 8, 11, 4, 0, 13, 10,
                                                    12, 15, 5]
    assert epoch_permutation(2**64 - 1, 2**64 - 1, 8).tolist() == [2, 4, 3, 6, 1, 7, 0, 5]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 200))
def test_matches_plain_integer_reference(seed, epoch, n):
    assert epoch_permutation(seed, epoch, n).tolist() == reference_permutation(seed, epoch, n)


def test_differs_between_epochs_and_seeds():
    n = 100
    base = epoch_permutation(0, 0, n)
    assert not np.array_equal(base, epoch_permutation(0, 1, n))
    assert not np.array_equal(base, epoch_permutation(1, 0, n))
    assert not np.array_equal(epoch_permutation(1, 1, n), epoch_permutation(1, 2, n))
    assert not np.array_equal(base, np.arange(n))  # it does shuffle
    epochs = {tuple(epoch_permutation(3, e, 20).tolist()) for e in range(10)}
    assert len(epochs) == 10


@pytest.mark.parametrize("seed,epoch,n", [(-1, 0, 5), (0, -1, 5), (2**64, 0, 5), (0, 2**64, 5),
                                          (0, 0, -1)])
def test_permutation_argument_errors(seed, epoch, n):
    with pytest.raises(ValueError):
        epoch_permutation(seed, epoch, n)


def test_part_indices():
    perm = epoch_permutation(4, 1, 30)
    assert part_indices(4, 30, 1, 5, 10).tolist() == perm[5:15].tolist()
    assert part_indices(4, 30, 1, 0, 30).tolist() == perm.tolist()
    assert part_indices(4, 30, 1, 30, 0).tolist() == []


@pytest.mark.parametrize("offset,count", [(-1, 3), (0, -1), (28, 3), (31, 0), (0, 31)])
def test_part_indices_bounds(offset, count):
    with pytest.raises(ValueError):
        part_indices(4, 30, 1, offset, count)


# the sampler ---------------------------------------------------------------------------------


def drain(sampler: Sampler, batch: int, partitions: int, limit: int = 10_000) -> list:
    rounds = []
    while True:
        parts = sampler.next_round(batch, partitions)
        if parts is None:
            return rounds
        rounds.append(parts)
        assert len(rounds) < limit


def covered(rounds, epoch: int) -> list[int]:
    """Offsets of `epoch` named by the rounds' parts, in order, with repeats."""
    return [o for parts in rounds for (e, off, c) in parts if e == epoch
            for o in range(off, off + c)]


def test_sampler_rejects_empty():
    with pytest.raises(ValueError):
        Sampler(0)


@pytest.mark.parametrize("n,batch,partitions", [(10, 3, 1), (10, 3, 2), (17, 5, 3), (8, 8, 1),
                                                (7, 100, 2), (12, 4, 4), (1, 3, 3)])
def test_every_sample_exactly_once_per_epoch(n, batch, partitions):
    rounds = drain(Sampler(n, epochs=3), batch, partitions)
    for epoch in range(3):
        assert covered(rounds, epoch) == list(range(n))  # in order, no gap, no repeat
    assert {e for parts in rounds for (e, _, _) in parts} == {0, 1, 2}
    per_epoch = -(-n // batch)
    assert len(rounds) == 3 * per_epoch


def test_rounds_never_span_epochs_and_last_batch_is_smaller():
    rounds = drain(Sampler(10, epochs=2), 3, 2)
    sizes = [sum(c for _, _, c in parts) for parts in rounds]
    assert sizes == [3, 3, 3, 1, 3, 3, 3, 1]
    for parts in rounds:
        assert len({e for e, _, _ in parts}) == 1
        for _, off, c in parts:
            assert c > 0 and 0 <= off and off + c <= 10


def test_partitions_split_counts():
    s = Sampler(100)
    assert s.next_round(10, 3) == [(0, 0, 3), (0, 3, 4), (0, 7, 3)]
    assert s.next_round(10, 1) == [(0, 10, 10)]
    assert s.next_round(4, 4) == [(0, 20, 1), (0, 21, 1), (0, 22, 1), (0, 23, 1)]
    assert s.next_round(2, 5) == [(0, 24, 1), (0, 25, 1)]  # no empty parts
    assert s.next_round(10, 0) == [(0, 26, 10)]  # at least one part


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 500), st.integers(1, 40))
def test_cuts_property(count, partitions):
    cuts = _cuts(count, partitions)
    assert len(cuts) == min(partitions, count) if count else cuts == []
    if cuts:
        assert cuts[0][0] == 0 and cuts[-1][1] == count
        for (_, b), (c, _) in zip(cuts, cuts[1:]):
            assert b == c
        sizes = [b - a for a, b in cuts]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_exhausted_after_epochs():
    s = Sampler(6, epochs=2)
    assert not s.exhausted
    rounds = drain(s, 4, 1)
    assert len(rounds) == 4
    assert s.exhausted
    assert s.next_round(4, 1) is None
    assert s.progress == 2.0


def test_unlimited_epochs_never_exhaust():
    s = Sampler(5)
    for _ in range(50):
        assert s.next_round(2, 1) is not None
    assert not s.exhausted
    assert s.epoch == 16 and s.offset == 4
    assert s.progress == pytest.approx(16.8)


def test_replan_comes_back_first_even_when_exhausted():
    s = Sampler(6, epochs=1)
    first = s.next_round(3, 2)
    second = s.next_round(3, 2)
    assert s.exhausted
    s.replan([list(p) for p in first])  # as lists, the way a checkpoint stores them
    s.replan(second)
    assert not s.exhausted
    assert s.next_round(100, 7) == first  # batch and partitions do not change a replanned round
    assert s.next_round(3, 2) == second
    assert s.exhausted
    assert s.next_round(3, 2) is None


def test_replan_before_new_data():
    s = Sampler(20)
    a = s.next_round(4, 1)
    b = s.next_round(4, 1)
    s.replan(a)
    assert s.next_round(4, 1) == a
    assert s.next_round(4, 1) == [(0, 8, 4)]
    assert b == [(0, 4, 4)]


def test_state_dict_resume_is_identical():
    s = Sampler(23, epochs=3)
    for _ in range(5):
        s.next_round(4, 2)
    s.replan([(0, 4, 2), (0, 6, 2)])
    s.replan([(0, 12, 4)])
    state = s.state_dict()
    # the state is plain data: it survives JSON (and torch's weights_only loading)
    state = json.loads(json.dumps(state))
    frozen = copy.deepcopy(state)
    resumed = Sampler(23, epochs=3)
    resumed.load_state_dict(state)
    assert state == frozen  # loading does not consume the caller's dict
    assert resumed.progress == s.progress
    assert drain(resumed, 4, 2) == drain(s, 4, 2)
    assert resumed.exhausted


def test_both_sides_expand_the_same():
    n, seed = 37, 11
    features = torch.arange(n, dtype=torch.float32).unsqueeze(1) * 10
    labels = torch.arange(n)
    dataset = TensorDataset(features, labels)
    s = Sampler(n, epochs=2)
    seen = {0: [], 1: []}
    for parts in drain(s, 8, 3):
        for epoch, offset, count in parts:
            x, y = part_batch(dataset, seed, epoch, offset, count)
            expected = part_indices(seed, n, epoch, offset, count)
            assert y.tolist() == expected.tolist()
            assert torch.equal(x[:, 0], labels[torch.tensor(expected.tolist())].float() * 10)
            seen[epoch] += y.tolist()
    for epoch in (0, 1):
        assert seen[epoch] == epoch_permutation(seed, epoch, n).tolist()
        assert sorted(seen[epoch]) == list(range(n))


def test_gather_generic_dataset_matches_tensor_dataset():
    class Plain(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return torch.tensor([float(i), -float(i)]), i

    idx = part_indices(2, 12, 0, 3, 5)
    x, y = gather(Plain(), idx)
    assert y.tolist() == idx.tolist()
    assert x.shape == (5, 2) and x[:, 1].tolist() == [-float(i) for i in idx]
