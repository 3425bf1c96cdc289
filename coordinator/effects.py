"""What the round core asks its driver to do, beside the scheduler's own actions (`Assign`,
`CancelSlots`, `Drained`, `Evicted`). Plain records: the server turns them into messages, log
lines and ledger records; the simulator into virtual events and accounting."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Union

from .slots import Assign, CancelSlots, Drained, Evicted, SlotWork, _DescribesWork


@dataclass(frozen=True)
class Event:
    kind: str
    text: str
    worker: Optional[str] = None
    level: int = logging.INFO


@dataclass(frozen=True)
class Contribution:
    """What one result used in an applied round earns its sender (credits.py)."""

    identity: str  # who earns it: its key, or its worker id without keys
    samples: int  # its share of the round's samples: the shares add up to the round's
    compute_s: float  # as its sender reported it
    verified_by: tuple = ()  # identities whose copies of its row were verified right


@dataclass(frozen=True)
class Applied:
    round: int
    version: int  # the model's version after the step
    parts: list
    samples: int
    staleness: int
    weight: float
    terms: int  # results summed
    slots: list  # every slot of the round
    credits: tuple = ()  # a Contribution per result the step used


@dataclass(frozen=True)
class Replanned:
    round: int
    staleness: int
    terms: int
    slots: list


@dataclass(frozen=True)
class Compute(_DescribesWork):
    """Compute slot `slot` here, exactly as a worker does (`work`: at its version, its parts and
    coefficients); then call the core's `computed` with the result (or the error). One at a
    time."""

    slot: int
    work: SlotWork


@dataclass(frozen=True)
class Ban:
    """Send this worker home as banned and forget its connection."""

    worker: str
    reason: str = ""  # what it is told; empty: the trust policy's ban


@dataclass(frozen=True)
class Used:
    """A worker's result for `slot` was taken into its round (the ledger's acknowledgement)."""

    slot: int


@dataclass(frozen=True)
class Joined:
    """A worker said hello as `worker`, judged as `identity` (for the credits' names)."""

    worker: str
    identity: str


@dataclass(frozen=True)
class Refused:
    """A result was refused (non-finite, outlandish, malformed, a wrong copy): it earns its
    sender nothing, and counts against it in the credits."""

    worker: str
    identity: str
    slot: int
    reason: str


@dataclass(frozen=True)
class Evaluated:
    """An evaluation handed to workers is complete: the metrics of the model at `version`."""

    version: int
    samples: int  # samples applied when it was planned
    metrics: dict
    seconds: float  # the workers' compute seconds for it, per worker (eval_slots.py)


# Everything the round core's entry points return: the scheduler's actions its driver performs,
# and the core's own records above.
Effect = Union[Assign, CancelSlots, Drained, Evicted, Event, Applied, Replanned, Compute, Ban,
               Used, Joined, Refused, Evaluated]
