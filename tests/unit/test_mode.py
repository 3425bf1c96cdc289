"""The round mode with no flag: synchronous unless another setting needs asynchronous rounds
(coordinator/mode.py), said in the status with its reason."""

from __future__ import annotations

import pytest

from idlegrad.common.errors import ConfigError
from idlegrad.coordinator.config import CoordinatorConfig, check
from idlegrad.coordinator.mode import resolve

PLAIN = dict(local_tasks=False, redundancy="none", verify_replicas=False, partitions=1,
             open_rounds=0, compensation=False)


def test_auto_is_synchronous_when_nothing_asks_for_asynchronous_rounds():
    mode = resolve("auto", **PLAIN)
    assert mode.sync and mode.name == "sync" and mode.reason.startswith("auto: synchronous")


@pytest.mark.parametrize("asks,says", [
    (dict(local_tasks=True), "--task local"),
    (dict(redundancy="replicate:2"), "--redundancy replicate:2"),
    (dict(verify_replicas=True), "--verify-replicas"),
    (dict(partitions=4), "--partitions 4"),
    (dict(open_rounds=2), "--open-rounds 2"),
    (dict(compensation=True), "--delay-compensation"),
])
def test_auto_is_asynchronous_for_what_only_asynchronous_rounds_do_and_says_why(asks, says):
    mode = resolve("auto", **dict(PLAIN, **asks))
    assert not mode.sync and mode.name == "async"
    assert mode.reason == f"auto: asynchronous rounds, for {says}"


def test_an_explicit_mode_wins_and_a_wrong_one_is_one_line():
    assert resolve("sync", **dict(PLAIN, partitions=4)).sync
    assert not resolve("async", **PLAIN).sync
    with pytest.raises(ConfigError, match="one of auto, sync, async, not 'fast'"):
        resolve("fast", **PLAIN)


def test_the_checked_config_carries_the_mode_the_scheduler_runs():
    assert check(CoordinatorConfig(job="digits")).mode.sync
    assert not check(CoordinatorConfig(job="digits", redundancy="cyclic:1")).mode.sync
    assert not check(CoordinatorConfig(job="digits", mode="async")).mode.sync
    with pytest.raises(ConfigError) as info:  # sync rounds have no copies to compare
        check(CoordinatorConfig(job="digits", mode="sync", redundancy="replicate:2",
                                verify_replicas=True))
    assert "\n" not in str(info.value)


def test_sync_with_copies_or_codes_is_one_line_not_a_silent_no_op():
    for redundancy in ("replicate:2", "cyclic:1", "adaptive"):
        with pytest.raises(ConfigError) as info:
            check(CoordinatorConfig(job="digits", mode="sync", redundancy=redundancy))
        assert f"--redundancy {redundancy} cannot be used with --sync" in str(info.value)
        assert "\n" not in str(info.value)
        assert not check(CoordinatorConfig(job="digits", redundancy=redundancy)).mode.sync
