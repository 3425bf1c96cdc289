"""Several projects per worker: one process, one asyncio loop, one session (`Worker`) per
coordinator, each with its own DEALER socket, keys and job, sharing the machine by resource share.

What is shared: the guest (one idle policy, one set of probes, one gate that pauses every engine;
the owner's limits count once, for the process), and the compute slot (one task computes at a
time, in the order `shares.ShareScheduler` picks). What is not: sockets, jobs, models, credits.

A coordinator that is down has no session computing and asks for nothing, so the others take its
time until it returns; each session reconnects on its own, forever (one project being away is not
a reason to stop serving the others).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import zmq.asyncio

from ..common.aio import on_stop_signals
from ..common.errors import ConfigError
from ..common.security import ClientKeys
from .building import pick_device
from .daemon import Worker, WorkerConfig
from .guest import Guest, watch
from .idle import describe_policy
from .shares import ShareScheduler

log = logging.getLogger("idlegrad.worker")


@dataclass(frozen=True)
class ProjectConfig:
    name: str
    coordinator: str
    share: float = 1.0
    job: Optional[str] = None
    credits: int = 2
    keys: Optional[ClientKeys] = None


class ComputeSlot:
    """The process's one compute thread, lent to one project's session at a time. Sessions with a
    task queued ask for it (`request`); when it is free the share scheduler picks among those
    asking. The holder gives it back with the seconds it computed (`leave`).

    A session that is up (`up`) but not asking may be owed the slot: its next task is on its way.
    The slot then waits for it, at most `hold_s`; a project that let the hold pass is quiet, not
    waited for again, until it next asks (a coordinator with no work costs one hold, not one per
    task).

    `clock` and `later` (call `fn` in `delay` seconds, as the running loop's `call_later`: a
    handle to cancel) are the slot's time, a virtual one in the in-memory pair's tests."""

    def __init__(self, scheduler: ShareScheduler, clock: Callable[[], float] = time.monotonic,
                 hold_s: float = 0.2, later: Optional[Callable[[float, Callable[[], None]],
                                                              Any]] = None):
        self.scheduler = scheduler
        self._clock = clock
        self._later = later
        self.hold_s = hold_s
        self._asking: dict[str, asyncio.Future] = {}
        self._up: set[str] = set()
        self._quiet: set[str] = set()
        self._hold: Any = None  # the hold's timer (its `cancel` ends it)
        self.holder: Optional[str] = None
        self.computed = {name: 0.0 for name in scheduler.shares}  # undecayed, for reports

    def up(self, project: str) -> None:
        """`project`'s session joined its coordinator: it will have work."""
        self._up.add(project)

    def down(self, project: str) -> None:
        """`project`'s session lost its coordinator (or stopped): nothing to wait for."""
        self._up.discard(project)
        self.leave(project, 0.0)

    def request(self, project: str) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._asking[project] = future
        self._quiet.discard(project)
        self._lend()
        return future

    def leave(self, project: str, computed_s: float) -> None:
        """`project` no longer asks for or holds the slot; it computed `computed_s` seconds."""
        asking = self._asking.pop(project, None)
        if asking is not None and not asking.done():
            asking.cancel()
        if self.holder == project:
            self.holder = None
            self.scheduler.charge(project, computed_s, self._clock())
            self.computed[project] += max(0.0, computed_s)
        self._lend()

    def _expected(self) -> set[str]:
        return self._up - set(self._asking) - self._quiet - {self.holder}

    def _lend(self) -> None:
        if self.holder is not None or not self._asking:
            return
        chosen = self.scheduler.pick(self._asking, self._clock(), self._expected())
        if chosen is None:  # owed to a project whose task is on its way: wait, not for long
            if self._hold is None:
                later = self._later or asyncio.get_running_loop().call_later
                self._hold = later(self.hold_s, self._hold_over)
            return
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None
        self.holder = chosen
        self._asking.pop(chosen).set_result(None)

    def _hold_over(self) -> None:
        self._hold = None
        self._quiet |= self._expected()
        self._lend()


class MultiWorker:
    """One worker process serving several coordinators, by share."""

    def __init__(self, base: WorkerConfig, projects: list[ProjectConfig],
                 half_life_s: float = 600.0):
        if not projects:
            raise ConfigError("no projects")
        names = [p.name for p in projects]
        if len(set(names)) != len(names):
            raise ConfigError(f"project names must differ, got {names}")
        device = pick_device(base.device)
        uses_gpu = device.type == "cuda"
        self.guest = Guest(base, uses_gpu, (device.index or 0) if uses_gpu else None)
        self.compute_slot = ComputeSlot(ShareScheduler({p.name: p.share for p in projects},
                                                       half_life_s))
        self.sessions: list[Worker] = []
        for project in projects:
            config = dataclasses.replace(
                base, coordinator=project.coordinator, job=project.job, credits=project.credits,
                keys=project.keys, state_log=None,  # the guest writes the one state log
                connect_timeout=0)  # a project that is away may come back: wait for it
            self.sessions.append(Worker(config, self.guest, self.compute_slot, project.name))
        self.base = base
        self._stop: Optional[str] = None

    @property
    def results_sent(self) -> int:
        return sum(s.results_sent for s in self.sessions)

    @property
    def pauses(self) -> int:
        return self.guest.pauses

    def run(self) -> str:
        return asyncio.run(self._main())

    def _on_signal(self, sig) -> None:
        self._stop = "interrupted"
        for session in self.sessions:
            session._on_signal(sig)

    async def _main(self) -> str:
        on_stop_signals(self._on_signal)
        log.info("idle policy: %s (readings: %s)", describe_policy(self.guest.policy.config),
                 self.guest.probes.describe())
        log.info("projects: %s", ", ".join(f"{s.project} ({s.config.coordinator}, share "
                                           f"{self.compute_slot.scheduler.shares[s.project]:g})"
                                           for s in self.sessions))
        ctx = zmq.asyncio.Context()
        watching = asyncio.ensure_future(watch(self.guest, self.base.sample_every, self._nudge))
        try:
            ended = await asyncio.gather(*(self._serve(s, ctx) for s in self.sessions))
        finally:
            watching.cancel()
            ctx.term()
            self.guest.close()
        failures = [exc for exc in ended if exc is not None]
        if self._stop is None and len(failures) == len(self.sessions):
            raise failures[0]  # every project refused this worker: say why, in one line
        return self._stop or next((s._stop for s in self.sessions if s._stop), "stopped")

    def _nudge(self) -> None:
        for session in self.sessions:
            session.nudge()

    async def _serve(self, session: Worker, ctx) -> Optional[Exception]:
        """One project's session until stopped; a project that refuses this worker ends, and
        the others go on."""
        try:
            await session.connect_loop(ctx)
            return None
        except Exception as exc:  # noqa: BLE001 - Refused, ConfigError, PeerGone: one project's
            log.error("project %s stopped: %s", session.project, exc)
            self.compute_slot.down(session.project)
            return exc
