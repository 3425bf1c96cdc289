"""Who may say what to the coordinator: keys, bans, and which key holds which worker id. Pure.

The policy is this one class; the drivers are tiny: the ZAP callback of the CURVE handshake
(`handshake`) and the server's check of every message (`admit`). Fails closed twice over: a key
not on the allow-list cannot finish its handshake, and every message's key is checked again, so
a key revoked after its handshake (SIGHUP) is not heard from its next message on.

Without keys (a loopback coordinator) a worker's identity is its worker id; with keys it is its
key, so a worker name is held by one key and bans apply to the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Refusal:
    counter: str  # what the coordinator counts
    code: Optional[str] = None  # a Reject to send back with this code; None: dropped silently
    reason: str = ""
    bad_message: bool = False  # counted and logged as a bad message


BANNED = "banned by this coordinator for repeated bad gradients"


class Gate:
    def __init__(self, allowed: Optional[frozenset[bytes]], is_banned: Callable[[str], bool]):
        """`allowed`: the keys that may connect; None for a coordinator without keys."""
        self.allowed = allowed
        self.is_banned = is_banned
        self.key_of: dict[str, bytes] = {}  # worker id -> the key that holds it
        self.routes: dict[str, bytes] = {}  # worker id -> its connection's routing id
        self.peers: dict[bytes, str] = {}  # routing id -> the worker id it said hello as

    @property
    def secure(self) -> bool:
        return self.allowed is not None

    def handshake(self, key: bytes) -> bool:
        return self.allowed is not None and key in self.allowed

    def listed(self, key: Optional[bytes]) -> bool:
        """Whether a message under `key` may be read at all."""
        return not self.secure or (key is not None and key in self.allowed)

    def identity(self, worker_id: str, key: Optional[bytes] = None) -> str:
        """Who is judged and banned: the key when there are keys, else the worker id."""
        key = key if key is not None else self.key_of.get(worker_id)
        return "key:" + key.decode("ascii") if key is not None else worker_id

    def admit(self, key: Optional[bytes], hello_id: Optional[str],
              sender: Optional[str]) -> Optional[Refusal]:
        """A decoded message from a listed key: `hello_id` the worker id a HELLO claims (None for
        any other message), `sender` the worker id its connection said hello as (None: none).
        None: it may be handled."""
        if hello_id is not None and self.is_banned(self.identity(hello_id, key)):
            return Refusal("hello_banned", "banned", BANNED)
        if key is not None and self.is_banned(self.identity("", key)):
            # A banned key still in --allow-keys: a monitor's commands (pause, drain) need no
            # hello, and a ban is of the key, whatever it says next.
            return Refusal("messages_banned_key")
        if key is not None and hello_id is not None:
            owner = self.key_of.get(hello_id)
            if owner is not None and owner != key:
                return Refusal("hello_identity", "identity",
                               f"worker id {hello_id!r} belongs to another key")
        elif key is not None and sender is not None and self.key_of.get(sender) != key:
            return Refusal("identity", reason="message under another key than its hello",
                           bad_message=True)
        return None

    def connect(self, worker_id: str, route: bytes, key: Optional[bytes]) -> None:
        """`worker_id` said hello on `route` (under `key`): its earlier connection is let go."""
        old = self.routes.get(worker_id)
        if old is not None:
            self.peers.pop(old, None)
        self.peers.pop(route, None)
        self.routes[worker_id] = route
        self.peers[route] = worker_id
        if key is not None:
            self.key_of[worker_id] = key

    def same_key(self, worker_id: str, key: Optional[bytes]) -> bool:
        return key is None or self.key_of.get(worker_id) == key

    def forget(self, worker_id: str) -> None:
        """The worker is gone (evicted, revoked, banned): nothing more from its connection."""
        route = self.routes.pop(worker_id, None)
        if route is not None:
            self.peers.pop(route, None)
        self.key_of.pop(worker_id, None)

    def reload(self, allowed: frozenset[bytes]) -> tuple[list[str], int]:
        """A new allow-list: the worker ids whose key it revokes, and how many keys it revokes."""
        revoked = (self.allowed or frozenset()) - allowed
        self.allowed = allowed
        return [w for w, key in self.key_of.items() if key not in allowed], len(revoked)
