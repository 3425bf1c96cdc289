"""`idlegrad worker status`: what this worker has earned at each coordinator it serves (every
[[project]] of its worker.toml, or its one coordinator): samples accepted, compute-seconds, slots
verified, results refused, first and last seen. Each coordinator answers a `credit_request` with
this worker's own row (its key's; without keys, its --id's), and nothing of anyone else's."""

from __future__ import annotations

import json
import sys
import time
from typing import Optional

from ..common import protocol as proto
from ..common.security import KEYS_HINT, client_keys
from ..monitor import view
from ..monitor.source import ZmqStatusSource


def run_worker_status(settings, as_json: bool, timeout: float) -> int:
    projects = settings.projects or (settings,)
    shown: dict[str, dict] = {}
    for project in projects:
        label = getattr(project, "label", project.coordinator)
        shown[label] = _ask(project, settings.id, timeout)
    answered = [p for p in shown.values() if p.get("error") is None]
    if as_json:
        print(json.dumps({"projects": shown}), flush=True)
    else:
        for label, project in shown.items():
            if project["error"] is None:
                print(_line(label, project))
            else:
                print(f"idlegrad worker status: error: {_line(label, project)}", file=sys.stderr)
    return 0 if answered else 1


def _ask(project, worker_id: Optional[str], timeout: float) -> dict:
    address = project.coordinator
    out: dict = {"coordinator": address, "worker": None, "credit": None, "error": None}
    keys = client_keys(project.coordinator_key, project.secret_key)
    if keys is None and worker_id is None:
        out["error"] = ("without keys a worker is known by its id, and this one has none: give "
                        "--id (or id in worker.toml)")
        return out
    with ZmqStatusSource(address, keys=keys) as source:
        # With keys the coordinator knows us by our key: no name to send.
        reply = source.ask(proto.CreditRequest(worker=None if keys else worker_id),
                           proto.Credit, timeout)
        refused = source.refused
    if reply is None:
        out["error"] = (f"refused: {view.shown(refused)}" if refused is not None else
                        f"no answer within {timeout:g}s (is it running?"
                        f"{KEYS_HINT if keys else ''})")
    elif not reply.ok:
        out["error"] = f"refused: {view.shown(reply.reason)}"
    else:
        out["worker"] = view.shown(reply.worker) if reply.worker else worker_id
        out["credit"] = dict(reply.row) if reply.row else None
        out["identities"] = reply.identities
    return out


def _line(label: str, project: dict) -> str:
    where = view.shown(label)
    if project["error"] is not None:
        return f"{where}: {project['error']}"
    row = project["credit"]
    if row is None:
        return f"{where}: nothing earned yet"
    seen = lambda t: time.strftime("%Y-%m-%d %H:%M", time.localtime(t))  # noqa: E731
    return (f"{where}: {project['worker']}: {int(row['samples']):,} samples accepted, "
            f"{row['compute_s']:,.1f} compute-seconds, {int(row['verified']):,} slots verified, "
            f"{int(row['refused']):,} results refused; first seen {seen(row['first_seen'])}, "
            f"last seen {seen(row['last_seen'])}")
