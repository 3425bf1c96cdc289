"""Status sources: where a monitor gets coordinator snapshots from.

`ZmqStatusSource` asks a coordinator over its ROUTER socket (a DEALER of its own; no HELLO, since
a monitor is not a worker). It is blocking and light: no torch, so front ends start instantly.
"""

from __future__ import annotations

import time
from typing import Optional

import zmq

from ..common import protocol as proto
from ..common.errors import ProtocolError


class ZmqStatusSource:
    def __init__(self, address: str, context: Optional[zmq.Context] = None):
        self.address = address
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._sock: Optional[zmq.Socket] = None
        self.cursor = 0

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, proto.SOCKET_MAX_MSG_BYTES)
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def fetch(self, timeout: float = 1.0) -> Optional[dict]:
        """One snapshot (events since the last one), or None when the coordinator did not answer.

        An unanswered request drops the socket, so a late reply cannot be taken for the next one.
        """
        sock = self._socket()
        sock.send_multipart(proto.encode(proto.StatusRequest(cursor=self.cursor)))
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                break
            try:
                msg = proto.decode(sock.recv_multipart())
            except ProtocolError:
                continue
            if isinstance(msg, proto.Status):
                self.cursor = int(msg.snapshot.get("cursor", self.cursor))
                return msg.snapshot
        self._drop()
        return None

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def close(self) -> None:
        self._drop()
        if self._own_context:
            self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
