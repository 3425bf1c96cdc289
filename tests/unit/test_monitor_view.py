"""The monitor's view model: snapshot -> header, rows, chart, panels, events. Pure."""

from __future__ import annotations

import pytest

from idlegrad.monitor import view


def worker(id, state="working", rate=10.0, done=1, host="h", device="cpu", **kw):
    return {"id": id, "host": host, "device": device, "state": state, "credits": 2, "assigned": 1,
            "done": done, "cancelled": 0, "failed": 0, "samples_per_s": rate, "staleness": 0.5,
            "last_seen_s": 0.25, **kw}


def snapshot(**kw):
    snap = {
        "job": "digits", "state": "training", "version": 1234, "samples": 40000, "epoch": 2.5,
        "epochs": 10, "train_samples": 16000, "samples_per_s": 1000.0, "loss": 0.25,
        "metrics": {"accuracy": 0.9, "loss": 0.3}, "target": "accuracy>=0.95",
        "target_metric": "accuracy", "target_value": 0.95, "target_higher": True,
        "elapsed_s": 10.0, "instance": "i1",  # the curve's last evaluation was just now
        "workers": [worker("b", "idle", 5.0, 3, host="beta"), worker("a", "working", 20.0, 1),
                    worker("c", "paused", 0.0, 7, device="cuda:0")],
        "curve": [{"t": float(t), "version": t, "samples": t * 100, "loss": 2.0 - 0.1 * t,
                   "metrics": {"accuracy": 0.5 + 0.04 * t, "loss": 2.0}} for t in range(11)],
        "rounds": {"open": 3, "pending_slots": 1, "opened": 50, "decoded": 47},
        "redundancy": {"code": "none", "partitions": 1, "open_rounds_limit": 0},
        "events": [], "cursor": 0,
    }
    snap.update(kw)
    return snap


def ids(rows):
    return [r.id for r in rows]


def test_rows_sorted_by_each_key():
    snap = snapshot()
    assert ids(view.worker_rows(snap, "id")) == ["a", "b", "c"]
    assert ids(view.worker_rows(snap, "samples_per_s")) == ["a", "b", "c"]  # fastest first
    assert ids(view.worker_rows(snap, "done")) == ["c", "b", "a"]  # most first
    assert ids(view.worker_rows(snap, "state")) == ["a", "b", "c"]  # working, idle, paused
    assert ids(view.worker_rows(snap, "nonsense")) == ["a", "b", "c"]


def test_sort_keys_cycle():
    seen = ["id"]
    for _ in range(len(view.SORT_KEYS)):
        seen.append(view.next_sort(seen[-1]))
    assert seen[-1] == "id" and set(seen) == set(view.SORT_KEYS)
    assert view.next_sort("bogus") == view.SORT_KEYS[0]


@pytest.mark.parametrize("text,want", [
    ("", ["a", "b", "c"]), ("eta", ["b"]),  # b's host is "beta"
    ("beta", ["b"]), ("CUDA", ["c"]), ("idle", ["b"]), ("cpu work", ["a"]), ("zzz", []),
    ("   ", ["a", "b", "c"]),
])
def test_filter(text, want):
    assert ids(view.worker_rows(snapshot(), "id", text)) == want


def test_row_cells_follow_columns():
    (row,) = [r for r in view.worker_rows(snapshot(), "id") if r.id == "a"]
    cells = dict(zip([k for k, _ in view.COLUMNS], row.cells))
    assert cells["id"] == "a" and cells["state"] == "working" and row.state == "working"
    assert cells["samples_per_s"] == "20.0" and cells["done"] == "1"
    assert cells["last_seen_s"] == "0.2s ago" or cells["last_seen_s"] == "0.3s ago"
    assert len(row.cells) == len(view.COLUMNS)


def test_rows_of_nothing():
    assert view.worker_rows(None) == []
    assert view.worker_rows({"workers": [None, 3]}) == []


def test_eta_from_the_target_trend():
    # accuracy rises 0.04 per second; at t=10 it is 0.9: 0.05 more takes 1.25 s
    seconds, why = view.eta(snapshot(epochs=None))
    assert why == "target" and seconds == pytest.approx(1.25)
    # it counts down between evaluations: a second later, from the same curve
    assert view.eta(snapshot(epochs=None, elapsed_s=11.0)) == (pytest.approx(0.25), "target")
    # past where the fit meets the target while the last evaluation is short of it: no guess
    assert view.eta(snapshot(epochs=None, elapsed_s=20.0)) == (None, "")


