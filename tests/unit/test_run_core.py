"""The run core (coordinator/run.py): when an evaluation starts and where, what its answer means,
confirming a target on the current model, and the stop. Virtual time: `now` is passed in."""

from __future__ import annotations

import math

import torch

from idlegrad.coordinator.effects import Evaluated
from idlegrad.coordinator.eval_slots import plan_ranges
from idlegrad.coordinator.rounds import RoundCore
from idlegrad.coordinator.run import COORDINATOR, WORKERS, EvaluateHere, RunCore
from idlegrad.coordinator.sampler import Sampler
from idlegrad.coordinator.scheduler import Assign, Scheduler, SchedulerConfig
from idlegrad.coordinator.target import Target
from idlegrad.coordinator.trust import TrustConfig, TrustPolicy

from .scheduling import NoModel


def rounds_core() -> RoundCore:
    scheduler = Scheduler(SchedulerConfig(batch_size=4), Sampler(4, None))
    return RoundCore(scheduler, NoModel(), TrustPolicy(TrustConfig(), reference=1.0))


def step(core: RoundCore, worker: str, now: float) -> None:
    """One round computed by `worker` and applied: the model moves one version."""
    held = core.scheduler.workers[worker].assigned
    if not held:
        core.ready(worker, 1, now)
    (slot,) = held
    version = core.version
    core.result(worker, slot, [torch.zeros(1)], 1.0, 0.1, now, samples=4, loss=1.0)
    assert core.version == version + 1


def test_on_the_coordinator_one_at_a_time_and_a_tenth_of_the_time():
    core = rounds_core()
    run = RunCore(core, COORDINATOR, plan_ranges(8, 4))
    assert run.tick(0.0) == [EvaluateHere(False)]
    assert run.evaluating and run.next_at() == math.inf
    assert run.tick(5.0) == []  # one in flight: no second
    assert run.evaluated(0, {"loss": 1.0}, 0.5, 5.0) == ("continue", [])
    assert not run.evaluating and run.next_at() == 10.0  # 10 times its 0.5 s after it ended
    core.join("a", {}, "a", 6.0)
    step(core, "a", 6.0)
    assert run.tick(9.9) == []
    assert run.tick(10.0) == [EvaluateHere(False)]


def test_a_model_that_has_not_moved_is_not_evaluated_again():
    run = RunCore(rounds_core(), COORDINATOR, plan_ranges(8, 4), every=1.0)
    run.tick(0.0)
    run.evaluated(0, {"loss": 1.0}, 0.1, 0.1)
    assert run.tick(1.1) == [] and run.next_at() == 2.1
    assert not run.stale()


def test_a_target_met_at_an_older_version_is_confirmed_on_the_current_model():
    core = rounds_core()
    core.join("a", {}, "a", 0.0)
    run = RunCore(core, COORDINATOR, plan_ranges(8, 4), target=Target.parse("accuracy>=0.9"))
    run.tick(0.0)
    step(core, "a", 0.5)  # training went on while it evaluated version 0
    outcome, start = run.evaluated(0, {"accuracy": 0.95}, 0.2, 1.0)
    assert (outcome, start) == ("confirm", [EvaluateHere(True)]) and run.stopped is None
    step(core, "a", 1.5)  # and goes on while it confirms: the confirmation's answer decides
    assert run.evaluated(1, {"accuracy": 0.93}, 0.2, 2.0) == ("target", [])
    assert run.stopped == "target" and run.tick(100.0) == []
    assert run.stale()  # the model stopped with is evaluated once more, as the run's last word


def test_a_confirmation_that_misses_the_target_lets_training_go_on():
    core = rounds_core()
    core.join("a", {}, "a", 0.0)
    run = RunCore(core, COORDINATOR, plan_ranges(8, 4), target=Target.parse("accuracy>=0.9"))
    run.tick(0.0)
    step(core, "a", 0.5)
    run.evaluated(0, {"accuracy": 0.95}, 0.2, 1.0)
    assert run.evaluated(1, {"accuracy": 0.85}, 0.2, 2.0) == ("continue", [])
    assert run.stopped is None and not run.evaluating


def test_a_target_on_a_metric_the_job_does_not_report_stops_the_run():
    run = RunCore(rounds_core(), COORDINATOR, [], target=Target.parse("accuracy>=0.9"))
    run.tick(0.0)
    assert run.evaluated(0, {"loss": 0.1}, 0.1, 0.1) == ("bad target", [])
    assert run.stopped == "bad target"


def test_an_answer_while_stopping_is_recorded_not_judged():
    core = rounds_core()
    run = RunCore(core, COORDINATOR, [], target=Target.parse("accuracy>=0.9"))
    run.tick(0.0)
    assert run.evaluated(0, {"accuracy": 1.0}, 0.1, 0.1, judge=False) == ("continue", [])
    assert run.stopped is None and not run.stale()


def test_on_workers_through_the_round_cores_evaluation_slots():
    core = rounds_core()
    run = RunCore(core, WORKERS, plan_ranges(4, 4), target=Target.parse("accuracy>=0.5"))
    assert run.tick(0.0) == [] and run.next_at() > 0.0  # nobody to hand it to: later
    core.join("a", {}, "a", 0.1)
    assert run.tick(run.next_at()) == [] and run.evaluating  # planned: a side slot waits
    (slot,) = [a for a in core.ready("a", 1, 0.3) if isinstance(a, Assign)]
    assert slot.kind == "eval" and run.tick(1.0) == []
    (done,) = [e for e in core.evaluated("a", slot.slot, 0, {"accuracy": (3.0, 4.0)}, 0.1, 0.5)
               if isinstance(e, Evaluated)]
    # the workers' sums met it: the coordinator's own evaluation decides, of the same model
    assert run.evaluated(done.version, done.metrics, done.seconds, 0.5) == (
        "confirm", [EvaluateHere(True)])
    assert run.evaluated(0, {"accuracy": 0.75}, 0.1, 0.6) == ("target", [])
