"""Epoch permutations that every side derives alike from (seed, epoch, n).

A task names its samples as (epoch, offset, count) into the permutation of that epoch, so a task
is a few integers on the wire, whatever its size. The permutation must be identical on every
worker, whatever its numpy or torch version: it sorts a splitmix64 hash of each index, integer
arithmetic with defined wrap-around, rather than relying on a library's random stream.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


@lru_cache(maxsize=4)
def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order in which epoch `epoch` visits samples 0..n-1 (read-only int64 array)."""
    if not (0 <= seed < 2**64 and 0 <= epoch < 2**64 and n >= 0):
        raise ValueError("seed and epoch must be in [0, 2**64), n non-negative")
    with np.errstate(over="ignore"):
        key = _splitmix64(_splitmix64(np.array([seed], dtype=np.uint64)) ^ np.uint64(epoch))[0]
        hashes = _splitmix64(np.arange(n, dtype=np.uint64) ^ key)
    perm = np.argsort(hashes, kind="stable").astype(np.int64)
    perm.setflags(write=False)
    return perm


def part_indices(seed: int, n: int, epoch: int, offset: int, count: int) -> np.ndarray:
    """Sample indices of one part; raises ValueError when the part lies outside the epoch."""
    if offset < 0 or count < 0 or offset + count > n:
        raise ValueError(f"part [{epoch}, {offset}, {count}] outside a data set of {n} samples")
    return epoch_permutation(seed, epoch, n)[offset:offset + count]
