"""Codes over a round's partitions (DESIGN.md section 3). Pure: numpy only.

A code is a matrix E (slots x partitions). Slot i computes f_i = sum_j E[i, j] g_j, where g_j is
the summed gradient of partition j. The arrived slots I decode when some a satisfies
a^T E_I = 1^T; then sum_i a_i f_i = sum_j g_j, the exact gradient of the whole batch.

This module holds the machinery and the `none` code (E = identity); the redundancy codes
(replication, cyclic gradient coding, speculation) are further constructors of the same `Code`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

DECODE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Code:
    name: str
    matrix: np.ndarray  # float64, slots x partitions

    @property
    def slots(self) -> int:
        return self.matrix.shape[0]

    @property
    def partitions(self) -> int:
        return self.matrix.shape[1]

    def row(self, slot: int) -> list[tuple[int, float]]:
        """The (partition, coefficient) pairs that slot `slot` computes."""
        return [(int(j), float(c)) for j, c in enumerate(self.matrix[slot]) if c != 0.0]


def none(partitions: int) -> Code:
    """No redundancy: one slot per partition, every slot must arrive."""
    if partitions < 1:
        raise ValueError("a round needs at least one partition")
    return Code("none", np.eye(partitions))


def decode(code: Code, arrived: Iterable[int]) -> Optional[dict[int, float]]:
    """Decoding weights {slot: a_slot} over the arrived slots, or None if they do not decode yet.

    Float64 least squares with a residual check: a pattern that does not span the all-ones vector
    is reported as undecodable rather than approximated.
    """
    slots = sorted(set(arrived))
    if not slots:
        return None
    rows = code.matrix[slots]  # |I| x k
    if np.any(np.all(rows == 0, axis=0)):  # some partition is covered by no arrived slot
        return None
    ones = np.ones(code.partitions)
    weights, *_ = np.linalg.lstsq(rows.T, ones, rcond=None)
    if np.max(np.abs(rows.T @ weights - ones)) > DECODE_TOLERANCE * max(1.0, code.partitions):
        return None
    return {s: float(w) for s, w in zip(slots, weights) if w != 0.0}