def test_eta_epochs_when_sooner_or_no_target():
    # (10 - 2.5) epochs * 16000 samples / 1000 per s = 120 s
    snap = snapshot(target_metric=None, target_value=None, target=None)
    assert view.eta(snap) == (pytest.approx(120.0), "epochs")
    flat = snapshot(curve=[{"t": float(t), "metrics": {"accuracy": 0.5}} for t in range(5)])
    assert view.eta(flat) == (pytest.approx(120.0), "epochs")  # no progress to extrapolate
    falling = snapshot(epochs=None, curve=[{"t": float(t), "metrics": {"accuracy": 0.9 - 0.01 * t}}
                                           for t in range(5)])
    assert view.eta(falling) == (None, "")


def test_eta_reached_and_lower_is_better():
    assert view.eta(snapshot(target_value=0.8)) == (0.0, "target")
    snap = snapshot(target_metric="loss", target_value=0.5, target_higher=False, epochs=None,
                    elapsed_s=3.0, curve=[{"t": float(t), "metrics": {"loss": 1.0 - 0.1 * t}} for t in range(4)])
    seconds, why = view.eta(snap)
    assert why == "target" and seconds == pytest.approx(2.0)


def test_header_shows_the_essentials():
    text = view.header(snapshot(), "connected")
    for part in ("digits", "1,234", "1,000 samples/s", "accuracy 0.9000", "ETA 1s (target)",
                 "workers 3", "connected", "training"):
        assert part in text.plain, part
    assert "waiting" in view.header(None).plain


def test_header_of_a_lost_coordinator_shows_no_current_rate():
    # the walkthrough of issue 29 met "coordinator lost ... 5,248 samples/s": a rate from the
    # last snapshot, read as if the fleet were still training at it
    text = view.header(snapshot(), "lost", lost=True).plain
    assert "coordinator lost" in text and "1,000 samples/s" not in text, text
    assert "- samples/s" in text and "ETA" not in text and "training" not in text


@pytest.mark.parametrize("seconds,text", [
    (None, "-"), (-1, "-"), (float("inf"), "-"), (0, "0s"), (59.4, "59s"), (61, "1m01s"),
    (3725, "1h02m")])
def test_duration(seconds, text):
    assert view.duration(seconds) == text


def test_chart_series_and_metric_choice():
    series = view.chart_series(snapshot())
    assert list(series) == ["loss", "accuracy"]
    assert series["loss"][0] == (0.0, 2.0) and series["accuracy"][-1] == (10.0, pytest.approx(0.9))
    assert view.target_metric({"metrics": {"loss": 1, "f1": 2}}) == "f1"
    assert list(view.chart_series({"metrics": {"loss": 1.0}, "curve": [
        {"t": 0, "loss": None, "metrics": {"loss": 1.0}}]})) == ["loss", "test loss"]
    assert view.chart_series(None) == {"loss": []}


def test_braille_draws_a_rising_line_corner_to_corner():
    lines = view.braille([(0, 0), (1, 1)], width=4, height=2)
    assert len(lines) == 2 and all(len(line) == 4 for line in lines)
    # bottom-left and top-right cells are inked, top-left and bottom-right are blank
    assert lines[1][0] != "\u2800" and lines[0][3] != "\u2800"
    assert lines[0][0] == "\u2800" and lines[1][3] == "\u2800"
    # the very corners: dot 7 (bottom-left) and dot 4 (top-right)
    assert ord(lines[1][0]) - 0x2800 & 0x40 and ord(lines[0][3]) - 0x2800 & 0x08


def test_braille_flat_and_empty():
    flat = view.braille([(0, 5), (10, 5)], width=5, height=1)
    assert all(c != "\u2800" for c in flat[0])  # a horizontal line across
    assert view.braille([], 3, 2) == ["\u2800" * 3] * 2
    assert view.braille([(float("nan"), 1)], 2, 1) == ["\u2800" * 2]


