"""`idlegrad status`: one snapshot of a coordinator, as tables or as JSON. No torch, no textual."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..common.security import MONITOR_KEYS_HINT, NO_KEYS_HINT, check_address, client_keys
from ..monitor import view
from ..monitor.source import ZmqStatusSource


def run_status(args) -> int:
    check_address(args.coordinator, "--coordinator")
    keys = client_keys(args.coordinator_key, args.secret_key)
    with ZmqStatusSource(args.coordinator, keys=keys) as source:
        snap = source.fetch(timeout=args.timeout)
    if snap is None and source.refused is not None:
        print(f"idlegrad status: error: the coordinator at {view.shown(args.coordinator)} "
              f"refused: {view.shown(source.refused)}", file=sys.stderr)
        return 1
    if snap is None:
        print(f"idlegrad status: error: no answer from the coordinator at {args.coordinator} "
              f"within {args.timeout:g}s (is it running? is the address right?"
              f"{MONITOR_KEYS_HINT if keys else NO_KEYS_HINT})", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(view.as_json(snap)), flush=True)
        return 0
    # Piped into a file or a pager a table has no terminal to fit: rich would squeeze twelve
    # columns into 80 and cut every cell to an ellipsis.
    width = None if sys.stdout.isatty() else 200
    # The snapshot's strings came from the network: nothing printed is read as markup, emoji
    # codes or highlighted; styles are given as Text only.
    console = Console(width=width, markup=False, emoji=False, highlight=False)
    summary = Table(title=Text(f"idlegrad coordinator at {view.shown(args.coordinator)}"),
                    show_header=False)
    for key, value in view.summary_rows(snap):
        summary.add_row(key, Text(value))
    for line in view.rounds_lines(snap)[:3]:
        summary.add_row("rounds", Text(line))
    console.print(summary)
    workers = Table(title=f"workers: {view.workers_count(snap)}")
    for _, title in view.COLUMNS:
        # who and in what state stay readable in a narrow terminal; the counts give way first
        workers.add_column(title, justify="left" if title in ("worker", "host", "device", "state")
                           else "right", no_wrap=title in ("worker", "state"),
                           min_width={"worker": 10, "state": 8}.get(title))
    state_col = [k for k, _ in view.COLUMNS].index("state")
    for row in view.worker_rows(snap, sort="id"):
        cells = [Text(cell) for cell in row.cells]
        cells[state_col].stylize(view.STATE_STYLES.get(row.state, ""))
        workers.add_row(*cells)
    console.print(workers)
    events = snap.get("events") or []
    if events:
        console.print(Text("recent events", style="bold"))
        for event in events[-8:]:
            console.print(Text(view.event_line(event)))
    return 0
