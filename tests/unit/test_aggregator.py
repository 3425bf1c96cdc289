"""Staleness weights and the optimizer step the coordinator takes for a decoded round."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from idlegrad.common.errors import ConfigError, GradientRejected
from idlegrad.common.job import FlatModel
from idlegrad.coordinator.aggregator import Aggregator, StalenessRule


# the staleness rule --------------------------------------------------------------------------


def test_inverse():
    rule = StalenessRule("inverse", max_staleness=5)
    assert [rule.weight(t) for t in range(4)] == [1.0, 0.5, 1 / 3, 0.25]


def test_sqrt():
    rule = StalenessRule("sqrt", max_staleness=5)
    assert rule.weight(0) == 1.0
    assert rule.weight(3) == pytest.approx(0.5)
    assert rule.weight(1) == pytest.approx(1 / math.sqrt(2))


def test_constant():
    rule = StalenessRule("constant", max_staleness=5)
    assert [rule.weight(t) for t in range(6)] == [1.0] * 6


@pytest.mark.parametrize("kind", StalenessRule.KINDS)
def test_none_past_max(kind):
    rule = StalenessRule(kind, max_staleness=2)
    assert rule.weight(2) is not None
    assert rule.weight(3) is None
    assert rule.weight(100) is None
    assert StalenessRule(kind, max_staleness=0).weight(0) == 1.0
    assert StalenessRule(kind, max_staleness=0).weight(1) is None


def test_defaults():
    rule = StalenessRule()
    assert rule.kind == "inverse" and rule.max_staleness == 32
    assert rule.weight(32) == pytest.approx(1 / 33) and rule.weight(33) is None


def test_future_gradient():
    with pytest.raises(ValueError):
        StalenessRule().weight(-1)


@pytest.mark.parametrize("kind", ["bogus", "", "Inverse", "linear"])
def test_bad_kind(kind):
    with pytest.raises(ConfigError):
        StalenessRule(kind)


def test_bad_max():
    with pytest.raises(ConfigError):
        StalenessRule("inverse", max_staleness=-1)


# the aggregator ------------------------------------------------------------------------------


def make(lr=0.1, rule=None, version=0, optimizer=torch.optim.SGD):
    torch.manual_seed(0)
    model = FlatModel(nn.Linear(3, 2))
    opt = optimizer(model.module.parameters(), lr=lr)
    return model, opt, Aggregator(model, opt, rule or StalenessRule("inverse", 8), version)


def gradient(model, seed=1):
    return torch.randn(model.numel, generator=torch.Generator().manual_seed(seed))


def test_apply_is_a_manual_sgd_step():
    model, opt, agg = make(lr=0.1)
    assert model.numel == 8
    before = model.params.clone()
    g = gradient(model)
    assert agg.apply(g, samples=4, round_version=0) == 1.0
    assert torch.allclose(model.params, before - 0.1 * g / 4, atol=1e-7)
    assert agg.version == 1
    # the module sees the same numbers: params are views
    w = model.module.weight.detach().reshape(-1)
    assert torch.equal(w, model.params[:6])
    assert opt.param_groups[0]["lr"] == 0.1


def test_stale_step_is_scaled_and_lr_restored():
    model, opt, agg = make(lr=0.2, version=3)
    before = model.params.clone()
    g = gradient(model, 2)
    weight = agg.apply(g, samples=5, round_version=1)  # tau = 2
    assert weight == pytest.approx(1 / 3)
    assert torch.allclose(model.params, before - 0.2 * (1 / 3) * g / 5, atol=1e-7)
    assert opt.param_groups[0]["lr"] == 0.2
    assert agg.version == 4
    assert agg.weight_for(4) == 1.0 and agg.weight_for(3) == 0.5


def test_several_steps_match_plain_sgd():
    model, opt, agg = make(lr=0.05, rule=StalenessRule("constant", 8))
    reference = model.params.clone()
    for i in range(5):
        g = gradient(model, 10 + i)
        agg.apply(g, samples=2, round_version=max(0, agg.version - 1))
        reference -= 0.05 * g / 2
    assert torch.allclose(model.params, reference, atol=1e-6)
    assert agg.version == 5


def test_lr_restored_when_step_fails(monkeypatch):
    model, opt, agg = make(lr=0.3, version=1)

    def boom(*a, **k):
        raise RuntimeError("step failed")

    monkeypatch.setattr(opt, "step", boom)
    with pytest.raises(RuntimeError):
        agg.apply(gradient(model), samples=1, round_version=0)
    assert opt.param_groups[0]["lr"] == 0.3
    assert agg.version == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rejected_params_unchanged(bad):
    model, opt, agg = make()
    before = model.params.clone()
    g = gradient(model)
    g[3] = bad
    with pytest.raises(GradientRejected):
        agg.apply(g, samples=4, round_version=0)
    assert torch.equal(model.params, before)
    assert torch.count_nonzero(model.grads) == 0  # nothing left for a later step to pick up
    assert agg.version == 0
    # a later good gradient is applied normally
    g2 = gradient(model, 5)
    agg.apply(g2, samples=1, round_version=0)
    assert torch.allclose(model.params, before - 0.1 * g2, atol=1e-7)


def test_overflow_to_inf_rejected():
    model, opt, agg = make()
    before = model.params.clone()
    g = torch.full((model.numel,), 3e38)
    with pytest.raises(GradientRejected):
        agg.apply(g * 10, samples=1, round_version=0)  # inf after scaling
    assert torch.equal(model.params, before)


@pytest.mark.parametrize("size", [7, 9, 0])
def test_wrong_size_rejected(size):
    model, opt, agg = make()
    before = model.params.clone()
    with pytest.raises(GradientRejected):
        agg.apply(torch.ones(size), samples=1, round_version=0)
    with pytest.raises(GradientRejected):
        agg.apply(torch.ones(2, 4), samples=1, round_version=0)
    assert torch.equal(model.params, before) and agg.version == 0


def test_no_samples_rejected():
    model, opt, agg = make()
    with pytest.raises(GradientRejected):
        agg.apply(gradient(model), samples=0, round_version=0)
    assert agg.version == 0


def test_too_stale_returns_none_and_changes_nothing():
    model, opt, agg = make(rule=StalenessRule("inverse", max_staleness=2), version=5)
    before = model.params.clone()
    state = {k: v for k, v in opt.state_dict().items()}
    assert agg.apply(gradient(model), samples=4, round_version=2) is None  # tau = 3
    assert torch.equal(model.params, before)
    assert agg.version == 5
    assert opt.state_dict()["state"] == state["state"]
    assert agg.apply(gradient(model), samples=4, round_version=3) == pytest.approx(1 / 3)


def test_adam_honours_the_weight_through_lr():
    """Adam normalises a scaled gradient away; a stale round must still move it less."""
    model, opt, agg = make(lr=0.01, optimizer=torch.optim.Adam, version=3,
                           rule=StalenessRule("inverse", 8))
    before = model.params.clone()
    g = gradient(model)
    agg.apply(g, samples=1, round_version=0)  # tau 3: weight 1/4
    step = (model.params - before).abs()
    # Adam's first step is lr * sign(g) (up to eps): here a quarter of lr
    assert torch.allclose(step, torch.full_like(step, 0.01 / 4), rtol=1e-3)


# weighted terms in chunks (the frames a gradient arrived in) -----------------------------------


def test_apply_terms_equals_apply_of_the_weighted_sum():
    torch.manual_seed(0)
    a, b = FlatModel(nn.Linear(5, 3)), FlatModel(nn.Linear(5, 3))
    b.load(a.params)
    opt_a = torch.optim.SGD(a.module.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(b.module.parameters(), lr=0.1, momentum=0.9)
    agg_a = Aggregator(a, opt_a, StalenessRule("constant"))
    agg_b = Aggregator(b, opt_b, StalenessRule("constant"))
    g1, g2 = torch.randn(a.numel), torch.randn(a.numel)
    agg_a.apply(0.5 * g1 - 2.0 * g2, samples=3, round_version=0)
    # the same sum as two terms, each cut into uneven chunks
    terms = [([g1[:7], g1[7:10], g1[10:]], 0.5), ([g2[:1], g2[1:]], -2.0)]
    agg_b.apply_terms(terms, samples=3, round_version=0)
    assert torch.allclose(a.params, b.params, atol=1e-6)
    assert agg_b.version == 1
    # with the terms' norms known (measured on arrival), the same step
    agg_a.apply(0.5 * g1 - 2.0 * g2, samples=3, round_version=1)
    agg_b.apply_terms(terms, samples=3, round_version=1,
                      norms=[float(g1.norm()), float(g2.norm())])
    assert torch.allclose(a.params, b.params, atol=1e-6)


def test_apply_terms_refuses_wrong_sizes_and_non_finite_terms():
    model = FlatModel(nn.Linear(2, 2))
    agg = Aggregator(model, torch.optim.SGD(model.module.parameters(), lr=0.1), StalenessRule())
    before = model.params.clone()
    with pytest.raises(GradientRejected):
        agg.apply_terms([([torch.ones(3), torch.ones(2)], 1.0)], samples=1, round_version=0)
    with pytest.raises(GradientRejected):
        agg.apply_terms([], samples=1, round_version=0)
    bad = torch.ones(model.numel)
    bad[-1] = float("nan")
    with pytest.raises(GradientRejected):
        agg.apply_terms([([torch.ones(model.numel)], 1.0), ([bad[:2], bad[2:]], 1.0)], samples=1,
                        round_version=0)
    with pytest.raises(GradientRejected):  # a non-finite norm bounds nothing: the sum is read
        agg.apply_terms([([bad], 1.0)], samples=1, round_version=0, norms=[math.nan])
    huge = torch.full((model.numel,), 1e30)
    with pytest.raises(GradientRejected):  # finite values, but squares beyond float32's range
        agg.apply_terms([([huge], 1.0)], samples=1, round_version=0,
                        norms=[float(huge.double().norm())])
    assert torch.equal(model.params, before) and agg.version == 0


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(1, 40), block=st.integers(1, 9), data=st.data())
def test_write_sum_blocks_across_uneven_chunks(numel, block, data):
    """Blocks that straddle the chunks of several terms write the weighted sum exactly and
    return its squared norm; a non-finite value anywhere reads as non-finite."""
    import idlegrad.coordinator.aggregator as aggregator

    saved, aggregator.BLOCK = aggregator.BLOCK, block
    try:
        terms, expected = [], torch.zeros(numel, dtype=torch.float64)
        for _ in range(data.draw(st.integers(1, 3))):
            values = torch.randn(numel)
            cuts = sorted(data.draw(st.lists(st.integers(0, numel), max_size=4)))
            chunks = [values[a:b] for a, b in zip([0, *cuts], [*cuts, numel])]
            coefficient = data.draw(st.floats(-3, 3, allow_nan=False))
            terms.append((chunks, coefficient))
            expected += values.double() * coefficient / 2
        out = torch.full((numel,), 7.0)
        squares = aggregator._write_sum(out, terms, samples=2)
        assert torch.allclose(out.double(), expected, atol=1e-5)
        assert squares == pytest.approx(float(expected.dot(expected)), rel=1e-4, abs=1e-6)
        chunks = list(terms[-1][0])
        k = max(i for i, c in enumerate(chunks) if c.numel())
        chunks[k] = chunks[k].clone()
        chunks[k][-1] = float("inf") if data.draw(st.booleans()) else float("nan")
        terms[-1] = (chunks, 1.0)
        assert not math.isfinite(aggregator._write_sum(out, terms, samples=2))
    finally:
        aggregator.BLOCK = saved
