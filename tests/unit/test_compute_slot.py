"""The compute slot that projects share (worker/projects.py), on a fake clock, and the one guest
that pauses them all."""

from __future__ import annotations

import asyncio

import pytest

from idlegrad.worker.daemon import WorkerConfig
from idlegrad.worker.idle import PolicyConfig, Readings
from idlegrad.worker.projects import ComputeSlot, MultiWorker, ProjectConfig
from idlegrad.worker.shares import ShareScheduler


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def slot_for(shares, hold_s=0.05) -> tuple[ComputeSlot, Clock]:
    clock = Clock()
    return ComputeSlot(ShareScheduler(shares), clock=clock, hold_s=hold_s), clock


def test_the_slot_goes_to_one_project_at_a_time_and_by_share():
    async def main():
        slot, clock = slot_for({"a": 3, "b": 1})
        slot.up("a"), slot.up("b")
        served = []
        for _ in range(40):
            asks = {name: slot.request(name) for name in "ab"}  # both always have a task queued
            (lent,) = [name for name, f in asks.items() if f.done()]
            served.append(lent)
            clock.now += 1.0
            slot.leave(lent, 1.0)
            for name in asks:
                if name != lent:
                    slot.leave(name, 0.0)  # withdraw, ask again next turn
        return served

    served = asyncio.run(main())
    assert served.count("a") == 30 and served.count("b") == 10, served


def test_an_owed_project_is_waited_for_at_most_the_hold_then_not_again():
    async def main():
        slot, clock = slot_for({"a": 3, "b": 1}, hold_s=0.05)
        slot.up("a"), slot.up("b")
        b = slot.request("b")  # a, owed most, is up but has no task queued yet
        assert not b.done()
        await asyncio.sleep(0.1)  # a never asks: the hold ends and b has the slot
        assert b.done() and slot.holder == "b"
        slot.leave("b", 1.0)
        again = slot.request("b")  # a is quiet now: no second wait
        assert again.done()
        slot.leave("b", 1.0)
        a = slot.request("a")  # a asks again: it is served, and waited for once more
        assert a.done()

    asyncio.run(main())


def test_a_project_that_goes_down_hands_the_slot_on():
    async def main():
        slot, clock = slot_for({"a": 3, "b": 1})
        slot.up("a"), slot.up("b")
        a = slot.request("a")
        b = slot.request("b")
        assert a.done() and not b.done()
        slot.down("a")  # its coordinator vanished mid-task
        assert b.done() and slot.holder == "b"
        slot.leave("b", 1.0)
        assert slot.request("b").done()  # a is down: nothing to wait for

    asyncio.run(main())


def test_one_guest_pauses_every_project(tmp_path):
    base = WorkerConfig(device="cpu", threads=1, state_log=str(tmp_path / "state.jsonl"),
                        policy=PolicyConfig(resume_after=0.0, user_idle_min_s=None,
                                            pause_on_battery=False,
                                            memory_available_min_mb=None))
    worker = MultiWorker(base, [ProjectConfig("a", "tcp://127.0.0.1:1", 3),
                                ProjectConfig("b", "tcp://127.0.0.1:2", 1, credits=4)])
    a, b = worker.sessions
    assert a.guest is b.guest is worker.guest and a._running is b._running
    assert (a.config.credits, b.config.credits) == (2, 4)
    assert a.config.connect_timeout == b.config.connect_timeout == 0  # wait for a project back
    assert worker.guest.apply(Readings(cpu_others_pct=90.0), 1.0) is not None
    assert a.paused and b.paused
    worker.guest.apply(Readings(cpu_others_pct=0.0), 2.0)
    assert not a.paused and not b.paused
    worker.guest.close()
    assert (tmp_path / "state.jsonl").read_text().count("\n") == 3  # one log: start, pause, resume


def test_project_names_must_differ():
    with pytest.raises(Exception, match="differ"):
        MultiWorker(WorkerConfig(device="cpu", threads=1),
                    [ProjectConfig("a", "tcp://127.0.0.1:1"), ProjectConfig("a", "tcp://127.0.0.1:2")])
