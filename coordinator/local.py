"""Local-SGD tasks (issue 9): what `--task` means and how many inner steps a slot gets. Pure.

`--task gradient` is the default: a slot computes a coded gradient. `--task local:H`: a slot runs
H inner steps of the job's optimizer, each on `inner_batch` samples (the job's batch size), and
returns its parameter change; the coordinator applies the outer optimizer (`outer.py`) to the
combined change of a round. `--task local:auto`: H is sized for the worker that opens a round
from two measurements of that worker, both passed in: its seconds of compute per sample, and its
link seconds per slot (model down and change up: a slot's wall time from task sent to result
arrived, less its compute and its wait in the worker's queue). A slot computes for at least
`link_factor` times its link seconds, so that transfers take at most 1 / (1 + link_factor) of its
wall time, and for at least `slot_s` seconds (on a fast link, every worker's slot then takes about
the same time); H is bounded by `min_steps` and `max_steps`, the latter because a larger H means
fewer outer steps per sample. Until the worker has returned a result, H is `start_steps`.

Why a slot is H * inner_batch samples: the inner steps see as many samples each as a gradient
round would, so `local:1` is a gradient round with the optimizer moved to the worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, TypeGuard

from ..common.coding import Redundancy
from ..common.errors import ConfigError

MAX_STEPS = 10_000


@dataclass(frozen=True)
class TaskMode:
    kind: str = "gradient"  # gradient | local
    steps: Optional[int] = None  # local:H; None with kind local: auto
    slot_s: float = 5.0  # auto: the least compute seconds of a slot
    min_steps: int = 2
    max_steps: int = 500
    # auto, before the worker is measured. A float32 round trip of a P-parameter model moves 8P
    # bytes and an inner step costs about 6P x batch FLOPs, so the H that makes compute F times
    # the link time, F x 4 x FLOP/s / (3 x link bytes/s x batch), does not depend on the model's
    # size: for a CPU core (~10 GFLOP/s) behind a 10 to 100 Mbit/s link, batch 64 and F = 3 it
    # is about 50 to 500. The start takes the low end, so that a slow worker's first slot does
    # not run long before it is measured; a smaller one wastes a wave of transfers (32 steps cost
    # bandwidth.py a wave of slots that fell short of its target).
    start_steps: int = 64
    # auto: a slot computes at least this many times as long as its transfers take, which
    # bounds the link's share of a slot's wall time to 1 / (1 + link_factor)
    link_factor: float = 3.0

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

    def steps_for(self, s_per_sample: Optional[float], inner_batch: int,
                  link_s: Optional[float] = None) -> int:
        """Inner steps of a slot for a worker computing `s_per_sample` seconds per sample whose
        slots spend `link_s` seconds on its link (None: not measured yet)."""
        if self.steps is not None:
            return self.steps
        if not _measured(s_per_sample):
            return max(self.min_steps, min(self.max_steps, self.start_steps))
        compute_s = self.slot_s
        if _measured(link_s):
            compute_s = max(compute_s, self.link_factor * link_s)
        steps = math.ceil(compute_s / (s_per_sample * max(1, inner_batch)) - 1e-9)
        return max(self.min_steps, min(self.max_steps, steps))

    def slot_samples(self, s_per_sample: Optional[float], inner_batch: int,
                     link_s: Optional[float] = None) -> int:
        return self.steps_for(s_per_sample, inner_batch, link_s) * max(1, inner_batch)


def _measured(seconds: Optional[float]) -> TypeGuard[float]:
    return seconds is not None and seconds > 0 and math.isfinite(seconds)


def parse_task(text: str, slot_s: float = 5.0, min_steps: int = 2,
               max_steps: int = 500, link_factor: float = TaskMode.link_factor) -> TaskMode:
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
    if not (link_factor >= 0 and math.isfinite(link_factor)):
        raise ConfigError("the local link factor must be a number >= 0")
    if value == "auto":
        return TaskMode("local", None, slot_s, min_steps, max_steps,
                        start_steps=max(min_steps, min(max_steps, TaskMode.start_steps)),
                        link_factor=link_factor)
    try:
        steps = int(value)
    except ValueError:
        steps = 0
    if not 1 <= steps <= MAX_STEPS:
        raise ConfigError(f"--task {text!r}: local takes a whole number of steps from 1 to "
                          f"{MAX_STEPS}, or auto")
    return TaskMode("local", steps, slot_s, min_steps, max_steps, link_factor=link_factor)


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


@dataclass(frozen=True)
class OuterConfig:
    # Defaults for asynchronous rounds of one slot each (the default --partitions 1): every
    # round is one worker's change, applied as it lands, so momentum adds up the changes of
    # workers that ran concurrently from nearly the same model and overshoots (momentum 0.9 and
    # even 0.3 diverged on `synthetic`, see docs/architecture.md). DiLoCo's lr 0.7, momentum 0.9
    # suit synchronous rounds that average several workers (--partitions K).
    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = True

    def __post_init__(self):
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"outer learning rate must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"outer momentum must be in [0, 1), got {self.momentum}")
