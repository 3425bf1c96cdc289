"""The speed model alone: EWMA speeds, the fleet's readings, predictions, deadlines, the moment a
slot turns late, and the slots a worker that keeps missing its predictions may hold."""

from __future__ import annotations

import math

import numpy as np
import pytest

from idlegrad.coordinator.speed import SpeedModel, WorkerSpeed


def test_ewma_mean_and_variance():
    model, speed = SpeedModel(alpha=0.5), WorkerSpeed()
    model.observe_result(speed, 1.0)
    assert speed.s_per_sample == 1.0 and speed.s_var == 0.0 and speed.observed == 1
    model.observe_result(speed, 3.0)
    assert speed.s_per_sample == pytest.approx(2.0)
    assert speed.s_var == pytest.approx(0.5 * (0 + 0.5 * 4))
    assert list(speed.recent) == [1.0, 3.0] and list(model.times) == [1.0, 3.0]


def test_a_censored_reading_is_recorded_but_moves_no_ewma():
    model, speed = SpeedModel(), WorkerSpeed()
    model.observe_result(speed, 1.0)
    model.observe(9.0, speed)  # a late slot's elapsed time: a lower bound only
    assert speed.s_per_sample == 1.0 and speed.observed == 1
    assert list(speed.recent) == [1.0, 9.0] and model.observations == 2


def test_a_worker_is_predicted_by_the_fleet_until_it_has_enough_results():
    model = SpeedModel(min_results=3)
    newcomer, veteran = WorkerSpeed(), WorkerSpeed()
    assert model.prediction(newcomer) is None  # nobody measured yet
    for t in (1.0, 2.0, 3.0):
        model.observe_result(veteran, t)
    mean, sd = model.prediction(newcomer)
    assert model.judged_by_fleet(newcomer) and not model.judged_by_fleet(veteran)
    assert mean == pytest.approx(2.0) and sd == pytest.approx(np.std([1.0, 2.0, 3.0]))
    own_mean, own_sd = model.prediction(veteran)
    assert own_mean == veteran.s_per_sample and own_sd == pytest.approx(math.sqrt(veteran.s_var))


def test_the_fleet_prediction_follows_its_latest_readings_as_they_slide():
    model, speed = SpeedModel(min_results=1), WorkerSpeed()
    rng = np.random.default_rng(0)
    readings = list(rng.lognormal(0.0, 1.0, size=3 * SpeedModel.FLEET_READINGS + 17))
    for t in readings:
        model.observe(t)
    last = np.array(readings[-SpeedModel.FLEET_READINGS:])
    mean, sd = model.prediction(speed)
    assert mean == pytest.approx(last.mean(), rel=1e-12)
    assert sd == pytest.approx(last.std(), rel=1e-9)


def test_deadline_is_the_minimum_until_measured_then_a_multiple_of_the_queue():
    model = SpeedModel(min_deadline_s=30.0, deadline_factor=4.0)
    speed = WorkerSpeed()
    assert model.deadline_s(speed, samples=100, credits=2) == 30.0
    speed.s_per_sample = 0.1
    assert model.deadline_s(speed, samples=100, credits=2) == pytest.approx(4 * 0.1 * 100 * 2)
    assert model.deadline_s(speed, samples=100, credits=0) == pytest.approx(4 * 0.1 * 100)
    assert model.deadline_s(speed, samples=10, credits=1) == 30.0  # short: the minimum


def test_a_slot_turns_late_at_its_predicted_time_plus_deviations_and_floor():
    model = SpeedModel(spec_sd=2.0, spec_floor_s=0.5)
    prediction = (0.01, 0.005)  # (mean, sd) seconds per sample
    allowed = (0.01 + 2.0 * 0.005) * 100 * 3 + 0.5  # 100 samples, third in its worker's queue
    assert model.late_at(prediction, 100, 3, started=10.0) == pytest.approx(10.0 + allowed)
    assert not model.is_late(prediction, 100, 3, elapsed=allowed - 1e-9)
    assert model.is_late(prediction, 100, 3, elapsed=allowed + 1e-9)
    assert not model.is_late(prediction, 0, 1, elapsed=0.5)  # an empty slot: the floor only
    assert model.is_late(prediction, 0, 1, elapsed=0.6)


def test_two_late_slots_in_a_row_halve_the_slots_allowed_and_answers_restore_them():
    model, speed = SpeedModel(), WorkerSpeed()
    assert speed.slots_allowed(4) == 4 and speed.slots_allowed(0) == 0
    model.slot_late(speed)
    assert speed.size_factor == 1.0 and speed.late == 1  # once may be bad luck
    model.slot_late(speed)
    assert speed.size_factor == 0.5 and speed.slots_allowed(4) == 2
    for _ in range(5):
        model.slot_late(speed)
    assert speed.size_factor == 0.25 and speed.slots_allowed(4) == 1
    assert speed.slots_allowed(1) == 1  # never below one slot
    model.slot_answered(speed, speculated=True)  # a late slot's answer proves nothing
    assert speed.size_factor == 0.25 and speed.late_streak == 7
    model.slot_answered(speed, speculated=False)
    assert speed.size_factor == 0.375 and speed.late_streak == 0
    for _ in range(5):
        model.slot_answered(speed, speculated=False)
    assert speed.size_factor == 1.0


def test_link_time_is_wall_less_compute_and_wait_and_its_median_ignores_one_resend():
    speed = WorkerSpeed()
    assert speed.link_s is None
    SpeedModel.observe_link(speed, wall_s=5.0, compute_s=1.0, waited_s=0.0)
    assert list(speed.link_times) == [4.0]
    SpeedModel.observe_link(speed, wall_s=5.0, compute_s=4.0, waited_s=3.0)  # misreported
    assert list(speed.link_times) == [4.0]
    for reading in (4.2, 3.9, 600.0, 4.1):  # one result resent after a lost connection
        SpeedModel.observe_link(speed, wall_s=reading + 1.0, compute_s=1.0, waited_s=0.0)
    assert speed.link_s == pytest.approx(4.1)
    SpeedModel.observe_link(speed, wall_s=4.8, compute_s=1.0, waited_s=0.0)
    assert speed.link_s == pytest.approx((4.0 + 4.1) / 2)
