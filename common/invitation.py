"""Invitation tokens: what `idlegrad invite` prints and `idlegrad worker join` reads. Pure.

A token is `idlegrad-invite:` and base64url of a small JSON object: the coordinator's address,
its public key (Z85), the invitation's id and its one-time enrolment secret. Nothing secret of
the coordinator's: the coordinator keeps only a hash of the secret.

Enrolment has its own endpoint, beside the training one: the training endpoint still refuses
the handshake of every unlisted key, and the enrolment endpoint (any key may finish its
handshake there) hears only `enrol`. Its address is the training address's port plus one
(`enrol_address`), so a token names one address.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass

from .errors import ConfigError

PREFIX = "idlegrad-invite:"
MAX_TOKEN = 1024
ID_RE = re.compile(r"^[0-9a-f]{16}$")
SECRET_RE = re.compile(r"^[A-Za-z0-9_-]{43}$")  # 32 random bytes, base64url without padding
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class Token:
    coordinator: str  # the training address, tcp://HOST:PORT
    server_key: bytes  # Z85, 40 characters
    id: str  # 16 hex digits
    secret: str  # 43 base64url characters

    def encode(self) -> str:
        body = json.dumps({"c": self.coordinator, "k": self.server_key.decode("ascii"),
                           "i": self.id, "s": self.secret}, separators=(",", ":"))
        return PREFIX + base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")


def parse(text: str) -> Token:
    """A token, or ConfigError with one line."""
    bad = "not an invitation token (it starts with " + PREFIX + "; copy the whole line)"
    text = (text or "").strip()
    if not text.startswith(PREFIX) or len(text) > MAX_TOKEN:
        raise ConfigError(bad)
    body = text[len(PREFIX):]
    try:
        data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise ConfigError(bad + ": damaged") from None
    if not isinstance(data, dict) or set(data) != {"c", "k", "i", "s"} or not all(
            isinstance(v, str) for v in data.values()):
        raise ConfigError(bad + ": damaged")
    if not ID_RE.match(data["i"]) or not SECRET_RE.match(data["s"]) or len(data["k"]) != 40:
        raise ConfigError(bad + ": damaged")
    enrol_address(data["c"])  # an address it can use
    return Token(data["c"], data["k"].encode("ascii"), data["i"], data["s"])


def enrol_address(address: str) -> str:
    """The enrolment endpoint beside the training `address`: the next port (ConfigError with one
    line when `address` is no tcp://HOST:PORT)."""
    transport, sep, rest = str(address).partition("://")
    host, colon, port = rest.rpartition(":")
    if transport != "tcp" or not sep or not colon or not host:
        raise ConfigError(f"invitations need a tcp://HOST:PORT address, not {address!r}")
    if port == "*":
        raise ConfigError(f"invitations need a fixed port, not {address!r}")
    if not (port.isdigit() and 1 <= int(port) <= 65534):
        raise ConfigError(f"{address!r}: port {port!r} is not a number from 1 to 65534")
    return f"{transport}://{host}:{int(port) + 1}"


def digest(secret: str) -> str:
    """What the coordinator keeps of a secret (32 random bytes: a plain hash is enough)."""
    return hashlib.sha256(secret.encode("ascii")).hexdigest()
