"""The textual app with a fake status source, through textual's `run_test()` pilot."""

from __future__ import annotations

import asyncio
from typing import Optional

import pytest

pytest.importorskip("textual")

from idlegrad.monitor.app import Confirm, MonitorApp  # noqa: E402
from idlegrad.monitor.source import StatusSource  # noqa: E402

SIZE = (120, 40)


def worker(id, state="working", rate=10.0, done=1, host="h"):
    return {"id": id, "host": host, "device": "cpu", "state": state, "credits": 2, "assigned": 1,
            "done": done, "cancelled": 0, "failed": 0, "samples_per_s": rate, "staleness": 0.0,
            "last_seen_s": 0.1}


def snap(workers, paused=False, instance="one", events=(), version=5):
    return {"job": "digits", "state": "paused" if paused else "training", "paused": paused,
            "version": version, "samples": 100, "epoch": 0.1, "samples_per_s": 50.0, "loss": 1.0,
            "metrics": {"accuracy": 0.5}, "workers": workers, "instance": instance,
            "curve": [{"t": 0.0, "loss": 2.0, "metrics": {"accuracy": 0.1}},
                      {"t": 1.0, "loss": 1.0, "metrics": {"accuracy": 0.5}}],
            "rounds": {"open": 2}, "redundancy": {"code": "none"}, "events": list(events),
            "cursor": 0}


class FakeSource:
    """Serves the snapshots it is given (the last one again and again); records commands."""

    address = "tcp://fake:1"

    def __init__(self, *snapshots: Optional[dict]):
        self.snapshots = list(snapshots)
        self.calls: list[tuple[str, Optional[str]]] = []
        self.fetches = 0
        self.restarted = False

    def fetch(self, timeout: float = 1.0) -> Optional[dict]:
        self.fetches += 1
        if len(self.snapshots) > 1:
            return self.snapshots.pop(0)
        return self.snapshots[0] if self.snapshots else None

    def control(self, action, worker=None, timeout=2.0):
        self.calls.append((action, worker))
        return True, f"{action} done"


FLEET = [worker("w2", "idle", 5.0, 3), worker("w1", "working", 30.0, 1),
         worker("w3", "paused", 0.0, 9, host="gpu-box")]


async def settle(pilot, app, fetches=1):
    for _ in range(100):
        if app.polls >= fetches:
            break
        await pilot.pause(0.02)
    await pilot.pause(0.05)


async def wait_for_command(pilot, source):
    """A confirmed command reaches the source from a thread: give it up to a second."""
    for _ in range(50):
        if source.calls:
            break
        await pilot.pause(0.02)


def test_fake_is_a_status_source():
    assert isinstance(FakeSource(), StatusSource)


def test_rows_appear_in_id_order():
    async def go():
        app = MonitorApp(FakeSource(snap(FLEET)), interval=10)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app)
            assert app.worker_ids() == ["w1", "w2", "w3"]
            header = str(app.query_one("#header").render())
            assert "digits" in header and "samples/s" in header
    asyncio.run(go())


def test_sort_key_cycles_the_order():
    async def go():
        app = MonitorApp(FakeSource(snap(FLEET)), interval=10)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app)
            await pilot.press("s")  # samples/s, fastest first
            assert app.sort == "samples_per_s"
            assert app.worker_ids() == ["w1", "w2", "w3"]
            await pilot.press("s")  # state: working, idle, paused
            assert app.worker_ids() == ["w1", "w2", "w3"]
            await pilot.press("s")  # done, most first
            assert app.sort == "done"
            assert app.worker_ids() == ["w3", "w2", "w1"]
    asyncio.run(go())


def test_filter_narrows_and_escape_clears():
    async def go():
        app = MonitorApp(FakeSource(snap(FLEET)), interval=10)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app)
            await pilot.press("slash")
            await pilot.press(*"gpu")
            assert app.worker_ids() == ["w3"]
            await pilot.press("enter")
            assert app.filter_text == "gpu" and app.worker_ids() == ["w3"]
            await pilot.press("escape")
            assert app.filter_text == "" and app.worker_ids() == ["w1", "w2", "w3"]
    asyncio.run(go())


def test_pause_confirmed_sends_pause_and_declined_sends_nothing():
    async def go():
        source = FakeSource(snap(FLEET))
        app = MonitorApp(source, interval=10)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app)
            await pilot.press("p")
            assert isinstance(app.screen, Confirm)
            await pilot.press("n")
            await pilot.pause(0.1)
            assert source.calls == [] and not isinstance(app.screen, Confirm)
            await pilot.press("p")
            await pilot.press("y")
            await wait_for_command(pilot, source)
            assert source.calls == [("pause", None)]
    asyncio.run(go())


def test_resume_when_paused():
    async def go():
        source = FakeSource(snap(FLEET, paused=True))
        app = MonitorApp(source, interval=10)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app)
            await pilot.press("p")
            await pilot.click("#yes")
            await wait_for_command(pilot, source)
            assert source.calls == [("resume", None)]
    asyncio.run(go())


def test_drain_sends_the_selected_worker():
    async def go():
        source = FakeSource(snap(FLEET))
        app = MonitorApp(source, interval=10)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app)
            await pilot.press("down")  # second row: w2
            assert app.selected_worker() == "w2"
            await pilot.press("d")
            assert isinstance(app.screen, Confirm) and "w2" in app.screen.question
            await pilot.press("y")
            await wait_for_command(pilot, source)
            assert source.calls == [("drain", "w2")]
    asyncio.run(go())


