"""Epoch permutations that every side derives alike from (seed, epoch, n).

A task names its samples as (epoch, offset, count) into the permutation of that epoch, so a task
is a few integers on the wire, whatever its size. The permutation must be identical on every
worker, whatever its numpy or torch version: it sorts a splitmix64 hash of each index, integer
arithmetic with defined wrap-around, rather than relying on a library's random stream.

Sharded data (common/sharded.py) may instead be read in a shard-aware order (`ShardOrder`): each
epoch shuffles the shards, cuts that sequence into blocks of `window` consecutive shards, and
shuffles the samples within each block only, as a shuffle buffer over a stream of shards would. A
block is a contiguous range of the epoch's positions, so any range of positions inside one block
touches at most `window` shards: what lets a worker compute on the shards it holds (the
coordinator's locality, coordinator/locality.py). Both orders are bijections over the epoch,
derived alike on every side from the seed and the epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple, Union

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _epoch_key(seed: int, epoch: int, salt: int = 0) -> np.uint64:
    if not (0 <= seed < 2**64 and 0 <= epoch < 2**64):
        raise ValueError("seed and epoch must be in [0, 2**64)")
    with np.errstate(over="ignore"):
        key = _splitmix64(_splitmix64(np.array([seed], dtype=np.uint64)) ^ np.uint64(epoch))
        if salt:  # the shard-aware order's keys differ from the full shuffle's
            key = _splitmix64(key ^ np.uint64(salt))
    return key[0]


def _hash_order(values: np.ndarray, key: np.uint64) -> np.ndarray:
    """`values` sorted by a keyed splitmix64 hash of each (ties, which need a 64-bit collision,
    by position)."""
    with np.errstate(over="ignore"):
        hashes = _splitmix64(values.astype(np.uint64) ^ key)
    return values[np.argsort(hashes, kind="stable")]


@lru_cache(maxsize=4)
def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order in which epoch `epoch` visits samples 0..n-1 (read-only int64 array)."""
    if n < 0:
        raise ValueError("n must be non-negative")
    perm = _hash_order(np.arange(n, dtype=np.int64), _epoch_key(seed, epoch))
    perm.setflags(write=False)
    return perm


@dataclass(frozen=True)
class ShardOrder:
    """The shard-aware order of a sharded training set: `shard_samples[k]` samples in shard k
    (samples numbered shard after shard, as a ShardedDataset numbers them), shuffled within
    blocks of `window` shards. Hashable: it keys the epoch cache."""

    seed: int
    shard_samples: tuple[int, ...]
    window: int

    def __post_init__(self):
        if self.window < 1:
            raise ValueError("the shuffle window is at least one shard")
        if any(s < 0 for s in self.shard_samples):
            raise ValueError("a shard holds a non-negative number of samples")

    @property
    def samples(self) -> int:
        return sum(self.shard_samples)


class Block(NamedTuple):
    """`window` consecutive shards of an epoch's shard order, and the positions they fill."""

    start: int  # first position in the epoch's order
    end: int  # one past the last
    shards: tuple[int, ...]


# What names an epoch's order: a seed (a full shuffle) or a ShardOrder.
EpochOrder = Union[int, ShardOrder]

_SHARD_SALT = 0x5348415244  # "SHARD"
_BLOCK_SALT = 0x424C4F434B  # "BLOCK"


@lru_cache(maxsize=8)
def epoch_blocks(order: ShardOrder, epoch: int) -> tuple[Block, ...]:
    """The blocks of epoch `epoch`, in the order the epoch visits them. O(shards log shards)."""
    shards = _hash_order(np.arange(len(order.shard_samples), dtype=np.int64),
                         _epoch_key(order.seed, epoch, _SHARD_SALT)).tolist()
    blocks, position = [], 0
    for first in range(0, len(shards), order.window):
        members = tuple(shards[first:first + order.window])
        size = sum(order.shard_samples[k] for k in members)
        blocks.append(Block(position, position + size, members))
        position += size
    return tuple(blocks)


@lru_cache(maxsize=4)
def shard_permutation(order: ShardOrder, epoch: int) -> np.ndarray:
    """The shard-aware order of epoch `epoch` (read-only int64 array of sample indices): the
    blocks one after another, each block's samples shuffled among themselves."""
    starts = np.concatenate([[0], np.cumsum(order.shard_samples, dtype=np.int64)])
    key = _epoch_key(order.seed, epoch, _BLOCK_SALT)
    pieces = []
    for block in epoch_blocks(order, epoch):
        members = [np.arange(starts[k], starts[k + 1], dtype=np.int64) for k in block.shards]
        if members:
            pieces.append(_hash_order(np.concatenate(members), key))
    perm = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    perm.setflags(write=False)
    return perm


def permutation(order: EpochOrder, epoch: int, n: int) -> np.ndarray:
    """Epoch `epoch`'s order of a data set of `n` samples, under `order`."""
    if isinstance(order, ShardOrder):
        if order.samples != n:
            raise ValueError(f"a shard order over {order.samples} samples for a data set of {n}")
        return shard_permutation(order, epoch)
    return epoch_permutation(order, epoch, n)


def part_indices(order: EpochOrder, n: int, epoch: int, offset: int, count: int) -> np.ndarray:
    """Sample indices of one part; raises ValueError when the part lies outside the epoch.
    `order`: the seed of a full shuffle, or a ShardOrder."""
    if offset < 0 or count < 0 or offset + count > n:
        raise ValueError(f"part [{epoch}, {offset}, {count}] outside a data set of {n} samples")
    return permutation(order, epoch, n)[offset:offset + count]
