"""The monitor's view model: pure functions from a status snapshot to what the screen shows.

No sockets, threads, clock or textual here: header text, worker rows (sorted, filtered), chart
series and their braille rendering, the rounds panel and event lines are computed from the snapshot
(a plain dict, as the coordinator's status endpoint sends it) and unit-tested on their own.

Every string in a snapshot came from the network (a worker names itself in its hello; the
coordinator names the rest), so every one is shown through `shown()`, and what this module returns
is plain text or `rich.text.Text`, never markup: the front ends must not parse it either.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, Union

from rich.text import Text

from ..common.text import MAX_SHOWN, shown  # noqa: F401 (the view's, as before)

# column key, title, width hint
COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "worker"), ("host", "host"), ("device", "device"), ("state", "state"),
    ("credits", "credits"), ("assigned", "held"), ("done", "done"), ("cancelled", "cancelled"),
    ("failed", "failed"), ("samples_per_s", "samples/s"), ("staleness", "staleness"),
    ("last_seen_s", "seen"),
)
# `s` cycles through these; rates and counts sort largest first, names A to Z.
SORT_KEYS: tuple[str, ...] = ("id", "samples_per_s", "state", "done", "staleness", "last_seen_s")
DESCENDING = frozenset({"samples_per_s", "done", "staleness", "last_seen_s"})
STATE_STYLES = {
    "working": "bold green", "idle": "yellow", "paused": "magenta", "draining": "cyan",
    "evicted": "red", "left": "dim",
}
STATE_ORDER = {"working": 0, "idle": 1, "draining": 2, "paused": 3}


# formatting ------------------------------------------------------------------------------------

def duration(seconds: Optional[float]) -> str:
    """1h02m, 3m05s, 42s; '-' for unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def number(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 100:
            return f"{value:.1f}"
        if value and abs(value) < 10 ** -digits:
            return f"{value:.1e}"
        return f"{value:.{digits}f}"
    return shown(value)


def epochs_done(value: Any) -> str:
    """Epochs as people read them: 12.3, 0.44, 0.0044 (the snapshot rounds to 4 decimals), never
    4.4e-03."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return "-"
    if value >= 10:
        return f"{value:,.1f}"
    if value >= 0.1 or value == 0:
        return f"{value:.2f}"
    return f"{value:.4f}"


# header and ETA --------------------------------------------------------------------------------


def target_metric(snap: dict) -> Optional[str]:
    """The metric the chart shows next to the loss: the target's, else accuracy, else the first."""
    name = snap.get("target_metric")
    if name:
        return name
    metrics = snap.get("metrics") or {}
    if "accuracy" in metrics:
        return "accuracy"
    others = [k for k in metrics if k != "loss"]
    return others[0] if others else ("loss" if "loss" in metrics else None)


def _line_fit(points: Sequence[tuple[float, float]]) -> Optional[tuple[float, float]]:
    """(intercept, slope) of the least-squares line through `points`; None for fewer than two
    distinct times."""
    n = len(points)
    if n < 2:
        return None
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    if den <= 0:
        return None
    slope = sum((t - mt) * (v - mv) for t, v in points) / den
    return mv - slope * mt, slope


def eta(snap: dict, window: int = 10) -> tuple[Optional[float], str]:
    """(seconds until training ends, why): the sooner of the target and the epoch limit at the
    current samples/s. The target's: where a line fit to the last `window` evaluations meets it,
    less the time elapsed since (so it counts down between evaluations); none when the curve is
    not approaching the target, or the fit says it is past it while the last evaluation is not."""
    best: tuple[Optional[float], str] = (None, "")
    metric, goal = snap.get("target_metric"), snap.get("target_value")
    higher = snap.get("target_higher")
    if metric and isinstance(goal, (int, float)):
        points = [(p["t"], p["metrics"][metric]) for p in snap.get("curve") or []
                  if isinstance(p.get("metrics"), dict) and metric in p["metrics"]
                  and isinstance(p.get("t"), (int, float))][-window:]
        if points:
            current = points[-1][1]
            if (current >= goal) if higher else (current <= goal):
                return 0.0, "target"
            fit = _line_fit(points)
            if fit and ((fit[1] > 0) if higher else (fit[1] < 0)):
                now = snap.get("elapsed_s")
                now = now if isinstance(now, (int, float)) else points[-1][0]
                left = (goal - fit[0]) / fit[1] - now
                if left > 0:
                    best = (left, "target")
    epochs, size = snap.get("epochs"), snap.get("train_samples")
    rate, epoch = snap.get("samples_per_s") or 0, snap.get("epoch") or 0
    if epochs and size and rate > 0:
        left = max(0.0, (epochs - epoch) * size / rate)
        if best[0] is None or left < best[0]:
            best = (left, "epochs")
    return best


def header(snap: Optional[dict], connection: Union[str, Text] = "", lost: bool = False) -> Text:
    """The top two lines. `lost`: `snap` is the last one of a coordinator that no longer answers
    (its state and ETA are not said as if they held)."""
    title = ("idlegrad top", "bold")
    if snap is None:
        return Text.assemble(title, "  ", connection or "waiting for the coordinator")
    state = "coordinator lost" if lost else snap.get("state", "?")
    style = {"training": "green", "paused": "magenta", "stopping": "yellow",
             "coordinator lost": "red"}.get(str(state), "white")
    metrics = snap.get("metrics") or {}
    metric = target_metric(snap)
    seconds, why = eta(snap) if not lost else (None, "")
    gap = "  "
    line1 = Text.assemble(
        title, gap, "job ", (shown(snap.get("job", "?")), "cyan"), gap, (shown(state), style), gap,
        "version ", (number(snap.get("version")), "bold"), gap,
        f"samples {number(snap.get('samples'))} ({epochs_done(snap.get('epoch'))} epochs)", gap,
        # a lost coordinator's last rate is not the fleet's now: no figure rather than a stale one
        (number(None if lost else snap.get("samples_per_s"), 1), "bold"), " samples/s")
    line2 = [f"loss {number(snap.get('loss'))}"]
    if metric and metric in metrics:
        line2.append(f"{shown(metric)} {number(metrics[metric], 4)}")
    if snap.get("target"):
        line2.append(f"target {shown(snap['target'])}")
    if seconds is not None:
        line2.append(f"ETA {duration(seconds)} ({why})")
    line2.append(f"workers {len(snap.get('workers') or [])}")
    b_simple = noise_b_simple(snap)
    if b_simple is not None:
        line2.append(f"noise scale {number(b_simple, 1)}")
    batch = batch_header(snap)
    if batch:
        line2.append(batch)
    line2.append(f"elapsed {duration(snap.get('elapsed_s'))}")
    text = Text.assemble(line1, "\n", gap.join(line2))
    if connection:
        text.append(gap)
        text.append_text(connection if isinstance(connection, Text) else Text(connection))
    return text


# workers ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerRow:
    id: str  # as the coordinator knows it: the key a drain names, never shown as it is
    state: str
    cells: tuple[str, ...]  # one per COLUMNS entry, formatted, plain text


def matches(worker: dict, text: str) -> bool:
    """Filter: every word of `text` appears (case-insensitive) in id, host, device or state."""
    hay = " ".join(str(worker.get(k, "")) for k in ("id", "host", "device", "state")).lower()
    return all(word in hay for word in text.lower().split())


def sort_key(key: str):
    def of(worker: dict):
        value = worker.get(key)
        if key == "state":
            return (STATE_ORDER.get(str(value), 9), str(value), str(worker.get("id", "")))
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return (-value if key in DESCENDING else value, str(worker.get("id", "")))
        return (0, str(value or ""), str(worker.get("id", "")))
    return of


def workers_count(snap: dict) -> str:
    """How many workers the coordinator holds; a large fleet's snapshot lists only the first
    ones (coordinator/status.py), and says so."""
    listed = len(snap.get("workers") or [])
    total = snap.get("workers_total", listed)
    if isinstance(total, int) and total > listed:
        return f"{number(total)} ({number(listed)} listed)"
    return str(listed)


def worker_rows(snap: Optional[dict], sort: str = "id", filter_text: str = "") -> list[WorkerRow]:
    workers = [w for w in (snap or {}).get("workers") or [] if isinstance(w, dict)]
    if filter_text.strip():
        workers = [w for w in workers if matches(w, filter_text)]
    workers.sort(key=sort_key(sort if sort in SORT_KEYS else "id"))
    rows = []
    for w in workers:
        cells = []
        for key, _ in COLUMNS:
            value = w.get(key)
            if key == "last_seen_s":
                cells.append(f"{value:.1f}s ago" if isinstance(value, (int, float)) else "-")
            elif key == "samples_per_s":
                cells.append(number(value, 1))
            elif key == "staleness":
                cells.append(number(value, 2))
            else:
                cells.append(number(value) if value is not None else "")
        rows.append(WorkerRow(str(w.get("id", "")), str(w.get("state", "")), tuple(cells)))
    return rows


def next_sort(key: str) -> str:
    i = SORT_KEYS.index(key) if key in SORT_KEYS else -1
    return SORT_KEYS[(i + 1) % len(SORT_KEYS)]


# chart -----------------------------------------------------------------------------------------


def chart_series(snap: Optional[dict]) -> dict[str, list[tuple[float, float]]]:
    """{"loss": [(t, train loss)...], METRIC: [(t, test metric)...]} from the snapshot's curve."""
    out: dict[str, list[tuple[float, float]]] = {"loss": []}
    metric = target_metric(snap or {})
    if metric:
        out[metric if metric != "loss" else "test loss"] = []
    for p in (snap or {}).get("curve") or []:
        t = p.get("t")
        if not isinstance(t, (int, float)):
            continue
        loss = p.get("loss")
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            out["loss"].append((float(t), float(loss)))
        value = (p.get("metrics") or {}).get(metric) if metric else None
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[metric if metric != "loss" else "test loss"].append((float(t), float(value)))
    return out


_DOTS = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))  # [row][col] of a braille cell


