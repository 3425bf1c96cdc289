"""A batch that follows the noise (`--batch adaptive`, coordinator/batch_policy.py): the policy's
growth, caps and hysteresis, the learning-rate rules, the schedule counted in base-batch steps,
checkpoints, the settings' errors, and a real digits coordinator growing its rounds from results
of a known noise scale, shown in its status."""

from __future__ import annotations

import math

import pytest
import torch

from idlegrad.common.errors import ConfigError
from idlegrad.coordinator import batch_policy as bp
from idlegrad.coordinator.batch_policy import (Batching, BatchPolicy, BatchSetting,
                                               adascale_gain, lr_factor, parse_batch,
                                               resolve_lr_rule)
from idlegrad.coordinator.noise import NoiseScale, RoundNoise

from .known_noise import KnownNoise, drive


def feed(policy: BatchPolicy, b_simple, rounds: int, capacity=None, multiple: int = 1) -> list:
    return [policy.observe(b_simple, capacity, multiple) for _ in range(rounds)]


# the policy -------------------------------------------------------------------------------------


def test_it_grows_towards_the_noise_scale_at_most_doubling_after_patience():
    policy = BatchPolicy(32)
    seen = feed(policy, 1000.0, 12, multiple=8)
    # three measured rounds asking, then one step of at most x2, each on a multiple of 8
    assert seen == [32, 32, 64, 64, 64, 128, 128, 128, 256, 256, 256, 512]
    assert all(b % 8 == 0 for b in seen)
    assert all(after <= 2 * before for before, after in zip(seen, seen[1:]))
    assert policy.changes == 4


def test_it_stops_at_the_noise_scale_max_and_the_fleets_capacity():
    policy = BatchPolicy(32)
    feed(policy, 150.0, 30, multiple=4)
    assert policy.batch == 128  # 150 is within the band of 128: no step to 150
    capped = BatchPolicy(32, cap=100)
    feed(capped, 1000.0, 30, multiple=8)
    assert capped.batch == 96  # the largest multiple of 8 under MAX
    fleet = BatchPolicy(32)
    feed(fleet, 1000.0, 30, capacity=200.0)
    assert fleet.batch == 200
    # the fleet shrinks: the batch follows it down, halving at most per change
    assert feed(fleet, 1000.0, 6, capacity=60.0) == [200, 200, 100, 100, 100, 60]


def test_never_below_the_jobs_batch():
    policy = BatchPolicy(32)
    feed(policy, 1000.0, 6)
    assert policy.batch == 128
    feed(policy, 1.0, 30, multiple=4)
    assert policy.batch == 32
    assert BatchPolicy(32, cap=8).upper() == 32  # a MAX below the base: the base holds


def test_hysteresis_one_estimate_or_a_wobble_does_not_move_it():
    policy = BatchPolicy(64)
    # inside the band (64 * 1.25 = 80) for ever: never a change
    feed(policy, 79.0, 20)
    assert policy.batch == 64 and policy.changes == 0
    # an outlier round among ordinary ones, twice in a row short of patience: no change
    for _ in range(10):
        feed(policy, 5000.0, 2)
        feed(policy, 70.0, 1)
    assert policy.batch == 64 and policy.changes == 0
    # a streak that turns (grow, grow, shrink) starts counting again
    policy = BatchPolicy(32)
    feed(policy, 128.0, 6)
    assert policy.batch == 128
    for _ in range(5):
        feed(policy, 1000.0, 2)
        feed(policy, 33.0, 2)
    assert policy.batch == 128 and policy.changes == 2
    # no estimate holds the batch and resets the streak
    feed(policy, 1000.0, 2)
    policy.observe(None)
    feed(policy, 1000.0, 2)
    assert policy.batch == 128


def test_a_coarse_multiple_still_moves_within_the_doubling():
    policy = BatchPolicy(32)
    feed(policy, 1000.0, 3, multiple=100)  # no multiple of 100 in (32, 64]: the step itself
    assert policy.batch == 64


# the learning-rate rules ------------------------------------------------------------------------


def test_lr_rules():
    assert lr_factor("linear", 128, 32) == 4.0
    assert lr_factor("sqrt", 128, 32) == 2.0
    assert lr_factor("none", 128, 32) == 1.0
    for rule in ("linear", "sqrt", "adascale"):  # a batch at or below the base: the job's rate
        assert lr_factor(rule, 32, 32, 1.0, 100.0) == 1.0
        assert lr_factor(rule, 20, 32, 1.0, 100.0) == 1.0
    with pytest.raises(ValueError):
        lr_factor("auto", 64, 32)


