"""Status sources: where a monitor gets coordinator snapshots from.

`ZmqStatusSource` asks a coordinator over its ROUTER socket (a DEALER of its own; no HELLO, since
a monitor is not a worker). It is blocking and light: no torch, so front ends start instantly.
"""

from __future__ import annotations

import threading
import time
from typing import Optional, Protocol, runtime_checkable

import zmq

from ..common import protocol as proto
from ..common.errors import ProtocolError
from ..common.security import ClientKeys


@runtime_checkable
class StatusSource(Protocol):
    """What the monitor reads: snapshots, and a channel for the operator's commands.

    Both calls may block (for at most about `timeout` seconds); the UI calls them off its loop.
    """

    address: str

    def fetch(self, timeout: float = 1.0) -> Optional[dict]:
        """One snapshot (events since the previous one), or None when nobody answered."""

    def control(self, action: str, worker: Optional[str] = None,
                timeout: float = 2.0) -> tuple[bool, str]:
        """Send pause / resume / drain; (done?, one line saying what happened)."""


class ZmqStatusSource:
    """The real status source. Thread-safe: calls are serialised on one socket.

    When the coordinator restarts (its `instance` changes), the event cursor starts again from 0 and
    `restarted` is set to True until the next snapshot.
    """

    def __init__(self, address: str, context: Optional[zmq.Context] = None,
                 keys: Optional[ClientKeys] = None):
        self.address = address
        self.keys = keys  # CURVE: the coordinator's pinned key and this monitor's pair
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._sock: Optional[zmq.Socket] = None
        self._lock = threading.Lock()
        self.cursor = 0
        self.instance: Optional[str] = None
        self.restarted = False
        # The coordinator's reason when it refused the last request (a key without the role
        # to read the status): data from the network, shown as text only.
        self.refused: Optional[str] = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, proto.SOCKET_MAX_MSG_BYTES)
            if self.keys is not None:
                self.keys.apply(sock)
            try:
                sock.connect(self.address)
            except zmq.ZMQError:
                sock.close(0)  # an open socket would hold the context's term() forever
                raise
            self._sock = sock
        return self._sock

    def fetch(self, timeout: float = 1.0) -> Optional[dict]:
        """One snapshot (events since the last one), or None when the coordinator did not answer.

        An unanswered request drops the socket, so a late reply cannot be taken for the next one.
        """
        with self._lock:
            end = time.monotonic() + timeout
            msg = self._ask(proto.StatusRequest(cursor=self.cursor), proto.Status, end)
            if msg is None:
                return None
            snap = msg.snapshot
            instance = snap.get("instance")
            self.restarted = self.instance is not None and instance != self.instance
            if self.restarted and self.cursor:
                # A new coordinator process numbers its events from 1 again: ask from the start.
                again = self._ask(proto.StatusRequest(cursor=0), proto.Status, end)
                snap = again.snapshot if again is not None else snap
            self.instance = instance
            cursor = snap.get("cursor", self.cursor)
            self.cursor = cursor if isinstance(cursor, int) and cursor >= 0 else self.cursor
            return snap

    def control(self, action: str, worker: Optional[str] = None,
                timeout: float = 2.0, invitation: Optional[str] = None) -> tuple[bool, str]:
        """Ask the coordinator to pause, resume, drain, ban or unban `worker`, or revoke
        `invitation`; (done?, what happened)."""
        with self._lock:
            try:
                request = proto.Control(action=action, worker=worker, invitation=invitation)
                proto.decode(proto.encode(request))  # the coordinator's checks, before sending
            except ProtocolError as exc:
                return False, f"invalid command: {exc}"
            reply = self._ask(request, proto.ControlReply, time.monotonic() + timeout)
            if reply is None:
                return False, f"the coordinator at {self.address} did not answer within {timeout:g}s"
            return reply.ok, reply.detail

    def ask(self, request: proto.Message, kind: type, timeout: float = 2.0):
        """Send `request` and return the coordinator's answer of type `kind`; None when it did
        not answer in time or refused (`refused` then says why)."""
        with self._lock:
            return self._ask(request, kind, time.monotonic() + timeout)

    def _ask(self, request: proto.Message, kind: type, end: float):
        sock = self._socket()
        sock.send_multipart(proto.encode(request))
        while (left := end - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                break
            try:
                msg = proto.decode(sock.recv_multipart())
            except ProtocolError:
                continue
            if isinstance(msg, kind):
                self.refused = None
                return msg
            if isinstance(msg, proto.Reject) and msg.code == "role":
                self.refused = msg.reason
                return None
        self._drop()
        return None

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()
        if self._own_context:
            self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
