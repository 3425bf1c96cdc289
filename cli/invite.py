"""`idlegrad invite`: mint, list and revoke invitations, on the coordinator's machine.

    idlegrad invite --coordinator ADDR --secret-key FILE --enrolled DIR [--uses N] [--expires 7d]
                    [--name PREFIX]                  prints the token as its last line
    idlegrad invite --enrolled DIR --list
    idlegrad invite --enrolled DIR --revoke ID

The invitation is written into the coordinator's --enrolled folder, which the running coordinator
reads at every enrolment: no signal, no restart. --secret-key is the coordinator's own key pair
file; only its public half goes into the token.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable


def add_invite_parser(sub, add_common: Callable, positive: Callable) -> None:
    p = sub.add_parser("invite", help="invite a volunteer: a one-command token for "
                                      "`idlegrad worker join`",
                       description="Mint an invitation: a token that lets `idlegrad worker join` "
                                   "enrol one worker key (or --uses N) with this coordinator.")
    p.add_argument("--enrolled", required=True, metavar="DIR",
                   help="the coordinator's --enrolled folder")
    p.add_argument("--coordinator", metavar="ADDR",
                   help="the address workers reach the coordinator at, tcp://HOST:PORT")
    p.add_argument("--secret-key", metavar="FILE",
                   help="the coordinator's NAME.key_secret (only its public key goes in the token)")
    p.add_argument("--uses", type=positive(int), default=1, metavar="N",
                   help="how many worker keys the token may enrol (default: 1)")
    p.add_argument("--expires", default="7d", metavar="DURATION",
                   help="valid for this long: 90s, 30m, 12h, 7d, 2w (default: 7d)")
    p.add_argument("--name", default="worker", metavar="PREFIX",
                   help="enrolled workers are named PREFIX-ID-N (default: worker)")
    act = p.add_mutually_exclusive_group()
    act.add_argument("--list", action="store_true", help="list the invitations and their uses")
    act.add_argument("--revoke", metavar="ID", help="revoke an invitation (its unused uses)")
    add_common(p)
    p.set_defaults(func=run_invite)


def run_invite(args) -> int:
    from ..common import security
    from ..common.errors import ConfigError
    from ..common.invitation import NAME_RE, enrol_address
    from ..coordinator.enrolment import Store, token
    from ..coordinator.invitations import parse_duration

    store = Store(args.enrolled).prepare()
    now = time.time()
    if args.list:
        rows = store.all()
        for inv, used in rows:
            state = ("expired" if now >= inv.expires else "used up" if used >= inv.uses
                     else f"expires {time.strftime('%Y-%m-%d %H:%M', time.localtime(inv.expires))}")
            print(f"{inv.id}  {inv.name:<16} used {used}/{inv.uses}  {state}")
        if not rows:
            print(f"no invitations in {args.enrolled}")
        return 0
    if args.revoke:
        if not store.revoke(args.revoke.strip()):
            raise ConfigError(f"--revoke {args.revoke}: no such invitation in {args.enrolled}")
        print(f"revoked {args.revoke} (keys it enrolled stay: remove them from "
              f"{store.keys} and send SIGHUP)")
        return 0
    if not args.coordinator or not args.secret_key:
        raise ConfigError("--coordinator and --secret-key are needed to mint an invitation "
                          "(or give --list or --revoke ID)")
    security.check_address(args.coordinator, "--coordinator")
    enrol_address(args.coordinator)
    if "*" in args.coordinator or "0.0.0.0" in args.coordinator:
        raise ConfigError(f"--coordinator {args.coordinator}: give the address workers dial, "
                          "not a bind address")
    if not NAME_RE.match(args.name):
        raise ConfigError(f"--name {args.name!r}: letters, digits, '.', '_' and '-', at most 64")
    public, _ = security.load_keypair(args.secret_key)
    inv, secret = store.mint(args.uses, parse_duration(args.expires), args.name, now)
    print(f"invitation {inv.id}: {inv.uses} use{'' if inv.uses == 1 else 's'}, expires "
          f"{time.strftime('%Y-%m-%d %H:%M %Z', time.localtime(inv.expires))}; the volunteer "
          "runs: idlegrad worker join TOKEN")
    print(token(args.coordinator, public, inv, secret))
    return 0
