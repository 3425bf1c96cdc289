"""Codes over a round's partitions (DESIGN.md section 3). Pure: numpy only.

A code is a matrix E (slots x partitions). Slot i computes f_i = sum_j E[i, j] g_j, where g_j is
the summed gradient of partition j. The arrived slots I decode when some a satisfies
a^T E_I = 1^T; then sum_i a_i f_i = sum_j g_j, the exact gradient of the whole batch.

Codes: `none` (identity), `replicate` (fractional repetition), `cyclic` (gradient coding after
Tandon et al. 2017), `heterogeneous` (windows sized by speed), and `speculate` (a late row
duplicated). `parse_redundancy` reads the coordinator's `--redundancy` text; `build` makes the
code a policy asks for over k partitions. A code's `tolerance` is how many slots may be missing,
whichever they are, with the rest still decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from itertools import combinations
from math import comb
from typing import Iterable, Optional, Sequence

import numpy as np

from .errors import ConfigError

DECODE_TOLERANCE = 1e-9
MAX_REPLICAS = 8  # bounds of --redundancy replicate:R and cyclic:S
MAX_STRAGGLERS = 7
_VERIFY_PATTERNS = 3000  # constructions check every straggler pattern when there are this few


@dataclass(frozen=True)
class Code:
    name: str
    matrix: np.ndarray  # float64, slots x partitions
    tolerance: int = 0  # any `tolerance` slots may be missing and the rest still decode

    @property
    def slots(self) -> int:
        return self.matrix.shape[0]

    @property
    def partitions(self) -> int:
        return self.matrix.shape[1]

    @cached_property
    def unit_rows(self) -> tuple[int, ...]:
        """For each row, the partition it is the unit vector of (one coefficient, 1.0), else -1."""
        out = []
        for row in self.matrix:
            nonzero = np.flatnonzero(row)
            out.append(int(nonzero[0]) if len(nonzero) == 1 and row[nonzero[0]] == 1.0 else -1)
        return tuple(out)

    def row(self, slot: int) -> list[tuple[int, float]]:
        """The (partition, coefficient) pairs that slot `slot` computes."""
        row = self.matrix[slot]
        return [(int(j), float(row[j])) for j in np.flatnonzero(row)]


def none(partitions: int) -> Code:
    """No redundancy: one slot per partition, every slot must arrive."""
    if partitions < 1:
        raise ValueError("a round needs at least one partition")
    return Code("none", np.eye(partitions))


def replicate(partitions: int, replicas: int) -> Code:
    """Fractional repetition: `partitions` groups of `replicas` identical rows (row g*r + c is
    copy c of partition g); any one row per group decodes, so any replicas-1 may be missing."""
    if partitions < 1:
        raise ValueError("a round needs at least one partition")
    if replicas < 1:
        raise ValueError("replicate needs at least one replica")
    if replicas == 1:
        return none(partitions)
    return Code(f"replicate:{replicas}", np.repeat(np.eye(partitions), replicas, axis=0),
                tolerance=replicas - 1)


def cyclic(n: int, stragglers: int) -> Code:
    """Cyclic gradient coding (Tandon et al. 2017): n slots over n partitions, slot i covering
    partitions i..i+s (mod n); any n-s slots decode exactly. Built by their random construction:
    a random H (s x n) with H 1 = 0, each row the (1-dimensional) null vector of H restricted to
    its support, so every row lies in null(H), which holds 1 and which any n-s rows span. The seed
    is fixed per (n, s), and small codes are checked against every straggler pattern (with the
    best-conditioned of a few seeds kept)."""
    if n < 1:
        raise ValueError("a round needs at least one partition")
    if not 0 <= stragglers < n:
        raise ValueError(f"cyclic:{stragglers} needs more than {stragglers} partitions (got {n})")
    if stragglers == 0:
        return none(n)
    return Code(f"cyclic:{stragglers}", _cyclic_matrix(n, stragglers).copy(), tolerance=stragglers)


def heterogeneous(speeds: Sequence[float], partitions: int, replicas: int = 1) -> Code:
    """One slot per entry of `speeds` (a worker's measured samples/s), each covering a run of
    consecutive partitions whose length follows its speed, so that slots finish together.

    The slots are dealt (fastest first, round-robin) into `replicas` copies; each copy's runs
    cover every partition exactly once, with coefficient 1. A missing slot spoils at most one
    copy, so any replicas-1 may be missing (tolerance), and mixed copies decode when they can."""
    n = len(speeds)
    if n < 1 or partitions < 1:
        raise ValueError("a heterogeneous code needs at least one slot and one partition")
    if any(not (float(v) > 0 and np.isfinite(v)) for v in speeds):
        raise ValueError("speeds must be positive")
    if not 1 <= replicas <= n:
        raise ValueError(f"{replicas} copies need at least {replicas} slots (got {n})")
    speed = np.asarray(speeds, dtype=np.float64)
    order = sorted(range(n), key=lambda i: (-speed[i], i))
    copies = [order[c::replicas] for c in range(replicas)]
    if max(len(c) for c in copies) > partitions:
        raise ValueError(f"{n} slots in {replicas} copies need at least "
                         f"{max(len(c) for c in copies)} partitions (got {partitions})")
    matrix = np.zeros((n, partitions))
    for members in copies:
        members = sorted(members)
        widths = _apportion(speed[members], partitions, 1, partitions)
        start = 0
        for i, w in zip(members, widths):
            matrix[i, start:start + w] = 1.0
            start += w
    name = "hetero" if replicas == 1 else f"hetero:{replicas}"
    return Code(name, matrix, tolerance=replicas - 1)


def speculate(code: Code, row: int) -> Code:
    """The code with a duplicate of row `row` appended (a speculative copy of a late slot)."""
    if not 0 <= row < code.slots:
        raise ValueError(f"no row {row} in a code of {code.slots} slots")
    return Code(code.name, np.vstack([code.matrix, code.matrix[row:row + 1]]), code.tolerance)


# policies ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Redundancy:
    """What `--redundancy` asks for: kind none|replicate|cyclic|adaptive, and its level."""

    kind: str = "none"
    level: int = 0  # replicate: copies R; cyclic: stragglers S

    def __str__(self) -> str:
        return self.kind if self.kind in ("none", "adaptive") else f"{self.kind}:{self.level}"


def parse_redundancy(text: str) -> Redundancy:
    """`none`, `replicate:R` (2 <= R <= 8), `cyclic:S` (1 <= S <= 7) or `adaptive`."""
    raw = str(text).strip().lower()
    if raw in ("none", "adaptive"):
        return Redundancy(raw)
    kind, sep, level = raw.partition(":")
    bounds = {"replicate": (2, MAX_REPLICAS), "cyclic": (1, MAX_STRAGGLERS)}
    if not sep or kind not in bounds:
        raise ConfigError(f"--redundancy {text!r}: expected none, replicate:R, cyclic:S or adaptive")
    lo, hi = bounds[kind]
    try:
        value = int(level)
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        raise ConfigError(f"--redundancy {text!r}: {kind} takes a whole number from {lo} to {hi}")
    return Redundancy(kind, value)


@lru_cache(maxsize=64)
def build(policy: Redundancy, partitions: int) -> Code:
    """The code of a fixed policy over `partitions` partitions (cyclic:S is capped at k-1).

    Cached, and read-only: a round's code is built once per policy and size, not per round."""
    code = _build(policy, partitions)
    code.matrix.setflags(write=False)
    return code


def _build(policy: Redundancy, partitions: int) -> Code:
    if policy.kind == "replicate":
        return replicate(partitions, policy.level)
    if policy.kind == "cyclic":
        return cyclic(partitions, min(policy.level, partitions - 1))
    if policy.kind == "none":
        return none(partitions)
    raise ValueError(f"{policy} is not a fixed code")


# construction helpers -----------------------------------------------------------------------------


def _apportion(speeds: np.ndarray, total: int, lo: int, hi: int) -> np.ndarray:
    """Integers in [lo, hi] summing to `total`, near total * speeds / sum(speeds)."""
    ideal = total * speeds / speeds.sum()
    widths = np.clip(np.floor(ideal).astype(int), lo, hi)
    while widths.sum() < total:
        room = np.where(widths < hi, ideal - widths, -np.inf)
        widths[int(np.argmax(room))] += 1
    while widths.sum() > total:
        room = np.where(widths > lo, widths - ideal, -np.inf)
        widths[int(np.argmax(room))] -= 1
    return widths


def _null_space_rows(support: np.ndarray, s: int, rng) -> Optional[np.ndarray]:
    """Rows on `support`, each in null(H) for a random H (s x k) with H 1 = 0 (so 1 is in it)."""
    n, k = support.shape
    h = rng.standard_normal((s, k))
    h -= h.mean(axis=1, keepdims=True)
    rows = np.zeros((n, k))
    for i in range(n):
        cols = np.flatnonzero(support[i])
        sub = h[:, cols]  # s x w
        _, _, vt = np.linalg.svd(sub)
        null = vt[s:] if len(cols) > s else np.zeros((0, len(cols)))
        if null.shape[0] == 0:
            return None
        vec = rng.standard_normal(null.shape[0]) @ null if null.shape[0] > 1 else null[0]
        if np.any(np.abs(vec) < 1e-3):
            return None  # a near-zero coefficient: an ill-conditioned code
        rows[i, cols] = vec / vec[0]
    return rows


def _worst_weights(matrix: np.ndarray, s: int) -> Optional[float]:
    """The largest sum |a_i| |E_i|_1 (how much float error a decode can amplify) over every pattern of s missing slots (None: one does not decode).
    Codes with too many patterns to check are scored on their full pattern only."""
    n = matrix.shape[0]
    code = Code("check", matrix)
    patterns = (combinations(range(n), s) if comb(n, s) <= _VERIFY_PATTERNS else [()])
    worst = 0.0
    for missing in patterns:
        weights = decode(code, [i for i in range(n) if i not in missing])
        if weights is None:
            return None
        worst = max(worst, sum(abs(w) * np.abs(matrix[i]).sum() for i, w in weights.items()))
    return worst


@lru_cache(maxsize=64)
def _cyclic_matrix(n: int, s: int) -> np.ndarray:
    support = np.zeros((n, n), dtype=bool)
    for i in range(n):
        support[i, (i + np.arange(s + 1)) % n] = True
    best = None
    seeds = max(4, min(64, 12000 // max(1, min(comb(n, s), _VERIFY_PATTERNS))))
    for seed in range(seeds):
        matrix = _null_space_rows(support, s, np.random.default_rng(n * 100 + s + 7919 * seed))
        if matrix is None:
            continue
        score = _worst_weights(matrix, s)
        if score is not None and (best is None or score < best[0]):
            best = (score, matrix)
    if best is None:  # pragma: no cover - random constructions succeed with probability 1
        raise ValueError(f"no cyclic code found for n={n}, s={s}")
    best[1].setflags(write=False)
    return best[1]


def decode(code: Code, arrived: Iterable[int]) -> Optional[dict[int, float]]:
    """Decoding weights {slot: a_slot} over the arrived slots, or None if they do not decode yet.

    Float64 least squares with a residual check: a pattern that does not span the all-ones vector
    is reported as undecodable rather than approximated.
    """
    slots = sorted(set(arrived))
    if not slots:
        return None
    # Fast path, exact: a unit row for every partition (no code, replicas, speculative copies).
    units = code.unit_rows
    chosen: dict[int, int] = {}
    for s in slots:
        if units[s] >= 0:
            chosen.setdefault(units[s], s)
    if len(chosen) == code.partitions:
        return {s: 1.0 for s in chosen.values()}
    rows = code.matrix[slots]  # |I| x k
    nonzero = rows != 0
    if not np.all(np.any(nonzero, axis=0)):  # some partition is covered by no arrived slot
        return None
    if np.all(np.count_nonzero(nonzero, axis=1) == 1):
        # Each slot is one partition times c_i (none, replicate, speculated copies): the least
        # squares solution in closed form, a_i = c_i / (sum of c^2 over that partition's slots),
        # without a k x k solve.
        cols = np.argmax(nonzero, axis=1)
        coef = rows[np.arange(len(slots)), cols]
        norm = np.bincount(cols, weights=coef * coef, minlength=code.partitions)
        return {s: float(w) for s, w in zip(slots, coef / norm[cols]) if w != 0.0}
    ones = np.ones(code.partitions)
    weights, *_ = np.linalg.lstsq(rows.T, ones, rcond=None)
    if np.max(np.abs(rows.T @ weights - ones)) > DECODE_TOLERANCE * max(1.0, code.partitions):
        return None
    return {s: float(w) for s, w in zip(slots, weights) if w != 0.0}
