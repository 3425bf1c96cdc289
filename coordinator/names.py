"""Which CURVE key holds which worker name, on disk, so that a name stays its first key's across
restarts: one small JSON file, `names.json`, mapping each worker name to the key (Z85) that first
said hello under it. It lives where the bans do (bans.py: the --enrolled folder, else the
checkpoint folder); with neither a name is bound until the coordinator stops. Written whole at
each new binding (common/atomic.py); at most MAX_NAMES are kept, the least recently used
forgotten first; the decisions are the gate's. Without keys nothing is bound:
a name is then not authenticated at all (docs/architecture.md, "Threat model").
"""

from __future__ import annotations

from typing import Optional

from . import kept_maps

FILENAME = "names.json"
# Bindings kept, the least recently used forgotten first: a worker's default name (HOST-PID) is
# new at each start, and the file must not grow for ever (nor past what `load` reads back).
MAX_NAMES = 100_000
MAX_BYTES = 64 * 1024 * 1024


def path_for(enrolled: Optional[str], checkpoint_dir: Optional[str]) -> Optional[str]:
    return kept_maps.path_for(FILENAME, enrolled, checkpoint_dir)


def load(path: Optional[str]) -> dict[str, bytes]:
    """The bindings saved at `path` (none when there is no file); ConfigError with one line
    when the file is not what `save` writes: a lost binding would let another key take a name."""
    names = kept_maps.load(path, "names", "name list", MAX_BYTES, valid=lambda key: len(key) == 40,
                           rule="worker names to 40-character keys")
    return {name: key.encode("ascii") for name, key in names.items()}


def save(path: str, names: dict[str, bytes]) -> None:
    # in the gate's order (the least recently used first), which `load` keeps
    kept_maps.save(path, "names", {name: key.decode("ascii") for name, key in names.items()},
                   sort_keys=False)
