"""The operator's bans on disk, so that a ban holds across restarts: one small JSON file,
`bans.json`, mapping each banned identity (a worker's key, or its worker id without keys) to
the name it was banned under. It lives beside the enrolled keys (`--enrolled DIR`), else in the
checkpoint folder; with neither a ban holds until the coordinator stops. Written whole at every
change (common/atomic.py); the decisions are the gate's.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from ..common import atomic
from ..common.errors import ConfigError

FILENAME = "bans.json"
MAX_BYTES = 16 * 1024 * 1024


def path_for(enrolled: Optional[str], checkpoint_dir: Optional[str]) -> Optional[str]:
    folder = enrolled or checkpoint_dir
    return os.path.join(folder, FILENAME) if folder else None


def load(path: Optional[str]) -> dict[str, str]:
    """The bans saved at `path` (none when there is no file); ConfigError with one line when
    the file is not what `save` writes: an unreadable ban list must not admit the banned."""
    if path is None or not os.path.exists(path):
        return {}
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(MAX_BYTES))
        bans = data["bans"]
        if not isinstance(bans, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in bans.items()):
            raise ValueError("bans must map strings to strings")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: not a ban list ({exc}); fix or remove it"[:300]) from None
    return bans


def save(path: str, bans: dict[str, str]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic.write_bytes(path, json.dumps({"bans": bans}, indent=1, sort_keys=True).encode())
