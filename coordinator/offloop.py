"""The coordinator's work off its event loop: the round core's `Compute` (a slot computed here, to
settle a dispute) and the run core's `EvaluateHere` (the model evaluated here), each in a thread,
one of each at a time. They are asyncio futures the server's loop waits on beside its socket;
a finished computation's answer goes to the round core, whose effects the server performs, and a
finished evaluation's to the server, which hands it to the run core.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from .effects import Compute


class OffLoop:
    def __init__(self, training, core):
        """`training`: where the model's computations and evaluations come from (training.py);
        `core`: the round core, which asked for the computations."""
        self.training = training
        self.core = core
        self.computing: Optional[asyncio.Future] = None  # the core's Compute in flight
        self.evaluating: Optional[asyncio.Future] = None  # the run core's EvaluateHere

    def futures(self) -> set:
        """What is in flight, for the loop to wait on."""
        return {f for f in (self.computing, self.evaluating) if f is not None}

    def compute(self, request: Compute) -> None:
        run = self.training.model.computation(request)
        if run is None:
            future = asyncio.get_running_loop().create_future()
            future.set_exception(LookupError(f"the model of version {request.version} is no "
                                             "longer kept"))
        else:
            future = asyncio.ensure_future(asyncio.to_thread(run))
        self.computing = future

    def computed(self, now: float) -> list:
        """Once the computation is done (and only once): its answer handed to the round core,
        and the effects that leads to; nothing until then."""
        future = self.computing
        if future is None or not future.done():
            return []
        self.computing = None
        try:
            reference, error = future.result(), None
        except Exception as exc:  # the job's code failed here, or the model is gone
            reference, error = None, f"{type(exc).__name__}: {exc}"
        return self.core.computed(reference, error, now)

    def evaluate(self) -> None:
        """Evaluate the model as it is now, in a thread (on a copy): training goes on meanwhile."""
        self.evaluating = asyncio.ensure_future(asyncio.to_thread(self.training.evaluation()))

    def evaluated(self) -> Optional[tuple]:
        """The evaluation's (version, samples, metrics, seconds) once it is done, once."""
        future = self.evaluating
        if future is None or not future.done():
            return None
        self.evaluating = None
        return future.result()

    async def confirm(self) -> tuple:
        """A confirming evaluation, in a thread, awaited: no round is applied meanwhile, so the
        model the run stops with is the one that met the target."""
        return await asyncio.to_thread(self.training.evaluation())

    async def settle(self) -> None:
        """Wait for what is still in flight (the loop is ending)."""
        for future in self.futures():
            await asyncio.wait({future})