def test_adascale_gain_from_the_noise_estimates():
    # r = (T / B0 + G) / (T / B + G), here B0 = 32, B = 128, G = 1, T = 64: (2 + 1) / (0.5 + 1)
    assert adascale_gain(128, 32, 1.0, 64.0) == pytest.approx(2.0)
    assert lr_factor("adascale", 128, 32, 1.0, 64.0) == pytest.approx(2.0)
    # noise dominates: the gain tends to S = B / B0; the gradient dominates: to 1
    assert adascale_gain(128, 32, 1e-9, 64.0) == pytest.approx(4.0, rel=1e-6)
    assert adascale_gain(128, 32, 1e9, 64.0) == pytest.approx(1.0, rel=1e-6)
    # bounded to [1, S], whatever the estimates say
    assert adascale_gain(128, 32, -1.0, 64.0) == 4.0  # |G|^2 measured <= 0: the bound
    assert adascale_gain(128, 32, 1.0, -5.0) == 1.0  # no noise measured
    assert adascale_gain(128, 32, None, None) == 1.0  # nothing measured yet
    assert adascale_gain(128, 32, math.nan, 64.0) == 1.0


def test_auto_is_adascale_for_sgd_and_sqrt_for_adam_and_the_rest():
    assert resolve_lr_rule("auto", "SGD") == "adascale"
    for name in ("Adam", "AdamW", "RMSprop", "SomethingElse"):
        assert resolve_lr_rule("auto", name) == "sqrt"
    assert resolve_lr_rule("linear", "Adam") == "linear"
    with pytest.raises(ConfigError, match="--batch-lr must be one of"):
        resolve_lr_rule("cubic", "SGD")


def test_batching_fixed_is_the_jobs_batch_and_rate():
    fixed = Batching(BatchSetting(), "sqrt", 32)
    assert not fixed.adaptive and fixed.batch == 32
    assert fixed.factor(128, 1.0, 64.0) == 1.0
    assert fixed.observe(1000.0, 1e6, 4) is None
    assert fixed.summary()["rule"] == "none"
    adaptive = Batching(BatchSetting(True, 500), "sqrt", 32, cap=200)
    assert adaptive.policy is not None and adaptive.policy.cap == 200  # --max-batch is smaller
    assert adaptive.factor(128, None, None) == 2.0
    changed = [adaptive.observe(1000.0, 10.0, 1) for _ in range(3)]  # 10 samples/s x 10 s
    assert changed == [None, None, 64]  # capacity 100 over the base: grows, within x2


# the schedule counts base-batch steps, the step takes the factor ----------------------------------


def make_aggregator(lr=0.1, progress_base=None):
    from idlegrad.common.job import FlatModel
    from idlegrad.coordinator.aggregator import Aggregator
    from idlegrad.coordinator.staleness import StalenessRule

    model = FlatModel(torch.nn.Linear(3, 1, bias=False))
    optimizer = torch.optim.SGD(model.module.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    aggregator = Aggregator(model, optimizer, StalenessRule("constant"), schedule=schedule)
    aggregator.progress_base = progress_base
    return aggregator


def test_the_schedule_counts_samples_over_the_base_batch_not_steps():
    aggregator = make_aggregator(progress_base=32)
    gradient = torch.ones(3)
    for samples in (64, 48, 16, 96):  # 2, 1.5, 0.5, 3 base-batch steps: 7 in all
        aggregator.apply(gradient * samples, samples, aggregator.version)
    assert aggregator.schedule.last_epoch == 7 and aggregator.schedule_steps == 7
    assert aggregator.progress == pytest.approx(7.0)
    assert aggregator.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 8)
    # without a base, one schedule step per optimizer step (the fixed batch)
    plain = make_aggregator()
    for samples in (64, 48, 16, 96):
        plain.apply(gradient * samples, samples, plain.version)
    assert plain.schedule.last_epoch == 4


def test_a_step_takes_the_factor_and_the_schedule_never_sees_it():
    aggregator = make_aggregator(lr=0.1)
    aggregator.schedule = None
    before = aggregator.model.params.detach().clone()
    aggregator.lr_factor = 2.0
    aggregator.apply(torch.ones(3) * 4, 4, 0)  # mean gradient 1
    moved = before - aggregator.model.params.detach()
    assert torch.allclose(moved, torch.full((3,), 0.2))  # lr 0.1 x 2
    assert aggregator.optimizer.param_groups[0]["lr"] == 0.1


