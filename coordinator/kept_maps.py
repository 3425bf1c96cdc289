"""The coordinator's small maps kept on disk across restarts (bans.py, names.py): one JSON file
each, `{FIELD: {string: string}}`, beside the enrolled keys (`--enrolled DIR`), else in the
checkpoint folder; with neither, a map lives until the coordinator stops. Written whole at every
change (common/atomic.py). A file that is not what `save` wrote stops the coordinator with one
line: a lost ban or binding would admit whom it kept out.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

from ..common import atomic
from ..common.errors import ConfigError


def path_for(filename: str, enrolled: Optional[str],
             checkpoint_dir: Optional[str]) -> Optional[str]:
    folder = enrolled or checkpoint_dir
    return os.path.join(folder, filename) if folder else None


def load(path: Optional[str], field: str, kind: str, max_bytes: int,
         valid: Callable[[str], bool] = lambda value: True,
         rule: str = "strings to strings") -> dict[str, str]:
    """The map saved at `path` under `field` (empty when there is no file); ConfigError naming
    the file as not a `kind` when it is not what `save` writes, or a value fails `valid`
    (`rule` says what the map must hold)."""
    if path is None or not os.path.exists(path):
        return {}
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(max_bytes))
        mapping = data[field]
        if not isinstance(mapping, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and valid(v)
                for k, v in mapping.items()):
            raise ValueError(f"{field} must map {rule}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: not a {kind} ({exc}); fix or remove it"[:300]) from None
    return mapping


def save(path: str, field: str, mapping: dict[str, str], sort_keys: bool) -> None:
    """`mapping` under `field` at `path`, atomically; `sort_keys` False keeps its order."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic.write_bytes(path, json.dumps({field: mapping}, indent=1 if sort_keys else 0,
                                        sort_keys=sort_keys).encode())
