"""Atomic checkpoints (common/atomic.py: a temporary file, fsync, rename over the old one, fsync
the folder).

A reader sees the old checkpoint or the new one, never half of one. Loading uses
`torch.load(weights_only=True)`: a checkpoint holds tensors and plain containers, no pickled code.

A crash mid-save leaves its temporary file behind, as large as a checkpoint; load and save remove
such orphans: regular files named as `save` names its temporary files, and none that a save in
this process is still writing.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
from typing import Any, Optional

import torch

from ..common import atomic
from ..common.errors import CheckpointError

FILENAME = "checkpoint.pt"
FORMAT = 1
TMP_PREFIX, TMP_SUFFIX = ".checkpoint-", ".tmp"
# atomic.writing's names (hex digits between), and mkstemp's of earlier versions
TMP_NAME = re.compile(re.escape(TMP_PREFIX) + r"[A-Za-z0-9_]+" + re.escape(TMP_SUFFIX))

_being_written: set[str] = set()  # this process's temporary files, from creation to rename
_being_written_lock = threading.Lock()


def path_in(directory: str) -> str:
    return os.path.join(directory, FILENAME)


def save(directory: str, state: dict[str, Any]) -> str:
    os.makedirs(directory, exist_ok=True)
    remove_orphans(directory)
    target = path_in(directory)
    writing: list[str] = []
    with contextlib.ExitStack() as stack:
        stack.callback(_written, writing)  # after the rename: until then the file is ours
        with _being_written_lock:  # claimed before remove_orphans can see it
            fh = stack.enter_context(atomic.writing(target, TMP_PREFIX, TMP_SUFFIX, mode=0o600))
            writing.append(os.path.abspath(fh.name))
            _being_written.add(writing[0])
        torch.save({"format": FORMAT, **state}, fh)
    return target


def _written(writing: list[str]) -> None:
    with _being_written_lock:
        _being_written.difference_update(writing)


def load(directory: str) -> Optional[dict[str, Any]]:
    """The checkpoint in `directory`, or None when there is none yet."""
    remove_orphans(directory)
    target = path_in(directory)
    if not os.path.exists(target):
        return None
    try:
        state = torch.load(target, map_location="cpu", weights_only=True)
    except Exception as exc:
        detail = " ".join(str(exc).split())  # torch's messages span lines; the CLI prints one
        raise CheckpointError(f"cannot read checkpoint {target}: {type(exc).__name__}: {detail}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{target} is not an idlegrad checkpoint of format {FORMAT}")
    return state


def remove_orphans(directory: str) -> list[str]:
    """Remove the temporary files that saves interrupted by a crash left in `directory`; return
    their paths. A file that cannot be removed is left for the next time."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for name in names:
        if not TMP_NAME.fullmatch(name):
            continue
        path = os.path.abspath(os.path.join(directory, name))
        with _being_written_lock:  # held while unlinking: a save cannot claim the name meanwhile
            if path in _being_written:
                continue
            try:
                if not stat.S_ISREG(os.lstat(path).st_mode):
                    continue
                os.unlink(path)
            except OSError:
                continue
        removed.append(path)
    return removed
