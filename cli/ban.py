"""`idlegrad ban`: an operator bans a worker (or lifts a ban) on a running coordinator.

    idlegrad ban --coordinator ADDR [--coordinator-key FILE --secret-key FILE] [--unban] WORKER

WORKER is a worker's name, its public key (Z85), or its NAME.key file. The coordinator sends a
banned worker home, refuses it from then on, across restarts, and answers in one line. With
keys, only a key in the coordinator's --operator-keys may.
"""

from __future__ import annotations

import os
import sys
from typing import Callable


def add_ban_parser(sub, add_common: Callable, add_client_keys: Callable,
                   positive: Callable) -> None:
    b = sub.add_parser("ban", help="ban a worker (its key) from a running coordinator",
                       description="Ban a worker from a running coordinator: it is sent home and "
                                   "refused from then on, across restarts (an operator's "
                                   "command).")
    b.add_argument("worker", metavar="WORKER",
                   help="the worker's name, its public key (Z85), or its NAME.key file")
    b.add_argument("--coordinator", default="tcp://127.0.0.1:5555", metavar="ADDR",
                   help="the coordinator's address (default: tcp://127.0.0.1:5555)")
    b.add_argument("--unban", action="store_true", help="lift the operator's ban instead")
    add_client_keys(b)
    b.add_argument("--timeout", type=positive(float), default=5.0, metavar="SECONDS",
                   help="give up when the coordinator does not answer this long (default: 5)")
    add_common(b)
    b.set_defaults(func=run_ban, log_level="warning")


def run_ban(args) -> int:
    from ..common.security import check_address, client_keys, load_public
    from ..monitor import view
    from ..monitor.source import ZmqStatusSource

    check_address(args.coordinator, "--coordinator")
    keys = client_keys(args.coordinator_key, args.secret_key)
    target = args.worker
    if os.path.isfile(target):  # a NAME.key: the key in it
        target = load_public(target, "WORKER").decode("ascii")
    action = "unban" if args.unban else "ban"
    with ZmqStatusSource(args.coordinator, keys=keys) as source:
        ok, detail = source.control(action, target, timeout=args.timeout)
    where = view.shown(args.coordinator)
    if ok:
        print(f"the coordinator at {where}: {view.shown(detail)}")
        return 0
    print(f"idlegrad ban: error: the coordinator at {where}: {view.shown(detail)}",
          file=sys.stderr)
    return 1
