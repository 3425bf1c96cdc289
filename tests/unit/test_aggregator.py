"""Staleness weights and the optimizer step the coordinator takes for a decoded round."""

from __future__ import annotations

import io
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


def test_stale_step_is_scaled_and_lr_untouched():
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


def test_lr_and_version_kept_when_step_fails(monkeypatch):
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


def test_adam_first_stale_step_is_weighted():
    """Adam normalises a scaled gradient away; a stale round must still move it less."""
    model, opt, agg = make(lr=0.01, optimizer=torch.optim.Adam, version=3,
                           rule=StalenessRule("inverse", 8))
    before = model.params.clone()
    g = gradient(model)
    agg.apply(g, samples=1, round_version=0)  # tau 3: weight 1/4
    step = (model.params - before).abs()
    # Adam's first step is lr * sign(g) (up to eps): here a quarter of lr
    assert torch.allclose(step, torch.full_like(step, 0.01 / 4), rtol=1e-3)


# staleness weights influence, over all later steps, for every optimizer the jobs use ----------

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),  # the synthetic job's
    "nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),  # outer.py's
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),  # the digits job's
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.01),
    "amsgrad": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
}


def displacement(build_optimizer, tau: int, history: int = 0, stale_gradient: bool = True,
                 then: int = 50) -> torch.Tensor:
    """How far the parameters move from one gradient applied with staleness `tau` and `then`
    fresh zero-gradient steps after it, after `history` fresh steps of other gradients."""
    torch.manual_seed(0)
    model = FlatModel(nn.Linear(3, 2))
    optimizer = build_optimizer(model.module.parameters())
    agg = Aggregator(model, optimizer, StalenessRule("inverse", 64))
    for i in range(history):
        agg.apply(gradient(model, 100 + i), samples=1, round_version=agg.version)
    agg.version += tau  # as if tau other rounds had been applied since this one was planned
    start = model.params.clone()
    g = gradient(model, 1) if stale_gradient else torch.zeros(model.numel)
    assert agg.apply(g, samples=1, round_version=agg.version - tau) == pytest.approx(1 / (1 + tau))
    for _ in range(then):
        agg.apply(torch.zeros(model.numel), samples=1, round_version=agg.version)
    return model.params - start


@pytest.mark.parametrize("tau", [1, 3, 9])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_stale_gradient_moves_the_model_w_times_as_far_over_later_steps(name, tau):
    # less the way the model moves with no gradient at all (AdamW's decay), which is no one's
    def influence(tau):
        return (displacement(OPTIMIZERS[name], tau=tau)
                - displacement(OPTIMIZERS[name], tau=tau, stale_gradient=False))

    fresh, stale = influence(0), influence(tau)
    w = 1 / (1 + tau)
    ratio = float(stale.norm() / fresh.norm())
    assert ratio == pytest.approx(w, rel=0.05)
    assert torch.allclose(stale, w * fresh, rtol=0.05, atol=1e-6)  # and in the same direction


@pytest.mark.parametrize("name", sorted(set(OPTIMIZERS) - {"sgd"}))  # SGD has no history
def test_stale_round_does_not_damp_the_history_it_joins(name):
    """A stale round of zero gradient leaves momentum and moments to move the model exactly as a
    fresh one would: the weight touches the stale gradient, never the steps' other terms."""
    fresh = displacement(OPTIMIZERS[name], tau=0, history=5, stale_gradient=False, then=3)
    stale = displacement(OPTIMIZERS[name], tau=3, history=5, stale_gradient=False, then=3)
    assert fresh.abs().max() > 1e-4  # there is a history to damp
    assert torch.allclose(stale, fresh, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("history", [0, 3])
def test_adam_moments_first_weighted_second_as_fresh(history):
    def moments(tau):
        torch.manual_seed(0)
        model = FlatModel(nn.Linear(3, 2))
        opt = torch.optim.Adam(model.module.parameters(), lr=0.01)
        agg = Aggregator(model, opt, StalenessRule("inverse", 8))
        for i in range(history):
            agg.apply(gradient(model, 100 + i), samples=1, round_version=agg.version)
        agg.version += tau
        # the history's part of the first moment, as it will be after one more step
        before = [0.9 * opt.state[p]["exp_avg"].clone() if history else 0
                  for p in model.module.parameters()]
        agg.apply(gradient(model, 1), samples=1, round_version=agg.version - tau)
        states = [opt.state[p] for p in model.module.parameters()]
        return ([s["exp_avg"] - b for s, b in zip(states, before)],
                [s["exp_avg_sq"] for s in states], [int(s["step"]) for s in states])

    fresh_share, fresh_sq, fresh_steps = moments(0)
    stale_share, stale_sq, stale_steps = moments(3)
    for f, s in zip(fresh_share, stale_share):
        assert torch.allclose(s, 0.25 * f, rtol=1e-5, atol=1e-9)
    for f, s in zip(fresh_sq, stale_sq):
        assert torch.allclose(s, f, rtol=1e-5, atol=1e-12)
    assert stale_steps == fresh_steps == [history + 1] * 2  # bias corrections as fresh


@pytest.mark.parametrize("options", [{"weight_decay": 0.5}, {"weight_decay": 0.5, "maximize": True},
                                     {"maximize": True}])
def test_adam_second_moment_as_fresh_with_l2_decay_and_maximize(options):
    """With coupled L2 decay (Adam adds l2 p to the gradient before its moments) and with
    maximize (it negates the gradient), the second moment after a stale step is the one the
    unscaled gradient leaves, except where the scaled one's square is the larger (decay and
    gradient opposed): there it is what the scaled one leaves, never less than fresh."""
    def second_moments(tau):
        torch.manual_seed(0)
        model = FlatModel(nn.Linear(4, 3))
        opt = torch.optim.Adam(model.module.parameters(), lr=0.01, **options)
        agg = Aggregator(model, opt, StalenessRule("inverse", 8))
        for i in range(2):
            agg.apply(gradient(model, 100 + i), samples=1, round_version=agg.version)
        params = model.params.clone()
        agg.version += tau
        weight = agg.weight_for(agg.version - tau)
        agg.apply(gradient(model, 1), samples=1, round_version=agg.version - tau)
        return torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1)
                          for p in model.module.parameters()]), params, weight

    (fresh, params, _), (stale, _, weight) = second_moments(0), second_moments(3)
    assert weight == pytest.approx(0.25)
    sign = -1.0 if options.get("maximize") else 1.0
    l2 = options.get("weight_decay", 0.0)
    g = gradient(FlatModel(nn.Linear(4, 3)), 1)
    unclamped = (sign * g + l2 * params).abs() >= (sign * weight * g + l2 * params).abs()
    assert unclamped.any()
    assert torch.allclose(stale[unclamped], fresh[unclamped], rtol=1e-5, atol=1e-12)
    assert bool((stale[~unclamped] >= fresh[~unclamped]).all())


