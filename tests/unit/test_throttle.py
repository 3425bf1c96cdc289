"""The log throttle: at most one line a period, the clock passed in."""

from idlegrad.common.throttle import Throttle


def test_one_line_a_period():
    throttle = Throttle(1.0)
    assert throttle.ready(100.0)  # the first line always goes out
    assert not throttle.ready(100.5) and not throttle.ready(101.0)
    assert throttle.ready(101.01)
    assert not throttle.ready(101.5)
