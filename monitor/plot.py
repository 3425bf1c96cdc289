"""`idlegrad plot`: a run's metrics log (JSON lines) as one PNG. Needs matplotlib (extra `plot`).

Four panels: training loss and the test metric against time, the same against samples, and
samples/s with the worker count against time. Rendering uses the Agg backend (no display).
A log's strings (metric names, the stop reason) are shown as text: matplotlib's mathtext and TeX
are off, since a `$` pair in a name would be parsed, and one that does not parse stops the plot.
"""

from __future__ import annotations

import json
import math
from typing import Optional

from ..common.errors import ConfigError
from .view import shown


def load_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl; ConfigError (one line) for a missing or broken file."""
    try:
        with open(path) as fh:
            lines = fh.readlines()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ConfigError(f"{path}:{n} is not JSON (a metrics log has one object a line)") from None
        if not isinstance(record, dict) or "elapsed" not in record:
            raise ConfigError(f"{path}:{n} is not a metrics record (no 'elapsed')")
        records.append(record)
    if not records:
        raise ConfigError(f"{path} holds no metrics records")
    return records


def pick_metric(records: list[dict], wanted: Optional[str] = None) -> Optional[str]:
    names: list[str] = []
    for r in records:
        for k in (r.get("metrics") or {}):
            if k not in names:
                names.append(k)
    if wanted:
        if wanted not in names:
            listed = shown(", ".join(shown(n, 40) for n in names[:20])) or "none"
            raise ConfigError(f"metric {shown(repr(wanted))} is not in the log (it has {listed})")
        return wanted
    if "accuracy" in names:
        return "accuracy"
    others = [n for n in names if n != "loss"]
    return others[0] if others else ("loss" if names else None)


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else math.nan


def plot(records: list[dict], out: str, metric: Optional[str] = None, title: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with plt.rc_context({"text.parse_math": False, "text.usetex": False}):
        return _plot(records, out, pick_metric(records, metric), title)


def _plot(records: list[dict], out: str, metric: Optional[str], title: str) -> str:
    import matplotlib.pyplot as plt

    name = shown(metric, 60) if metric else None
    t = [_num(r.get("elapsed")) for r in records]
    samples = [_num(r.get("samples")) for r in records]
    loss = [_num(r.get("loss")) for r in records]
    value = [_num((r.get("metrics") or {}).get(metric)) for r in records] if metric else []
    test_loss = [_num((r.get("metrics") or {}).get("loss")) for r in records]
    rate = [_num(r.get("samples_per_s")) for r in records]
    workers = [_num(r.get("workers")) for r in records]

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    for ax, x, xlabel in ((axes[0][0], t, "time (s)"), (axes[0][1], samples, "samples applied")):
        ax.plot(x, loss, color="tab:red", label="training loss")
        if metric != "loss" and any(not math.isnan(v) for v in test_loss):
            ax.plot(x, test_loss, color="tab:orange", linestyle="--", label="test loss")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        if metric and metric != "loss":
            ax2 = ax.twinx()
            ax2.plot(x, value, color="tab:blue", label=f"test {name}")
            ax2.set_ylabel(name)
            lines = ax.get_lines() + ax2.get_lines()
        else:
            lines = ax.get_lines()
        ax.legend(lines, [ln.get_label() for ln in lines], loc="center right")
        ax.set_title(f"loss and {name or 'metrics'} against {xlabel.split(' ')[0]}")
    ax = axes[1][0]
    ax.plot(t, rate, color="tab:green")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("samples/s")
    ax.set_title("throughput")
    ax.grid(alpha=0.3)
    ax = axes[1][1]
    ax.step(t, workers, where="post", color="tab:purple")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("workers")
    ax.set_title("workers connected")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    final = records[-1]
    fig.suptitle(shown(title or f"idlegrad run: {len(records)} evaluations, version "
                               f"{final.get('version')}, {final.get('samples')} samples"
                               + (f", stopped: {final.get('reason')}" if final.get("final") else "")))
    try:
        fig.savefig(out, dpi=100)
    except OSError as exc:
        raise ConfigError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return out
