"""Atomic checkpoints: write to a temporary file, fsync, rename over the old one, fsync the folder.

A reader sees the old checkpoint or the new one, never half of one. Loading uses
`torch.load(weights_only=True)`: a checkpoint holds tensors and plain containers, no pickled code.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Optional

import torch

from ..common.errors import CheckpointError

FILENAME = "checkpoint.pt"
FORMAT = 1


def path_in(directory: str) -> str:
    return os.path.join(directory, FILENAME)


def save(directory: str, state: dict[str, Any]) -> str:
    os.makedirs(directory, exist_ok=True)
    target = path_in(directory)
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save({"format": FORMAT, **state}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


def load(directory: str) -> Optional[dict[str, Any]]:
    """The checkpoint in `directory`, or None when there is none yet."""
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
