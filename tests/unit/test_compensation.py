"""Delay compensation (DC-ASGD): the correction itself, its setting, and where the coordinator
applies it (the aggregator, with the snapshot the model state kept of the round's version)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from idlegrad.common.builtin_jobs import digits
from idlegrad.common.errors import ConfigError
from idlegrad.common.job import FlatModel, build
from idlegrad.coordinator.aggregator import Aggregator
from idlegrad.coordinator.compensation import DelayCompensator, compensate_
from idlegrad.coordinator.config import CoordinatorConfig, check
from idlegrad.coordinator.model_state import ModelState
from idlegrad.coordinator.staleness import (DelayCompensation, StalenessRule,
                                            parse_delay_compensation)

# the correction -------------------------------------------------------------------------------


def hand_case():
    grad = torch.tensor([1.0, 2.0, -1.0, 0.5])
    now = torch.tensor([0.5, 0.0, 1.0, 2.0])
    sent = torch.tensor([0.0, 1.0, 1.0, 1.0])  # now - sent = [0.5, -1, 0, 1]
    return grad, now, sent


def test_constant_correction_by_hand():
    grad, now, sent = hand_case()
    # g + 0.5 g^2 (now - sent): 1 + 0.5*1*0.5, 2 + 0.5*4*(-1), -1 + 0, 0.5 + 0.5*0.25*1
    out = compensate_(grad, now, sent, 0.5)
    assert out is grad  # in place
    assert torch.allclose(out, torch.tensor([1.25, 0.0, -1.0, 0.625]))


def test_adaptive_correction_by_hand():
    grad, now, sent = hand_case()
    mean_square = torch.tensor([4.0, 1.0, 1.0, 0.25])  # roots 2, 1, 1, 0.5
    # corrections 0.5 * g^2 * d / root: 0.25/2, -2/1, 0, 0.125/0.5
    out = compensate_(grad, now, sent, 0.5, mean_square)
    assert torch.allclose(out, torch.tensor([1.125, 0.0, -1.0, 0.75]), atol=1e-6)


def test_unmoved_model_changes_nothing():
    grad, now, _ = hand_case()
    assert torch.equal(compensate_(grad.clone(), now, now.clone(), 2.0), grad)


@pytest.mark.parametrize("seed", range(5))
def test_on_a_quadratic_the_corrected_stale_gradient_is_nearer_the_fresh_one(seed):
    """f(w) = 1/2 sum a_i w_i^2: the gradient at w is a * w. A gradient computed at w_sent and
    applied at w_now (a few SGD steps later) is corrected towards a * w_now: with lambda small
    enough that lambda g_i^2 <= a_i the curvature is never overestimated, so each coordinate's
    error shrinks (or stays 0 where the model did not move)."""
    gen = torch.Generator().manual_seed(seed)
    a = 0.5 + 1.5 * torch.rand(50, generator=gen)
    sent = torch.randn(50, generator=gen)
    now = sent.clone()
    for _ in range(3):
        now -= 0.1 * a * now  # three fresh steps the stale gradient missed
    stale, fresh = a * sent, a * now
    lam = float((a / (stale * stale)).min())
    corrected = compensate_(stale.clone(), now, sent, lam)
    assert (corrected - fresh).norm() < 0.9 * (stale - fresh).norm()
    assert bool(((corrected - fresh).abs() <= (stale - fresh).abs() + 1e-6).all())
    # the adaptive variant, its mean square that of this gradient: lambda |g| is the curvature
    adaptive = compensate_(stale.clone(), now, sent, float((a / stale.abs()).min()),
                           stale * stale)
    assert (adaptive - fresh).norm() < 0.9 * (stale - fresh).norm()


# the setting ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, kind, lam", [
    ("off", "off", 0.0), ("dc", "dc", 0.04), ("dc:0.5", "dc", 0.5), ("dc-a", "dc-a", 2.0),
    ("dc-a:1e-1", "dc-a", 0.1)])
def test_parsed(text, kind, lam):
    setting = parse_delay_compensation(text)
    assert (setting.kind, setting.lam) == (kind, lam)
    assert setting.on == (kind != "off")


@pytest.mark.parametrize("text", ["", "dc:", "dc:0", "dc:-1", "dc:nan", "dc:inf", "dc:x",
                                  "off:1", "DC", "adaptive"])
def test_refused(text):
    with pytest.raises(ConfigError, match="delay-compensation"):
        parse_delay_compensation(text)


def test_checked_with_the_configuration(tmp_path):
    config = dict(job="digits", insecure=True, checkpoint_dir=str(tmp_path))
    assert check(CoordinatorConfig(**config)).compensation == DelayCompensation()
    assert check(CoordinatorConfig(**config, delay_compensation="dc:1")).compensation == \
        DelayCompensation("dc", 1.0)
    with pytest.raises(ConfigError, match="local tasks"):
        check(CoordinatorConfig(**config, delay_compensation="dc", task="local:4"))
    with pytest.raises(ConfigError, match="delay-compensation"):
        check(CoordinatorConfig(**config, delay_compensation="dc:zero"))


def test_off_by_default_from_the_command_line():
    from idlegrad.cli.main import build_parser

    args = build_parser().parse_args(["coordinator", "--job", "digits"])
    assert args.delay_compensation == "off" and args.max_staleness == 32


# where the coordinator applies it --------------------------------------------------------------


def sgd_aggregator(setting: str, version: int = 3):
    torch.manual_seed(0)
    model = FlatModel(nn.Linear(3, 2))
    opt = torch.optim.SGD(model.module.parameters(), lr=0.1)
    agg = Aggregator(model, opt, StalenessRule("constant", 8), version,
                     compensation=parse_delay_compensation(setting))
    return model, agg


def test_a_stale_round_is_stepped_with_the_corrected_gradient():
    model, agg = sgd_aggregator("dc:0.5")
    before = model.params.detach().clone()
    sent = before + torch.linspace(-1, 1, model.numel)
    g = torch.linspace(0.5, 2.0, model.numel)
    assert agg.apply_terms([([g * 2], 1.0)], 2, round_version=1, sent=sent) == 1.0
    expected = compensate_(g.clone(), before, sent, 0.5)
    assert not torch.allclose(expected, g)
    assert torch.allclose(model.params, before - 0.1 * expected, atol=1e-6)
    assert agg.compensator.compensated == 1 and agg.compensator.without_snapshot == 0
    # the noise scale's figure is the round's own (uncorrected) mean gradient
    assert agg.mean_square == pytest.approx(float((g * g).sum()), rel=1e-6)


def test_the_adaptive_variant_divides_by_the_rounds_mean_square():
    """dc-a's first round starts its running mean with its own g*g: the correction is then
    lambda |g| (now - sent)."""
    model, agg = sgd_aggregator("dc-a:0.5")
    before = model.params.detach().clone()
    sent = before + torch.linspace(-1, 1, model.numel)
    g = torch.linspace(0.5, 2.0, model.numel)
    agg.apply_terms([([g], 1.0)], 1, round_version=1, sent=sent)
    expected = g + 0.5 * g.abs() * (before - sent)
    assert torch.allclose(model.params, before - 0.1 * expected, atol=1e-5)


def test_a_fresh_round_and_one_whose_model_was_not_kept_are_plain_steps():
    model, agg = sgd_aggregator("dc:0.5")
    g = torch.linspace(0.5, 2.0, model.numel)
    before = model.params.detach().clone()
    agg.apply_terms([([g], 1.0)], 1, round_version=3, sent=before + 1)  # fresh: nothing moved
    assert torch.allclose(model.params, before - 0.1 * g, atol=1e-6)
    before = model.params.detach().clone()
    agg.apply_terms([([g], 1.0)], 1, round_version=2, sent=None)  # stale, its model gone
    assert torch.allclose(model.params, before - 0.1 * g, atol=1e-6)
    assert agg.compensator.compensated == 0 and agg.compensator.without_snapshot == 1


def test_off_never_corrects():
    model, agg = sgd_aggregator("off")
    g = torch.linspace(0.5, 2.0, model.numel)
    before = model.params.detach().clone()
    agg.apply_terms([([g], 1.0)], 1, round_version=1, sent=before + 1)
    assert torch.allclose(model.params, before - 0.1 * g, atol=1e-6)
    assert (agg.compensator.compensated, agg.compensator.without_snapshot) == (0, 0)


def test_the_adaptive_mean_square_follows_every_applied_round():
    compensator = DelayCompensator(DelayCompensation("dc-a", 1.0))
    compensator.observe(torch.tensor([2.0, 0.0]))
    compensator.observe(torch.tensor([0.0, 1.0]))
    assert compensator.mean_square is not None
    assert torch.allclose(compensator.mean_square, torch.tensor([4 * 0.95, 0.05]))
    plain = DelayCompensator(DelayCompensation("dc", 1.0))
    plain.observe(torch.ones(2))
    assert plain.mean_square is None


def test_the_model_state_corrects_with_the_snapshot_of_the_rounds_version():
    """A round sent at version 0 (its snapshot made when it was sent), applied after a step:
    corrected with the model of version 0, which the model state kept for it."""
    built = build(digits())
    optimizer = torch.optim.SGD(built.model.module.parameters(), lr=0.1)
    state = ModelState(built, optimizer, StalenessRule(), 0,
                       compensation=DelayCompensation("dc", 1.0))
    state.blob(0)  # the stale round's task went out at version 0
    sent = state.model.params.detach().clone()
    numel = state.model.numel
    g = torch.full((numel,), 0.5)
    state.apply([([g.clone()], 1.0)], [1.0], 1, 0, lambda v: v == 0)  # a fresh round
    now = state.model.params.detach().clone()
    before = state.aggregator.compensator.compensated
    weight = state.apply([([g.clone()], 1.0)], [1.0], 1, 0, lambda v: False)  # the stale one
    assert weight == 0.5 and state.aggregator.compensator.compensated == before + 1
    expected = compensate_(g.clone(), now, sent, 1.0)
    assert torch.allclose(state.model.params, now - 0.1 * 0.5 * expected, atol=1e-6)
