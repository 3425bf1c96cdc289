"""`idlegrad invite`: mint, list and revoke invitations.

On the coordinator's machine, in its --enrolled folder (which the running coordinator reads at
every enrolment: no signal, no restart); --secret-key is the coordinator's own key pair file,
and only its public half goes into the token:

    idlegrad invite --enrolled DIR --coordinator ADDR --secret-key COORD.key_secret
                    [--uses N] [--expires 7d] [--name PREFIX]      prints the token as its last line
    idlegrad invite --enrolled DIR --list
    idlegrad invite --enrolled DIR --revoke ID

From anywhere, as an operator (a key in the coordinator's --operator-keys), through the running
coordinator, which writes the same files:

    idlegrad invite --coordinator ADDR --coordinator-key COORD.key --secret-key OPERATOR.key_secret
                    [--uses N] [--expires 7d] [--name PREFIX]
    idlegrad invite --coordinator ADDR --coordinator-key ... --secret-key ... --revoke ID
"""

from __future__ import annotations

import sys
import time
from typing import Callable


def add_invite_parser(sub, add_common: Callable, positive: Callable) -> None:
    p = sub.add_parser("invite", help="invite a volunteer: a one-command token for "
                                      "`idlegrad worker join`",
                       description="Mint an invitation: a token that lets `idlegrad worker join` "
                                   "enrol one worker key (or --uses N) with this coordinator. "
                                   "With --enrolled, on the coordinator's machine; without, "
                                   "through the running coordinator, with an operator's key.")
    p.add_argument("--enrolled", metavar="DIR",
                   help="the coordinator's --enrolled folder (on its machine); without it, ask "
                        "the running coordinator at --coordinator")
    p.add_argument("--coordinator", metavar="ADDR",
                   help="the address workers reach the coordinator at, tcp://HOST:PORT")
    p.add_argument("--secret-key", metavar="FILE",
                   help="with --enrolled: the coordinator's NAME.key_secret (only its public key "
                        "goes in the token); without: an operator's NAME.key_secret")
    p.add_argument("--coordinator-key", metavar="FILE",
                   help="without --enrolled: the coordinator's public key (NAME.key), pinned")
    p.add_argument("--uses", type=positive(int), default=1, metavar="N",
                   help="how many worker keys the token may enrol (default: 1)")
    p.add_argument("--expires", default="7d", metavar="DURATION",
                   help="valid for this long: 90s, 30m, 12h, 7d, 2w (default: 7d)")
    p.add_argument("--name", default="worker", metavar="PREFIX",
                   help="enrolled workers are named PREFIX-ID-N (default: worker)")
    p.add_argument("--timeout", type=positive(float), default=5.0, metavar="SECONDS",
                   help="without --enrolled: wait this long for the coordinator (default: 5)")
    act = p.add_mutually_exclusive_group()
    act.add_argument("--list", action="store_true",
                     help="list the invitations, their uses, and which are revoked (--enrolled)")
    act.add_argument("--revoke", metavar="ID", help="revoke an invitation (its unused uses)")
    add_common(p)
    p.set_defaults(func=run_invite)


def run_invite(args) -> int:
    from ..common.errors import ConfigError
    from ..coordinator.invitations import parse_duration

    expires_s = parse_duration(args.expires)  # a bad duration: one line, wherever it goes
    if args.enrolled is None:
        if args.list:
            raise ConfigError("--list reads the coordinator's --enrolled folder: give --enrolled "
                              "DIR on its machine")
        return _remote(args, expires_s)
    if args.coordinator_key is not None:
        raise ConfigError("--coordinator-key is for asking a running coordinator: without "
                          "--enrolled")
    return _local(args, expires_s)


