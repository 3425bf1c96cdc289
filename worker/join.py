"""`idlegrad worker join TOKEN`: the volunteer's one command. Makes this worker's CURVE key pair
(or keeps the one beside the configuration file), enrols its public key with the coordinator's
enrolment endpoint using the token's one-time secret, and writes worker.toml (the coordinator's
address, its pinned public key, this worker's key pair and the name the coordinator gave it), so
that a bare `idlegrad worker` (or the service) runs with it.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Optional

from ..common import atomic, security
from ..common import protocol as proto
from ..common.errors import ConfigError, IdlegradError, ProtocolError
from ..common.invitation import Token, enrol_address, parse

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

KEY_NAME = "worker"
COORDINATOR_KEY = "coordinator" + security.PUBLIC_SUFFIX


class InvitationRefused(IdlegradError):
    """The coordinator answered, and refused the invitation (used up, expired, revoked, forged)."""


def enrol(token: Token, keys: security.ClientKeys, timeout_s: float) -> str:
    """The worker name the coordinator enrolled `keys` under; IdlegradError with one line."""
    import zmq

    address = enrol_address(token.coordinator)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 4096)
        keys.apply(sock)
        sock.connect(address)
        sock.send_multipart(proto.encode(proto.Enrol(invitation=token.id, secret=token.secret)))
        if not sock.poll(int(timeout_s * 1000)):
            raise IdlegradError(f"no answer from the coordinator's enrolment endpoint {address} "
                                f"within {timeout_s:g}s (is it running with --enrolled, and is "
                                "this the token it printed?)")
        reply = proto.decode(sock.recv_multipart())
    except ProtocolError as exc:
        raise IdlegradError(f"the enrolment endpoint {address} answered nonsense: {exc}") from None
    finally:
        sock.close(0)
        ctx.term()
    if not isinstance(reply, proto.Enrolled):
        raise IdlegradError(f"the enrolment endpoint {address} answered {reply.TYPE}")
    if not reply.ok:
        raise InvitationRefused(f"the coordinator refused the invitation: {reply.reason}")
    if not NAME_RE.match(reply.name):
        raise IdlegradError(f"the coordinator named this worker {reply.name[:40]!r}: not a name")
    return reply.name


def _keypair(directory: str) -> tuple[str, bytes, bytes, bool]:
    secret_path = os.path.join(directory, KEY_NAME + security.SECRET_SUFFIX)
    made = not os.path.exists(secret_path)
    if made:
        security.generate(KEY_NAME, directory)
    public, secret = security.load_keypair(secret_path, "this worker's key")
    return secret_path, public, secret, made


def join(text: str, config_path: str, timeout_s: float = 20.0) -> list[str]:
    """What `worker join` prints, line by line; ConfigError or IdlegradError with one line."""
    from .config import _toml_value

    token = parse(text)
    config_path = os.path.abspath(config_path)
    if os.path.exists(config_path):
        raise ConfigError(f"{config_path} exists: remove it, or give --config another file")
    directory = os.path.dirname(config_path)
    secret_path, public, secret, made = _keypair(directory)
    try:
        name = enrol(token, security.ClientKeys(token.server_key, public, secret), timeout_s)
    except InvitationRefused:
        if made:  # a key pair no coordinator knows, that nothing will use: not left behind
            for path in (secret_path, secret_path[:-len(security.SECRET_SUFFIX)]
                         + security.PUBLIC_SUFFIX):
                with contextlib.suppress(OSError):
                    os.remove(path)
        raise
    coordinator_key = os.path.join(directory, COORDINATOR_KEY)
    try:
        atomic.write_bytes(coordinator_key, security.public_key_text(
            token.server_key, f"coordinator {token.coordinator}"))
        settings = {"coordinator": token.coordinator, "coordinator_key": coordinator_key,
                    "secret_key": secret_path, "id": name}
        body = "".join(f"{k} = {_toml_value(v)}\n" for k, v in settings.items())
        atomic.write_text(config_path,
                          f"# written by `idlegrad worker join`: enrolled as {name}\n" + body)
    except OSError as exc:
        raise ConfigError(f"enrolled as {name}, but cannot write {config_path}: "
                          f"{exc.strerror or exc}") from None
    return [f"{'made' if made else 'kept'} this worker's key pair {secret_path}",
            f"enrolled with {token.coordinator} as {name}",
            f"wrote {config_path}: run `idlegrad worker` (it reads this file)"]


def default_config(config: Optional[str]) -> str:
    from .config import default_path

    return config or default_path()
