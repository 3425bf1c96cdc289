"""The coordinator's ZeroMQ glue: its ROUTER socket, the CurveZMQ authenticator, and the fast
paths for sending and draining messages. No decisions: who may connect is the gate's
(gate.py), what to send the round core's (rounds.py)."""

from __future__ import annotations

import logging
from typing import Callable, Optional

import zmq
import zmq.asyncio

from ..common import protocol as proto
from ..common.errors import ConfigError

HANDSHAKE_S = 5.0  # a connection that has not finished its handshake by then is dropped

_send_frame = zmq.backend.Socket.send  # (socket, data, flags, copy, track): one frame, no checks
_recv_frame = zmq.backend.Socket.recv  # (socket, flags, copy): one frame, no checks
_MORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)


class ZmqTransport:
    """The bound ROUTER. While a received batch is handled no receive is pending, so sending and
    draining through a plain (blocking-API) view of the socket cannot swallow the wake-up
    asyncio waits for, and skips a Future per message; a ROUTER's send never blocks (it drops at
    the high-water mark), so it never stalls the loop."""

    def __init__(self, bind: str, keypair: Optional[tuple[bytes, bytes]] = None,
                 allow: Optional[Callable[[bytes], bool]] = None):
        """`keypair` and `allow` (the ZAP decision for a client key): CurveZMQ."""
        self.ctx = zmq.asyncio.Context()
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, proto.SOCKET_MAX_MSG_BYTES)
        sock.setsockopt(zmq.LINGER, 500)  # let SHUTDOWNs flush, but never hold the exit long
        # No handover: a peer that says the routing id of a connection already here is ignored
        # (libzmq drops it), rather than taking that connection over. With handover, any
        # listed key naming a peer's routing id (libzmq's own are a counter: guessable) would
        # cut that peer off. Workers choose no routing id: each connection gets a fresh one.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        # Half-open connections are shed: a peer that has not finished the ZMTP (and CURVE)
        # handshake within this long is dropped, and TCP keepalives find peers that vanished.
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 60)
        self.sock = sock
        self.auth = None
        try:
            if keypair is not None:
                self.auth = _authenticator(self.ctx, allow)
                sock.curve_publickey, sock.curve_secretkey = keypair
                sock.curve_server = True
            sock.bind(bind)
        except zmq.ZMQError as exc:
            self.close(0)
            raise ConfigError(f"cannot bind {bind}: {exc}") from None
        except BaseException:
            self.close(0)
            raise
        self.direct = zmq.Socket.shadow(sock.underlying)
        self.handling = False

    def receive(self):
        """A future of the next message's frames."""
        return self.sock.recv_multipart(copy=False)

    def waiting(self) -> list:
        """The next whole message already queued (zmq.Again if none), frame by frame: pyzmq's
        recv_multipart asks the socket for RCVMORE through its option machinery, more than half
        the cost of a small message. The parts of a message arrive together, so only the first
        receive can find nothing."""
        frame = _recv_frame(self.direct, _NOBLOCK, False)
        frames = [frame]
        while frame.more:
            frame = _recv_frame(self.direct, _NOBLOCK, False)
            frames.append(frame)
        return frames

    async def send(self, route: bytes, frames: list, track: bool):
        if self.handling:
            # pyzmq's send_multipart adds per-frame checks and enum arithmetic: a third of the
            # cost of a small message
            _send_frame(self.direct, route, _MORE)
            for frame in frames[:-1]:
                _send_frame(self.direct, frame, _MORE, not track, track)
            return _send_frame(self.direct, frames[-1], 0, not track, track)
        return await self.sock.send_multipart([route, *frames], copy=not track, track=track)

    def close(self, linger: Optional[int] = None) -> None:
        self.sock.close(linger)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


def _authenticator(ctx, allow: Callable[[bytes], bool]):
    """ZAP through pyzmq's asyncio authenticator, asking `allow` about every handshake. Fails
    closed: a handshake nobody answers never completes."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    class Policy:
        def callback(self, domain, key: bytes) -> bool:
            return allow(key)

    auth = AsyncioAuthenticator(ctx, log=logging.getLogger("idlegrad.coordinator.auth"))
    try:
        auth.start()
        auth.configure_curve_callback("*", credentials_provider=Policy())
    except Exception as exc:
        auth.stop()
        raise ConfigError(f"cannot start the CURVE authenticator: {exc}") from None
    return auth


def user_id(frame) -> Optional[bytes]:
    """The peer's CURVE public key (Z85), which the authenticator made the message's User-Id."""
    try:
        return frame.get("User-Id").encode("ascii")
    except (zmq.ZMQError, AttributeError, UnicodeError):
        return None


def short(key: bytes) -> str:
    return key[:8].decode("ascii", errors="replace") + "..."
