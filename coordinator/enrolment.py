"""Enrolment by invitation: the invitations and enrolled keys on disk (`Store`, shared with
`idlegrad invite`), and the coordinator's enrolment endpoint (`Endpoint`), an I/O shell beside
the training socket. The decisions are invitations.py's.

The training endpoint's handshake stays closed to every unlisted key. The enrolment endpoint is
a second ROUTER at the training port plus one, CURVE with the coordinator's own key pair, whose
handshake any key may finish; there it may say one thing, `enrol`, with an invitation's id and
secret. The key enrolled is the key of the handshake (the sender proved it holds its secret), and
it becomes a worker key at once, and across restarts: its NAME.key is written under DIR/keys.

The folder (`--enrolled DIR`):
    DIR/invites/ID.json   an invitation: hash of the secret, uses, expiry (written by `invite`)
    DIR/invites/ID.used   how many keys it has enrolled (written by the coordinator only)
    DIR/invites/ID.revoked  present once the invitation is revoked (its record stays, listed)
    DIR/keys/NAME.key     an enrolled worker's public key
    DIR/bans.json         the operator's bans (bans.py)
Every file is written whole (common/atomic.py: tmp, fsync, rename); the coordinator reads the record at every
enrolment, so an invitation minted or revoked by `idlegrad invite` on this machine needs no
signal. An operator elsewhere mints and revokes through the running coordinator (`invite`, and
`control` "revoke"), which writes the same files.

A stranger with no token may reach this endpoint; what a flood of them costs is bounded (the
decisions are door.py's): a valid token is checked first and never charged; a refusal is charged
to its source address before the window's overall bound; each connection has a deadline and a
byte budget, and their number is capped well under the process's file descriptors. The
connections are watched through the socket's monitor (accepted, disconnected), and one is cut by
shutting down a duplicate of its file descriptor: ZeroMQ sees the end of the stream and drops it,
with whatever part of a message it had buffered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import socket
import struct
import time
from typing import Optional

import zmq
import zmq.asyncio
import zmq.utils.monitor

from ..common import atomic, security
from ..common import protocol as proto
from ..common.errors import ConfigError, ProtocolError
from ..common.invitation import ID_RE, NAME_RE, Token, digest, enrol_address
from .door import ANSWER, DROP, Connections, RefusalBudget, connection_cap
from .invitations import Invitation, SourceLimit, judge, key_name

log = logging.getLogger("idlegrad.coordinator.enrolment")
_ENROLLED_WITH = re.compile(r"enrolled with invitation ([0-9a-f]{1,64})")
_PUBLIC_KEY = re.compile(r'public-key = "([^"]{40})"')
ENROL_MAX_BYTES = 4096  # an enrol message in all (its one frame is bounded by ZMQ_MAXMSGSIZE too)
WATCH_S = 0.05  # how often open connections are looked at (deadline, bytes received)
_TCP_INFO_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received in Linux's struct tcp_info


class Store:
    def __init__(self, directory: str, flag: str = "--enrolled"):
        self.dir, self.flag = directory, flag
        self.invites = os.path.join(directory, "invites")
        self.keys = os.path.join(directory, "keys")

    def prepare(self) -> "Store":
        try:
            for d in (self.invites, self.keys):
                os.makedirs(d, mode=0o700, exist_ok=True)
            if not os.access(self.invites, os.W_OK | os.X_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as exc:
            raise ConfigError(f"{self.flag} {self.dir}: cannot write there: "
                              f"{exc.strerror or exc}") from None
        return self

    def mint(self, uses: int, expires_s: float, name: str, now: float) -> tuple[Invitation, str]:
        """A new invitation (written) and its secret (not kept)."""
        secret = secrets.token_urlsafe(32)
        inv = Invitation(id=secrets.token_hex(8), digest=digest(secret), uses=uses,
                         expires=now + expires_s, name=name, created=now)
        atomic.write_bytes(os.path.join(self.invites, inv.id + ".json"),
                     json.dumps(inv.to_json()).encode())
        return inv, secret

    def load(self, inv_id: str) -> Optional[Invitation]:
        if not ID_RE.match(inv_id):
            return None
        try:
            with open(os.path.join(self.invites, inv_id + ".json"), "rb") as f:
                inv = Invitation.from_json(json.loads(f.read(65536)))
        except (OSError, ValueError, TypeError):
            return None
        return inv if inv.id == inv_id else None

    def used(self, inv_id: str) -> int:
        if not ID_RE.match(inv_id):
            return 1 << 30
        try:
            with open(os.path.join(self.invites, inv_id + ".used"), "rb") as f:
                return max(0, int(f.read(32)))
        except FileNotFoundError:
            return 0
        except (OSError, ValueError):
            return 1 << 30  # unreadable: counted as used up, failing closed

    def revoked(self, inv_id: str) -> bool:
        return bool(ID_RE.match(inv_id)) and os.path.exists(
            os.path.join(self.invites, inv_id + ".revoked"))

    def all(self) -> list[tuple[Invitation, int, bool]]:
        """(invitation, keys enrolled, revoked?) for each, the oldest first."""
        out = []
        for name in sorted(os.listdir(self.invites)):
            if name.endswith(".json"):
                inv = self.load(name[:-5])
                if inv is not None:
                    out.append((inv, self.used(inv.id), self.revoked(inv.id)))
        return sorted(out, key=lambda row: row[0].created)

    def revoke(self, inv_id: str, now: float) -> Optional[bool]:
        """Revoke an invitation: True, or False when it already was; None when there is no
        such invitation. The record stays, so that it is listed as revoked."""
        if self.load(inv_id) is None:
            return None
        if self.revoked(inv_id):
            return False
        atomic.write_bytes(os.path.join(self.invites, inv_id + ".revoked"), f"{now:.3f}".encode())
        return True

    def enrol(self, inv: Invitation, used: int, name: str, key: bytes) -> None:
        """Count the use first: a crash between the two writes loses a use, never exceeds one."""
        atomic.write_bytes(os.path.join(self.invites, inv.id + ".used"), str(used + 1).encode())
        atomic.write_bytes(os.path.join(self.keys, name + security.PUBLIC_SUFFIX),
                     security.public_key_text(key, f"enrolled with invitation {inv.id}"))

    def invitations(self) -> dict[bytes, str]:
        """Each enrolled key's invitation, as its NAME.key file says (`enrol` writes it there):
        keys of one invitation may be one volunteer (gate.py, `kin`)."""
        out: dict[bytes, str] = {}
        if not os.path.isdir(self.keys):
            return out
        for name in os.listdir(self.keys):
            if not name.endswith(security.PUBLIC_SUFFIX):
                continue
            try:
                with open(os.path.join(self.keys, name), "rb") as f:
                    text = f.read(4096).decode("ascii", "replace")
            except OSError:
                continue
            invitation, key = _ENROLLED_WITH.search(text), _PUBLIC_KEY.search(text)
            if invitation is not None and key is not None:
                out[key.group(1).encode("ascii")] = invitation.group(1)
        return out

    def enrolled_keys(self) -> frozenset[bytes]:
        if not os.path.isdir(self.keys) or not any(
                n.endswith(security.PUBLIC_SUFFIX) for n in os.listdir(self.keys)):
            return frozenset()
        return security.load_allowed(self.keys, f"{self.flag} {self.dir}: keys")


def issue(store: Store, address: str, server_key: bytes, uses: int, expires_s: float, name: str,
          now: float) -> tuple[Invitation, str]:
    """Mint an invitation to the coordinator at `address` (the address workers dial): the
    record written, and the token. ConfigError with one line on a bad address or name."""
    check_invite(address, name)
    inv, secret = store.mint(uses, expires_s, name, now)
    return inv, token(address, server_key, inv, secret)


def check_invite(address: str, name: str) -> None:
    """ConfigError with one line unless workers can dial `address`, and `name` is a name."""
    security.check_address(address, "--coordinator")
    enrol_address(address)
    if "*" in address or "0.0.0.0" in address:
        raise ConfigError(f"--coordinator {address}: give the address workers dial, not a bind "
                          "address")
    if not NAME_RE.match(name):
        raise ConfigError(f"--name {name!r}: letters, digits, '.', '_' and '-', at most 64")


def peer_address(frame) -> str:
    """The source address of a received frame (ZeroMQ's Peer-Address), "?" when unknown."""
    try:
        return str(frame.get("Peer-Address"))[:64]
    except (AttributeError, zmq.ZMQError, TypeError, UnicodeDecodeError):
        return "?"


def token(coordinator: str, server_key: bytes, inv: Invitation, secret: str) -> str:
    return Token(coordinator, server_key, inv.id, secret).encode()


class Desk:
    """What the enrolment endpoint answers each message (no sockets: the store's files, and
    `owner`'s gate, counters and events)."""

    def __init__(self, owner, store: Store):
        self.owner, self.store = owner, store
        self.budget = RefusalBudget()

    def handle(self, frames: list, now: float) -> Optional[proto.Message]:
        """The answer to one received message (None: none). The token is checked before any
        budget: a valid one enrols however many forged ones are refused meanwhile."""
        from .transport import short, user_id

        key = user_id(frames[1]) if len(frames) > 1 else None
        source = peer_address(frames[1]) if len(frames) > 1 else "?"
        try:
            if len(frames) != 2:  # the routing id and one header: an enrol has no blob
                raise ProtocolError("frames", f"{len(frames) - 1} frames, an enrol is one")
            msg = proto.decode(frames[1:], max_bytes=ENROL_MAX_BYTES)
            if not isinstance(msg, proto.Enrol) or key is None:
                raise ProtocolError("unexpected", "only enrol is heard here")
        except ProtocolError as exc:
            return self._refuse(f"bad enrolment message: {exc}"[:200], key, now, source=source)
        inv = self.store.load(msg.invitation)
        used = self.store.used(msg.invitation)
        reason = judge(inv, used, msg.secret, now, self.store.revoked(msg.invitation))
        if reason is not None:
            return self._refuse(reason, key, now, msg.invitation, source)
        assert inv is not None  # judge refuses no invitation
        name = key_name(inv, used)
        self.store.enrol(inv, used, name, key)
        self.owner.gate.enrol(key, inv.id)
        self.owner.counters["enrolled"] += 1
        self.owner.training.event("enrolled", f"key {short(key)} enrolled as {name} with "
                                              f"invitation {inv.id} (use {used + 1} of {inv.uses})")
        return proto.Enrolled(ok=True, name=name)

    def _refuse(self, reason: str, key, now: float, inv_id: str = "?",
                source: str = "?") -> Optional[proto.Message]:
        counters = self.owner.counters
        verdict, wait_s = self.budget.charge(source, now)
        if verdict == DROP:
            counters["enrolments_dropped"] += 1
            return None
        if verdict != ANSWER:
            counters["enrolments_throttled"] += 1
            return proto.Enrolled(ok=False, reason=SourceLimit.told(source, wait_s))
        counters["enrolments_refused"] += 1
        # one line each: the window's overall bound (RefusalBudget) already caps how many
        who = key[:8].decode("ascii", "replace") + "..." if key else "?"
        self.owner.training.event("refused", f"enrolment of key {who} from {source} with "
                                             f"invitation {inv_id} refused: {reason}",
                                  level=logging.WARNING)
        return proto.Enrolled(ok=False, reason=reason)


class Endpoint:
    """The enrolment ROUTER of a running coordinator (`owner`: its gate, counters, events)."""

    def __init__(self, owner, store: Store):
        self.owner, self.store = owner, store
        self.desk = Desk(owner, store)
        self.connections = Connections(connection_cap())
        self.fds: dict[int, socket.socket] = {}  # ZeroMQ's fd of a connection: our duplicate
        self.address = enrol_address(owner.config.bind)
        self.ctx = zmq.asyncio.Context()
        from .transport import _authenticator  # any key may finish this handshake

        self.auth = _authenticator(self.ctx, lambda key: True)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, ENROL_MAX_BYTES)
        self.sock.setsockopt(zmq.LINGER, 200)
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, 5000)  # half-open connections are shed
        self.sock.curve_publickey, self.sock.curve_secretkey = owner.keypair
        self.sock.curve_server = True
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        try:
            self.sock.bind(self.address)
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError(f"cannot bind the enrolment endpoint {self.address}: {exc}") from None
        self.task = asyncio.ensure_future(self._serve())
        self.watch = asyncio.ensure_future(self._watch())

    async def _serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                reply = self.desk.handle(frames, time.time())
            except Exception as exc:  # never takes the coordinator down
                log.error("enrolment failed: %s", exc)
                reply = proto.Enrolled(ok=False, reason="the coordinator could not enrol the key")
            if reply is not None:
                await self.sock.send_multipart([frames[0], *proto.encode(reply)])

    # connections --------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Follow the connections through the monitor; cut those past their deadline, over
        their bytes or over the cap."""
        while True:
            try:
                # with nothing open there is no deadline to keep: wake for events only, mostly
                if await self.monitor.poll(int((WATCH_S if self.fds else 1.0) * 1000)):
                    while True:
                        self._event(await self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                pass
            except Exception as exc:  # never takes the coordinator down
                log.error("enrolment connections: %s", exc)
            now = time.monotonic()
            for fd in self.connections.due(now):
                self._cut(fd, "enrolment_connections_expired")
            for fd, sock in list(self.fds.items()):
                if self.connections.received(fd, _bytes_received(sock)):
                    self._cut(fd, "enrolment_connections_oversize")

    def _event(self, frames: list) -> None:
        event = zmq.utils.monitor.parse_monitor_message(frames)
        fd = event["value"]
        if event["event"] != zmq.EVENT_ACCEPTED:  # disconnected, closed: forget it
            self.connections.closed(fd)
            dup = self.fds.pop(fd, None)
            if dup is not None:
                dup.close()
            return
        try:
            dup = socket.socket(fileno=os.dup(fd))
        except OSError:  # no descriptor to spare: cut it through ZeroMQ's own
            _shut(fd)
            self.owner.counters["enrolment_connections_refused"] += 1
            return
        try:
            peer = dup.getpeername()
        except OSError:  # gone already
            dup.close()
            return
        self.fds[fd] = dup
        source = str(peer[0] if isinstance(peer, tuple) else peer or "local")[:64]
        for victim in self.connections.opened(fd, source, time.monotonic()):
            self._cut(victim, "enrolment_connections_refused")

    def _cut(self, fd: int, counter: str) -> None:
        self.owner.counters[counter] += 1
        dup = self.fds.pop(fd, None)
        if dup is not None:
            try:
                dup.shutdown(socket.SHUT_RDWR)  # ZeroMQ reads the end, closes its own fd
            except OSError:
                pass
            dup.close()

    def close(self) -> None:
        for name in ("task", "watch"):
            task = getattr(self, name, None)
            if task is not None:
                task.cancel()
        for dup in getattr(self, "fds", {}).values():
            dup.close()
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
        self.auth.stop()
        self.ctx.term()


def _bytes_received(sock: socket.socket) -> int:
    """What the connection has received in all (Linux's TCP_INFO); 0 where it cannot say."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except (OSError, AttributeError):
        return 0
    if len(info) < _TCP_INFO_BYTES_RECEIVED + 8:
        return 0
    return struct.unpack_from("Q", info, _TCP_INFO_BYTES_RECEIVED)[0]


def _shut(fd: int) -> None:
    """Shut down ZeroMQ's own descriptor `fd` without closing it (ZeroMQ closes it)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()


def start(owner) -> Optional[Endpoint]:
    """The enrolment endpoint of `owner` (a Coordinator), when it has --enrolled."""
    if not owner.config.enrolled:
        return None
    endpoint = Endpoint(owner, Store(owner.config.enrolled).prepare())
    owner.training.event("enrolment", f"enrolment by invitation on {endpoint.address} (keys under "
                              f"{endpoint.store.keys})")
    return endpoint
