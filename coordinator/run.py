"""The run core: one run's evaluations, its target and its stop. Pure: no sockets, no threads, no
clock (`now` is an argument).

It is the one place an evaluation's state lives: when the next is due (the plan, evaluation.py),
where it runs (on the coordinator, or handed to workers as evaluation slots through the round
core's `evaluate`), whether one is in flight, what its answer means (the target, kept here
once), confirming a target met by an evaluation of an older version on the current model, and
why the run stops. Its drivers, the server and the simulator, call `tick` on their cadence and
`evaluated` with each answer, and do what they return: the round core's effects (the slots
handed out) and `EvaluateHere`, an evaluation of the model as it is now that the driver makes
off its event loop (a thread in the server) and answers with `evaluated`.

Workers' sums never stop the run: an evaluation handed to workers that met the target (or named
no metric the target reads) is confirmed by the coordinator's own evaluation of the model as it is
then, whatever version it was of. A worker can make up sums of honest shape (eval_slots.py
refuses the rest), and nothing but the coordinator's own evaluation tells them from true ones.
A confirming evaluation's answer decides (met: the run stops on its target; not met: training
goes on). The server applies no round while it runs (it awaits the thread), so the model the run
stops with is the one confirmed; a driver that let training go on meanwhile would stop a few
steps past it, and the run's last word (`stale`) would evaluate that model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .eval_slots import EvalShape
from .evaluation import BAD_TARGET, CONFIRM, CONTINUE, TARGET, EvaluationPlan
from .rounds import RoundCore
from .target import Target

WORKERS, COORDINATOR = "workers", "coordinator"


@dataclass(frozen=True)
class EvaluateHere:
    """Evaluate the model as it is now on the coordinator (a copy, off the event loop), then
    call `RunCore.evaluated` with the answer. `confirming`: of a target met at an older
    version."""

    confirming: bool = False


class RunCore:
    def __init__(self, rounds: RoundCore, where: str, parts: list[list[int]],
                 every: Optional[float] = None, target: Optional[Target] = None,
                 shape: Optional[EvalShape] = None):
        """`shape`: what an honest worker's answer for a range looks like (None: any finite)."""
        self.rounds = rounds
        self.shape = shape
        self.where = where  # WORKERS or COORDINATOR
        self.parts = parts  # the test set cut into evaluation slots' parts
        self.plan = EvaluationPlan(every, target)
        self.here: Optional[EvaluateHere] = None  # the one on the coordinator in flight
        self.stopped: Optional[str] = None  # TARGET or BAD_TARGET, once met

    @property
    def target(self) -> Optional[Target]:
        return self.plan.target

    @property
    def evaluating(self) -> bool:
        """Whether an evaluation is in flight, here or on workers."""
        return self.here is not None or self.rounds.evaluation is not None

    def next_at(self) -> float:
        """When `tick` may start the next evaluation (never, while one is in flight)."""
        return math.inf if self.evaluating else self.plan.next_at

    def tick(self, now: float) -> list:
        """Start the evaluation that is due, if one is: `EvaluateHere`, or the round core's
        effects handing it to workers (with no worker to hand it to, it is asked again later)."""
        if self.evaluating or self.stopped is not None \
                or not self.plan.due(now, self.rounds.version):
            return []
        if self.where == COORDINATOR:
            return [self._here(False)]
        if not self.rounds.scheduler.workers:
            self.plan.postpone(now)
            return []
        return self.rounds.evaluate(self.parts, self.rounds.samples_applied, now, self.shape)

    def _here(self, confirming: bool) -> EvaluateHere:
        self.here = EvaluateHere(confirming)
        return self.here

    def evaluated(self, version: int, metrics: dict, seconds: float, now: float,
                  judge: bool = True) -> tuple[str, list]:
        """An evaluation of `version` is done (here, or the round core's `Evaluated`): what it
        means for the run (evaluation.py's outcomes), and what to start now. Without `judge`
        (the run is stopping anyway) it is only recorded. The answer is the coordinator's own
        when it asked for one (`EvaluateHere`): only one is in flight, here or on workers."""
        mine = self.here is not None
        confirming = self.here is not None and self.here.confirming
        self.here = None
        outcome = self.plan.record(version, metrics, seconds, now, self.rounds.version)
        if not judge:
            return CONTINUE, []
        if not mine and outcome in (CONFIRM, TARGET, BAD_TARGET):
            return CONFIRM, [self._here(True)]  # the workers' word: the coordinator decides
        if outcome == CONFIRM:
            if not confirming:
                return CONFIRM, [self._here(True)]
            outcome = TARGET  # the confirmation itself met it: it was the current model
        if outcome in (TARGET, BAD_TARGET):
            self.stopped = outcome
        return outcome, []

    def stale(self) -> bool:
        """Whether the model as it is now has not been evaluated (the last word of a run)."""
        return self.plan.stale(self.rounds.version)
