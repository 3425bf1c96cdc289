"""The data plan: which samples each round takes. Pure: no torch, no clock.

A part is (epoch, offset, count) into the order of that epoch (`common.permutation`), which
workers expand to the same sample indices. A round's batch never spans two epochs: the last batch
of an epoch is smaller. Rounds that could not be applied (too stale, or open when a checkpoint
was taken) come back through `replan` before any new data, so no sample of an epoch is skipped.

With a shard-aware order (`blocks` given), an epoch's positions fall into blocks of a few
shards, and each block is planned on its own cursor: a round lies in one block (the last round
of a block is smaller), and the caller names the block (the one a worker holds the shards of,
coordinator/locality.py), so rounds from several blocks are planned side by side. Every position
of an epoch is still planned exactly once before the next epoch begins.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Callable, Optional, Sequence

from ..common.permutation import Block

Part = tuple[int, int, int]


class Sampler:
    def __init__(self, n: int, epochs: Optional[int] = None,
                 blocks: Optional[Callable[[int], Sequence[Block]]] = None):
        """`blocks(epoch)`: the epoch's blocks in order (a shard-aware order); None: the epoch
        is planned front to back."""
        if n <= 0:
            raise ValueError("the training set is empty")
        self.n = n
        self.epochs = epochs
        self.epoch = 0
        self.offset = 0  # positions of the epoch planned so far (front to back: the next one)
        self.blocks = blocks
        self._cursors: dict[int, int] = {}  # block -> its next position (blocks begun)
        self._open: dict[int, None] = {}  # blocks with positions left, in the epoch's order
        self._replan: deque[list[Part]] = deque()
        self._starts: dict[int, list[int]] = {}  # epoch -> its blocks' first positions
        self._start_epoch()

    def _start_epoch(self) -> None:
        self._cursors = {}
        if self.blocks is not None:
            self._open = {b: None for b, block in enumerate(self.blocks(self.epoch))
                          if block.end > block.start}

    @property
    def replanning(self) -> bool:
        """Whether the next round is a replanned one (its parts come back as they were cut)."""
        return bool(self._replan)

    def next_round(self, batch_size: int, partitions: int, block: Optional[int] = None,
                   shares: Optional[Sequence[float]] = None) -> Optional[list[Part]]:
        """The parts of the next round, or None when the plan is exhausted. `block`: the block
        of the current epoch to plan from (shard-aware order; default: the first with samples
        left); a block without samples left is ignored. `shares`: one positive weight per part,
        the parts cut in proportion to them (each of at least one sample; equal parts where the
        batch has fewer samples than shares)."""
        if self._replan:
            return self._replan.popleft()
        if self.epochs is not None and self.epoch >= self.epochs:
            return None
        block, start, end = self._span(block)
        count = min(batch_size, end - start)
        cuts = _cuts_by_shares(count, shares) if shares else None
        parts = [(self.epoch, start + a, b - a) for a, b in cuts or _cuts(count, partitions)]
        self.offset += count
        if self.blocks is not None:
            assert block is not None  # chosen above, among the open blocks
            self._cursors[block] = start + count
            if start + count >= end:
                del self._open[block]
        if self.offset >= self.n:
            self.epoch, self.offset = self.epoch + 1, 0
            self._start_epoch()
        return parts

    def _span(self, block: Optional[int]) -> tuple[Optional[int], int, int]:
        """The block the next round is planned from and its positions left, [start, end)."""
        if self.blocks is None:
            return block, self.offset, self.n
        if block not in self._open:
            block = next(iter(self._open))
        span = self.blocks(self.epoch)[block]
        return block, self._cursors.get(block, span.start), span.end

    def next_count(self, batch_size: int, block: Optional[int] = None) -> int:
        """The samples `next_round(batch_size, ..., block)` would plan, outside a replan: fewer
        than the batch at an epoch's (or a block's) end."""
        _, start, end = self._span(block)
        return min(batch_size, end - start)

    def open_blocks(self) -> list[int]:
        """Blocks of the current epoch with positions left, in the epoch's order (none without
        a shard-aware order)."""
        return list(self._open) if self.blocks is not None else []

    def has_left(self, block: int) -> bool:
        return block in self._open

    def block_left(self, block: int) -> float:
        """The fraction of `block`'s positions (current epoch) not planned yet: 0 once closed."""
        if self.blocks is None or block not in self._open:
            return 0.0
        span = self.blocks(self.epoch)[block]
        start = self._cursors.get(block, span.start)
        return (span.end - start) / max(1, span.end - span.start)

    def block_of(self, part: Part) -> Optional[tuple[int, int]]:
        """(epoch, block) of the block holding `part` (a round's parts share one); None without
        a shard-aware order."""
        if self.blocks is None:
            return None
        epoch, offset = part[0], part[1]
        starts = self._starts.get(epoch)
        if starts is None:
            if len(self._starts) > 2:
                self._starts.clear()
            starts = self._starts[epoch] = [b.start for b in self.blocks(epoch)]
        return epoch, max(0, bisect.bisect_right(starts, offset) - 1)

    def replan(self, parts: list[Part]) -> None:
        """Give a round's parts back; they come out again, as one round, before new data."""
        self._replan.append([(epoch, offset, count) for epoch, offset, count in parts])

    @property
    def exhausted(self) -> bool:
        return not self._replan and self.epochs is not None and self.epoch >= self.epochs

    @property
    def progress(self) -> float:
        """Epochs planned so far, fractional."""
        return self.epoch + self.offset / self.n

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "offset": self.offset,
                 "replan": [[list(p) for p in parts] for parts in self._replan]}
        if self.blocks is not None:
            state["cursors"] = [[b, c] for b, c in sorted(self._cursors.items())]
        return state

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._replan = deque([[tuple(p) for p in parts] for parts in state["replan"]])
        self._start_epoch()
        if self.blocks is None:
            return
        blocks = self.blocks(self.epoch)
        if "cursors" in state:
            cursors = {int(b): int(c) for b, c in state["cursors"]}
        else:  # a plan made front to back: the first `offset` positions are planned
            cursors = {b: min(max(self.offset, s.start), s.end) for b, s in enumerate(blocks)
                       if self.offset > s.start}
        for b, position in cursors.items():
            self._cursors[b] = position
            if position >= blocks[b].end:
                self._open.pop(b, None)


def _cuts(count: int, partitions: int) -> list[tuple[int, int]]:
    """Split range(count) into at most `partitions` contiguous, nearly equal, non-empty pieces."""
    k = max(1, min(partitions, count))
    bounds = [round(i * count / k) for i in range(k + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _cuts_by_shares(count: int, shares: Sequence[float]) -> Optional[list[tuple[int, int]]]:
    """Split range(count) into one contiguous piece per share, sized in proportion to the shares
    (cumulative rounding: the sizes add up to `count` exactly), each of at least one sample.
    None where that cannot be done (fewer samples than shares, a share not positive)."""
    k = len(shares)
    if k == 0 or count < k or not all(share > 0 for share in shares):
        return None
    total = math.fsum(shares)
    bounds, cumulative = [0], 0.0
    for i, share in enumerate(shares[:-1]):
        cumulative += share
        ideal = round(count * cumulative / total)
        # at least one sample for this piece and for each piece after it
        bounds.append(min(max(ideal, bounds[-1] + 1), count - (k - 1 - i)))
    bounds.append(count)
    return list(zip(bounds, bounds[1:]))
