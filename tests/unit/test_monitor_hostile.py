"""Strings from the network are shown as text in every view, never read as markup or escapes.

A worker names itself (id, host, device) in its HELLO, and a coordinator names everything else
(job, events, metrics, bans, replies); both reach `idlegrad status`, `idlegrad top` and
`idlegrad plot`. Here every such field holds markup brackets, emoji codes, terminal escapes,
control characters, bidi overrides and very long strings: each view must show the brackets
literally, pass no escape or control character to the terminal, and cut what is too long.
"""

from __future__ import annotations

import asyncio
import json
import types

import pytest

from idlegrad.monitor import view

MARKUP = ("[bold]", "[/]", "[link=file:///etc/passwd]x[/link]", "[red", ":warning:")
ESCAPES = "\x1b[2J\x1b]0;pwned\x07"  # clear the screen, retitle the terminal
CONTROLS = "\r\n\t\x00\x7f\x9b\u202e"  # C0, DEL, C1 (CSI), right-to-left override
LONG = "A" * 5000
FORBIDDEN = ("\x1b", "\x00", "\x07", "\x7f", "\x9b", "\u202e", "A" * 500)


def hostile(label: str) -> str:
    return f"{label}[/]{ESCAPES}{CONTROLS}日本語🚀"


def hostile_snapshot() -> dict:
    workers = [
        {"id": "[/]w1", "host": "[link=file:///etc/passwd]x[/link]", "device": ESCAPES + "cuda",
         "state": "[bold]working", "credits": 2, "assigned": 1, "done": "[red", "cancelled": 0,
         "failed": LONG, "samples_per_s": 10.0, "staleness": 0.0, "last_seen_s": 0.1},
        {"id": "[bold]w2" + CONTROLS, "host": LONG, "device": ":warning:", "state": "idle",
         "credits": 2, "assigned": 0, "done": 1, "cancelled": 0, "failed": 0,
         "samples_per_s": 1.0, "staleness": 0.0, "last_seen_s": 0.2},
    ]
    metric = "[red" + ESCAPES
    return {
        "job": hostile("job"), "state": "[bold]training", "version": "[/]", "samples": 100,
        "epoch": 0.1, "samples_per_s": 5.0, "loss": 1.0, "metrics": {metric: 0.5, "[/]": 1.0},
        "target": hostile("target") + LONG, "target_metric": metric, "target_value": 0.9,
        "target_higher": True, "workers": workers, "instance": "one", "task": hostile("task"),
        "curve": [{"t": 0.0, "loss": 2.0, "metrics": {metric: 0.1}},
                  {"t": 1.0, "loss": 1.0, "metrics": {metric: 0.5}}],
        "rounds": {"open": "[/]"},
        "redundancy": {"code": hostile("code"), "partitions": ":warning:",
                       "staleness_rule": "[bold]", "max_staleness": LONG},
        "trust": {"refused": 1, "banned": [hostile("ban"), "[/]"], "banned_count": 2},
        "events": [{"id": 1, "time": 0, "kind": "[b", "text": hostile("event") + LONG},
                   {"id": 2, "time": 0, "kind": ESCAPES, "text": "[/]"}],
        "cursor": 2,
        "credits": {"identities": 3, "workers": {
            "[/]credit" + ESCAPES: {"samples": 10, "compute_s": 1.0, "verified": 1,
                                    "refused": 0, "first_seen": 0.0, "last_seen": 1.0},
            ":warning:credit" + CONTROLS + LONG: {"samples": "[red", "compute_s": LONG,
                                                "verified": "[/]", "refused": None,
                                                "first_seen": "[b", "last_seen": 1e300},
            "[bold]credit": "not a row"}},
    }


def assert_shown_as_text(out: str, markup=MARKUP) -> None:
    for literal in markup:
        assert literal in out, literal
    for bad in FORBIDDEN:
        assert bad not in out, repr(bad)
    assert "⚠" not in out  # ":warning:" was not read as an emoji code


# the view model ------------------------------------------------------------------------------


@pytest.mark.parametrize("value,want", [
    ("[bold]x[/]", "[bold]x[/]"), ("a\x1b[2Jb", "a\ufffd[2Jb"), ("\r\n\t\x00\x7f\x9b", "\ufffd" * 6),
    ("\u202eevil", "\ufffdevil"), ("日本語🚀", "日本語🚀"), (3, "3"), (None, "None")])
def test_shown_replaces_control_and_format_characters(value, want):
    assert view.shown(value) == want


def test_shown_cuts_long_strings():
    assert view.shown("A" * 5000, limit=10) == "A" * 9 + "…"
    assert len(view.shown("A" * 5000)) == view.MAX_SHOWN


# idlegrad status ----------------------------------------------------------------------------


class FakeZmqSource:
    def __init__(self, address, keys=None):
        self.address = address

    def fetch(self, timeout=1.0):
        return hostile_snapshot()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.mark.parametrize("terminal", [False, True], ids=["piped-wide", "terminal"])
def test_status_shows_hostile_strings_as_text(monkeypatch, capsys, terminal):
    from idlegrad.cli import status

    monkeypatch.setattr(status, "ZmqStatusSource", FakeZmqSource)
    monkeypatch.setattr("sys.stdout.isatty", lambda: terminal, raising=False)
    monkeypatch.setenv("COLUMNS", "100")
    args = types.SimpleNamespace(coordinator="tcp://127.0.0.1:5555", coordinator_key=None,
                                 secret_key=None, timeout=1.0, json=False)
    assert status.run_status(args) == 0
    out = capsys.readouterr().out
    if terminal:  # styled (escapes of its own), and a narrow table wraps: check the payload
        for bad in set(FORBIDDEN) - {"\x1b"} | {"\x1b[2J", "\x1b]0;"}:
            assert bad not in out, repr(bad)
    else:
        assert_shown_as_text(out)


