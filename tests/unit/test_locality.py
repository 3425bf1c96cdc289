"""Locality: the shard-aware epoch order, its plan block by block, and the scheduler's
preference for the shards a worker holds. Pure: no sockets, no clock."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from idlegrad.common import protocol as proto
from idlegrad.common.errors import ProtocolError
from idlegrad.common.job import epoch_order
from idlegrad.common.permutation import (ShardOrder, epoch_blocks, epoch_permutation,
                                         part_indices, shard_permutation)
from idlegrad.common.coding import Redundancy
from idlegrad.coordinator.locality import Locality, group_for
from idlegrad.coordinator.sampler import Sampler
from idlegrad.coordinator.scheduler import Assign, Decoded, Scheduler, SchedulerConfig
from .scheduling import Dealing


def shard_of(order: ShardOrder) -> np.ndarray:
    """Sample index -> its shard, as a ShardedDataset numbers them."""
    return np.repeat(np.arange(len(order.shard_samples)), order.shard_samples)


# the order --------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(0, 50),
       st.lists(st.integers(0, 40), min_size=1, max_size=30), st.integers(1, 8))
def test_a_bijection_whose_blocks_hold_at_most_window_shards(seed, epoch, sizes, window):
    order = ShardOrder(seed, tuple(sizes), window)
    perm = shard_permutation(order, epoch)
    assert sorted(perm.tolist()) == list(range(sum(sizes)))
    blocks = epoch_blocks(order, epoch)
    # the blocks partition the shards and, in order, the positions
    assert sorted(k for b in blocks for k in b.shards) == list(range(len(sizes)))
    assert [b.start for b in blocks] == [0] + [b.end for b in blocks[:-1]]
    assert blocks[-1].end == sum(sizes)
    shards = shard_of(order)
    for block in blocks:
        assert len(block.shards) <= window
        inside = set(shards[perm[block.start:block.end]].tolist())
        assert inside <= set(block.shards)  # a block's positions read only its shards


def test_deterministic_read_only_and_reshuffled_each_epoch():
    order = ShardOrder(7, (30,) * 12, 3)
    a = shard_permutation(order, 2)
    shard_permutation.cache_clear()
    epoch_blocks.cache_clear()
    b = shard_permutation(ShardOrder(7, (30,) * 12, 3), 2)
    assert a is not b and np.array_equal(a, b)
    with pytest.raises(ValueError):
        b[0] = 1
    assert not np.array_equal(a, shard_permutation(order, 3))
    assert not np.array_equal(a, shard_permutation(ShardOrder(8, (30,) * 12, 3), 2))
    # the shard order itself changes between epochs, not only the samples within blocks
    assert ([blk.shards for blk in epoch_blocks(order, 2)]
            != [blk.shards for blk in epoch_blocks(order, 3)])
    # and samples are shuffled within a block (not left shard after shard)
    shards = shard_of(order)[a]
    assert np.any(shards[1:] != shards[:-1]) and np.count_nonzero(np.diff(shards)) > 12


def test_part_indices_follows_the_order():
    order = ShardOrder(3, (10, 0, 7, 13), 2)
    perm = shard_permutation(order, 1)
    assert part_indices(order, 30, 1, 4, 9).tolist() == perm[4:13].tolist()
    with pytest.raises(ValueError):
        part_indices(order, 31, 1, 0, 3)  # an order over another data set


class FakeSharded(TensorDataset):
    """A data set that declares a manifest, as ShardedDataset does."""

    def __init__(self, sizes):
        super().__init__(torch.arange(sum(sizes)))
        self.manifest_sha256 = "a" * 64
        self.manifest = type("M", (), {"shards": [type("S", (), {"samples": s})() for s in sizes]})


def test_data_that_is_not_sharded_keeps_the_full_shuffle():
    plain = TensorDataset(torch.arange(50))
    assert epoch_order(plain, 5, 4) == 5
    assert part_indices(epoch_order(plain, 5, 4), 50, 2, 0, 50).tolist() == \
        epoch_permutation(5, 2, 50).tolist()
    assert epoch_order(FakeSharded([20, 30]), 5, 0) == 5  # --locality off
    assert epoch_order(FakeSharded([20, 30]), 5, 4) == ShardOrder(5, (20, 30), 4)


# the plan block by block ----------------------------------------------------------------------


def block_sampler(order: ShardOrder, epochs=None) -> Sampler:
    return Sampler(order.samples, epochs, blocks=partial(epoch_blocks, order))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 25), min_size=1, max_size=12).filter(lambda s: sum(s) > 0),
       st.integers(1, 4), st.integers(1, 9), st.integers(1, 3), st.randoms())
def test_every_position_once_per_epoch_whatever_blocks_are_asked(sizes, window, batch, k, rnd):
    order = ShardOrder(1, tuple(sizes), window)
    sampler = block_sampler(order, epochs=2)
    seen = {0: [], 1: []}
    while (parts := sampler.next_round(batch, k, rnd.choice([None, 0, 1, 2, 5]))) is not None:
        blocks = {sampler.block_of(p) for p in parts}
        assert len(blocks) == 1  # a round never spans two blocks
        (epoch, b), = blocks
        span = epoch_blocks(order, epoch)[b]
        for e, offset, count in parts:
            assert span.start <= offset and offset + count <= span.end
            seen[e] += range(offset, offset + count)
    for epoch in (0, 1):
        assert sorted(seen[epoch]) == list(range(sum(sizes)))


def test_the_asked_block_is_planned_and_the_plan_survives_a_checkpoint():
    order = ShardOrder(0, (10,) * 8, 2)
    sampler = block_sampler(order)
    blocks = epoch_blocks(order, 0)
    parts = sampler.next_round(6, 2, block=2)
    assert parts == [(0, blocks[2].start, 3), (0, blocks[2].start + 3, 3)]
    assert sampler.next_round(100, 1, block=2) == [(0, blocks[2].start + 6, 14)]
    assert not sampler.has_left(2) and sampler.open_blocks() == [0, 1, 3]
    again = block_sampler(order)
    again.load_state_dict(sampler.state_dict())
    assert again.open_blocks() == [0, 1, 3]
    assert again.next_round(5, 1, block=3) == sampler.next_round(5, 1, block=3)


def test_a_checkpoint_planned_front_to_back_resumes_by_blocks():
    order = ShardOrder(0, (10,) * 8, 2)
    sampler = block_sampler(order)
    sampler.load_state_dict({"epoch": 0, "offset": 25, "replan": []})
    assert sampler.open_blocks() == [1, 2, 3]
    assert sampler.next_round(100, 1, block=1) == [(0, 25, 15)]


# the scheduler's preference -----------------------------------------------------------------


def local_scheduler(order: ShardOrder, redundancy=Redundancy(), **config) -> Dealing:
    return Dealing(Scheduler(SchedulerConfig(batch_size=config.pop("batch", 4), redundancy=redundancy,
                                     **config),
                     block_sampler(order), locality=Locality(order, group_for(redundancy))))


def block_of_assign(s: Scheduler, a: Assign):
    return s.sampler.block_of(tuple(a.parts[0]))


def test_a_worker_gets_slots_of_the_shards_it_holds():
    order = ShardOrder(0, (400,) * 12, 3)  # 300 rounds a block: none runs out here
    blocks = epoch_blocks(order, 0)
    s = local_scheduler(order, partitions=4)  # a round's slots outnumber a worker's credits
    for name, block in (("a", 3), ("b", 1)):
        s.join(name, {}, 0.0)
        s.holdings(name, list(blocks[block].shards))
    handed = s.ready("a", 2, 0.0) + s.ready("b", 2, 0.0)
    assert s.pending() == 4  # two slots of each worker's round wait for it
    for a in handed:
        assert block_of_assign(s, a) == (0, {"a": 3, "b": 1}[a.worker])
    # answering keeps each in its block: b takes none of a's pending slots
    for now in range(1, 20):
        out = []
        for a in [x for x in handed if isinstance(x, Assign)]:
            ok, actions = s.result(a.worker, a.slot, 0.1, float(now))
            out += actions
            if any(isinstance(d, Decoded) for d in actions):
                out += s.applied(s.version + 1, float(now))
        handed = [x for x in out if isinstance(x, Assign)]
        assert handed
        for a in handed:
            assert block_of_assign(s, a) == (0, {"a": 3, "b": 1}[a.worker])


def test_a_cold_worker_works_from_the_block_it_is_told_to_fetch():
    order = ShardOrder(0, (40,) * 12, 3)
    s = local_scheduler(order)
    s.join("cold", {}, 0.0)
    (a,) = s.ready("cold", 1, 0.0)
    epoch, block = block_of_assign(s, a)
    shards = epoch_blocks(order, 0)[block].shards
    assert a.prefetch == shards  # its block's shards: the next block's only near its end
    # a second cold worker is sent to another block (one worker per block without redundancy)
    s.join("cold2", {}, 0.0)
    (b,) = s.ready("cold2", 1, 0.0)
    assert block_of_assign(s, b) != (epoch, block)
    # once it holds its block, the hint names only what it lacks
    s.holdings("cold", list(shards))
    s.result("cold", a.slot, 0.1, 1.0)
    more = [x for x in s.applied(1, 1.0) if isinstance(x, Assign) and x.worker == "cold"]
    assert more and not set(more[0].prefetch) & set(shards)


def test_the_next_blocks_shards_are_hinted_only_near_the_end_of_the_home_block():
    order = ShardOrder(0, (40,) * 12, 3)
    locality = Locality(order)
    blocks = epoch_blocks(order, 0)
    open_blocks = lambda: list(range(len(blocks)))
    home = locality.block_for("w", 0, open_blocks())
    early = locality.hint("w", 0, open_blocks, left=lambda block: 0.9)
    assert early == blocks[home].shards
    late = locality.hint("w", 0, open_blocks, left=lambda block: 0.2)
    assert late[:3] == blocks[home].shards and len(late) == 6
    following = set(late[3:])
    # when its home closes, it moves to the block it was told to fetch, held or not yet
    assert blocks[locality.block_for("w", 0, [b for b in open_blocks() if b != home])].shards == \
        tuple(late[3:]) and following


def test_the_prefetch_hint_is_bounded():
    order = ShardOrder(0, (2,) * 1000, 200)
    s = local_scheduler(order, batch=8)
    s.join("w", {}, 0.0)
    (a,) = s.ready("w", 1, 0.0)
    assert len(a.prefetch) == proto.MAX_PREFETCH
    assert len(set(a.prefetch)) == len(a.prefetch)


def test_slots_of_a_worker_that_left_go_to_the_others():
    order = ShardOrder(0, (40,) * 12, 3)
    blocks = epoch_blocks(order, 0)
    s = local_scheduler(order, partitions=4, batch=8)
    s.join("a", {}, 0.0)
    s.holdings("a", list(blocks[0].shards))
    (first,) = s.ready("a", 1, 0.0)  # a round of block 0: three slots left pending
    s.join("b", {}, 0.0)
    s.holdings("b", list(blocks[3].shards))
    s.leave("a", 1.0)
    taken = [x for x in s.ready("b", 8, 1.0) if isinstance(x, Assign)]
    assert {block_of_assign(s, x) for x in taken} >= {(0, 0)}  # nobody else would take them
    assert any(x.slot == first.slot for x in taken)


def test_redundant_copies_go_to_workers_sharing_the_block():
    order = ShardOrder(0, (40,) * 12, 3)
    s = local_scheduler(order, redundancy=Redundancy("replicate", 2), partitions=1)
    for name in ("a", "b", "c", "d"):
        s.join(name, {}, 0.0)
    handed = [x for n in ("a", "b", "c", "d") for x in s.ready(n, 1, 0.0)]
    rounds: dict[int, set] = {}
    for a in handed:
        rounds.setdefault(a.round, set()).add(a.worker)
    # two rounds, each replicated over the two workers at home in its block
    assert sorted(len(w) for w in rounds.values()) == [2, 2]
    assert len({block_of_assign(s, a) for a in handed}) == 2


def test_group_sizes():
    assert group_for(Redundancy()) == 1
    assert group_for(Redundancy("replicate", 3)) == 3
    assert group_for(Redundancy("cyclic", 1)) == 2


# the wire ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("msg", [
    proto.Heartbeat(state="idle", shards=list(range(proto.MAX_HELD_SHARDS + 1))),
    proto.Heartbeat(state="idle", shards=[3, -1]),
    proto.Task(slot=1, round=1, version=0, parts=[[0, 0, 1]], coefficients=[1.0],
               deadline_s=1.0, prefetch=list(range(proto.MAX_PREFETCH + 1))),
    proto.Welcome(job="digits", job_args={}, fingerprint="f", seed=0, heartbeat_s=1.0,
                  liveness=3, shuffle_window=proto.MAX_SHUFFLE_WINDOW + 1),
])
def test_locality_fields_are_bounded_on_the_wire(msg):
    with pytest.raises(ProtocolError):
        proto.decode(proto.encode(msg))


def test_locality_fields_travel():
    beat = proto.decode(proto.encode(proto.Heartbeat(state="working", shards=[0, 5, 9])))
    assert beat.shards == [0, 5, 9]
    assert proto.decode(proto.encode(proto.Heartbeat())).shards is None


# the simulator ----------------------------------------------------------------------------------


def test_locality_cuts_what_workers_download_in_the_simulator():
    from idlegrad.coordinator import simulator as sim

    def run(locality: bool):
        fleet = [sim.WorkerSpec(f"w{i}", s_per_sample=0.002 * (1 + 0.1 * i), bandwidth=50e6)
                 for i in range(4)]
        config = sim.SimConfig(duration_s=3000, batch_size=256, partitions=4,
                               train_samples=16_000, target_samples=16_000, shards=32,
                               shard_bytes=2**20, shuffle_window=1, locality=locality)
        return sim.simulate(fleet, config, "none")

    with_, without = run(True), run(False)
    assert with_.samples_applied >= 16_000 and without.samples_applied >= 16_000
    assert without.download_ratio == 4.0  # a full shuffle: every worker fetches every shard
    assert with_.download_ratio <= 1.5, with_.downloaded
