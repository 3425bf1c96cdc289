"""Lasting credit per identity (a worker's key, or its worker id without keys). Pure.

Fed by the round core's effects (`take`): a `Joined` names an identity, an `Applied` step credits
the results it used (each result's share of the round's samples, its compute seconds, and one
verified slot to each identity whose copy of a verified row was right), a `Refused` result
counts against its sender. Credit is earned only when a round is applied: work refused,
dropped, replanned or discarded earns nothing, so the samples credited always add up to the
samples applied.

The credits are saved inside the checkpoint (`state_dict`), in the same atomic write as the
model: after a kill -9 and a restart they are exactly the checkpoint's, as the samples applied
are, and the steps redone after the restart are credited once more to whoever redoes them.
Times are wall-clock seconds (they outlive the process), passed in as `now`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from ..common.errors import CheckpointError
from .effects import Applied, Joined, Refused

FORMAT = 1
# Identities kept. Past this, the ones that never earned anything are forgotten first (oldest
# first): a fleet that churns through worker ids without keys must not grow the checkpoint for
# ever, and an identity that earned something keeps its credit.
MAX_ACCOUNTS = 100_000
SHOWN_PER_STATUS = 100  # rows in a status snapshot: a snapshot stays far below its size limit
FIELDS = ("samples", "compute_s", "verified", "refused", "first_seen", "last_seen")


@dataclass
class Account:
    name: str  # the worker id it last used (how a key is shown)
    first_seen: float
    last_seen: float
    samples: int = 0  # its shares of applied rounds' samples
    compute_s: float = 0.0  # compute seconds of its results used in applied rounds
    verified: int = 0  # slots of verified rows whose copy from it was right, in applied rounds
    refused: int = 0  # results refused

    def row(self) -> dict:
        return {"samples": self.samples, "compute_s": round(self.compute_s, 3),
                "verified": self.verified, "refused": self.refused,
                "first_seen": round(self.first_seen, 3), "last_seen": round(self.last_seen, 3)}


def shares(total: int, sizes: Sequence[int]) -> list[int]:
    """`total` split in proportion to `sizes`, in whole numbers that add up to `total` exactly:
    each gets the floor of its exact share, and what is left goes one each to the largest
    remainders (the earlier on a tie). Sizes that add up to nothing split it evenly."""
    if not sizes:
        return []
    if sum(sizes) <= 0:
        sizes = [1] * len(sizes)
    weight = sum(sizes)
    exact = [total * size for size in sizes]  # numerators over `weight`: no rounding
    out = [e // weight for e in exact]
    left = total - sum(out)
    for i in sorted(range(len(sizes)), key=lambda i: (-(exact[i] % weight), i))[:left]:
        out[i] += 1
    return out


class Credits:
    def __init__(self, max_accounts: int = MAX_ACCOUNTS):
        self.accounts: dict[str, Account] = {}
        self.max_accounts = max_accounts
        self._named: dict[str, str] = {}  # a worker name -> the identity that used it last

    def take(self, effects: Iterable, now: float) -> None:
        """The round core's effects, as they are performed; those that earn or cost credit
        count."""
        for effect in effects:
            kind = type(effect)
            if kind is Applied:
                for share in effect.credits:
                    account = self._account(share.identity, now)
                    account.samples += share.samples
                    account.compute_s += share.compute_s
                    account.last_seen = now
                    for identity in share.verified_by:
                        self._account(identity, now).verified += 1
            elif kind is Refused:
                account = self._account(effect.identity, now, effect.worker)
                account.refused += 1
                account.last_seen = now
            elif kind is Joined:
                account = self._account(effect.identity, now, effect.worker)
                self._rename(effect.identity, account, effect.worker)
                account.last_seen = now

    def _account(self, identity: str, now: float, name: Optional[str] = None) -> Account:
        account = self.accounts.get(identity)
        if account is None:
            if len(self.accounts) >= self.max_accounts:
                self._forget_idle()
            account = self.accounts[identity] = Account(name or identity, now, now)
            self._named[account.name] = identity
        return account

    def _rename(self, identity: str, account: Account, name: str) -> None:
        if self._named.get(account.name) == identity:
            del self._named[account.name]
        account.name = name
        self._named[name] = identity

    def named(self, name: str) -> Optional[str]:
        """The identity that last used the worker name `name`; None when none did."""
        return self._named.get(name)

    def row(self, identity: str) -> tuple[str, dict]:
        """(the name `identity` is shown by, its row); an identity never seen: ("", {})."""
        account = self.accounts.get(identity)
        return ("", {}) if account is None else (account.name, account.row())

    def _forget_idle(self) -> None:
        """Make room: forget a tenth of the accounts that never earned anything, oldest
        first (amortised: a tenth at a time, not one per newcomer)."""
        idle = [(a.last_seen, i) for i, a in self.accounts.items()
                if not a.samples and not a.verified]
        for _, identity in heapq.nsmallest(max(1, self.max_accounts // 10), idle):
            name = self.accounts.pop(identity).name
            if self._named.get(name) == identity:
                del self._named[name]

    @property
    def samples(self) -> int:
        return sum(a.samples for a in self.accounts.values())

    def table(self, limit: Optional[int] = None) -> dict:
        """{"workers": {name: {samples, compute_s, verified, refused, first_seen, last_seen}},
        "identities": how many there are}, the most samples first (at most `limit`). Keys are
        shown by the worker name they last used; a name two identities share is told apart by
        the identity's beginning."""
        ranked: Iterable[tuple[str, Account]] = self.accounts.items()
        order = lambda item: (item[1].samples, item[1].verified, item[0])  # noqa: E731
        if limit is not None and limit < len(self.accounts):
            ranked = heapq.nlargest(limit, ranked, key=order)
        else:
            ranked = sorted(ranked, key=order, reverse=True)
        workers: dict[str, dict] = {}
        for identity, account in ranked:
            name = account.name
            if name in workers or (name != identity and name in self.accounts):
                name = f"{name} ({identity[:12]}...)"
            workers[name] = account.row()
        return {"workers": workers, "identities": len(self.accounts)}

    # checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Plain containers (a checkpoint is loaded with weights_only)."""
        return {"format": FORMAT, "accounts": {
            identity: {"name": a.name, **{f: getattr(a, f) for f in FIELDS}}
            for identity, a in self.accounts.items()}}

    @classmethod
    def from_state(cls, state: Optional[dict], max_accounts: int = MAX_ACCOUNTS) -> "Credits":
        """The credits a checkpoint holds; none when it predates them."""
        credits = cls(max_accounts)
        if state is None:
            return credits
        try:
            if state["format"] != FORMAT:
                raise ValueError(f"format {state['format']!r}")
            for identity, row in state["accounts"].items():
                account = credits.accounts[str(identity)] = Account(
                    name=str(row["name"]), first_seen=float(row["first_seen"]),
                    last_seen=float(row["last_seen"]), samples=int(row["samples"]),
                    compute_s=float(row["compute_s"]), verified=int(row["verified"]),
                    refused=int(row["refused"]))
                credits._named[account.name] = str(identity)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"the checkpoint's credits cannot be read: "
                                  f"{type(exc).__name__}: {exc}"[:300]) from None
        return credits
