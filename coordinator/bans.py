"""The operator's bans on disk, so that a ban holds across restarts: one small JSON file,
`bans.json`, mapping each banned identity (a worker's key, or its worker id without keys) to
the name it was banned under. It lives beside the enrolled keys (`--enrolled DIR`), else in the
checkpoint folder; with neither a ban holds until the coordinator stops. Written whole at every
change (common/atomic.py); the decisions are the gate's.
"""

from __future__ import annotations

from typing import Optional

from . import kept_maps

FILENAME = "bans.json"
MAX_BYTES = 16 * 1024 * 1024


def path_for(enrolled: Optional[str], checkpoint_dir: Optional[str]) -> Optional[str]:
    return kept_maps.path_for(FILENAME, enrolled, checkpoint_dir)


def load(path: Optional[str]) -> dict[str, str]:
    """The bans saved at `path` (none when there is no file); ConfigError with one line when
    the file is not what `save` writes: an unreadable ban list must not admit the banned."""
    return kept_maps.load(path, "bans", "ban list", MAX_BYTES)


def save(path: str, bans: dict[str, str]) -> None:
    kept_maps.save(path, "bans", bans, sort_keys=True)
