"""When to evaluate, and what an evaluation means for the run. Pure: times are arguments.

Evaluations run on a copy of the model while training goes on. Without a fixed period, the next
starts 10 times the last one's duration after it ended (at least 0.2 s), so that evaluation takes
at most about a tenth of the coordinator's time; a model that has not moved is not evaluated
again. The target is met only by the model training stops with: a result for a version that
training has moved past is confirmed on the current model first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .target import Target

CONTINUE, CONFIRM, TARGET, BAD_TARGET = "continue", "confirm", "target", "bad target"


@dataclass
class EvaluationPlan:
    every: Optional[float] = None  # seconds between evaluations; None: adaptive
    target: Optional[Target] = None
    next_at: float = 0.0
    last_version: Optional[int] = None
    last_seconds: float = 0.0

    def interval(self) -> float:
        if self.every is not None:
            return self.every
        return max(0.2, 10 * self.last_seconds)

    def due(self, now: float, version: int) -> bool:
        """Whether to start one now. A due check on an unchanged model pushes the next one back."""
        if now < self.next_at:
            return False
        if version == self.last_version:
            self.next_at = now + self.interval()
            return False
        return True

    def postpone(self, now: float) -> None:
        """A due evaluation could not start (no worker to hand it to): ask again later."""
        self.next_at = now + self.interval()

    def stale(self, version: int) -> bool:
        """Whether the model at `version` has not been evaluated (the last word of a run)."""
        return version != self.last_version

    def record(self, version: int, metrics: dict, seconds: float, now: float,
               current_version: int) -> str:
        """An evaluation of `version` ended at `now`: what it means for the run."""
        self.last_seconds = seconds
        self.last_version = version
        self.next_at = now + self.interval()
        target = self.target
        if target is None:
            return CONTINUE
        if target.metric not in metrics:
            return BAD_TARGET
        if not target.reached(metrics):
            return CONTINUE
        if version != current_version:
            # The model moved on while it was evaluated: the model we stop with must meet the
            # target itself, so confirm on it.
            return CONFIRM
        return TARGET
