"""`idlegrad credits`: what each worker (each key, or each worker id without keys) has earned:
offline from a checkpoint, or live from a coordinator's status. No textual; torch only offline."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..common.errors import ConfigError
from ..common.security import MONITOR_KEYS_HINT, NO_KEYS_HINT, check_address, client_keys
from ..monitor import view
from ..monitor.source import ZmqStatusSource


def run_credits(args) -> int:
    if args.checkpoint_dir is not None:
        section, note = _from_checkpoint(args.checkpoint_dir)
    else:
        section, note = _from_coordinator(args)
        if section is None:
            return 1
    if args.json:
        workers = section.get("workers") if isinstance(section, dict) else None
        print(json.dumps({"workers": workers if isinstance(workers, dict) else {}}), flush=True)
        return 0
    width = None if sys.stdout.isatty() else 200
    # names came from the network: text, never markup
    console = Console(width=width, markup=False, emoji=False, highlight=False)
    table = Table(title=Text(note))
    table.add_column("worker", no_wrap=True, min_width=10)
    for _, title in view.CREDIT_COLUMNS:
        table.add_column(title, justify="right")
    for cells in view.credit_rows(section):
        table.add_row(*(Text(cell) for cell in cells))
    console.print(table)
    return 0


def _from_checkpoint(directory: str) -> tuple[dict, str]:
    from ..coordinator import checkpoint
    from ..coordinator.credits import Credits

    state = checkpoint.load(directory)
    if state is None:
        raise ConfigError(f"--checkpoint-dir {directory}: no checkpoint there")
    credits = Credits.from_state(state.get("credits"))
    credited, applied = credits.samples, int(state.get("samples", 0))
    note = (f"credits in {view.shown(checkpoint.path_in(directory))} (version "
            f"{state.get('version')}): {credited:,} of {applied:,} samples applied")
    if "credits" not in state:
        note += " (this checkpoint predates credits)"
    return credits.table(), note


def _from_coordinator(args) -> tuple[dict | None, str]:
    check_address(args.coordinator, "--coordinator")
    keys = client_keys(args.coordinator_key, args.secret_key)
    with ZmqStatusSource(args.coordinator, keys=keys) as source:
        snap = source.fetch(timeout=args.timeout)
        refused = getattr(source, "refused", None)
    where = view.shown(args.coordinator)
    if snap is None:
        why = (f"refused: {view.shown(refused)}" if refused is not None else
               f"no answer within {args.timeout:g}s (is it running? is the address right?"
               f"{MONITOR_KEYS_HINT if keys else NO_KEYS_HINT})")
        print(f"idlegrad credits: error: the coordinator at {where}: {why}", file=sys.stderr)
        return None, ""
    section = snap.get("credits")
    if not isinstance(section, dict):
        print(f"idlegrad credits: error: the coordinator at {where} reports no credits (an "
              "idlegrad older than this one?)", file=sys.stderr)
        return None, ""
    shown = len(section.get("workers") or {})
    total = section.get("identities", shown)
    note = f"credits at {where}: {view.number(total)} identities"
    if isinstance(total, int) and total > shown:
        note += f" (the {view.number(shown)} with the most samples shown)"
    return section, note