def _local(args, expires_s: float) -> int:
    from ..common import security
    from ..common.errors import ConfigError
    from ..coordinator.enrolment import Store, issue

    store = Store(args.enrolled).prepare()
    now = time.time()
    if args.list:
        rows = store.all()
        for inv, used, revoked in rows:
            state = ("revoked" if revoked else "expired" if now >= inv.expires
                     else "used up" if used >= inv.uses
                     else f"expires {time.strftime('%Y-%m-%d %H:%M', time.localtime(inv.expires))}")
            print(f"{inv.id}  {inv.name:<16} used {used}/{inv.uses}  {state}")
        if not rows:
            print(f"no invitations in {args.enrolled}")
        return 0
    if args.revoke:
        done = store.revoke(args.revoke.strip(), now)
        if done is None:
            raise ConfigError(f"--revoke {args.revoke}: no such invitation in {args.enrolled}")
        print(f"{'revoked' if done else 'already revoked:'} {args.revoke} (keys it enrolled "
              f"stay: `idlegrad ban` them, or remove them from {store.keys} and send SIGHUP)")
        return 0
    if not args.coordinator or not args.secret_key:
        raise ConfigError("--coordinator and --secret-key are needed to mint an invitation "
                          "(or give --list or --revoke ID)")
    public, _ = security.load_keypair(args.secret_key)
    inv, text = issue(store, args.coordinator, public, args.uses, expires_s, args.name, now)
    _print_token(inv.id, inv.uses, inv.expires, text)
    return 0


def _print_token(inv_id: str, uses: int, expires: float, text: str) -> None:
    print(f"invitation {inv_id}: {uses} use{'' if uses == 1 else 's'}, expires "
          f"{time.strftime('%Y-%m-%d %H:%M %Z', time.localtime(expires))}; the volunteer "
          "runs: idlegrad worker join TOKEN")
    print(text)


def _remote(args, expires_s: float) -> int:
    """Through the running coordinator, as an operator."""
    from ..common import protocol as proto
    from ..common.errors import ConfigError
    from ..common.invitation import parse
    from ..common.security import client_keys
    from ..monitor import view
    from ..monitor.source import ZmqStatusSource

    if not args.coordinator or not args.coordinator_key or not args.secret_key:
        raise ConfigError("give --enrolled DIR (on the coordinator's machine), or --coordinator, "
                          "--coordinator-key and an operator's --secret-key (to ask the running "
                          "coordinator)")
    from ..coordinator.enrolment import check_invite

    check_invite(args.coordinator, args.name)  # the coordinator checks too; one line now
    keys = client_keys(args.coordinator_key, args.secret_key)
    where = view.shown(args.coordinator)
    with ZmqStatusSource(args.coordinator, keys=keys) as source:
        if args.revoke:
            ok, detail = source.control("revoke", invitation=args.revoke.strip(),
                                        timeout=args.timeout)
            return _said(ok, f"the coordinator at {where}: {view.shown(detail)}")
        reply = source.ask(proto.Invite(address=args.coordinator, uses=args.uses,
                                        expires_s=expires_s, name=args.name),
                           proto.Invited, args.timeout)
        refused = source.refused
    if reply is None:
        return _said(False, f"the coordinator at {where} refused: {view.shown(refused)}"
                     if refused is not None else
                     f"no answer from the coordinator at {where} within {args.timeout:g}s (is "
                     f"it running? is --coordinator-key its key?{OPERATOR_HINT})")
    if not reply.ok:
        return _said(False, f"the coordinator at {where} refused: {view.shown(reply.reason)}")
    try:
        token = parse(reply.token)
    except ConfigError:
        return _said(False, f"the coordinator at {where} answered no token")
    if token.server_key != keys.server_public or token.id != reply.invitation:
        return _said(False, f"the coordinator at {where} answered a token for another key")
    _print_token(reply.invitation, args.uses, reply.expires, token.encode())
    return 0


# With CURVE a key the coordinator does not list gets silence, not a refusal.
OPERATOR_HINT = " is --secret-key's NAME.key in its --operator-keys?"


def _said(ok: bool, line: str) -> int:
    if ok:
        print(line)
        return 0
    print(f"idlegrad invite: error: {line}", file=sys.stderr)
    return 1
