"""The engine's pause gate: it stops between micro-batches, sleeps without CPU, resumes with the
same gradient, counts no paused time as compute time, and a cancel while paused ends it."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from idlegrad.common.builtin_jobs import digits
from idlegrad.common.job import build
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


def test_pause_stops_between_micro_batches_and_resume_gives_the_same_gradient(built):
    work = Work(1, 0, params_of(built), [[0, 0, 40]], [1.0])
    plain = engine_for(built).compute(work, threading.Event())

    running = threading.Event()
    running.set()
    paused_at = []

    def on_call(n):
        if n == 3:
            running.clear()  # the pause arrives in the middle of the third micro-batch
            paused_at.append(n)
    b, calls = gated(built, 3, on_call)
    engine = engine_for(b)
    result = {}
    t = threading.Thread(target=lambda: result.update(out=engine.compute(work, threading.Event(),
                                                                         running)))
    t.start()
    time.sleep(0.6)
    assert len(calls) == 3, "the engine computed past a pause"
    assert t.is_alive()
    cpu0 = time.thread_time()  # (our own thread; the engine's sleeps on an Event)
    running.set()
    t.join(10)
    assert not t.is_alive()
    assert len(calls) == 10
    out = result["out"]
    assert torch.allclose(out.gradient, plain.gradient, atol=1e-6)
    assert out.compute_s < 0.5, "paused time was counted as compute time"
    assert cpu0 >= 0


def test_cancel_while_paused_ends_promptly(built):
    running = threading.Event()  # never set: paused from the start
    cancel = threading.Event()
    b, calls = gated(built, 0, lambda n: None)
    engine = engine_for(b)
    errors = []

    def go():
        try:
            engine.compute(Work(1, 0, params_of(built), [[0, 0, 40]], [1.0]), cancel, running)
        except Cancelled:
            errors.append("cancelled")
    t = threading.Thread(target=go)
    t.start()
    time.sleep(0.3)
    assert calls == []
    t0 = time.monotonic()
    cancel.set()
    t.join(5)
    assert errors == ["cancelled"]
    assert time.monotonic() - t0 < 1.0


def test_paused_engine_uses_no_cpu(built):
    import psutil

    running = threading.Event()
    cancel = threading.Event()
    engine = engine_for(built)
    t = threading.Thread(target=lambda: pytest.raises(
        Cancelled, engine.compute, Work(1, 0, params_of(built), [[0, 0, 40]], [1.0]), cancel,
        running))
    t.start()
    time.sleep(0.2)
    proc = psutil.Process()
    before = sum(proc.cpu_times()[:2])
    time.sleep(1.0)
    used = sum(proc.cpu_times()[:2]) - before
    cancel.set()
    t.join(5)
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
