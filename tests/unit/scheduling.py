"""The scheduler as the round core drives it, for tests of the scheduler alone.

The scheduler's events never deal; the round core deals once at the end of each of its entry
points, after it has acted on what the event led to. `Dealing` does the same around a bare
scheduler: each event's actions, then `deal(now)`, except when the event leaves the caller
something to do first (a `Decoded` round to step, then `applied`; `CompareCopies` to judge, then
a verdict), exactly where the core would deal only after that.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

from idlegrad.common.tensors import distance, finite_norm
from idlegrad.coordinator.sampler import Sampler
from idlegrad.coordinator.scheduler import CompareCopies, Decoded, Scheduler, SchedulerConfig

_EVENTS = ("join", "ready", "result", "failed", "handback", "leave", "tick", "resume", "drain",
           "applied", "copies_agreed", "copies_disagreed", "copies_settled", "side_result",
           "drop_side", "drop_side_slot", "speculate")


class Dealing:
    """A `Scheduler` whose events are each followed by a deal, as in the round core."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.scheduler, name)
        if name not in _EVENTS:
            return attr
        signature = inspect.signature(attr)

        def event(*args, **kwargs):
            now = signature.bind(*args, **kwargs).arguments["now"]
            got = attr(*args, **kwargs)
            pair = isinstance(got, tuple)
            actions = got[1] if pair else got
            if not any(isinstance(a, (Decoded, CompareCopies)) for a in actions):
                actions = actions + self.scheduler.deal(now)
            return (got[0], actions) if pair else actions
        return event


def make(n: int = 40, batch: int = 4, epochs=None, **config) -> Dealing:
    """A dealing scheduler over `n` samples (`epochs` of them; None: endless) in batches of
    `batch`, with `config` the rest of its SchedulerConfig."""
    return Dealing(Scheduler(SchedulerConfig(batch_size=batch, **config), Sampler(n, epochs)))


class NoModel:
    """A round core's backend without a model: each applied round steps the version; every
    result is as far from another as from nothing (0)."""

    version = 0

    def apply(self, terms, norms, samples, round_version, in_use):
        self.version += 1
        return 1.0

    def distance(self, a, b):
        return 0.0

    def size(self, a):
        return 0.0

    def merge_buffers(self, states, weight):
        pass


class VectorBackend(NoModel):
    """NoModel whose results are lists of tensors, compared for real (settlements)."""

    def distance(self, a, b):
        return distance(a, b)

    def size(self, a):
        return finite_norm(a)


def verified_core(credits: dict, settle_on_workers: bool = True,
                  kin: Optional[dict] = None) -> tuple:
    """A round core under `--verify-replicas` (replicate:2, batches of 4) with a VectorBackend,
    and the workers of `credits` (name -> credits) joined and ready in that order, each of the
    kin `kin` gives it (beside its own name). Returns (core, the effects they brought)."""
    from idlegrad.common.coding import parse_redundancy
    from idlegrad.coordinator.rounds import RoundCore
    from idlegrad.coordinator.trust import TrustConfig, TrustPolicy

    scheduler = Scheduler(SchedulerConfig(batch_size=4, redundancy=parse_redundancy("replicate:2"),
                                          verify_replicas=True, heartbeat_s=1.0, liveness=3),
                          Sampler(400, None))
    core = RoundCore(scheduler, VectorBackend(), TrustPolicy(TrustConfig(), reference=1.0),
                     settle_on_workers=settle_on_workers)
    out: list = []
    for worker, n in credits.items():
        if kin is None:
            out += core.join(worker, {}, worker, 0.0)
        else:
            out += core.join(worker, {}, worker, 0.0, kin.get(worker, frozenset()))
        out += core.ready(worker, n, 0.0)
    return core, out
