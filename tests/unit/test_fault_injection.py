"""Fault injection for tests and benchmarks (issue 3): the worker's --slowdown and --stall."""

from __future__ import annotations

import threading
import time

import pytest

from idlegrad.cli.main import build_parser
from idlegrad.cli.worker_cli import settings_of
from idlegrad.common.errors import ConfigError
from idlegrad.worker import config
from idlegrad.worker.engine import Cancelled, Engine


def settings(*argv):
    return settings_of(build_parser().parse_args(["worker", "--config", "/dev/null", *argv]))[0]


def test_off_by_default_and_set_by_flags():
    plain = settings()
    assert plain.slowdown == 1.0 and plain.stall is None
    s = settings("--slowdown", "5", "--stall", "0.2:3")
    assert s.slowdown == 5.0 and config.parse_stall(s.stall) == (0.2, 3.0)
    assert "[faults]" in config.to_toml(s) and "slowdown = 5.0" in config.to_toml(s)


@pytest.mark.parametrize("argv", [("--slowdown", "0.5"), ("--slowdown", "x"), ("--stall", "2:1"),
                                  ("--stall", "0.5"), ("--stall", "0.5:-1"), ("--stall", "a:b")])
def test_bad_values_one_line(argv):
    with pytest.raises(ConfigError) as info:
        settings(*argv)
    assert "\n" not in str(info.value) and argv[0] in str(info.value)


def bare_engine() -> Engine:
    engine = Engine.__new__(Engine)  # the injection needs no job
    engine.slowdown, engine.stall = 1.0, None
    import random
    engine._random = random.Random(0)
    return engine


def test_injected_delay():
    engine = bare_engine()
    assert engine._injected_delay(0.3) == 0.0
    engine.slowdown = 3.0
    assert engine._injected_delay(0.3, 0.3) == pytest.approx(0.6)  # 3x the CPU time in all
    assert engine._injected_delay(0.3, 0.5) == pytest.approx(0.4)  # a wait for a core is in it
    assert engine._injected_delay(0.3, 1.2) == 0.0  # waited past 3x already: nothing added
    engine.slowdown, engine.stall = 1.0, (1.0, 2.0)
    assert engine._injected_delay(0.3) == 2.0
    engine.stall = (0.0, 2.0)
    assert engine._injected_delay(0.3) == 0.0


def test_the_slowdown_multiplies_the_slots_cpu_time_not_its_wait_for_the_cores():
    engine = bare_engine()
    engine._cpu_start = time.thread_time()
    time.sleep(0.2)  # waiting (for a core, for anything) is no compute
    assert engine._slot_cpu_s() < 0.05
    spin_until = time.perf_counter() + 0.1
    while time.perf_counter() < spin_until:
        pass
    assert engine._slot_cpu_s() > 0.05


def test_injected_sleep_is_cancellable_and_pausable():
    engine = bare_engine()
    cancel, running = threading.Event(), threading.Event()
    running.set()
    t0 = time.perf_counter()
    assert engine._sleep(0.2, cancel, running) == 0.0
    assert 0.19 <= time.perf_counter() - t0 < 1.0
    threading.Timer(0.1, cancel.set).start()
    t0 = time.perf_counter()
    with pytest.raises(Cancelled):
        engine._sleep(30.0, cancel, running)
    assert time.perf_counter() - t0 < 1.0  # a stalled task is cancelled promptly
    cancel.clear()
    running.clear()
    threading.Timer(0.3, running.set).start()
    t0 = time.perf_counter()
    paused = engine._sleep(0.1, cancel, running)
    assert paused >= 0.25 and time.perf_counter() - t0 >= 0.35  # the pause does not eat the delay


def test_poison_setting_and_what_it_does():
    import math

    import torch

    from idlegrad.worker.engine import poisoned

    assert config.parse_poison("scale:1000") == ("scale", 1000.0)
    assert config.parse_poison("flip") == ("flip", -1.0)
    kind, factor = config.parse_poison("nan")
    assert kind == "nan" and math.isnan(factor)
    for bad in ("scale", "scale:x", "scale:inf", "flip:2", "zero", ""):
        with pytest.raises(ValueError):
            config.parse_poison(bad)
    g = torch.tensor([1.0, -2.0])
    assert torch.equal(poisoned(g, "scale", 1000.0), torch.tensor([1000.0, -2000.0]))
    assert torch.equal(poisoned(g, "flip", -1.0), -g)
    assert torch.isnan(poisoned(g, "nan", math.nan)).all()
    assert settings("--poison", "flip").poison == "flip"
    assert settings().poison is None
