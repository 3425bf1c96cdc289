"""Link emulation (the worker's --link-mbps): the token bucket with a fake clock, the flag, and the
socket wrapper over a real inproc ZeroMQ pair."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from idlegrad.cli.main import build_parser
from idlegrad.cli.worker_cli import settings_of
from idlegrad.common.errors import ConfigError
from idlegrad.worker import config
from idlegrad.worker.link import OVERHEAD_BYTES, LinkShaper, ShapedSocket


def test_a_message_waits_its_size_over_the_rate():
    link = LinkShaper(mbps=8.0, burst_bytes=0)  # 1 MB/s
    assert link.delay(1_000_000 - OVERHEAD_BYTES, now=10.0) == pytest.approx(1.0)


def test_messages_queue_behind_each_other():
    link = LinkShaper(mbps=8.0, burst_bytes=0)
    n = 500_000 - OVERHEAD_BYTES
    assert link.delay(n, 0.0) == pytest.approx(0.5)
    assert link.delay(n, 0.1) == pytest.approx(0.9)  # waits for the first, then its own 0.5 s
    assert link.delay(n, 5.0) == pytest.approx(0.5)  # an idle link starts afresh
    assert link.carried == 3 * n


def test_a_burst_passes_small_messages_at_once():
    link = LinkShaper(mbps=8.0, burst_bytes=10_000)
    assert link.delay(100, now=100.0) == 0.0
    assert link.delay(100, now=100.0) == 0.0
    # the burst is not a second link: a large message still takes its time, less the burst
    assert link.delay(1_000_000, now=100.0) == pytest.approx(1.0 - 0.01, abs=1e-3)


def test_bad_speed():
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            LinkShaper(bad)


def settings(*argv):
    return settings_of(build_parser().parse_args(["worker", "--config", "/dev/null", *argv]))[0]


def test_flag_off_by_default_and_validated():
    assert settings().link_mbps is None
    assert settings("--link-mbps", "10").link_mbps == 10.0
    assert "link_mbps = 10.0" in config.to_toml(settings("--link-mbps", "10"))
    for bad in ("0", "-5", "x"):
        with pytest.raises(ConfigError) as info:
            settings("--link-mbps", bad)
        assert "\n" not in str(info.value) and "--link-mbps" in str(info.value)


def test_shaped_socket_delays_both_ways_and_keeps_order():
    async def run():
        ctx = zmq.asyncio.Context()
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind("inproc://link-test")
        b.connect("inproc://link-test")
        shaped = ShapedSocket(a, mbps=1.0)  # 125 kB/s
        loop = asyncio.get_running_loop()
        try:
            t0 = loop.time()
            await shaped.send_multipart([b"x" * 50_000])
            await shaped.send_multipart([b"small"])
            assert loop.time() - t0 < 0.1  # sending never blocks the caller
            first = await asyncio.wait_for(b.recv_multipart(), 5)
            first_at = loop.time() - t0
            second = await asyncio.wait_for(b.recv_multipart(), 5)
            assert [first, second] == [[b"x" * 50_000], [b"small"]]
            assert first_at >= (50_000 / 125_000) - 0.14  # less at most the burst
            await b.send_multipart([b"y" * 50_000])
            t1 = loop.time()
            got = await asyncio.wait_for(shaped.recv_multipart(), 5)
            assert got == [b"y" * 50_000] and loop.time() - t1 >= 0.25
            assert shaped.up.carried == 50_005 and shaped.down.carried == 50_000
        finally:
            shaped.close(linger=0)
            b.close(linger=0)
            ctx.term()

    asyncio.run(run())