def test_chart_lines_fit_the_box():
    lines = view.chart_lines(snapshot(), 80, 10)
    assert len(lines) == 10 and all(len(line) <= 80 for line in lines)
    assert lines[0].startswith("loss 1.0000") and "accuracy 0.9000" in lines[0]
    empty = view.chart_lines({"metrics": {}}, 40, 4)
    assert "no evaluations yet" in empty[0]


def test_rounds_lines():
    lines = view.rounds_lines(snapshot(bad_messages={"schema": 2}, counters={}))
    assert "code none  partitions 1" in lines
    assert "open rounds 3 (limit none)" in lines
    red = {"code": "none", "partitions": 1, "mode": "sync\x1b[2J", "mode_reason": "--sync",
           "slot_spread": 0.123}
    assert view.rounds_lines(snapshot(redundancy=red))[0].startswith("sync")
    assert "\x1b" not in view.rounds_lines(snapshot(redundancy=red))[0]
    assert any("bad messages 2" in line for line in lines)
    assert view.rounds_lines(None) == []


def test_the_status_says_which_rounds_run_why_and_how_close_their_slots_finish():
    red = {"mode": "sync", "mode_reason": "auto: synchronous rounds sized to each worker's speed",
           "slot_spread": 0.0714}
    line = dict(view.summary_rows(snapshot(redundancy=red)))["rounds"]
    assert line == ("sync (auto: synchronous rounds sized to each worker's speed); slots finish "
                    "within 7% of a round")
    assert view.mode_line(snapshot(redundancy=dict(red, slot_spread=float("nan")))) == \
        "sync (auto: synchronous rounds sized to each worker's speed)"
    assert view.mode_line(snapshot(redundancy={"mode": 3})) == "-"
    assert view.mode_line(snapshot(redundancy="x")) == "-"


def test_event_log_takes_new_events_once_and_marks_restarts():
    log = view.EventLog(maxlen=5)
    ev = [{"id": i, "time": 0, "kind": "join", "text": f"w{i} joined"} for i in (1, 2, 3)]
    assert log.update({"instance": "a", "events": ev[:2]}) == 2
    assert log.update({"instance": "a", "events": ev}) == 1  # 1 and 2 again: skipped
    assert [line.split()[-2] for line in log.tail(10)] == ["w1", "w2", "w3"]
    assert log.update({"instance": "b", "events": [ev[0]]}) == 2  # restarted: ids from 1 again
    assert "restarted" in log.tail(2)[0]
    for i in range(10):
        log.update({"instance": "b", "events": [{"id": 10 + i, "kind": "x", "text": str(i)}]})
    assert len(log.tail(100)) == 5 and log.tail(0) == []


def test_summary_and_json():
    rows = dict(view.summary_rows(snapshot()))
    assert rows["version"] == "1,234" and rows["workers"] == "3"
    snap = snapshot(events=[{"id": i} for i in range(50)])
    out = view.as_json(snap)
    assert len(out["events"]) == 20 and out["workers"] == snap["workers"]


def test_summary_counts_every_worker_and_ban_of_a_large_fleet():
    rows = dict(view.summary_rows(snapshot(workers_total=3)))
    assert rows["workers"] == "3"  # all of them listed
    rows = dict(view.summary_rows(snapshot(workers_total=12000)))
    assert rows["workers"] == "12,000 (3 listed)"
    trust = {"refused": 400, "banned": [f"w{i}" for i in range(100)], "banned_count": 130}
    rows = dict(view.summary_rows(snapshot(trust=trust)))
    assert rows["gradients refused"] == "400; banned: w0, w1, w2, w3, w4 and 125 more"


def test_summary_shows_local_task_and_wire_bytes():
    rows = dict(view.summary_rows(snapshot()))
    assert "task" not in rows and "wire" not in rows  # gradient mode, older coordinators
    rows = dict(view.summary_rows(snapshot(task="local:10", bytes_per_sample=2048.0)))
    assert rows["task"] == "local:10" and rows["wire"] == "2.0 KiB/sample"


