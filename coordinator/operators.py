"""The operator's commands, apart from the socket they arrive on: pause, resume and drain (the
round core's), ban and unban a worker (the gate's decision, kept in bans.json for the next run;
so are the gate's bindings of worker names to keys, in names.json),
revoke and mint invitations (the --enrolled store), a worker's credit row, and the key folders
re-read on SIGHUP. Each answers with its reply and the round core's effects; the server sends the
one and performs the others. No sockets, no threads; the wall clock only for the invitations'
times, as the enrolment store keeps them.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from ..common import protocol as proto
from ..common.errors import ConfigError
from . import bans, enrolment, names
from .config import CoordinatorConfig, load_key_lists
from .credits import Credits
from .gate import BANNED, Gate, KeyLists
from .rounds import RoundCore

NO_ENROLMENT = "this coordinator enrols no one (it has no --enrolled folder)"


class Operators:
    def __init__(self, config: CoordinatorConfig, gate: Gate, core: RoundCore, credits: Credits,
                 public_key: Optional[bytes], event: Callable[..., None]):
        self.config, self.gate, self.core, self.credits = config, gate, core, credits
        self.public_key = public_key
        self.event = event
        self.bans_path = bans.path_for(config.enrolled, config.checkpoint_dir)
        self.names_path = names.path_for(config.enrolled, config.checkpoint_dir)
        self.store: Optional[enrolment.Store] = None  # with --enrolled, while serving
        gate.on_bind = self._save_names

    def load_bans(self) -> None:
        """What the gate keeps across restarts: the operator's bans, which key holds which
        worker name, and which invitation each enrolled key came with."""
        self.gate.load_bans(bans.load(self.bans_path))
        if self.gate.secure:
            self.gate.load_owners(names.load(self.names_path))
            if self.config.enrolled:
                self.gate.invitation_of.update(enrolment.Store(self.config.enrolled).invitations())

    def _save_names(self) -> None:
        """A worker name was bound to its first key: kept for the next run, so that no other
        key takes it then either."""
        if self.names_path is None:
            return  # (bound until this coordinator stops, as the threat model says)
        try:
            names.save(self.names_path, self.gate.owners)
        except OSError as exc:
            self.event("names", f"cannot save the worker names in {self.names_path}: {exc}",
                       level=logging.ERROR)

    def command(self, action: str, worker: Optional[str], invitation: Optional[str],
                now: float) -> tuple[bool, str, list]:
        """An operator's command (from a monitor or `idlegrad ban` / `invite`): (ok, the reply's
        detail, the round core's effects)."""
        if action in ("ban", "unban"):
            ok, detail, identity = self.gate.ban(action, worker, self.core.identities,
                                                 self.credits.named)
            effects = []
            if ok and action == "ban":
                effects = self.core.expel(identity, self.gate.ban_reason(identity) or BANNED, now)
            if ok:
                self.event(action, f"{detail} by the operator", level=logging.WARNING)
                detail += self._save_bans()
            return ok, detail, effects
        if action == "revoke":
            return (*self._revoke_invitation(invitation), [])
        return self.core.control(action, worker, now)

    def _save_bans(self) -> str:
        """Keep the operator's bans for the next run; what the reply adds about it."""
        if self.bans_path is None:
            return " (until this coordinator stops: it has no --enrolled or --checkpoint-dir)"
        try:
            bans.save(self.bans_path, self.gate.bans)
        except OSError as exc:
            self.event("bans", f"cannot save the bans in {self.bans_path}: {exc}",
                       level=logging.ERROR)
            return f" (but not saved: {exc.strerror or exc})"
        return ""

    def _revoke_invitation(self, invitation: Optional[str]) -> tuple[bool, str]:
        if self.store is None:
            return False, NO_ENROLMENT
        done = self.store.revoke(invitation, time.time())
        if done is None:
            return False, f"no invitation {invitation} here"
        if done:
            self.event("revoked", f"invitation {invitation} revoked by the operator")
        return True, (f"invitation {invitation} {'revoked' if done else 'was already revoked'} "
                      "(keys it enrolled stay: `idlegrad ban` them)")

    def invite(self, msg: proto.Invite) -> proto.Invited:
        if self.store is None:
            return proto.Invited(ok=False, reason=NO_ENROLMENT)
        try:
            inv, text = enrolment.issue(self.store, msg.address, self.public_key, msg.uses,
                                        msg.expires_s, msg.name, time.time())
        except ConfigError as exc:
            return proto.Invited(ok=False, reason=str(exc)[:200])
        self.core.counters["invitations_minted"] += 1
        self.event("invited", f"invitation {inv.id} minted by the operator ({inv.uses} "
                              f"use{'' if inv.uses == 1 else 's'})")
        return proto.Invited(ok=True, token=text, invitation=inv.id, expires=inv.expires)

    def credit(self, key: Optional[bytes], msg: proto.CreditRequest) -> proto.Message:
        """A credit row, to whom the gate lets read it."""
        identity, refusal = self.gate.credit_of(key, msg.worker, self.credits.named)
        if refusal is not None:
            self.core.counters[refusal.counter] += 1
            return refusal.reply(msg)
        name, row = self.credits.row(identity)
        return proto.Credit(ok=True, worker=name[:200], row=row,
                            identities=len(self.credits.accounts))

    def reload_keys(self) -> list[str]:
        """Re-read the key folders (SIGHUP): new keys may connect, a removed key's connections
        are cut off from the next message on. Returns the workers whose key is no longer in
        --allow-keys: they are to be told and evicted."""
        if not self.gate.secure:
            self.event("keys", "SIGHUP ignored: this coordinator runs without keys")
            return []
        try:
            keys = load_key_lists(self.config)
        except ConfigError as exc:
            # Fail closed: an unreadable folder admits nobody until it is fixed and re-read.
            keys = KeyLists()
            self.event("keys", f"{exc}; admitting nobody", level=logging.ERROR)
        revoked_workers, revoked = self.gate.reload(keys)
        self.event("keys", f"key folders re-read: {keys.describe()}; {revoked} revoked")
        return revoked_workers
