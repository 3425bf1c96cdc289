"""Codes over a round's partitions (DESIGN.md section 3). Pure: numpy only.

A code is a matrix E (slots x partitions). Slot i computes f_i = sum_j E[i, j] g_j, where g_j is
the summed gradient of partition j. The arrived slots I decode when some a satisfies
a^T E_I = 1^T; then sum_i a_i f_i = sum_j g_j, the exact gradient of the whole batch.

Codes: `none` (identity), `replicate` (fractional repetition), `cyclic` (gradient coding after
Tandon et al. 2017, by their fractional-repetition construction), `heterogeneous` (windows sized by
speed), and `speculate` (a late row duplicated). `parse_redundancy` reads the coordinator's
`--redundancy` text; `build` makes the code a policy asks for over k partitions. A code's
`tolerance` is how many slots may be missing, whichever they are, with the rest still decoding.

Rounding. Each result f_i carries a rounding error (the worker's float32 sum, and bfloat16 on the
wire with `--result-dtype bfloat16`) of at most u * sum_j |E[i, j]| |g_j|, so a decoded sum carries
at most u * sum_j c_j |g_j|, where c_j = sum_i |a_i E[i, j]| is the weight partition j enters the
decoding with, counting cancellations. Without a code c_j = 1. `amplification` is max_j c_j: how
many times the code multiplies the rounding of its inputs. `decode` returns only decodings with an
amplification of at most MAX_AMPLIFICATION (a pattern past it waits for more slots), and every code
built here (none, replicate, cyclic, speculative copies of them) decodes every pattern it decodes
with weights 1.0 on rows of 0s and 1s: amplification 1, a plain sum of results (`Code.exact`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Iterable, Optional, Sequence

import numpy as np

from .errors import ConfigError

DECODE_TOLERANCE = 1e-9
MAX_AMPLIFICATION = 2.0  # decode refuses weights that multiply the results' rounding more than this
MAX_REPLICAS = 8  # bounds of --redundancy replicate:R and cyclic:S
MAX_STRAGGLERS = 7
RESULT_DTYPES = ("float32", "bfloat16")  # --result-dtype


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
    def runs(self) -> Optional[tuple[tuple[int, int], ...]]:
        """For each row, the run [start, end) of consecutive partitions it is 1.0 on (and 0.0
        off), or None when some row is not such a run."""
        m = self.matrix
        if m.size == 0:
            return None
        nonzero = m != 0
        count = nonzero.sum(axis=1)
        start = np.argmax(nonzero, axis=1)
        last = m.shape[1] - 1 - np.argmax(nonzero[:, ::-1], axis=1)
        if np.any(count == 0) or np.any(last - start + 1 != count) or np.any(m[nonzero] != 1.0):
            return None
        return tuple(zip(start.tolist(), (last + 1).tolist()))

    @cached_property
    def groups(self) -> Optional[tuple[int, ...]]:
        """When the rows are runs (`runs`) that are pairwise equal or disjoint and cover every
        partition: each row's group (its run's rank), else None. Such a code decodes exactly
        when one row of every group has arrived, with weight 1.0 each (`exact`)."""
        runs = self.runs
        if runs is None:
            return None
        distinct = sorted(set(runs))
        if distinct[0][0] != 0 or distinct[-1][1] != self.partitions or any(
                a[1] != b[0] for a, b in zip(distinct, distinct[1:])):
            return None  # overlapping runs, or a partition no row covers
        rank = {run: g for g, run in enumerate(distinct)}
        return tuple(rank[run] for run in runs)

    @cached_property
    def group_count(self) -> int:
        """How many groups `groups` has (0 when it is None)."""
        return 0 if self.groups is None else max(self.groups) + 1

    @property
    def exact(self) -> bool:
        """Every pattern that decodes, decodes as a plain sum: one row of each group, weight 1.0
        (amplification 1, whatever the result dtype; error feedback sees weight 1)."""
        return self.groups is not None

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
    """Gradient coding against any `stragglers` (s) missing slots over n partitions (Tandon et al.
    2017), by their fractional-repetition construction made to fit every n: the partitions are cut
    into g = ceil(n / (s+1)) runs of consecutive partitions, as equal as can be (each at most s+1
    long), and each run is computed by s+1 identical slots (row r*(s+1) + c is copy c of run r).
    Any s missing slots leave a copy of every run, and a round decodes as the plain sum of one copy
    per run: weights 1.0, rows of 0s and 1s, no cancellation, so the rounding of the results
    (float32 or bfloat16) is not multiplied. As in their cyclic construction, every partition is in
    s+1 slots and every slot covers at most s+1 partitions; there are n slots when s+1 divides n,
    else g*(s+1) <= n+s (the shorter runs make lighter slots); the copies of a run that arrived
    are cancelled like replicas.

    Their cyclic construction (n slots, slot i covering partitions i..i+s mod n, real coefficients)
    is not used: its decodings cancel, and must. With n = s+2 slots of at most s+1 partitions, any
    two rows span the all-ones vector, so all rows lie in one plane span(1, v), row p being a
    multiple of v - v_p 1 with the v_p distinct; rows p, q decode as (row_q - row_p) / (v_p - v_q),
    and for the closest pair of values (gap at most range/(n-1)) the partition farthest from them
    enters at least n-1 times over: amplification >= n-1 (3 at best for n=3). Their random codes
    measured 3 at n=6 and 3e2-8e4 at n=12-100 (benchmarks/coding_error.py), and took minutes to
    build at n=100."""
    if n < 1:
        raise ValueError("a round needs at least one partition")
    if not 0 <= stragglers < n:
        raise ValueError(f"cyclic:{stragglers} needs more than {stragglers} partitions (got {n})")
    if stragglers == 0:
        return none(n)
    copies = stragglers + 1
    runs = -(-n // copies)
    lengths = [n // runs + (1 if r < n % runs else 0) for r in range(runs)]
    matrix = np.zeros((runs * copies, n))
    start = 0
    for r, length in enumerate(lengths):
        matrix[r * copies:(r + 1) * copies, start:start + length] = 1.0
        start += length
    return Code(f"cyclic:{stragglers}", matrix, tolerance=stragglers)


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


def decode(code: Code, arrived: Iterable[int]) -> Optional[dict[int, float]]:
    """Decoding weights {slot: a_slot} over the arrived slots, or None if they do not decode yet.

    Codes of runs (`Code.runs`: none, replicate, cyclic, heterogeneous, speculative copies) decode
    as a plain sum: one arrived row per group, or an exact cover of the partitions by arrived
    runs, with weights 1.0. Any other pattern or code: float64 least squares (the smallest
    weights, each row counted by its norm) with a residual check, and a bound on how much the
    weights multiply the results' rounding (`amplification` at most MAX_AMPLIFICATION). A pattern
    that does not span the all-ones vector, or spans it only by cancelling past the bound, is
    reported as undecodable (the round waits for more slots) rather than approximated.
    """
    slots = sorted(set(arrived))
    if not slots:
        return None
    groups = code.groups
    if groups is not None:
        # One row of every group, weight 1.0: the lowest arrived slot of each (rows of a group
        # are identical; nothing else can decode, since the groups are disjoint).
        chosen: dict[int, int] = {}
        for s in slots:
            chosen.setdefault(groups[s], s)
        if len(chosen) < code.group_count:
            return None
        return {s: 1.0 for s in chosen.values()}
    runs = code.runs
    if runs is not None:
        cover = _exact_cover(runs, slots, code.partitions)
        if cover is not None:
            return {s: 1.0 for s in cover}
    rows = code.matrix[slots]  # |I| x k
    nonzero = rows != 0
    if not np.all(np.any(nonzero, axis=0)):  # some partition is covered by no arrived slot
        return None
    if np.all(np.count_nonzero(nonzero, axis=1) == 1):
        # Each slot is one partition times c_i: the least squares solution in closed form,
        # a_i = c_i / (sum of c^2 over that partition's slots), without a k x k solve. Each
        # partition enters with sum |a_i c_i| = 1: no amplification.
        cols = np.argmax(nonzero, axis=1)
        coef = rows[np.arange(len(slots)), cols]
        norm = np.bincount(cols, weights=coef * coef, minlength=code.partitions)
        return {s: float(w) for s, w in zip(slots, coef / norm[cols]) if w != 0.0}
    ones = np.ones(code.partitions)
    norms = np.linalg.norm(rows, axis=1)
    norms[norms == 0] = 1.0
    scaled, *_ = np.linalg.lstsq((rows / norms[:, None]).T, ones, rcond=None)
    weights = scaled / norms
    if np.max(np.abs(rows.T @ weights - ones)) > DECODE_TOLERANCE * max(1.0, code.partitions):
        return None
    if float(np.max(np.abs(weights) @ np.abs(rows))) > MAX_AMPLIFICATION:
        return None  # cancels: wait for slots that decode with smaller weights
    return {s: float(w) for s, w in zip(slots, weights) if w != 0.0}


def amplification(code: Code, weights: dict[int, float]) -> float:
    """max_j sum_i |a_i E[i, j]|: how many times decoding with `weights` multiplies the bound on
    the rounding error of the results it combines (1.0: no cancellation, a plain sum)."""
    if not weights:
        return 0.0
    slots = list(weights)
    a = np.abs(np.array([weights[s] for s in slots]))
    return float(np.max(a @ np.abs(code.matrix[slots])))


def check_result_dtype(redundancy: Redundancy | str, result_dtype: str) -> None:
    """Refuse, with one line (ConfigError), results in `result_dtype` under the `--redundancy`
    policy (a Redundancy or its text) when a code it can build could decode with weights other
    than 1. bfloat16 results are rounded to 8 significant bits, with error feedback on the worker
    (the next result carries what rounding dropped), which cancels out only when results are summed
    with weight 1; a decoding with other weights multiplies that rounding (up to MAX_AMPLIFICATION)
    instead. Every code of the policy is built over 1..32 partitions (every remainder of k by the
    run length, for every level), adaptive standing for every fixed policy it may choose. The
    coordinator calls this at start-up."""
    if result_dtype not in RESULT_DTYPES:
        raise ConfigError(f"--result-dtype {str(result_dtype)[:20]!r}: expected "
                          + " or ".join(RESULT_DTYPES))
    if result_dtype == "float32":
        return
    policy = parse_redundancy(redundancy) if isinstance(redundancy, str) else redundancy
    if policy.kind == "adaptive":
        policies = ([Redundancy("none")]
                    + [Redundancy("replicate", r) for r in range(2, MAX_REPLICAS + 1)]
                    + [Redundancy("cyclic", s) for s in range(1, MAX_STRAGGLERS + 1)])
    else:
        policies = [policy]
    for fixed in policies:
        for k in range(1, 33):
            code = _build(fixed, k)
            if not code.exact:
                raise ConfigError(
                    f"--result-dtype {result_dtype} cannot be used with --redundancy {policy}: "
                    f"its code {code.name} over {k} partitions can decode with weights other than "
                    f"1, which multiply the rounding of {result_dtype} results; use --result-dtype "
                    f"float32")


def _exact_cover(runs: Sequence[tuple[int, int]], slots: Sequence[int],
                 partitions: int) -> Optional[list[int]]:
    """Arrived slots whose runs tile [0, partitions) exactly (each partition once), or None."""
    starting: dict[int, list[tuple[int, int]]] = {}
    for s in slots:
        start, end = runs[s]
        starting.setdefault(start, []).append((end, s))
    reached: dict[int, Optional[tuple[int, int]]] = {0: None}  # position -> (previous, slot)
    for start in sorted(starting):  # a run ends after it starts: positions in order suffice
        if start not in reached:
            continue
        for end, s in starting[start]:
            reached.setdefault(end, (start, s))
    if partitions not in reached:
        return None
    cover, position = [], partitions
    while position:
        step = reached[position]
        assert step is not None  # only position 0 has no previous
        position, s = step
        cover.append(s)
    return sorted(cover)
