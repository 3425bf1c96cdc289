"""The trust policy: outlier gradients, offences, bans (pure; time passed in)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idlegrad.coordinator.trust import RollingMedian, TrustConfig, TrustPolicy


def honest(policy: TrustPolicy, n: int, per_sample: float = 1.0, scale: float = 32.0,
           who: str = "h", now: float = 0.0) -> None:
    for i in range(n):
        verdict = policy.judge(who, per_sample * scale * (1 + 0.1 * (i % 5)), scale, now)
        assert verdict.ok, verdict


def test_non_finite_is_refused_whatever_the_history():
    policy = TrustPolicy()
    for bad in (math.nan, math.inf):
        verdict = policy.judge("w", bad, 32.0, 0.0)
        assert not verdict.ok and verdict.reason == "non-finite"


def test_the_reference_judges_the_very_first_result():
    policy = TrustPolicy(TrustConfig(norm_factor=10), reference=1.0)
    assert not policy.judge("evil", 1000 * 32.0, 32.0, 0.0).ok
    assert policy.judge("good", 3 * 32.0, 32.0, 0.0).ok


def test_scaled_gradients_refused_honest_ones_accepted():
    policy = TrustPolicy(TrustConfig(norm_factor=10))
    honest(policy, 50)
    verdict = policy.judge("evil", 1000 * 32.0, 32.0, 1.0)
    assert not verdict.ok and verdict.reason == "norm" and "median" in verdict.detail
    assert policy.judge("ok", 8 * 32.0, 32.0, 1.0).ok  # within 10x
    assert not policy.judge("evil", 13 * 32.0, 32.0, 1.0).ok  # median 1.2


def test_norms_are_per_sample_and_small_slots_get_room():
    policy = TrustPolicy(TrustConfig(norm_factor=10))
    honest(policy, 50, per_sample=0.1, scale=256.0)
    # A bigger slot has a bigger gradient: per sample it is the same.
    assert policy.judge("h", 0.1 * 1024, 1024.0, 0.0).ok
    # One sample, noise-dominated: its norm is about sqrt(256) = 16 times the big slots' per sample.
    assert policy.judge("h", 0.1 * 16, 1.0, 0.0).ok
    assert not policy.judge("evil", 0.1 * 1000, 1.0, 0.0).ok


def test_median_is_robust_to_a_minority_of_poison():
    policy = TrustPolicy(TrustConfig(norm_factor=10, window=64), reference=1.0)
    for i in range(200):
        if i % 5 == 0:
            policy.judge("evil", 1000 * 32.0, 32.0, float(i))
        else:
            assert policy.judge("h", 32.0, 32.0, float(i)).ok
    assert policy.median() == pytest.approx(1.0)


def test_an_outlier_is_a_suspicion_not_an_offence_until_confirmed():
    policy = TrustPolicy(TrustConfig(norm_factor=10, ban_after=3))
    honest(policy, 20)
    for _ in range(5):
        verdict = policy.judge("unlucky", 1e6, 32.0, 0.0)
        assert not verdict.ok and verdict.reason == "norm" and not verdict.banned
    assert not policy.is_banned("unlucky") and policy.suspected == 5
    # A third computation found it honest: accepted, and the median learns from it.
    before = policy.median()
    for _ in range(30):
        policy.accept(1e6, 32.0)
    assert policy.median() > before
    assert policy.judge("unlucky", 1e6, 32.0, 1.0).ok


def test_ban_after_repeated_offences_within_the_window():
    policy = TrustPolicy(TrustConfig(norm_factor=10, ban_after=3, offence_window_s=60))
    honest(policy, 20)
    assert not policy.confirmed("evil", 0.0)
    assert not policy.confirmed("evil", 100.0)  # the first was forgiven
    assert not policy.is_banned("evil")
    assert not policy.judge("evil", math.nan, 32.0, 110.0).banned  # non-finite: an offence at once
    assert policy.confirmed("evil", 120.0)
    assert policy.is_banned("evil") and policy.banned() == ["evil"]
    assert not policy.confirmed("evil", 121.0)  # banned once, not again
    summary = policy.summary()
    assert summary["banned"] == ["evil"] and summary["banned_count"] == 1
    assert summary["offenders"]["evil"]["reasons"] == {"norm": 4, "non-finite": 1}
    assert not policy.is_banned("h")


def test_other_offences_count_and_zero_never_bans():
    policy = TrustPolicy(TrustConfig(ban_after=2))
    assert not policy.offence("w", "malformed", 0.0)
    assert policy.offence("w", "malformed", 1.0)
    never = TrustPolicy(TrustConfig(ban_after=0))
    for t in range(10):
        assert not never.offence("w", "malformed", float(t))


def test_check_off_accepts_any_finite_norm():
    policy = TrustPolicy(TrustConfig(norm_factor=0))
    honest(policy, 10)
    assert policy.judge("w", 1e30, 32.0, 0.0).ok
    assert not policy.judge("w", math.nan, 32.0, 0.0).ok


@pytest.mark.parametrize("kw", [dict(norm_factor=-1), dict(norm_factor=1.0),
                                dict(norm_factor=math.inf), dict(window=0), dict(ban_after=-1),
                                dict(offence_window_s=0)])
def test_config_checks(kw):
    with pytest.raises(ValueError):
        TrustConfig(**kw)


@settings(max_examples=100, deadline=None)
@given(window=st.integers(1, 9),
       values=st.lists(st.floats(0, 1e6, allow_nan=False), max_size=40))
def test_rolling_median_is_the_median_of_the_last_window_values(window, values):
    rolling = RollingMedian(window)
    assert rolling.median() is None
    for i, value in enumerate(values):
        rolling.add(value)
        assert rolling.median() == statistics.median(values[max(0, i + 1 - window):i + 1])


def test_the_summary_names_a_hundred_bans_and_counts_them_all():
    """Bans are for good, and the summary goes out in every status snapshot: it stays small."""
    policy = TrustPolicy(TrustConfig(norm_factor=10, ban_after=1))
    for i in range(150):
        policy.judge(f"evil-{i:03d}", math.nan, 32.0, float(i))
    summary = policy.summary()
    assert len(policy.banned()) == 150 and summary["banned_count"] == 150
    assert summary["banned"] == [f"evil-{i:03d}" for i in range(100)]


def test_records_of_offenders_without_a_ban_stay_bounded_and_bans_hold():
    """Without keys a peer can offend under any number of ids; the records no ban can come from
    are dropped, oldest first, and a ban is never forgotten."""
    policy = TrustPolicy(TrustConfig(norm_factor=10, ban_after=2, offence_window_s=60))
    policy.MAX_UNBANNED = 100
    policy.offence("banned", "malformed", 0.0)
    assert policy.offence("banned", "malformed", 1.0)
    for i in range(1000):
        policy.offence(f"id-{i}", "malformed", 2.0 + i)
        assert len(policy.offenders) <= 101
    assert policy.is_banned("banned")
    assert "id-999" in policy.offenders and "id-0" not in policy.offenders
    # a recent offender that was kept still gets banned by its next offence
    kept = max(i for i in policy.offenders if i != "banned")
    assert policy.offence(kept, "malformed", 1001.0)


def honest_run(policy: TrustPolicy, n: int, sigma: float, seed: int = 0) -> list[int]:
    """Honest norms of a converged run (spread wide, lognormal), every suspect computed again
    and found honest, as the settlement does: the indices of the suspects."""
    rng = np.random.default_rng(seed)
    suspects = []
    for i in range(n):
        norm = float(rng.lognormal(0.0, sigma))
        if policy.judge("w", norm, 1.0, float(i)).reason == "norm":
            suspects.append(i)
            policy.accept(norm, 1.0, verified=True)
    return suspects


def test_the_screen_widens_to_the_spread_of_verified_honest_outliers():
    policy = TrustPolicy(TrustConfig(norm_factor=10.0, ban_after=0), reference=1.0)
    late = [i for i in honest_run(policy, 3000, sigma=1.5) if i >= 1500]
    # a fixed 10x limit suspects about 6% of such a run's results (some 90 of these 1500)
    assert len(late) <= 15, len(late)
    assert policy.factor() > 10.0
    # poison far beyond any honest result is still suspected, and a result that was never
    # verified does not move the limit
    factor = policy.factor()
    assert policy.judge("w", 1e4 * policy.median(), 1.0, 4000.0).reason == "norm"
    policy.accept(1e6 * policy.median(), 1.0)  # judged by the median alone: not proof
    assert policy.factor() == factor


def test_the_widened_screen_is_bounded():
    policy = TrustPolicy(TrustConfig(norm_factor=10.0, ban_after=0), reference=1.0)
    policy.accept(1e9, 1.0, verified=True)  # one wild (but verified) outlier
    assert policy.factor() == 10.0 * TrustPolicy.MAX_ADAPTED
