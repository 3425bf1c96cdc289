"""The data plan: which samples each round takes. Pure: no torch, no clock.

A part is (epoch, offset, count) into the seeded permutation of that epoch
(`common.permutation`), which workers expand to the same sample indices. A round's batch never
spans two epochs: the last batch of an epoch is smaller. Rounds that could not be applied (too
stale, or open when a checkpoint was taken) come back through `replan` before any new data, so no
sample of an epoch is skipped.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

Part = tuple[int, int, int]


class Sampler:
    def __init__(self, n: int, epochs: Optional[int] = None):
        if n <= 0:
            raise ValueError("the training set is empty")
        self.n = n
        self.epochs = epochs
        self.epoch = 0
        self.offset = 0
        self._replan: deque[list[Part]] = deque()

    def next_round(self, batch_size: int, partitions: int) -> Optional[list[Part]]:
        """The parts of the next round, or None when the plan is exhausted."""
        if self._replan:
            return self._replan.popleft()
        if self.epochs is not None and self.epoch >= self.epochs:
            return None
        count = min(batch_size, self.n - self.offset)
        parts = [(self.epoch, self.offset + a, b - a) for a, b in _cuts(count, partitions)]
        self.offset += count
        if self.offset >= self.n:
            self.epoch, self.offset = self.epoch + 1, 0
        return parts

    def replan(self, parts: list[Part]) -> None:
        """Give a round's parts back; they come out again, as one round, before new data."""
        self._replan.append([tuple(p) for p in parts])

    @property
    def exhausted(self) -> bool:
        return not self._replan and self.epochs is not None and self.epoch >= self.epochs

    @property
    def progress(self) -> float:
        """Epochs planned so far, fractional."""
        return self.epoch + self.offset / self.n

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset,
                "replan": [[list(p) for p in parts] for parts in self._replan]}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._replan = deque([[tuple(p) for p in parts] for parts in state["replan"]])


def _cuts(count: int, partitions: int) -> list[tuple[int, int]]:
    """Split range(count) into at most `partitions` contiguous, nearly equal, non-empty pieces."""
    k = max(1, min(partitions, count))
    bounds = [round(i * count / k) for i in range(k + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
