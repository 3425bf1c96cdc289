"""Locality: which worker computes on which shards. Pure: no sockets, no clock.

With a shard-aware order (common/permutation.py) an epoch is a sequence of blocks of a few
shards, and any slot's samples lie in one block. Workers say which shards of the training set
they hold; each worker is given a home block to work from, the one whose shards it holds most of
(a cold worker: the first block too few workers share), and the scheduler prefers its pending
slots of blocks a worker is at home in or holds whole (BOINC's locality scheduling). A worker is
told the shards it will need next (its home block's, then the block it would be given after), so
it fetches ahead: a cold worker's first slots come from the block it is fetching.

`group`: how many workers share a block before a cold one is sent to another: a code with
redundancy needs its copies computed by different workers (replicate:R, R workers).
`patience`: a pending slot of a round that has waited about that many slot times (its age in
versions over the rounds open) is anybody's, so that a block whose workers are slow or gone never
holds its round back for long.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable, Optional, Sequence

from ..common.coding import Redundancy
from ..common.permutation import Block, ShardOrder, epoch_blocks
from ..common.locality_bounds import MAX_PREFETCH

BlockKey = tuple[int, int]  # (epoch, block)


def group_for(redundancy: Redundancy, adaptive_max_level: int = 2) -> int:
    """Workers a block needs at home so that a round's copies go to different workers: R for
    replicate:R, S+1 for cyclic:S (a slot covers S+1 partitions), the most adaptive may
    choose."""
    if redundancy.kind == "replicate":
        return redundancy.level
    if redundancy.kind == "cyclic":
        return redundancy.level + 1
    if redundancy.kind == "adaptive":
        return adaptive_max_level + 1
    return 1


class Locality:
    # A worker is told its next block's shards once its home block has this fraction of its
    # positions left to plan: early enough to fetch them before it runs out, late enough that a
    # worker that never gets there (the epoch ends, others finish it) fetches nothing for it.
    NEXT_BLOCK_WHEN_LEFT = 0.25

    def __init__(self, order: ShardOrder, group: int = 1, patience: float = 2.0,
                 max_hint: int = MAX_PREFETCH):
        self.order = order
        self.group = max(1, group)
        self.patience = max(0.0, patience)
        self.max_hint = max(0, min(max_hint, MAX_PREFETCH))
        self.held: dict[str, frozenset[int]] = {}
        self.home: dict[str, BlockKey] = {}
        # A worker keeps tending the block it left (its last rounds there may still be pending)
        # and claims the block its hint names next (so that cold choices spread).
        self.previous: dict[str, BlockKey] = {}
        self.claim: dict[str, BlockKey] = {}
        self.homed: Counter[BlockKey] = Counter()  # workers at home in (or tending) each block
        self.claims: Counter[BlockKey] = Counter()
        # worker -> (epoch, whether it names the next block too, hint)
        self._hints: dict[str, tuple[int, bool, tuple[int, ...]]] = {}
        self._shard_block: tuple[int, dict[int, int]] = (-1, {})

    # what workers say -------------------------------------------------------------------------

    def report(self, worker: str, shards: Iterable[int]) -> None:
        """The shards `worker` holds now (indices outside the data set are ignored)."""
        count = len(self.order.shard_samples)
        held = frozenset(k for k in shards if 0 <= k < count)
        if held != self.held.get(worker, frozenset()):
            self.held[worker] = held
            self._hints.pop(worker, None)

    def forget(self, worker: str) -> None:
        self.held.pop(worker, None)
        self._hints.pop(worker, None)
        for held in (self.home, self.previous):
            key = held.pop(worker, None)
            if key is not None:
                self._leave_home(key)
        self._unclaim(worker)

    # decisions --------------------------------------------------------------------------------

    def blocks(self, epoch: int) -> tuple[Block, ...]:
        return epoch_blocks(self.order, epoch)

    def block_for(self, worker: str, epoch: int, open_blocks: Sequence[int]) -> Optional[int]:
        """The block `worker` should plan its next round from: its home while that has samples
        left, else a new home (`choose`). None when no block of the epoch has samples left."""
        key = self.home.get(worker)
        if key is not None and key[0] == epoch and key[1] in open_blocks:
            return key[1]
        block = self.choose(worker, epoch, open_blocks)
        self._move(worker, None if block is None else (epoch, block))
        return block

    def choose(self, worker: str, epoch: int, open_blocks: Sequence[int],
               exclude: Optional[int] = None) -> Optional[int]:
        """The open block whose shards `worker` holds most of (ties: the fewest workers at home
        there, then the epoch's order); for a worker holding none of them, the first block
        fewer than `group` workers share, else the least shared."""
        candidates = [b for b in open_blocks if b != exclude]
        if not candidates:
            return None
        open_set = set(candidates)
        shard_block = self._blocks_by_shard(epoch)
        held: Counter[int] = Counter()
        for shard in self.held.get(worker, ()):
            block = shard_block.get(shard)
            if block in open_set:
                held[block] += 1
        if held:
            return max(held, key=lambda b: (held[b], -self.homed[(epoch, b)], -b))
        claimed = self.claim.get(worker)
        if claimed is not None and claimed[0] == epoch and claimed[1] in open_set:
            return claimed[1]  # the block it was told to fetch next, maybe still on its way
        def load(b):
            return self.homed[(epoch, b)] + self.claims[(epoch, b)]
        for block in candidates:
            if load(block) < self.group:
                return block
        return min(candidates, key=lambda b: (load(b), b))

    def affine(self, worker: str, key: Optional[BlockKey]) -> bool:
        """Whether `worker` is at home in block `key` or holds all its shards."""
        if key is None:
            return True
        if self.home.get(worker) == key or self.previous.get(worker) == key:
            return True
        held = self.held.get(worker)
        if not held:
            return False
        return all(k in held for k in self.blocks(key[0])[key[1]].shards)

    def anybodys(self, key: Optional[BlockKey], waited: float, speculated: bool) -> bool:
        """Whether a pending slot of block `key` may go to any worker: nobody is at home in
        its block (its workers left, or it was replanned), its round has `waited` `patience`
        slot times, or it duplicates a late slot (it is wanted now)."""
        return (key is None or speculated or waited >= self.patience
                or self.homed[key] == 0)

    def hint(self, worker: str, epoch: int, open_blocks: Callable[[], Sequence[int]],
             left: Callable[[int], float] = lambda block: 1.0) -> tuple[int, ...]:
        """The shards `worker` should fetch ahead, at most `max_hint`: what it lacks of its
        home block, and once that block has NEXT_BLOCK_WHEN_LEFT of its positions left to plan
        (`left(block)`, a fraction), of the block it would be given next. Kept until its
        holdings or home change or its home nears its end (`open_blocks` is asked only then)."""
        key = self.home.get(worker)
        home = key[1] if key is not None and key[0] == epoch else None
        ending = home is None or left(home) <= self.NEXT_BLOCK_WHEN_LEFT
        cached = self._hints.get(worker)
        if cached is not None and cached[0] == epoch and cached[1] == ending:
            return cached[2]
        held = self.held.get(worker, frozenset())
        wanted: list[int] = []
        blocks = self.blocks(epoch)
        self._unclaim(worker)
        following = None
        if ending:
            following = self.choose(worker, epoch, open_blocks(), exclude=home)
            if following is not None:
                self.claim[worker] = (epoch, following)
                self.claims[(epoch, following)] += 1
        for block in (home, following):
            if block is not None:
                wanted += [k for k in blocks[block].shards if k not in held and k not in wanted]
        hint = tuple(wanted[:self.max_hint])
        self._hints[worker] = (epoch, ending, hint)
        return hint

    # internals --------------------------------------------------------------------------------

    def _move(self, worker: str, key: Optional[BlockKey]) -> None:
        old = self.home.pop(worker, None)
        if old is not None:
            gone = self.previous.pop(worker, None)
            if gone is not None:
                self._leave_home(gone)
            self.previous[worker] = old  # still counted in `homed`
        self._unclaim(worker)
        if key is not None:
            self.home[worker] = key
            self.homed[key] += 1
        self._hints.pop(worker, None)

    def _unclaim(self, worker: str) -> None:
        key = self.claim.pop(worker, None)
        if key is not None:
            self.claims[key] -= 1
            if self.claims[key] <= 0:
                del self.claims[key]

    def _leave_home(self, key: BlockKey) -> None:
        self.homed[key] -= 1
        if self.homed[key] <= 0:
            del self.homed[key]

    def _blocks_by_shard(self, epoch: int) -> dict[int, int]:
        cached_epoch, mapping = self._shard_block
        if cached_epoch != epoch:
            mapping = {k: b for b, block in enumerate(self.blocks(epoch)) for k in block.shards}
            self._shard_block = (epoch, mapping)
        return mapping
