"""Being a good guest, for the whole process: the idle policy (`idle.py`), the probes
(`probes.py`), and the gate that lets the engines compute.

The probes are read every `sample_every` seconds, in a thread (`watch`, one task per process
however many projects it serves); `apply` decides on a reading. A pause clears the gate: the engines
stop at their next micro-batch boundary (well within a second) and sleep, and downloads under the
gate stop between two blocks. Every change of state is logged, and written as a JSON line to
`state_log` when one is configured. (The compute thread the projects share is named here too:
`SharedCompute`.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
import time
from typing import Callable, Optional, Protocol

from . import allocator
from .idle import Decision, IdlePolicy, Readings
from .probes import Probes

log = logging.getLogger("idlegrad.worker")


class SharedCompute(Protocol):
    """The compute thread as the projects of one process share it (projects.ComputeSlot; named
    here, since projects builds on the daemon)."""

    def up(self, project: str) -> None: ...
    def down(self, project: str) -> None: ...
    def request(self, project: str) -> asyncio.Future: ...
    def leave(self, project: str, computed_s: float) -> None: ...


class Guest:
    """Being a good guest, for the whole process: the idle policy, the probes, and the gate that
    lets the engines compute. One per process however many projects it serves, so that one
    reading of the machine pauses them all and the owner's limits count once."""

    def __init__(self, config, uses_gpu: bool, gpu_index: Optional[int] = None):
        """`config`: a WorkerConfig (its policy, cpu_ignore_niced and state_log)."""
        self.policy = IdlePolicy(dataclasses.replace(config.policy, uses_gpu=uses_gpu))
        self.probes = Probes(ignore_niced=config.cpu_ignore_niced, gpu_index=gpu_index)
        self.running = threading.Event()  # the engines' gate: set while computing is allowed
        self.running.set()
        self.pauses = 0
        self._state_log = open(config.state_log, "a", buffering=1) if config.state_log else None
        self.log_state("start", Decision(True, (), False), None)

    def apply(self, readings: Readings, now: float) -> Optional[Decision]:
        """Decide on `readings`; open or close the gate. The decision when it changed, else None."""
        decision = self.policy.decide(readings, now)
        if not decision.changed:
            return None
        if decision.run:
            self.running.set()
            log.info("resuming: the machine has been idle for %gs", self.policy.config.resume_after)
        else:
            self.running.clear()  # the engines stop at their next micro-batch boundary
            allocator.return_freed_memory()  # sleeping, the worker holds what it uses, not its peak
            self.pauses += 1
            log.info("pausing: %s", "; ".join(decision.reasons))
        self.log_state("running" if decision.run else "paused", decision, readings)
        return decision

    def log_state(self, state: str, decision: Decision, readings: Optional[Readings]) -> None:
        if self._state_log is None:
            return
        record = {"time": time.time(), "monotonic": time.monotonic(), "state": state,
                  "reasons": list(decision.reasons), "unknown": list(decision.unknown),
                  "readings": dataclasses.asdict(readings) if readings is not None else None,
                  "pid": os.getpid()}
        try:
            self._state_log.write(json.dumps(record) + "\n")
        except OSError as exc:
            log.warning("cannot write the state log: %s", exc)

    def close(self) -> None:
        if self._state_log is not None:
            self._state_log.close()


async def watch(guest: Guest, sample_every: float, changed: Callable[[], None]) -> None:
    """Read the machine every `sample_every` seconds; a pause or resume calls `changed`."""
    guest.probes.restart()  # the first reading covers one sample, not the start-up
    while True:
        await asyncio.sleep(sample_every)
        try:
            readings = await asyncio.to_thread(guest.probes.read)
        except Exception:  # noqa: BLE001 - an unreadable machine: unknown readings
            readings = Readings()
        if guest.apply(readings, time.monotonic()) is not None:
            changed()