def braille(points: Sequence[tuple[float, float]], width: int, height: int,
            y_range: Optional[tuple[float, float]] = None) -> list[str]:
    """A line chart of (x, y) points in `height` lines of `width` braille characters (2x4 dots
    each), consecutive points joined. Empty points: blank lines."""
    width, height = max(1, width), max(1, height)
    cells = [[0] * width for _ in range(height)]
    pts = [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]
    if pts:
        x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
        y0, y1 = y_range or (min(p[1] for p in pts), max(p[1] for p in pts))
        xs, ys = 2 * width - 1, 4 * height - 1

        def px(x):
            return 0 if x1 == x0 else round((x - x0) / (x1 - x0) * xs)

        def py(y):
            y = min(max(y, y0), y1)
            return ys // 2 if y1 == y0 else ys - round((y - y0) / (y1 - y0) * ys)

        def dot(cx, cy):
            cells[cy // 4][cx // 2] |= _DOTS[cy % 4][cx % 2]

        prev = None
        for x, y in pts:
            cur = (px(x), py(y))
            if prev is None:
                dot(*cur)
            else:
                steps = max(abs(cur[0] - prev[0]), abs(cur[1] - prev[1]), 1)
                for k in range(steps + 1):
                    dot(round(prev[0] + (cur[0] - prev[0]) * k / steps),
                        round(prev[1] + (cur[1] - prev[1]) * k / steps))
            prev = cur
    return ["".join(chr(0x2800 + c) for c in row) for row in cells]


def chart_block(name: str, points: Sequence[tuple[float, float]], width: int,
                height: int) -> list[str]:
    """A titled chart: a title line (last value, range, time span), then `height - 1` lines."""
    if not points:
        title = f"{shown(name)}: no evaluations yet"
        return [title[:width]] + [" " * width for _ in range(max(0, height - 1))]
    ys = [y for _, y in points]
    span = points[-1][0] - points[0][0]
    title = f"{shown(name)} {number(ys[-1], 4)}  [{number(min(ys), 3)}..{number(max(ys), 3)}]"
    if len(title) + len(duration(span)) + 6 <= width:
        title += f" over {duration(span)}"
    return [title[:width].ljust(width)] + braille(points, width, max(1, height - 1))


def chart_lines(snap: Optional[dict], width: int, height: int) -> list[str]:
    """Loss and the target metric side by side, over time."""
    series = list(chart_series(snap).items())
    gap = 2
    each = max(8, (width - gap * (len(series) - 1)) // max(1, len(series)))
    blocks = [chart_block(name, pts, each, height) for name, pts in series]
    return [(" " * gap).join(block[i] for block in blocks) for i in range(height)]


# rounds panel and events ------------------------------------------------------------------------


def rounds_lines(snap: Optional[dict]) -> list[str]:
    if not snap:
        return []
    r, red = snap.get("rounds") or {}, snap.get("redundancy") or {}
    limit = red.get("open_rounds_limit")
    mode = red.get("mode")
    lines = [
        (f"{shown(mode)} rounds  " if isinstance(mode, str) else "")
        + f"code {number(red.get('code', '?'))}  partitions {number(red.get('partitions', '?'))}",
        f"open rounds {number(r.get('open', 0))} (limit {number(limit or 'none')})",
        f"pending slots {number(r.get('pending_slots', 0))}",
        f"decoded {number(r.get('decoded', 0))} / opened {number(r.get('opened', 0))}",
        f"replanned {number(r.get('replanned', 0))}  "
        f"too stale {number(red.get('rounds_too_stale', 0))}",
        f"requeued {number(r.get('slots_requeued', 0))} "
        f"(late {number(r.get('deadline_requeues', 0))})",
        f"duplicates {number(r.get('results_duplicate', 0))}  "
        f"rejected {number(red.get('rounds_rejected', 0))}",
        f"staleness {number(red.get('staleness_rule', '?'))} "
        f"(max {number(red.get('max_staleness', '?'))})",
    ]
    bad = _total((snap.get("bad_messages") or {}).values())
    grads = (snap.get("counters") or {}).get("gradients_rejected", 0)
    if bad or grads:
        lines.append(f"bad messages {number(bad)}  bad gradients {number(grads)}")
    return lines


def _total(values: Iterable[Any]) -> int:
    return sum(v for v in values if isinstance(v, int) and not isinstance(v, bool))


def event_line(event: dict) -> str:
    t = event.get("time")
    stamp = time.strftime("%H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "--:--:--"
    return f"{stamp} {shown(event.get('kind', '?'), 20):<10} {shown(event.get('text', ''))}"


class EventLog:
    """The events seen across snapshots, newest last, bounded; restarts are marked."""

    def __init__(self, maxlen: int = 500):
        self.lines: deque[str] = deque(maxlen=maxlen)
        self.last_id = 0
        self.instance: Optional[str] = None

    def update(self, snap: dict) -> int:
        """Take the snapshot's new events; how many lines were added."""
        added = 0
        instance = snap.get("instance")
        if self.instance is not None and instance != self.instance:
            self.lines.append("--------- the coordinator restarted ---------")
            self.last_id = 0
            added += 1
        self.instance = instance
        for event in snap.get("events") or []:
            eid = event.get("id")
            if isinstance(eid, int) and eid > self.last_id:
                self.lines.append(event_line(event))
                self.last_id = eid
                added += 1
        return added

    def tail(self, n: int) -> list[str]:
        return list(self.lines)[-n:] if n > 0 else []


def _finite(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def noise_b_simple(snap: Optional[dict]) -> Optional[float]:
    """The snapshot's gradient noise scale B_simple (samples), if it holds a finite one."""
    noise = snap.get("noise") if isinstance(snap, dict) else None
    value = noise.get("b_simple") if isinstance(noise, dict) else None
    return float(value) if _finite(value) else None


def noise_line(snap: dict) -> str:
    """The gradient noise scale for `idlegrad status`: B_simple, the round's batch beside it,
    and how many rounds it is measured over (untrusted: every value checked)."""
    noise = snap.get("noise")
    if not isinstance(noise, dict):
        return "-"
    rounds = noise.get("rounds")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds <= 0:
        return "- (no round measured yet: it takes rounds of two or more partitions)"
    b_simple, batch = noise_b_simple(snap), noise.get("batch")
    if b_simple is None:
        text = "- (noise swamps the gradient: larger than the batches measured can tell)"
    else:
        text = f"B_simple {number(b_simple, 1)} samples"
        if _finite(batch) and batch > 0:
            text += f" (batch {number(batch)}: {number(batch / max(b_simple, 1e-12), 2)}x)"
    return f"{text}, over {number(rounds)} rounds"


def _batch(snap: Optional[dict]) -> Optional[dict]:
    """The snapshot's batch field when its figures are whole numbers of samples (untrusted)."""
    batch = snap.get("batch") if isinstance(snap, dict) else None
    if not isinstance(batch, dict):
        return None
    if not all(isinstance(batch.get(k), int) and not isinstance(batch.get(k), bool)
               and 0 < batch[k] < 10 ** 12 for k in ("batch", "base")):
        return None
    return batch


def batch_header(snap: Optional[dict]) -> str:
    """The top header's batch: the round batch now, and, when it is adaptive, the rule."""
    batch = _batch(snap)
    if batch is None:
        return ""
    if batch.get("adaptive") is not True:
        return f"batch {number(batch['batch'])}"
    return f"batch {number(batch['batch'])} (adaptive, lr {shown(str(batch.get('rule')), 12)})"


def batch_line(snap: dict) -> str:
    """The round batch for `idlegrad status`: now, against the job's, and the learning-rate
    rule with its last factor."""
    batch = _batch(snap)
    if batch is None:
        return "-"
    now, base = batch["batch"], batch["base"]
    if batch.get("adaptive") is not True:
        return f"{number(now)} (fixed: the job's)"
    text = f"{number(now)} (adaptive from {number(base)}: {number(now / base, 2)}x"
    cap = batch.get("max")
    if _finite(cap) and cap > 0:
        text += f", at most {number(cap)}"
    factor = batch.get("lr_factor")
    text += f"; lr by {shown(str(batch.get('rule')), 12)}"
    if _finite(factor):
        text += f", x{number(factor, 3)}"
    return text + ")"


def mode_line(snap: dict) -> str:
    """Which rounds run and why (coordinator/mode.py), and how close together a round's slots
    finish (the spread of their finish times over the round's time; untrusted: checked)."""
    red = snap.get("redundancy")
    if not isinstance(red, dict) or not isinstance(red.get("mode"), str):
        return "-"
    text = f"{shown(red['mode'])} ({shown(red.get('mode_reason', ''), 160)})"
    spread = red.get("slot_spread")
    if _finite(spread):
        text += f"; slots finish within {number(100 * spread, 0)}% of a round"
    return text


def summary_rows(snap: dict) -> list[tuple[str, str]]:
    """Key/value lines for `idlegrad status`."""
    metrics = snap.get("metrics") or {}
    seconds, why = eta(snap)
    rows = [
        ("job", shown(snap.get("job", "?"))), ("state", shown(snap.get("state", "?"))),
        ("version", number(snap.get("version"))),
        ("samples", f"{number(snap.get('samples'))} ({epochs_done(snap.get('epoch'))} epochs)"),
        ("samples/s", number(snap.get("samples_per_s"), 1)),
        ("train loss", number(snap.get("loss"))),
        ("metrics", shown(", ".join(f"{shown(k)} {number(v, 4)}" for k, v in metrics.items()))
         or "-"),
        ("target", shown(snap.get("target") or "-")),
        ("ETA", f"{duration(seconds)} ({why})" if seconds is not None else "-"),
        ("elapsed", duration(snap.get("elapsed_s"))),
        ("workers", workers_count(snap)),
        ("noise scale", noise_line(snap)),
        ("batch", batch_line(snap)),
        ("rounds", mode_line(snap)),
    ]
    trust = snap.get("trust")
    if isinstance(trust, dict) and (trust.get("refused") or trust.get("banned")):
        every = trust.get("banned") or []
        banned = [shown(b) for b in list(every)[:5]]
        count = trust.get("banned_count", len(every))
        more = f" and {number(count - 5)} more" if isinstance(count, int) and count > 5 else ""
        rows.append(("gradients refused", f"{number(trust.get('refused'))}"
                     + (f"; banned: {', '.join(banned[:5])}{more}" if banned else "")))
    if snap.get("task") not in (None, "gradient"):
        rows.append(("task", shown(snap["task"])))
    if snap.get("bytes_per_sample") is not None:  # wire bytes, both ways, per sample applied
        rows.append(("wire", f"{number(snap['bytes_per_sample'] / 1024, 1)} KiB/sample"))
    data = snap.get("data")
    if isinstance(data, dict):  # the data plane: served here, and what workers' caches say
        rows.append(("data", data_line(data)))
    return rows


def _mib(value: Any) -> str:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return f"{number(value / 2**20, 1)} MiB" if ok else "-"


def data_line(data: dict) -> str:
    """One line of the data plane from a snapshot's `data` (untrusted: every value shown)."""
    shards = "shard" if data.get("shards") == 1 else "shards"
    return (f"{_mib(data.get('bytes'))} in {number(data.get('shards'))} {shards}; served "
            f"{_mib(data.get('served_bytes'))}; workers fetched "
            f"{_mib(data.get('bytes_from_mirrors'))} from mirrors, "
            f"{_mib(data.get('bytes_from_coordinator'))} from here; "
            f"{number(data.get('cache_hits'))} cache hits, "
            f"{number(data.get('downloads_in_flight'))} downloads in flight")


def data_panel_lines(data: dict) -> list[str]:
    """The data plane in `top`'s narrow rounds panel: `data_line`, one clause a line."""
    first, *rest = data_line(data).split("; ")
    return [f"data: {first}", *rest]


# credits ----------------------------------------------------------------------------------------

CREDIT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("samples", "samples"), ("compute_s", "compute"), ("verified", "verified"),
    ("refused", "refused"), ("first_seen", "first seen"), ("last_seen", "last seen"),
)


def _moment(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(value))
    except (OverflowError, OSError, ValueError):
        return "-"


def _credits_of(section: Any) -> list[tuple[str, dict]]:
    """The rows of a credits section ({"workers": {name: {...}}}), the most samples first,
    whatever the section holds."""
    workers = section.get("workers") if isinstance(section, dict) else None
    if not isinstance(workers, dict):
        return []
    rows = [(str(name), row) for name, row in workers.items() if isinstance(row, dict)]

    def most_samples_first(item: tuple[str, dict]):
        samples = item[1].get("samples")
        return (-samples if isinstance(samples, int) else 0, item[0])
    return sorted(rows, key=most_samples_first)


def credit_rows(section: Any) -> list[tuple[str, ...]]:
    """`idlegrad credits`: (worker, then one cell per CREDIT_COLUMNS entry), plain text."""
    out = []
    for name, row in _credits_of(section):
        cells = [shown(name)]
        for key, _ in CREDIT_COLUMNS:
            value = row.get(key)
            if key in ("first_seen", "last_seen"):
                cells.append(_moment(value))
            elif key == "compute_s":
                cells.append(duration(value) if isinstance(value, (int, float)) else "-")
            else:
                cells.append(number(value))
        out.append(tuple(cells))
    return out


def leaderboard_lines(snap: Optional[dict], rows: int = 9, width: int = 36) -> list[str]:
    """The monitor's leaderboard: who has earned the most samples, and slots verified."""
    credits = _credits_of((snap or {}).get("credits"))
    if not credits:
        return ["no credit earned yet"]
    lines = []
    for name, row in credits[:rows]:
        figures = f" {number(row.get('samples'))}"
        if row.get("verified"):
            figures += f" v{number(row.get('verified'))}"
        room = max(4, width - len(figures))
        lines.append(shown(name, room).ljust(room) + figures)
    return lines


def as_json(snap: dict) -> dict:
    """The `idlegrad status --json` document: the snapshot, minus the event ring's bulk."""
    keep = dict(snap)
    keep["events"] = list(snap.get("events") or [])[-20:]
    return keep


def iter_columns() -> Iterable[str]:
    return (title for _, title in COLUMNS)
