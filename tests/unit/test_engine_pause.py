"""The engine's pause gate: it stops between micro-batches, sleeps without CPU, resumes with the
same gradient, counts no paused time as compute time, and a cancel while paused ends it.

The engine runs in a thread, as in the worker: what it returns or raises is carried back to the
test's thread, and the test waits for the engine to reach its gate, never for a guessed time."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from idlegrad.common.builtin_jobs import digits
from idlegrad.common.job import build
from idlegrad.worker import engine as engine_module
from idlegrad.worker.engine import Cancelled, Engine, Work


@pytest.fixture(scope="module")
def built():
    return build(digits())


def gated(built, after_calls: int, on_call):
    """A copy of the job whose loss calls `on_call(n)` at every micro-batch."""
    loss = built.job.loss
    calls = []

    def wrapped(model, batch):
        calls.append(1)
        on_call(len(calls))
        return loss(model, batch)
    return dataclasses.replace(built, job=dataclasses.replace(built.job, loss=wrapped)), calls


def engine_for(b):
    e = Engine(b, seed=3, device=torch.device("cpu"))
    e.micro_batch = 4
    e._observe = lambda *a: None
    return e


def params_of(b):
    return 0.2 * torch.randn(b.model.numel, generator=torch.Generator().manual_seed(0))


def report_waiting(engine) -> threading.Event:
    """An event set when the engine starts waiting at its pause gate: what the tests wait for,
    instead of sleeping and hoping it got there."""
    waiting = threading.Event()
    wait = engine._wait

    def reporting(*args):
        waiting.set()
        return wait(*args)
    engine._wait = reporting
    return waiting


def in_thread(fn) -> tuple[threading.Thread, dict]:
    """Run `fn` in a thread; its return value or exception lands in the dict, for the test's
    own thread to assert on (an assertion inside the thread would die with it, unseen)."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = fn()
        except BaseException as exc:
            outcome["error"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, outcome


def until(condition, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


class Clock:
    """The engine's clock, moved forward by hand: a pause can last an hour in no time."""

    def __init__(self):
        self.offset = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.offset

    def thread_time(self) -> float:  # CPU time (--slowdown's): a pause spends none
        return time.thread_time()


def test_pause_stops_between_micro_batches_and_resume_gives_the_same_gradient(built, monkeypatch):
    work = Work(1, 0, params_of(built), [[0, 0, 40]], [1.0])
    plain = engine_for(built).compute(work, threading.Event())

    running = threading.Event()
    running.set()

    def on_call(n):
        if n == 3:
            running.clear()  # the pause arrives in the middle of the third micro-batch
    b, calls = gated(built, 3, on_call)
    engine = engine_for(b)
    waiting = report_waiting(engine)
    clock = Clock()
    monkeypatch.setattr(engine_module, "time", clock)
    t, outcome = in_thread(lambda: engine.compute(work, threading.Event(), running))
    assert until(lambda: waiting.is_set() or not t.is_alive())
    assert len(calls) == 3, "the engine computed past a pause"
    assert t.is_alive() and waiting.is_set()
    clock.offset += 3600.0  # an hour paused
    running.set()
    t.join(10)
    assert not t.is_alive()
    assert "error" not in outcome, outcome
    assert len(calls) == 10
    out = outcome["value"]
    assert torch.allclose(out.gradient, plain.gradient, atol=1e-6)
    assert out.compute_s < 60, "paused time was counted as compute time"


def test_cancel_while_paused_ends_promptly(built):
    running = threading.Event()  # never set: paused from the start
    cancel = threading.Event()
    b, calls = gated(built, 0, lambda n: None)
    engine = engine_for(b)
    waiting = report_waiting(engine)
    t, outcome = in_thread(lambda: engine.compute(
        Work(1, 0, params_of(built), [[0, 0, 40]], [1.0]), cancel, running))
    assert until(lambda: waiting.is_set() or not t.is_alive())
    assert calls == [] and t.is_alive()
    t0 = time.monotonic()
    cancel.set()
    t.join(5)
    assert not t.is_alive()
    assert isinstance(outcome.get("error"), Cancelled), outcome
    assert time.monotonic() - t0 < 1.0


def thread_cpu_s(native_id: int) -> float:
    import psutil

    for thread in psutil.Process().threads():
        if thread.id == native_id:
            return thread.user_time + thread.system_time
    raise AssertionError(f"no thread {native_id} in this process")


def test_paused_engine_uses_no_cpu(built):
    running = threading.Event()
    cancel = threading.Event()
    engine = engine_for(built)
    waiting = report_waiting(engine)
    t, outcome = in_thread(lambda: engine.compute(
        Work(1, 0, params_of(built), [[0, 0, 40]], [1.0]), cancel, running))
    assert until(lambda: waiting.is_set() or not t.is_alive())
    assert t.is_alive()
    before = thread_cpu_s(t.native_id)  # the engine's own thread: nothing else in the process
    time.sleep(1.0)  # the window measured, not a wait for anything
    used = thread_cpu_s(t.native_id) - before
    cancel.set()
    t.join(5)
    assert isinstance(outcome.get("error"), Cancelled), outcome
    assert used < 0.05, f"{used:.3f} CPU seconds in one paused second"


def test_a_task_of_many_empty_parts_is_checked_at_once_and_cancelled_between_parts(built):
    """A hostile or broken coordinator's task of 65,536 parts with a different epoch each (each
    part an epoch permutation to build) held the worker's event loop in `check` for 20 s, and
    empty parts never reached the micro-batch loop where cancel and pause are looked at."""
    engine = engine_for(built)
    parts = [[epoch, 0, 0] for epoch in range(65_536)]
    work = Work(1, 0, params_of(built), parts, [1.0] * len(parts))
    t0 = time.monotonic()
    engine.check(work)  # bounds only: no permutation is built on the loop
    assert time.monotonic() - t0 < 0.5
    with pytest.raises(ValueError, match="outside"):
        engine.check(Work(1, 0, params_of(built), [[0, 0, len(built.train) + 1]], [1.0]))
    cancel = threading.Event()
    cancel.set()
    t0 = time.monotonic()
    with pytest.raises(Cancelled):
        engine.compute(work, cancel)
    assert time.monotonic() - t0 < 0.5
