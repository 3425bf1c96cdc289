"""Local-SGD tasks (issue 9): what `--task` means and how many inner steps a slot gets. Pure.

`--task gradient` is the default: a slot computes a coded gradient. `--task local:H`: a slot runs
H inner steps of the job's optimizer, each on `inner_batch` samples (the job's batch size), and
returns its parameter change; the coordinator applies the outer optimizer (`outer.py`) to the
combined change of a round. `--task local:auto`: H is sized for the worker that opens a round, from
its measured seconds per sample, so that each slot takes about `slot_s` seconds of compute;
bounded by `min_steps` and `max_steps`, and `start_steps` while the worker is not yet measured.

Why a slot is H * inner_batch samples: the inner steps see as many samples each as a gradient
round would, so `local:1` is a gradient round with the optimizer moved to the worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..common.coding import Redundancy
from ..common.errors import ConfigError

MAX_STEPS = 10_000


@dataclass(frozen=True)
class TaskMode:
    kind: str = "gradient"  # gradient | local
    steps: Optional[int] = None  # local:H; None with kind local: auto
    slot_s: float = 5.0  # auto: compute seconds a slot should take
    min_steps: int = 2
    max_steps: int = 500
    # auto, before the worker's speed is known: a first slot must be worth the model it
    # downloads (8 steps cost the benchmark a wave of link-bound slots; see bandwidth.py)
    start_steps: int = 32

    @property
    def local(self) -> bool:
        return self.kind == "local"

    @property
    def auto(self) -> bool:
        return self.local and self.steps is None

    def __str__(self) -> str:
        if not self.local:
            return "gradient"
        return "local:auto" if self.auto else f"local:{self.steps}"

    def steps_for(self, s_per_sample: Optional[float], inner_batch: int) -> int:
        """Inner steps of a slot for a worker computing `s_per_sample` seconds per sample."""
        if self.steps is not None:
            return self.steps
        if s_per_sample is None or s_per_sample <= 0 or not math.isfinite(s_per_sample):
            return max(self.min_steps, min(self.max_steps, self.start_steps))
        steps = round(self.slot_s / (s_per_sample * max(1, inner_batch)))
        return max(self.min_steps, min(self.max_steps, steps))

    def slot_samples(self, s_per_sample: Optional[float], inner_batch: int) -> int:
        return self.steps_for(s_per_sample, inner_batch) * max(1, inner_batch)


def parse_task(text: str, slot_s: float = 5.0, min_steps: int = 2,
               max_steps: int = 500) -> TaskMode:
    """`gradient`, `local:H` (1 <= H <= 10000) or `local:auto`. ConfigError with one line."""
    raw = str(text).strip().lower()
    if raw == "gradient":
        return TaskMode()
    kind, sep, value = raw.partition(":")
    if kind != "local" or not sep:
        raise ConfigError(f"--task {text!r}: expected gradient, local:H or local:auto")
    if not 1 <= min_steps <= max_steps <= MAX_STEPS:
        raise ConfigError(f"local steps bounds must satisfy 1 <= min ({min_steps}) <= "
                          f"max ({max_steps}) <= {MAX_STEPS}")
    if not (slot_s > 0 and math.isfinite(slot_s)):
        raise ConfigError("the local slot time must be a positive number of seconds")
    if value == "auto":
        return TaskMode("local", None, slot_s, min_steps, max_steps,
                        start_steps=max(min_steps, min(max_steps, TaskMode.start_steps)))
    try:
        steps = int(value)
    except ValueError:
        steps = 0
    if not 1 <= steps <= MAX_STEPS:
        raise ConfigError(f"--task {text!r}: local takes a whole number of steps from 1 to "
                          f"{MAX_STEPS}, or auto")
    return TaskMode("local", steps, slot_s, min_steps, max_steps)


def inner_steps(samples: int, inner_batch: int) -> int:
    """The inner steps of a local slot of `samples` samples: one per `inner_batch` begun, so a
    short slot (the end of an epoch) takes fewer steps, never smaller ones."""
    return max(1, math.ceil(samples / max(1, inner_batch)))


def check_redundancy(mode: TaskMode, redundancy: Redundancy, sync: bool = False) -> None:
    """Refuse what local tasks cannot do, with one line. Gradient coding decodes a *linear*
    combination of the partitions' results; H optimizer steps are not linear in the samples, so a
    coded slot's change is not the combination of the partitions' changes."""
    if not mode.local:
        return
    if redundancy.kind == "cyclic":
        raise ConfigError("--redundancy cyclic cannot be used with --task local: gradient coding "
                          "needs results linear in the samples, and H optimizer steps are not; "
                          "use replicate:R")
    if redundancy.kind == "adaptive":
        raise ConfigError("--redundancy adaptive cannot be used with --task local: it may choose "
                          "cyclic codes, which local tasks cannot decode; use none or replicate:R")
    if sync:
        raise ConfigError("--sync cannot be used with --task local: use --partitions K for rounds "
                          "of K local slots")
