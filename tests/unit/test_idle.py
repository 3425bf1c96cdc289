"""The idle policy (worker/idle.py): every rule, hysteresis, unknown readings, limits. Fake clock."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idlegrad.worker.idle import (
    RULES, IdlePolicy, PolicyConfig, Readings, format_hours, in_hours, parse_hours)

# A machine where every rule is clear.
IDLE = Readings(cpu_others_pct=3.0, user_idle_s=3600.0, on_battery=False,
                memory_available_mb=8000.0, gpu_others_pct=0.0, worker_rss_mb=500.0,
                local_minute=12 * 60)

ALL_ON = PolicyConfig(resume_after=10.0, cpu_others_max_pct=25.0, user_idle_min_s=180.0,
                      pause_on_battery=True, memory_available_min_mb=256.0,
                      gpu_others_max_pct=10.0, uses_gpu=True, hours=((9 * 60, 17 * 60),),
                      worker_rss_max_mb=1024.0)


# every rule: (rule, reading field, value that pauses, value that does not, a word of the reason)
RULE_TABLE = [
    ("cpu", "cpu_others_pct", 25.1, 25.0, "other processes use 25%"),
    ("cpu", "cpu_others_pct", 100.0, 0.0, "100%"),
    ("user", "user_idle_s", 179.0, 180.0, "user input 179s ago"),
    ("user", "user_idle_s", 0.0, 1e6, "user input"),
    ("battery", "on_battery", True, False, "on battery"),
    ("memory", "memory_available_mb", 255.0, 256.0, "255 MiB available"),
    ("gpu", "gpu_others_pct", 10.5, 10.0, "of the GPU"),
    ("hours", "local_minute", 17 * 60, 9 * 60, "outside the allowed hours 09:00-17:00"),
    ("hours", "local_minute", 8 * 60 + 59, 16 * 60 + 59, "08:59"),
    ("rss", "worker_rss_mb", 1025.0, 1024.0, "1024 MiB ceiling"),
]


@pytest.mark.parametrize("rule,field,bad,good,needle", RULE_TABLE)
def test_each_rule_pauses_at_once_and_only_past_its_limit(rule, field, bad, good, needle):
    policy = IdlePolicy(ALL_ON)
    assert policy.decide(dataclasses.replace(IDLE, **{field: good}), now=0.0).run
    d = policy.decide(dataclasses.replace(IDLE, **{field: bad}), now=0.5)
    assert not d.run and d.changed and d.state == "paused"
    assert len(d.reasons) == 1 and d.reasons[0].startswith(rule + ":")
    assert needle in d.reasons[0]


RULE_OFF = [
    ("cpu", {"cpu_others_max_pct": None}, {"cpu_others_pct": 100.0}),
    ("user", {"user_idle_min_s": None}, {"user_idle_s": 0.0}),
    ("battery", {"pause_on_battery": False}, {"on_battery": True}),
    ("memory", {"memory_available_min_mb": None}, {"memory_available_mb": 1.0}),
    ("gpu", {"gpu_others_max_pct": None}, {"gpu_others_pct": 100.0}),
    ("gpu", {"uses_gpu": False}, {"gpu_others_pct": 100.0}),  # a CPU worker ignores the GPU
    ("hours", {"hours": ()}, {"local_minute": 3 * 60}),
    ("rss", {"worker_rss_max_mb": None}, {"worker_rss_mb": 1e6}),
]


@pytest.mark.parametrize("rule,off,reading", RULE_OFF)
def test_a_rule_switched_off_never_pauses(rule, off, reading):
    policy = IdlePolicy(dataclasses.replace(ALL_ON, **off))
    assert policy.decide(dataclasses.replace(IDLE, **reading), now=0.0).run
    # ... while the same reading pauses with the rule on
    assert not IdlePolicy(ALL_ON).decide(dataclasses.replace(IDLE, **reading), now=0.0).run


def test_several_rules_all_reported():
    d = IdlePolicy(ALL_ON).decide(
        dataclasses.replace(IDLE, cpu_others_pct=90, on_battery=True, memory_available_mb=10), 0)
    assert [r.split(":")[0] for r in d.reasons] == ["cpu", "battery", "memory"]


def test_defaults_are_on_where_they_make_sense():
    c = PolicyConfig()
    assert c.cpu_others_max_pct and c.user_idle_min_s and c.pause_on_battery
    assert c.memory_available_min_mb and c.gpu_others_max_pct and c.resume_after > 0
    assert c.hours == () and c.worker_rss_max_mb is None and not c.pause_when_unknown


# unknown readings ---------------------------------------------------------------------------------

FIELDS = {"cpu": "cpu_others_pct", "user": "user_idle_s", "battery": "on_battery",
          "memory": "memory_available_mb", "gpu": "gpu_others_pct", "hours": "local_minute",
          "rss": "worker_rss_mb"}


def test_the_table_covers_every_rule():
    assert set(FIELDS) == set(RULES) == {r[0] for r in RULE_TABLE} == {r[0] for r in RULE_OFF}


@pytest.mark.parametrize("rule", RULES)
def test_unknown_runs_by_default_and_is_reported(rule):
    d = IdlePolicy(ALL_ON).decide(dataclasses.replace(IDLE, **{FIELDS[rule]: None}), now=0.0)
    assert d.run and d.unknown == (rule,)


@pytest.mark.parametrize("rule", RULES)
def test_unknown_pauses_when_the_owner_says_so(rule):
    config = dataclasses.replace(ALL_ON, pause_when_unknown=frozenset({rule}))
    d = IdlePolicy(config).decide(dataclasses.replace(IDLE, **{FIELDS[rule]: None}), now=0.0)
    assert not d.run and d.reasons == (f"{rule}: unknown on this machine",)
    # a known reading for the same rule does not pause
    assert IdlePolicy(config).decide(IDLE, now=0.0).run


def test_everything_unknown_runs_on_a_bare_machine():
    d = IdlePolicy(PolicyConfig()).decide(Readings(), now=0.0)
    assert d.run and set(d.unknown) == {"cpu", "user", "battery", "memory"}  # gpu, hours, rss off


def test_unknown_for_a_rule_that_is_off_is_not_reported():
    d = IdlePolicy(dataclasses.replace(ALL_ON, uses_gpu=False, hours=())).decide(
        dataclasses.replace(IDLE, gpu_others_pct=None, local_minute=None), 0.0)
    assert d.run and d.unknown == ()


# hysteresis --------------------------------------------------------------------------------------

BUSY = dataclasses.replace(IDLE, cpu_others_pct=80.0)

# (time, readings, expected run, expected changed, expected resume_in or None)
TIMELINE = [
    (0.0, IDLE, True, False, None),
    (1.0, BUSY, False, True, None),  # pause at once
    (1.5, BUSY, False, False, None),
    (2.0, IDLE, False, False, 10.0),  # clear: the resume clock starts
    (7.0, IDLE, False, False, 5.0),
    (8.0, BUSY, False, False, None),  # busy again: the clock resets
    (9.0, IDLE, False, False, 10.0),
    (18.9, IDLE, False, False, 0.1),
    (19.0, IDLE, True, True, None),  # clear for resume_after seconds: run
    (19.5, IDLE, True, False, None),
    (20.0, BUSY, False, True, None),
]


def test_hysteresis_timeline():
    policy = IdlePolicy(ALL_ON)
    for now, readings, run, changed, resume_in in TIMELINE:
        d = policy.decide(readings, now)
        assert (d.run, d.changed) == (run, changed), (now, d)
        if resume_in is None:
            assert d.resume_in is None, (now, d)
        else:
            assert d.resume_in == pytest.approx(resume_in), (now, d)
        if not d.run:
            assert d.reasons and d.reasons[0].startswith("cpu:"), d  # the reason is kept


def test_resume_after_zero_resumes_on_the_first_clear_sample():
    policy = IdlePolicy(dataclasses.replace(ALL_ON, resume_after=0.0))
    assert not policy.decide(BUSY, 0.0).run
    d = policy.decide(IDLE, 0.5)
    assert d.run and d.changed


def test_starting_paused_waits_resume_after():
    policy = IdlePolicy(ALL_ON, running=False)
    assert not policy.decide(IDLE, 100.0).run
    assert policy.decide(IDLE, 110.0).run


def test_a_clock_going_backwards_restarts_the_wait():
    policy = IdlePolicy(ALL_ON)
    policy.decide(BUSY, 50.0)
    policy.decide(IDLE, 50.0)
    assert not policy.decide(IDLE, 10.0).run  # never resumes early
    assert policy.decide(IDLE, 20.0).run


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 5.0), st.booleans()), min_size=1, max_size=60),
       st.floats(0.0, 20.0))
def test_hysteresis_properties(steps, resume_after):
    """Runs iff no rule fired within the last resume_after seconds of samples (and since the
    last pause all samples were clear); a busy sample always pauses at once."""
    policy = IdlePolicy(dataclasses.replace(ALL_ON, resume_after=resume_after))
    now = 0.0
    running = True
    clear_since = None
    for dt, busy in steps:
        now += dt
        d = policy.decide(BUSY if busy else IDLE, now)
        if busy:
            running, clear_since = False, None
        elif not running:
            clear_since = now if clear_since is None else clear_since
            if now - clear_since >= resume_after:
                running, clear_since = True, None
        assert d.run == running, (now, d)
        if busy:
            assert not d.run


# hours -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,span", [
    ("09:00-17:00", (540, 1020)), ("22:00-07:00", (1320, 420)), ("00:00-24:00", (0, 1440)),
    (" 8:30 - 9:15 ", (510, 555)), ("24:00-06:00", (0, 360)),
])
def test_parse_hours(text, span):
    assert parse_hours(text) == span
    assert parse_hours(format_hours(span)) == span


@pytest.mark.parametrize("text", ["", "9-17", "09:00", "25:00-01:00", "10:60-11:00",
                                  "12:00-12:00", "24:30-01:00", None, 9])
def test_parse_hours_rejects(text):
    with pytest.raises(ValueError):
        parse_hours(text)


@pytest.mark.parametrize("minute,spans,inside", [
    (0, (), True),
    (539, ((540, 1020),), False), (540, ((540, 1020),), True), (1019, ((540, 1020),), True),
    (1020, ((540, 1020),), False),
    (1320, ((1320, 420),), True), (1439, ((1320, 420),), True), (0, ((1320, 420),), True),
    (419, ((1320, 420),), True), (420, ((1320, 420),), False), (720, ((1320, 420),), False),
    (720, ((1320, 420), (700, 800)), True), (0, ((0, 1440),), True), (1439, ((0, 1440),), True),
])
def test_in_hours(minute, spans, inside):
    assert in_hours(minute, spans) is inside


# limits ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,needle", [
    ({"resume_after": -1}, "resume_after"),
    ({"resume_after": None}, "resume_after"),
    ({"resume_after": float("nan")}, "resume_after"),
    ({"cpu_others_max_pct": 101}, "cpu_others_max_pct"),
    ({"cpu_others_max_pct": "25"}, "cpu_others_max_pct"),
    ({"user_idle_min_s": -5}, "user_idle_min_s"),
    ({"memory_available_min_mb": True}, "memory_available_min_mb"),
    ({"gpu_others_max_pct": -0.1}, "gpu_others_max_pct"),
    ({"worker_rss_max_mb": float("inf")}, "worker_rss_max_mb"),
    ({"hours": ((10, 10),)}, "hours"),
    ({"hours": ((0, 2000),)}, "hours"),
    ({"pause_when_unknown": frozenset({"mouse"})}, "pause_when_unknown"),
])
def test_impossible_limits_are_refused_naming_the_field(change, needle):
    with pytest.raises(ValueError, match=needle):
        dataclasses.replace(PolicyConfig(), **change)
