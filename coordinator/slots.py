"""The scheduling rooms' one vocabulary: what a slot computes, a slot's record, the actions. Pure.

A **slot** is one piece of work handed to workers: a coded part of a round, a range of the test set
to evaluate, a settlement's recomputation of a disputed slot. Whatever it is for, `SlotWork` says
what computing it means (the model version, the parts of the sample order, their coefficients,
gradient or local steps or an evaluation), and that one record travels everywhere a slot is
described: in the `Assign` that hands it to a worker, in the round core's `Compute` when the
coordinator computes it itself, and in a settlement handed to a third worker.

`Lease` is the scheduler's record of a slot: who holds it, since when, and where it is in its one
life (`LeaseState`): waiting for a holder, out with holders, arrived, or dead (a copy of its row
arrived first). Leases of rounds and side leases (round 0) live in one table (leases.py).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass(frozen=True)
class SlotWork:
    """What computing a slot means, as its holders are told: enough to compute it again."""

    version: int  # the model version it is computed at
    parts: list  # [epoch, offset, count] of the sample order (an evaluation: [0, offset, count])
    coefficients: list  # one per part (the code's row)
    kind: str = "gradient"  # gradient | local | eval
    steps: int = 0  # local: inner steps; otherwise 0

    @property
    def samples(self) -> int:
        return sum(p[2] for p in self.parts)


class _DescribesWork:
    """The fields of the `SlotWork` an action carries, read through it."""

    work: SlotWork

    @property
    def version(self) -> int:
        return self.work.version

    @property
    def parts(self) -> list:
        return self.work.parts

    @property
    def coefficients(self) -> list:
        return self.work.coefficients

    @property
    def kind(self) -> str:
        return self.work.kind

    @property
    def steps(self) -> int:
        return self.work.steps


class LeaseState(enum.Enum):
    WAITING = "waiting"  # in a pending queue for a (further) holder; it may still have holders
    OUT = "out"  # held by its holders, not queued
    ARRIVED = "arrived"  # its result was used
    DEAD = "dead"  # a copy of its row arrived first: it is no longer needed


@dataclass(eq=False)
class Lease:
    id: int
    work: SlotWork
    round: int = 0  # its round; 0: a side lease, outside any round
    row: tuple = ()  # a round lease: its code row, ((partition index, coefficient), ...)
    index: int = 0  # a round lease: its row's index in the round's code
    state: LeaseState = LeaseState.WAITING
    speculated: bool = False  # a duplicate row was appended for it (or it is that duplicate)
    holders: set[str] = field(default_factory=set)
    started: dict[str, float] = field(default_factory=dict)  # holder -> when it was assigned
    with_model: set[str] = field(default_factory=set)  # holders it was sent to with the model
    exclude: frozenset = frozenset()  # a side lease: workers that must not take it
    # a sync round's slot sized to one worker: only it takes the slot while it is active and
    # the slot has never been handed out (round_book.py, "slots sized to their worker")
    reserved: Optional[str] = None
    samples: int = 0  # work.samples, kept: it is read on every answer and deadline
    side: bool = field(init=False)  # a side lease (round 0); kept: it is read on every deal

    def __post_init__(self):
        self.samples = self.work.samples
        self.side = self.round == 0

    @property
    def needed(self) -> bool:
        """Whether a result for it may still be used."""
        return self.state in (LeaseState.WAITING, LeaseState.OUT)


@dataclass(frozen=True)
class Stored:
    """A round slot's arrived result, screened, kept while its round is open (the round
    core's store; what a settlement compares)."""

    gradient: Any  # as the backend stores it (the server: the frames' chunks)
    norm: float
    worker: str
    identity: str
    compute_s: float = 0.0
    waited_s: float = 0.0
    samples: int = 0
    loss: float = math.nan
    # identities whose copies of this row agreed or were settled right: each earns a verified
    # slot if the row's round is applied
    verified_by: tuple = ()
    # the model's buffers as the slot's computation left them (as the backend stores them), or
    # None when the model has none
    buffers: Any = None
    kin: frozenset = frozenset()  # whom its sender may be one party with (fleet.py)


# actions: what the scheduler asks its driver (the round core) to do ----------------------------


@dataclass(frozen=True)
class Assign(_DescribesWork):
    """Send `worker` the task of slot `slot`."""

    worker: str
    slot: int
    round: int  # 0: a side slot
    work: SlotWork
    deadline_s: float
    send_model: bool  # the worker's cached model is not at the work's version
    prefetch: tuple[int, ...] = ()  # locality: shards the worker should fetch ahead


@dataclass(frozen=True)
class CancelSlots:
    worker: str
    slots: list[int]


@dataclass(frozen=True)
class Decoded:
    round: int
    version: int
    parts: list
    samples: int
    weights: dict[int, float]  # slot id -> decoding weight
    slots: list[int]  # every slot of the round: their stored gradients can be released
    slot_samples: dict[int, int] = field(default_factory=dict)  # of the slots in `weights`
    # of the slots in `weights`: their code rows, (partition index, coefficient) pairs
    rows: dict[int, tuple[tuple[int, float], ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class CompareCopies:
    """Two copies of one row of a verified round have arrived, from different workers: compare
    their stored results, then call `copies_agreed`, or `copies_disagreed` and `copies_settled`."""

    round: int
    slots: tuple[int, int]  # in arrival order
    workers: tuple[str, str]  # their senders


@dataclass(frozen=True)
class Evicted:
    worker: str
    reason: str
    requeued: int


@dataclass(frozen=True)
class Drained:
    """A draining worker holds no more slots: send it home."""

    worker: str


Action = Union[Assign, CancelSlots, Decoded, Evicted, Drained, CompareCopies]
