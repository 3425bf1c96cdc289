"""Who may say what to the coordinator: keys and their roles, bans, and which key holds which
worker id. Pure.

The policy is this one class; the drivers are tiny: the ZAP callback of the CURVE handshake
(`handshake`) and the server's check of every message (`admit`). Fails closed twice over: a key
in none of the key folders cannot finish its handshake, and every message's key is checked
again, so a key revoked after its handshake (SIGHUP) is not heard from its next message on.

Roles, with keys: a key in `--allow-keys` may work (hello, results, heartbeats); one in
`--monitor-keys` may read the status; one in `--operator-keys` may read the status and command
(pause, resume, drain, ban, revoke and mint invitations). Any listed key may ask for its own
credit; only monitors and operators may name another's. A key in several folders holds each of their
roles, so an operator who lends their own machine lists its key twice. Without keys (a loopback
coordinator) whoever can reach the socket is already on this machine: anyone may do anything.

Enrolment by invitation happens elsewhere, on its own endpoint (enrolment.py): the key it
enrols becomes a worker key here (`enrol`), as if its NAME.key had been added to --allow-keys.

Without keys a worker's identity is its worker id; with keys it is its key, and bans apply to
the key. With keys a worker name is bound, for good, to the key that first said hello under it
(`owners`, kept in names.json by the operators' room so that it holds across restarts): another
key's hello under that name is refused ("identity"), saying why, and the owner's always works.
Without keys names are not authenticated: whoever says a name is that worker.

Each worker also has its kin (`kin`): its key, the invitation that key was enrolled with, and the
source address of its hello. Two workers of one kin may be one party: a verified row's copies
and a settlement's computation never come from the same kin (verify.py, rounds.py).

Bans come from two places: the trust policy's (repeated bad gradients, for this run) and the
operator's (`ban`, kept in `bans`; the server saves them, so they hold across restarts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..common import protocol as proto
from ..common.errors import ProtocolError
from . import names

# what a message asks to do; OWN: something about its own key (any listed key may)
WORK, READ, OPERATE, OWN = "work", "read", "operate", "own"

# What each message to the coordinator asks to do; anything else is not for the coordinator.
NEEDS: dict[type, str] = {
    proto.Hello: WORK, proto.Ready: WORK, proto.Result: WORK, proto.EvalResult: WORK, proto.Heartbeat: WORK,
    proto.Bye: WORK, proto.Fetch: WORK, proto.Handback: WORK, proto.StatusRequest: READ,
    proto.Control: OPERATE, proto.Invite: OPERATE, proto.CreditRequest: OWN,
}
LOOPBACK = ("127.", "::1", "::ffff:127.")
KEY_LENGTH = 40  # a public key in Z85
_Z85 = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


@dataclass(frozen=True)
class KeyLists:
    """The public keys (Z85) in each key folder: who holds which role."""

    workers: frozenset[bytes] = frozenset()  # --allow-keys
    monitors: frozenset[bytes] = frozenset()  # --monitor-keys
    operators: frozenset[bytes] = frozenset()  # --operator-keys

    def describe(self) -> str:
        counts = ((len(self.workers), "worker"), (len(self.monitors), "monitor"),
                  (len(self.operators), "operator"))
        return ", ".join(f"{n} {role} key{'' if n == 1 else 's'}" for n, role in counts)


@dataclass(frozen=True)
class Refusal:
    counter: str  # what the coordinator counts
    code: Optional[str] = None  # a Reject to send back with this code; None: dropped silently
    reason: str = ""
    bad_message: bool = False  # counted and logged as a bad message

    def reply(self, msg: proto.Message) -> proto.Message:
        """What the refused sender is told: a command gets its own answer (a monitor waits for
        that), anything else a Reject."""
        if isinstance(msg, proto.Control):
            return proto.ControlReply(action=msg.action, ok=False, detail=self.reason)
        if isinstance(msg, proto.CreditRequest):
            return proto.Credit(ok=False, reason=self.reason)
        if isinstance(msg, proto.Invite):
            return proto.Invited(ok=False, reason=self.reason)
        return proto.Reject(code=self.code or "refused", reason=self.reason)


BANNED = "banned by this coordinator for repeated bad gradients"
BANNED_BY_OPERATOR = "banned by this coordinator's operator"
REVOKED = "this worker's key was revoked by the coordinator's operator"

_ROLE_REFUSALS = {
    WORK: Refusal("work_refused", "role", "this key may not work here: only keys in the "
                                          "coordinator's --allow-keys may"),
    READ: Refusal("status_refused", "role", "this key may not read the status: only keys in the "
                                            "coordinator's --monitor-keys or --operator-keys may"),
    OPERATE: Refusal("controls_refused", "role", "this key may not pause, resume, drain, ban, "
                                                 "revoke or invite: only keys in the "
                                                 "coordinator's --operator-keys may"),
    OWN: Refusal("credits_refused", "role", "this key is in none of the coordinator's key "
                                            "folders"),
}
OTHERS_CREDIT = Refusal("credits_refused", "role", "a worker key reads only its own credit: only "
                                                   "keys in the coordinator's --monitor-keys or "
                                                   "--operator-keys may read another's")


class NeedHello(ProtocolError):
    """A message from a connection that has not said hello (or one this process evicted)."""

    def __init__(self):
        super().__init__("hello_first", "message from a peer that has not said hello")


class Gate:
    def __init__(self, keys: Optional[KeyLists], is_banned: Callable[[str], bool]):
        """`keys`: who holds which role; None for a coordinator without keys."""
        self.keys = keys
        self._listed = self._every(keys)
        self.trust_banned = is_banned
        self.bans: dict[str, str] = {}  # identity -> the name it was banned under (the operator's)
        self.key_of: dict[str, bytes] = {}  # worker id -> the key that holds it, while connected
        self.owners: dict[str, bytes] = {}  # worker id -> the key that first used it, for good
        self.on_bind: Callable[[], None] = lambda: None  # a new binding in `owners`: save them
        self.invitation_of: dict[bytes, str] = {}  # enrolled key -> the invitation it came with
        self.sources: dict[bytes, str] = {}  # routing id -> the source address of its hello
        self.routes: dict[str, bytes] = {}  # worker id -> its connection's routing id
        self.peers: dict[bytes, str] = {}  # routing id -> the worker id it said hello as

    @staticmethod
    def _every(keys: Optional[KeyLists]) -> frozenset[bytes]:
        # asked of every message: one set, not three (empty without keys)
        return frozenset() if keys is None else keys.workers | keys.monitors | keys.operators

    @property
    def secure(self) -> bool:
        return self.keys is not None

    @property
    def allowed(self) -> Optional[frozenset[bytes]]:
        """The worker keys (--allow-keys); None without keys."""
        return None if self.keys is None else self.keys.workers

    def describe(self) -> str:
        return self.keys.describe() if self.keys is not None else "no keys"

    def handshake(self, key: bytes) -> bool:
        return key in self._listed

    def worker_of(self, route: bytes) -> str:
        """The worker that said hello on `route`; NeedHello if none did."""
        worker_id = self.peers.get(route)
        if worker_id is None:
            raise NeedHello()
        return worker_id

    def listed(self, key: Optional[bytes]) -> bool:
        """Whether a message under `key` may be read at all."""
        return not self.secure or (key is not None and key in self._listed)

    def may(self, key: Optional[bytes], need: str) -> bool:
        """Whether `key` holds a role that may `need` (WORK, READ, OPERATE)."""
        keys = self.keys
        if keys is None:
            return True
        if need == WORK:
            return key in keys.workers
        if need == READ:
            return key in keys.monitors or key in keys.operators
        if need == OWN:
            return key in self._listed
        return need == OPERATE and key in keys.operators

    def identity(self, worker_id: str, key: Optional[bytes] = None) -> str:
        """Who is judged and banned: the key when there are keys, else the worker id."""
        key = key if key is not None else self.key_of.get(worker_id)
        return "key:" + key.decode("ascii") if key is not None else worker_id

    def admit(self, key: Optional[bytes], msg: proto.Message,
              route: bytes) -> Optional[Refusal]:
        """A decoded message from a listed key, on the connection `route`. None: it may be
        handled."""
        hello_id = msg.worker_id if isinstance(msg, proto.Hello) else None
        if hello_id is not None:
            why = self.ban_reason(self.identity(hello_id, key))
            if why is not None:
                return Refusal("hello_banned", "banned", why)
        if key is not None and self.is_banned(self.identity("", key)):
            # A banned key still listed: a monitor's commands (pause, drain) need no hello, and
            # a ban is of the key, whatever it says next or whichever roles it holds. Asking
            # what it earned (`worker status`), it is told why it earns nothing, as its hello is.
            if isinstance(msg, proto.CreditRequest):
                return Refusal("messages_banned_key", "banned",
                               self.ban_reason(self.identity("", key)) or "")
            return Refusal("messages_banned_key")
        need = NEEDS.get(type(msg))
        if need is not None and not self.may(key, need):
            return _ROLE_REFUSALS[need]
        sender = None if hello_id is not None else self.peers.get(route)
        if key is not None and hello_id is not None:
            owner = self.owners.get(hello_id, self.key_of.get(hello_id))
            if owner is not None and owner != key:
                return Refusal("hello_identity", "identity",
                               f"worker name {hello_id!r} is bound to another key (the one that "
                               "first joined under it): give this worker another --id")
        elif key is not None and sender is not None and self.key_of.get(sender) != key:
            return Refusal("identity", reason="message under another key than its hello",
                           bad_message=True)
        return None

    # bans -------------------------------------------------------------------------------------

    def is_banned(self, identity: str) -> bool:
        return identity in self.bans or self.trust_banned(identity)

    def ban_reason(self, identity: str) -> Optional[str]:
        """What a banned identity is told; None when it is not banned."""
        if identity in self.bans:
            return BANNED_BY_OPERATOR
        return BANNED if self.trust_banned(identity) else None

    def resolve(self, target: str, identities: dict[str, str],
                named: Callable[[str], Optional[str]]) -> Optional[str]:
        """Whom an operator's `target` names: a worker connected now (its id), one the credits
        know by name, or a key (Z85); without keys any worker id is an identity. None: nobody
        known (with keys, a name alone cannot be banned before its key is known)."""
        if target in identities:
            return identities[target]
        known = named(target)
        if known is not None:
            return known
        if not self.secure:
            return target
        return "key:" + target if len(target) == KEY_LENGTH and set(target) <= _Z85 else None

    def ban(self, action: str, target: str, identities: dict[str, str],
            named: Callable[[str], Optional[str]]) -> tuple[bool, str, Optional[str]]:
        """An operator's `ban` or `unban` of `target`: (done?, one line, the identity)."""
        identity = self.resolve(target, identities, named)
        shown = str(target)[:80]
        if identity is None:
            return False, (f"no worker or key {shown!r} known here (give its key, from its "
                           "NAME.key, or the name of a worker that has joined)"), None
        if action == "unban":
            if self.bans.pop(identity, None) is None:
                return False, f"{shown} was not banned by the operator", identity
            return True, f"{shown} unbanned", identity
        if identity in self.bans:
            return True, f"{shown} was already banned", identity
        self.bans[identity] = shown
        return True, f"{shown} banned", identity

    def load_bans(self, bans: dict[str, str]) -> None:
        self.bans = dict(bans)

    # credit -------------------------------------------------------------------------------------

    def credit_of(self, key: Optional[bytes], worker: Optional[str],
                  named: Callable[[str], Optional[str]]) -> tuple[Optional[str], Optional[Refusal]]:
        """Whose credit row a `credit_request` (from `key`, naming `worker` or nobody) reads:
        (identity, None), or (None, the refusal). A worker key reads only its own."""
        if not self.secure:
            if worker is None:
                return None, Refusal("credits_refused", "role", "without keys a worker is its "
                                                                "id: name the worker")
            return worker, None
        assert key is not None  # with keys, a message without one is not read (`listed`)
        own = "key:" + key.decode("ascii")
        if worker is None:
            return own, None
        identity = self.key_identity(worker) or named(worker)
        if identity == own or self.may(key, READ):
            return identity or "?" + worker, None
        return None, OTHERS_CREDIT

    def key_identity(self, worker_id: str) -> Optional[str]:
        key = self.key_of.get(worker_id)
        return None if key is None else "key:" + key.decode("ascii")

    def connect(self, worker_id: str, route: bytes, key: Optional[bytes]) -> None:
        """`worker_id` said hello on `route` (under `key`): its earlier connection is let go."""
        old = self.routes.get(worker_id)
        if old is not None and old != route:
            self.peers.pop(old, None)
            self.sources.pop(old, None)
        self.peers.pop(route, None)
        self.routes[worker_id] = route
        self.peers[route] = worker_id
        if key is not None:
            self.key_of[worker_id] = key
            if worker_id in self.owners:  # the owner is back: its name is the last to go
                self.owners[worker_id] = self.owners.pop(worker_id)
            else:
                self.owners[worker_id] = key
                while len(self.owners) > names.MAX_NAMES:  # the longest unused goes first
                    del self.owners[next(iter(self.owners))]
                self.on_bind()

    def load_owners(self, owners: dict[str, bytes]) -> None:
        self.owners = dict(owners)

    def heard_from(self, route: bytes, source: str) -> None:
        """A hello arrived on `route` from `source` (ZeroMQ's Peer-Address; "?" when unknown)."""
        self.sources[route] = source

    def kin(self, worker_id: str, key: Optional[bytes], route: bytes) -> frozenset[str]:
        """Who `worker_id` (saying hello under `key` on `route`) may be one party with: its
        identity, its key's invitation, its source address (each as far as known)."""
        tags = {self.identity(worker_id, key)}
        invitation = self.invitation_of.get(key) if key is not None else None
        if invitation is not None:
            tags.add("inv:" + invitation)
        source = self.sources.get(route, "?")
        # Loopback is the coordinator's own machine (the operator's workers, and every test):
        # no volunteer comes from there. Without keys names prove nothing, sources included.
        if self.secure and source != "?" and not source.startswith(LOOPBACK):
            tags.add("src:" + source)
        return frozenset(tags)

    def same_key(self, worker_id: str, key: Optional[bytes]) -> bool:
        return key is None or self.key_of.get(worker_id) == key

    def forget(self, worker_id: str) -> None:
        """The worker is gone (evicted, revoked, banned): nothing more from its connection."""
        route = self.routes.pop(worker_id, None)
        if route is not None:
            self.peers.pop(route, None)
            self.sources.pop(route, None)
        self.key_of.pop(worker_id, None)

    def enrol(self, key: bytes, invitation: Optional[str] = None) -> None:
        """`key` was enrolled by invitation: it may work from its next handshake on."""
        if invitation is not None:
            self.invitation_of[key] = invitation
        if self.keys is not None:
            self.keys = KeyLists(self.keys.workers | {key}, self.keys.monitors,
                                 self.keys.operators)
            self._listed = self._every(self.keys)

    def reload(self, keys: KeyLists) -> tuple[list[str], int]:
        """New key folders: the worker ids whose key may no longer work (each is to be evicted),
        and how many keys lost every role."""
        revoked = self._listed - self._every(keys)
        self.keys, self._listed = keys, self._every(keys)
        return [w for w, key in self.key_of.items() if key not in keys.workers], len(revoked)