def test_adam_state_made_for_a_stale_first_step_is_adams_own():
    """The state created before a stale first step has the layout Adam's own first step gives
    it, so a checkpoint of it loads into a new Adam and training goes on identically."""
    def first(tau):
        torch.manual_seed(0)
        model = FlatModel(nn.Linear(3, 2))
        opt = torch.optim.Adam(model.module.parameters(), lr=0.01)
        agg = Aggregator(model, opt, StalenessRule("inverse", 8), version=tau)
        agg.apply(gradient(model), samples=1, round_version=0)
        return model, opt

    _, fresh = first(0)
    model, stale = first(2)
    for p_fresh, p_stale in zip(fresh.state.values(), stale.state.values()):
        assert p_fresh.keys() == p_stale.keys()
        for key in p_fresh:
            assert (p_fresh[key].dtype, p_fresh[key].device, p_fresh[key].shape) == \
                (p_stale[key].dtype, p_stale[key].device, p_stale[key].shape)
    copy = FlatModel(nn.Linear(3, 2))
    copy.load(model.params)
    reloaded = torch.optim.Adam(copy.module.parameters(), lr=0.01)
    saved = io.BytesIO()
    torch.save(stale.state_dict(), saved)  # as a checkpoint does: load_state_dict would share
    saved.seek(0)
    reloaded.load_state_dict(torch.load(saved, weights_only=True))
    a = Aggregator(model, stale, StalenessRule("inverse", 8), version=3)
    b = Aggregator(copy, reloaded, StalenessRule("inverse", 8), version=3)
    for i in range(3):
        a.apply(gradient(model, 20 + i), samples=1, round_version=2)
        b.apply(gradient(copy, 20 + i), samples=1, round_version=2)
    assert torch.equal(model.params, copy.params)


def test_adam_with_l2_decay_never_gets_a_negative_second_moment():
    """With Adam's L2 decay the stale square can exceed the fresh one (the gradient and the decay
    opposed); the second moment then takes the larger, and stays a square."""
    model = FlatModel(nn.Linear(1, 1, bias=False))
    opt = torch.optim.Adam(model.module.parameters(), lr=0.01, weight_decay=1.0)
    agg = Aggregator(model, opt, StalenessRule("inverse", 8), version=1)
    model.load(torch.tensor([2.0]))
    # w = 1/2: Adam takes g + 1.0 * p, fresh -2 + 2 = 0, stale -1 + 2 = 1
    agg.apply(torch.tensor([-2.0]), samples=1, round_version=0)
    (state,) = opt.state.values()
    assert float(state["exp_avg_sq"]) == pytest.approx(0.001 * 1.0)
    assert math.isfinite(float(model.params[0]))


def test_optimizers_not_known_to_be_exact_are_named_in_a_warning(caplog):
    model = FlatModel(nn.Linear(2, 1))
    Aggregator(model, torch.optim.RMSprop(model.module.parameters()), StalenessRule())
    assert "RMSprop" in caplog.text
    caplog.clear()
    Aggregator(model, torch.optim.SGD(model.module.parameters(), lr=0.1), StalenessRule())
    Aggregator(model, torch.optim.AdamW(model.module.parameters()), StalenessRule())
    assert caplog.text == ""


def test_adam_without_a_second_moment_history_is_refused():
    model = FlatModel(nn.Linear(2, 1))
    with pytest.raises(ConfigError):
        Aggregator(model, torch.optim.Adam(model.module.parameters(), betas=(0.9, 0.0)),
                   StalenessRule())


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


def test_mean_square_is_the_rounds_mean_before_clipping_and_weighting():
    """The noise scale's big-batch figure (noise.py): |sum / samples|^2 of what was applied, not
    of the clipped or staleness-weighted gradient; None for a round not applied."""
    model, opt, agg = make(rule=StalenessRule("inverse", max_staleness=4), version=2)
    agg.clip_norm = 1e-3  # every step here is clipped
    g, h = gradient(model, 1), gradient(model, 2)
    assert agg.apply_terms([([g], 1.0), ([h], 2.0)], samples=4, round_version=1) == 0.5
    assert agg.mean_square == pytest.approx(float(((g + 2 * h) / 4).square().sum()), rel=1e-6)
    assert agg.clipped == 1
    assert agg.apply(g, samples=4, round_version=-10) is None  # too stale
    assert agg.mean_square is None