def test_selection_follows_the_worker_across_refreshes():
    async def go():
        first = snap(FLEET)
        second = snap([worker("w0", rate=1.0)] + FLEET)  # a new worker sorts first
        source = FakeSource(first, second)
        app = MonitorApp(source, interval=10)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app)
            await pilot.press("down")
            assert app.selected_worker() == "w2"
            app.poll()
            await settle(pilot, app, fetches=2)
            assert app.worker_ids() == ["w0", "w1", "w2", "w3"]
            assert app.selected_worker() == "w2"
    asyncio.run(go())


def test_lost_and_restarted_coordinator_is_said_on_screen():
    async def go():
        ev = [{"id": 1, "time": 0, "kind": "join", "text": "w1 joined"}]
        source = FakeSource(snap(FLEET, events=ev), None, None,
                            snap(FLEET, instance="two", events=ev))
        app = MonitorApp(source, interval=10)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app)
            assert "connected to tcp://fake:1" in app.connection
            app.poll()
            await settle(pilot, app, fetches=2)
            assert "lost the coordinator" in app.connection
            assert app.worker_ids() == ["w1", "w2", "w3"]  # the last known state stays
            head = str(app.query_one("#header").render())
            assert "coordinator lost" in head and "training" not in head and "ETA" not in head
            app.poll()
            await settle(pilot, app, fetches=3)
            app.poll()
            await settle(pilot, app, fetches=4)
            assert "restarted" in app.connection
            events = str(app.query_one("#events").render())
            assert "restarted" in events and events.count("w1 joined") == 2
    asyncio.run(go())


def test_never_connected_says_so_and_q_quits():
    async def go():
        app = MonitorApp(FakeSource(), interval=10)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app)
            assert "connecting to tcp://fake:1" in app.connection
            assert app.worker_ids() == []
            await pilot.press("d")  # nothing selected: no dialog
            assert not isinstance(app.screen, Confirm)
            await pilot.press("q")
            await pilot.pause(0.1)
        assert app.return_code in (0, None)
    asyncio.run(go())


def test_a_key_without_the_monitors_role_is_told_why():
    async def go():
        source = FakeSource()
        source.refused = "this key may not read the status: [bold]only keys in --monitor-keys"
        app = MonitorApp(source, interval=10)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app)
            assert "refused: this key may not read the status" in app.connection
            assert "[bold]only" in str(app.query_one("#connection").render())  # text, not markup
    asyncio.run(go())


def test_the_leaderboard_shows_the_most_samples_first():
    async def go():
        board = {"identities": 2, "workers": {
            "w2": {"samples": 40, "verified": 3}, "w1": {"samples": 400, "verified": 0}}}
        app = MonitorApp(FakeSource(dict(snap(FLEET), credits=board)), interval=10)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app)
            lines = str(app.query_one("#leaderboard").render()).splitlines()
            assert lines[0] == "credits: samples, verified"
            assert lines[1].split() == ["w1", "400"] and lines[2].split() == ["w2", "40", "v3"]
    asyncio.run(go())


def test_watch_ends_the_app_with_its_message():
    async def go():
        done = {"now": False}
        app = MonitorApp(FakeSource(snap(FLEET)), interval=0.05,
                         watch=lambda: "finished" if done["now"] else None)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app)
            done["now"] = True
            for _ in range(100):
                if app.end_message:
                    break
                await pilot.pause(0.02)
        assert app.end_message == "finished"
    asyncio.run(go())


def test_a_snapshot_that_arrives_after_the_app_closed_is_dropped():
    """A fetch runs in a thread; one that ends while the app closes finds no widgets to show it
    in, and must not crash the app on its way out."""
    async def go():
        app = MonitorApp(FakeSource(snap(FLEET)), interval=10)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
        app.apply(snap(FLEET))  # its widgets are gone now
        assert app.snapshot is not None

    asyncio.run(go())


def test_the_data_plane_is_shown_as_status_shows_it():
    async def go():
        data = {"bytes": 3 * 2**20, "shards": 4, "served_bytes": 2**20, "bytes_from_mirrors": 0,
                "bytes_from_coordinator": 2**20, "cache_hits": 7, "downloads_in_flight": 1}
        app = MonitorApp(FakeSource(dict(snap(FLEET), data=data)), interval=10)
        async with app.run_test(size=(160, 40)) as pilot:
            await settle(pilot, app)
            panel = " ".join(str(app.query_one("#rounds").render()).split())
            assert "data: 3" in panel and "4 shards" in panel and "7 cache hits" in panel, panel
            # and on screen: the walkthrough of issue 29 met the panel's last rows cut, the
            # cache hits and downloads in flight never shown
            screen = app.export_screenshot().replace("&#160;", " ")
            assert "cache hits" in screen and "downloads in flight" in screen
    asyncio.run(go())


def test_a_confirmation_with_a_long_worker_name_fits_the_screen_and_says_it_all():
    long_name = "w-" + "x" * 120  # a host name and a pid fit in MAX_WORKER_ID (128)

    async def go():
        app = MonitorApp(FakeSource(snap([worker(long_name)])), interval=10)
        async with app.run_test(size=(160, 40)) as pilot:
            await settle(pilot, app)
            await pilot.press("d")
            await pilot.pause()
            assert isinstance(app.screen, Confirm)
            label = app.screen.query_one("#question")
            box = label.parent.region
            assert box.x >= 0 and box.right <= 160 and label.region.right <= box.right
            shown = "".join(str(label.render()).split())
            assert long_name in shown and shown.endswith("andleaves."), shown
    asyncio.run(go())