# checkpoints ------------------------------------------------------------------------------------


def test_policy_and_noise_state_survive_a_checkpoint_exactly(tmp_path):
    from idlegrad.coordinator import checkpoint

    batching = Batching(BatchSetting(True), "adascale", 32)
    noise = NoiseScale()
    for i in range(7):
        noise.observe(RoundNoise(1.0 + 0.1 * i, 300.0, 4, 32))
        batching.observe(noise.b_simple, None, 4)
    batching.factor(64, noise.gradient_sq, noise.trace)
    assert batching.batch == 128 and batching.policy.streak == 1
    aggregator = make_aggregator(progress_base=32)
    aggregator.apply(torch.ones(3) * 48, 48, 0)
    checkpoint.save(str(tmp_path), {"batching": batching.state_dict(),
                                    "noise": noise.state_dict(),
                                    "progress": aggregator.progress_state()})
    state = checkpoint.load(str(tmp_path))  # weights_only: plain numbers only
    resumed, resumed_noise = Batching(BatchSetting(True), "adascale", 32), NoiseScale()
    resumed.load_state_dict(state["batching"])
    resumed_noise.load_state_dict(state["noise"])
    assert resumed.state_dict() == batching.state_dict()
    assert resumed_noise.summary() == noise.summary()
    again = make_aggregator(progress_base=32)
    again.load_progress_state(state["progress"])
    assert (again.progress, again.schedule_steps) == (1.5, 1)
    # both go on exactly as the uninterrupted ones
    for n in (noise, resumed_noise):
        n.observe(RoundNoise(2.0, 500.0, 4, 128))
    assert [batching.observe(noise.b_simple, None, 4) for _ in range(3)] == \
        [resumed.observe(resumed_noise.b_simple, None, 4) for _ in range(3)]
    # a resumed run whose MAX is now smaller keeps within it
    smaller = Batching(BatchSetting(True, 64), "adascale", 32)
    smaller.load_state_dict(state["batching"])
    assert smaller.batch == 64


# the settings: one clear line each ----------------------------------------------------------------


def test_parse_batch():
    assert parse_batch("fixed") == BatchSetting()
    assert parse_batch("adaptive") == BatchSetting(True)
    assert parse_batch("adaptive:4096") == BatchSetting(True, 4096)
    assert str(parse_batch("adaptive:4096")) == "adaptive:4096"
    for bad, needle in (("big", "--batch must be fixed, adaptive or adaptive:MAX"),
                        ("adaptive:0", "MAX must be a whole number"),
                        ("adaptive:", "MAX must be a whole number"),
                        ("adaptive:x1", "MAX must be a whole number")):
        with pytest.raises(ConfigError, match=needle):
            parse_batch(bad)


@pytest.mark.parametrize("argv,needle", [
    (["--batch", "huge"], "--batch must be fixed, adaptive or adaptive:MAX, not 'huge'"),
    (["--batch", "adaptive:-5"], "--batch adaptive:MAX: MAX must be a whole number"),
    (["--batch-lr", "cubic"], "invalid choice: 'cubic'"),
    (["--batch-lr", "sqrt"], "--batch-lr sqrt scales the learning rate of a larger batch: it "
                             "needs --batch adaptive"),
    (["--batch", "adaptive", "--task", "local:4"], "--batch adaptive grows rounds of gradients"),
])
def test_the_flags_errors_are_one_line(run_cli, argv, needle):
    from idlegrad.cli.processes import free_port

    result = run_cli(["coordinator", "--job", "digits", "--bind",
                      f"tcp://127.0.0.1:{free_port()}", *argv])
    assert result.code == 2
    assert needle in result.one_line_error()


def test_the_parser_passes_the_flags_to_the_config():
    from idlegrad.cli.main import build_parser

    args = build_parser().parse_args(["coordinator", "--job", "digits"])
    assert (args.batch, args.batch_lr) == ("fixed", "auto")
    args = build_parser().parse_args(["coordinator", "--job", "digits", "--batch",
                                      "adaptive:512", "--batch-lr", "linear"])
    assert (args.batch, args.batch_lr) == ("adaptive:512", "linear")