def test_the_noise_scale_in_the_summary_and_the_header():
    rows = dict(view.summary_rows(snapshot()))
    assert rows["noise scale"] == "-"  # an older coordinator
    noise = {"b_simple": 640.0, "gradient_sq": 0.5, "trace": 320.0, "rounds": 42, "batch": 128}
    snap = snapshot(noise=noise)
    assert dict(view.summary_rows(snap))["noise scale"] == \
        "B_simple 640.0 samples (batch 128: 0.20x), over 42 rounds"
    assert "noise scale 640.0" in view.header(snap).plain
    waiting = snapshot(noise=dict(noise, b_simple=None, rounds=0))
    assert dict(view.summary_rows(waiting))["noise scale"].startswith("- (no round measured")
    assert "noise scale" not in view.header(waiting).plain
    swamped = dict(view.summary_rows(snapshot(noise=dict(noise, b_simple=None))))
    assert swamped["noise scale"].startswith("- (noise swamps the gradient")
    for hostile in ({"b_simple": "\x1b[2J", "rounds": True}, {"b_simple": float("inf"),
                    "rounds": 3, "batch": "x"}, {"b_simple": 5.0, "rounds": 3, "batch": -1}, []):
        row = dict(view.summary_rows(snapshot(noise=hostile)))["noise scale"]
        assert "\x1b" not in row and "inf" not in row
        assert "\x1b" not in view.header(snapshot(noise=hostile)).plain


@pytest.mark.parametrize("value,text", [
    (None, "-"), (3, "3"), (12345, "12,345"), (0.25, "0.250"), (0.00012, "1.2e-04"), (0.0, "0.000"),
    (123.45, "123.5"), (4567.8, "4,568"), (float("nan"), "-"), (True, "True"), ("x", "x")])
def test_number(value, text):
    assert view.number(value) == text


CREDITS = {"identities": 3, "workers": {
    "slow": {"samples": 64, "compute_s": 5.0, "verified": 0, "refused": 2,
             "first_seen": 1_700_000_000.0, "last_seen": 1_700_000_100.0},
    "fast": {"samples": 1_280, "compute_s": 3725.0, "verified": 7, "refused": 0,
             "first_seen": 1_700_000_000.0, "last_seen": 1_700_000_200.0},
    "a-name-far-too-long-for-the-leaderboard-panel": {"samples": 8, "verified": 0}}}


def test_leaderboard_most_samples_first_with_verified_slots():
    lines = view.leaderboard_lines({"credits": CREDITS}, rows=9, width=30)
    assert [line.split()[0] for line in lines[:2]] == ["fast", "slow"]
    assert lines[0].endswith(" 1,280 v7") and lines[1].endswith(" 64")
    assert all(len(line) <= 30 for line in lines) and "\u2026" in lines[2]
    assert view.leaderboard_lines({"credits": CREDITS}, rows=1) == [lines[0].split()[0].ljust(
        36 - len(" 1,280 v7")) + " 1,280 v7"]
    assert view.leaderboard_lines({}) == ["no credit earned yet"]
    assert view.leaderboard_lines(None) == ["no credit earned yet"]


def test_credit_rows_follow_the_columns():
    rows = view.credit_rows(CREDITS)
    assert [r[0] for r in rows] == ["fast", "slow", "a-name-far-too-long-for-the-leaderboard-panel"]
    fast = dict(zip(["worker", *(k for k, _ in view.CREDIT_COLUMNS)], rows[0]))
    assert fast["samples"] == "1,280" and fast["compute_s"] == "1h02m"
    assert fast["verified"] == "7" and fast["refused"] == "0"
    assert fast["first_seen"].startswith("2023-11-1")
    assert rows[2][-1] == "-"  # no time given
    assert view.credit_rows(None) == [] and view.credit_rows({"workers": []}) == []


def test_epochs_read_as_fractions_not_in_scientific_notation():
    snap = dict(snapshot(), epoch=0.0044)
    assert "(0.0044 epochs)" in view.header(snap).plain
    assert dict(view.summary_rows(snap))["samples"].endswith("(0.0044 epochs)")
    assert [view.epochs_done(e) for e in (0, 0.44, 3.25, 12.34, None)] == \
        ["0.00", "0.44", "3.25", "12.3", "-"]


def test_the_data_line_counts_shards_in_words():
    from idlegrad.monitor.view import data_line

    assert " in 1 shard; " in data_line({"bytes": 2 ** 20, "shards": 1})
    assert " in 3 shards; " in data_line({"bytes": 2 ** 20, "shards": 3})
    assert "shards" in data_line({"shards": "<b>"})  # untrusted: shown, never a crash