def test_status_json_escapes_control_characters(monkeypatch, capsys):
    from idlegrad.cli import status

    monkeypatch.setattr(status, "ZmqStatusSource", FakeZmqSource)
    args = types.SimpleNamespace(coordinator="tcp://127.0.0.1:5555", coordinator_key=None,
                                 secret_key=None, timeout=1.0, json=True)
    assert status.run_status(args) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out
    assert json.loads(out)["workers"][0]["id"] == "[/]w1"  # the data itself, unchanged


@pytest.mark.parametrize("command", ["status", "credits"])
def test_a_refusal_is_one_line_naming_the_coordinators_reason(monkeypatch, capsys, command):
    from idlegrad.cli import credits, status

    class Refusing(FakeZmqSource):
        refused = "this key may not read the status" + ESCAPES + "[bold]"

        def fetch(self, timeout=1.0):
            return None

    module = {"status": status, "credits": credits}[command]
    monkeypatch.setattr(module, "ZmqStatusSource", Refusing)
    args = types.SimpleNamespace(coordinator="tcp://127.0.0.1:5555", coordinator_key=None,
                                 secret_key=None, timeout=1.0, json=False, checkpoint_dir=None)
    runner = status.run_status if command == "status" else credits.run_credits
    assert runner(args) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "\x1b" not in err
    assert err.startswith(f"idlegrad {command}: error: ") and "refused: this key may not" in err
    assert "[bold]" in err


# idlegrad credits ---------------------------------------------------------------------------


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_credits_shows_hostile_names_as_text(monkeypatch, capsys, as_json):
    from idlegrad.cli import credits

    monkeypatch.setattr(credits, "ZmqStatusSource", FakeZmqSource)
    monkeypatch.setattr("sys.stdout.isatty", lambda: False, raising=False)
    args = types.SimpleNamespace(coordinator="tcp://127.0.0.1:5555", coordinator_key=None,
                                 secret_key=None, timeout=1.0, json=as_json, checkpoint_dir=None)
    assert credits.run_credits(args) == 0
    out = capsys.readouterr().out
    if as_json:
        assert "\x1b" not in out and "\u202e" not in out
        workers = json.loads(out.strip().splitlines()[-1])["workers"]
        assert "[/]credit" + ESCAPES in workers  # the data itself, unchanged
    else:
        assert_shown_as_text(out, markup=("[/]credit", ":warning:credit"))
        assert "[bold]credit" not in out  # not a row: not shown


# idlegrad top -------------------------------------------------------------------------------


def screen_text(app) -> str:
    strips = app.screen._compositor.render_strips()
    return "\n".join("".join(segment.text for segment in strip) for strip in strips)


def test_top_shows_hostile_strings_as_text():
    pytest.importorskip("textual")
    from idlegrad.monitor.app import Confirm, MonitorApp

    class Source:
        address = "tcp://[::1]:5555"
        restarted = False
        calls: list = []

        def fetch(self, timeout=1.0):
            return hostile_snapshot()

        def control(self, action, worker=None, timeout=2.0):
            self.calls.append((action, worker))
            return True, hostile("detail")

    async def go():
        source = Source()
        app = MonitorApp(source, interval=10)
        async with app.run_test(size=(200, 50), notifications=True) as pilot:
            for _ in range(100):
                if app.polls:
                    break
                await pilot.pause(0.02)
            await pilot.pause(0.05)
            assert app.worker_ids() == ["[/]w1", "[bold]w2" + CONTROLS]  # the ids, as they are
            assert_shown_as_text(screen_text(app))
            board = str(app.query_one("#leaderboard").render())
            assert "[/]credit" in board and ":warning:credit" in board  # the leaderboard
            await pilot.press("slash", *"[/]")  # the operator's own brackets are text too
            await pilot.pause(0.05)
            assert app.worker_ids() == ["[/]w1"]
            await pilot.press("enter")
            await pilot.press("d")
            assert isinstance(app.screen, Confirm)
            await pilot.pause(0.05)
            assert "Drain worker [/]w1?" in screen_text(app)
            await pilot.press("y")
            for _ in range(50):
                if source.calls:
                    break
                await pilot.pause(0.02)
            await pilot.pause(0.1)
            assert source.calls == [("drain", "[/]w1")]  # the real id, not what is shown
            assert_shown_as_text(screen_text(app), markup=("detail[/]",))

    asyncio.run(go())


# idlegrad plot ------------------------------------------------------------------------------


def test_plot_shows_metric_names_and_reasons_as_text(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from idlegrad.monitor import plot

    metric = r"$\frac{$" + ESCAPES + LONG  # mathtext that does not parse
    records = [{"elapsed": i, "samples": i * 10, "loss": 1.0 / (i + 1), "workers": 1,
                "samples_per_s": 5.0, "version": i, "metrics": {metric: 0.1 * i}}
               for i in range(4)]
    records[-1].update(final=True, reason=r"$\undefined$ [/]" + CONTROLS)
    figures = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), real_close(fig)))
    out = tmp_path / "run.png"
    assert plot.plot(records, str(out)) == str(out)
    assert out.read_bytes()[:4] == b"\x89PNG"
    (fig,) = figures
    texts = [t for t in fig.findobj(lambda a: hasattr(a, "get_parse_math"))
             if t.get_text()]
    shown = "\n".join(t.get_text() for t in texts)
    assert r"$\frac{$" in shown and r"$\undefined$ [/]" in shown
    assert not any(t.get_parse_math() for t in texts)
    for bad in FORBIDDEN:
        assert bad not in shown, repr(bad)