# a real coordinator ---------------------------------------------------------------------------


def test_a_coordinator_grows_its_rounds_shows_the_batch_and_resumes_it(tmp_path):
    from idlegrad.coordinator.config import CoordinatorConfig, check
    from idlegrad.coordinator.status import coordinator_snapshot
    from idlegrad.coordinator.training import Training
    from idlegrad.monitor import view

    def training():
        config = CoordinatorConfig(job="digits", partitions=4, batch="adaptive",
                                   checkpoint_dir=str(tmp_path))
        return Training(config, check(config))

    first = training()
    assert first.core.batching.rule == "sqrt"  # auto, for digits' Adam
    assert first.model.aggregator.progress_base == 32
    problem = KnownNoise(200.0, seed=3, dim=first.model.model.numel)
    driven = drive(first, problem, 60)
    batches, now = driven.batches, driven.now
    # 32 -> 64 -> 128 -> the measured B_simple (within its band), on multiples of 4
    batch = first.scheduler.batch
    assert 160 <= batch <= 256 and batch % 4 == 0
    assert {64, 128, batch} <= batches
    assert first.core.counters["batch_changes"] == 3
    snap = coordinator_snapshot(first, now)
    assert snap["batch"]["batch"] == batch and snap["batch"]["base"] == 32
    assert snap["batch"]["rule"] == "sqrt" and snap["batch"]["adaptive"] is True
    factor = math.sqrt(batch / 32)
    assert snap["batch"]["lr_factor"] == pytest.approx(factor, abs=1e-4)
    assert first.metrics_record(now)["batch"] == snap["batch"]
    row = dict(view.summary_rows(snap))["batch"]
    assert row == (f"{batch} (adaptive from 32: {view.number(batch / 32, 2)}x; lr by sqrt, "
                   f"x{view.number(snap['batch']['lr_factor'], 3)})")
    assert f"batch {batch} (adaptive, lr sqrt)" in view.header(snap).plain
    first.save_checkpoint(now)
    again = training()
    assert again.scheduler.batch == batch
    assert again.core.noise.summary() == first.core.noise.summary()
    assert again.core.batching.state_dict() == first.core.batching.state_dict()
    assert again.model.aggregator.progress == pytest.approx(first.model.aggregator.progress)


def test_a_fixed_coordinator_keeps_the_jobs_batch_and_says_so():
    from idlegrad.coordinator.config import CoordinatorConfig, check
    from idlegrad.coordinator.status import coordinator_snapshot
    from idlegrad.coordinator.training import Training
    from idlegrad.monitor import view

    config = CoordinatorConfig(job="digits", partitions=4)
    training = Training(config, check(config))
    assert training.model.aggregator.progress_base is None
    driven = drive(training, KnownNoise(200.0, dim=training.model.model.numel), 20)
    batches, now = driven.batches, driven.now
    assert max(batches) == 32  # (fewer at an epoch's end)
    assert training.scheduler.batch == 32
    snap = coordinator_snapshot(training, now)
    assert snap["batch"]["batch"] == 32 and snap["batch"]["adaptive"] is False
    assert dict(view.summary_rows(snap))["batch"] == "32 (fixed: the job's)"
    assert "batch 32" in view.header(snap).plain


@pytest.mark.parametrize("hostile", [
    None, "x", {"batch": "many", "base": 32}, {"batch": 10**30, "base": 32},
    {"batch": True, "base": 32}, {"batch": 64, "base": 0},
    {"batch": 64, "base": 32, "adaptive": True, "rule": "\x1b[31mred" * 50, "lr_factor": "x"},
])
def test_the_monitor_reads_the_batch_field_as_untrusted(hostile):
    from idlegrad.monitor import view

    snap = {"job": "j", "batch": hostile}
    row = dict(view.summary_rows(snap))["batch"]
    header = view.header(snap).plain
    assert "\x1b" not in row and "\x1b" not in header
    assert len(row) < 200
    if not isinstance(hostile, dict) or not isinstance(hostile.get("batch"), int) \
            or isinstance(hostile.get("batch"), bool) or hostile["batch"] > 10**12 \
            or not hostile.get("base"):
        assert row == "-"


def test_constants_are_the_documented_ones():
    # docs/scaling.md states these: a change to one is a change to the docs
    assert (bp.ROUND_S, bp.BAND, bp.PATIENCE, bp.STEP) == (10.0, 0.25, 3, 2.0)
