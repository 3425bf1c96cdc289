"""CurveZMQ keys: the files pyzmq's `zmq.auth` writes, and applying them to sockets.

A key pair is two files, as `zmq.auth.create_certificates` writes them: `NAME.key` (the public key,
safe to hand out: it goes into a coordinator's --allow-keys directory or a worker's
--coordinator-key) and `NAME.key_secret` (the public and the secret key: it never leaves its
machine). Keys travel as Z85 text, which is also what the coordinator sees as a peer's User-Id.

Without keys the coordinator listens on loopback only, unless the operator says --insecure:
`is_loopback` is the address check. Pure but for reading and writing the key files.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass
from typing import Optional

from .errors import ConfigError

log = logging.getLogger("idlegrad.security")

# With CURVE a refused handshake looks like silence to the client: the coordinator never answers.
KEYS_HINT = ("; with keys: is --coordinator-key the coordinator's, and is this side's public key "
             "in its --allow-keys?")
# ... and for a monitor, whose key belongs in --monitor-keys or --operator-keys; without keys a
# coordinator that has them is silence too
MONITOR_KEYS_HINT = ("; with keys: is --coordinator-key the coordinator's, and is this side's "
                     "public key in its --monitor-keys or --operator-keys?")
NO_KEYS_HINT = "; a coordinator with keys answers only --coordinator-key and --secret-key"

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"


def generate(name: str, directory: str = ".") -> tuple[str, str]:
    """Write NAME.key and NAME.key_secret into `directory`; (public path, secret path).

    Refuses to overwrite an existing pair: a replaced secret silently locks out its holder.
    """
    import zmq.auth

    if not name or os.sep in name or name in (".", "..") or (os.altsep and os.altsep in name):
        raise ConfigError(f"key name {name!r} must be a plain file name")
    public = os.path.join(directory, name + PUBLIC_SUFFIX)
    secret = os.path.join(directory, name + SECRET_SUFFIX)
    for path in (public, secret):
        if os.path.exists(path):
            raise ConfigError(f"{path} exists; remove it first or choose another name")
    try:
        os.makedirs(directory, exist_ok=True)
        # The secret half is readable by its owner alone from the moment it exists; the public
        # half is meant to be copied around, so it is made as the user's umask says.
        umask = os.umask(0o077)
        try:
            public, secret = zmq.auth.create_certificates(directory, name)
        finally:
            os.umask(umask)
        os.chmod(public, 0o666 & ~umask)
    except OSError as exc:
        raise ConfigError(f"cannot write keys into {directory}: {exc.strerror or exc}") from None
    return public, secret


def public_key_text(key: bytes, note: str = "") -> bytes:
    """A NAME.key file's text holding the Z85 public `key`, as `zmq.auth` writes and reads it."""
    comment = f"#   {note}\n" if note else ""
    return (f"#   ****  idlegrad public key: safe to share  ****\n{comment}metadata\ncurve\n"
            f"    public-key = \"{key.decode('ascii')}\"\n").encode("ascii")


def _load(path: str, what: str) -> tuple[Optional[bytes], Optional[bytes]]:
    import zmq.auth

    if not os.path.isfile(path):
        raise ConfigError(f"{what} {path}: no such file")
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError, KeyError, IndexError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {path}: not a key file ({exc})"[:300]) from None


def load_public(path: str, what: str = "public key") -> bytes:
    """The Z85 public key in `path` (a NAME.key or a NAME.key_secret file)."""
    public, _ = _load(path, what)
    if not public or len(public) != 40:
        raise ConfigError(f"{what} {path}: holds no public key")
    return public


def load_keypair(path: str, what: str = "--secret-key") -> tuple[bytes, bytes]:
    """(public, secret), Z85, from a NAME.key_secret file."""
    public, secret = _load(path, what)
    if not public or not secret or len(public) != 40 or len(secret) != 40:
        raise ConfigError(f"{what} {path}: holds no secret key (give the NAME{SECRET_SUFFIX} file)")
    return public, secret


def load_allowed(directory: str, flag: str = "--allow-keys",
                 empty_ok: bool = False) -> frozenset[bytes]:
    """The Z85 public keys of every NAME.key file in `directory` (a key folder: `flag` is the
    option that named it, for the messages). `empty_ok`: an empty folder is expected (keys come
    by invitation), not warned of."""
    import zmq.auth

    if not os.path.isdir(directory):
        raise ConfigError(f"{flag} {directory}: no such directory")
    try:
        keys = frozenset(zmq.auth.load_certificates(directory))
        secrets = sorted(n for n in os.listdir(directory) if n.endswith(SECRET_SUFFIX))
    except (OSError, ValueError, KeyError, IndexError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag} {directory}: unreadable key file ({exc})"[:300]) from None
    if secrets:
        log.warning("%s %s holds secret keys (%s): only the public NAME%s files belong there, "
                    "and a secret key is not one", flag, directory, ", ".join(secrets[:3]),
                    PUBLIC_SUFFIX)
    if not keys and not empty_ok:
        log.warning("%s %s holds no NAME%s file: no key holds its role until one is added "
                    "(then send SIGHUP)", flag, directory, PUBLIC_SUFFIX)
    return keys


@dataclass(frozen=True)
class ClientKeys:
    """What a worker or monitor needs to talk to a CURVE coordinator."""

    server_public: bytes  # pinned: a coordinator without the matching secret cannot answer
    public: bytes
    secret: bytes

    def apply(self, sock) -> None:
        """Make `sock` (before connect) a CURVE client."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def client_keys(coordinator_key: Optional[str], secret_key: Optional[str]) -> Optional[ClientKeys]:
    """Both files or neither: ClientKeys, or None for a plain (loopback) coordinator."""
    if coordinator_key is None and secret_key is None:
        return None
    if coordinator_key is None or secret_key is None:
        raise ConfigError("--coordinator-key and --secret-key go together: give both or neither")
    public, secret = load_keypair(secret_key)
    return ClientKeys(load_public(coordinator_key, "--coordinator-key"), public, secret)


def check_address(address: str, flag: str, bind: bool = False) -> str:
    """`address` if ZeroMQ can use it, else ConfigError naming `flag` in one line: tcp://HOST:PORT
    (PORT 1-65535; `*` to bind any free one), ipc://PATH or inproc://NAME. ZeroMQ itself would
    take port 99999 as 34463, and a connect to no address at all fails only when tried."""
    example = "tcp://127.0.0.1:5555"
    transport, sep, rest = str(address).partition("://")
    if not sep or not rest:
        raise ConfigError(f"{flag} {address!r} is not a ZeroMQ address like {example}")
    if transport in ("ipc", "inproc"):
        return address
    if transport not in ("tcp", "ws"):
        raise ConfigError(f"{flag} {address!r}: transport {transport!r} unknown: use tcp://, "
                          "ipc:// or inproc://")
    host, colon, port = rest.split("/", 1)[0].rpartition(":")
    if not colon or not host:
        raise ConfigError(f"{flag} {address!r} has no host:port, like {example}")
    if bind and port == "*":
        return address
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(f"{flag} {address!r}: port {port!r} is not a number from 1 to 65535")
    return address


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ bind address only listens on this machine (ipc:// and inproc:// too).

    Interface names and wildcards (tcp://*:5555, tcp://eth0:5555, tcp://0.0.0.0:5555) are not.
    """
    transport, sep, rest = address.partition("://")
    if not sep:
        return False
    if transport in ("ipc", "inproc"):
        return True
    if transport not in ("tcp", "ws"):
        return False
    host = rest.split("/", 1)[0]
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else ""
    else:
        host = host.rsplit(":", 1)[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
