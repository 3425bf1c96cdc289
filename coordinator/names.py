"""Which CURVE key holds which worker name, on disk, so that a name stays its first key's across
restarts: one small JSON file, `names.json`, mapping each worker name to the key (Z85) that first
said hello under it. It lives where the bans do (bans.py: the --enrolled folder, else the
checkpoint folder); with neither a name is bound until the coordinator stops. Written whole at
each new binding (common/atomic.py); at most MAX_NAMES are kept, the least recently used
forgotten first; the decisions are the gate's. Without keys nothing is bound:
a name is then not authenticated at all (docs/architecture.md, "Threat model").
"""

from __future__ import annotations

import json
import os
from typing import Optional

from ..common import atomic
from ..common.errors import ConfigError

FILENAME = "names.json"
# Bindings kept, the least recently used forgotten first: a worker's default name (HOST-PID) is
# new at each start, and the file must not grow for ever (nor past what `load` reads back).
MAX_NAMES = 100_000
MAX_BYTES = 64 * 1024 * 1024


def path_for(enrolled: Optional[str], checkpoint_dir: Optional[str]) -> Optional[str]:
    folder = enrolled or checkpoint_dir
    return os.path.join(folder, FILENAME) if folder else None


def load(path: Optional[str]) -> dict[str, bytes]:
    """The bindings saved at `path` (none when there is no file); ConfigError with one line
    when the file is not what `save` writes: a lost binding would let another key take a name."""
    if path is None or not os.path.exists(path):
        return {}
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(MAX_BYTES))
        names = data["names"]
        if not isinstance(names, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and len(v) == 40
                for k, v in names.items()):
            raise ValueError("names must map worker names to 40-character keys")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: not a name list ({exc}); fix or remove it"[:300]) from None
    return {name: key.encode("ascii") for name, key in names.items()}


def save(path: str, names: dict[str, bytes]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    text = {name: key.decode("ascii") for name, key in names.items()}
    # in the gate's order (the least recently used first), which `load` keeps
    atomic.write_bytes(path, json.dumps({"names": text}, indent=0).encode())
