"""Files written whole or not at all: a temporary file in the same folder, fsynced, renamed over
the target (`os.replace`, atomic within a file system), and the folder fsynced so that the rename
itself survives a crash. A reader, or a process started after a crash, sees the old file or the
new one, never a part.

`write_bytes` and `write_text` write what is in hand; `writing` is the streaming form, for what
is written piece by piece (a checkpoint). The temporary file is removed when the write fails.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import BinaryIO, Iterator


@contextlib.contextmanager
def writing(path: str, prefix: str = ".", suffix: str = ".tmp",
            mode: int = 0o666) -> Iterator[BinaryIO]:
    """A binary file to write `path`'s new contents to; in place once the block ends without an
    exception. The temporary file is `prefix` + hex digits + `suffix` in `path`'s folder (its
    `name`), for a caller that recognises the ones a crash left; it is created with `mode` less
    the umask, as `open` would create the file itself."""
    directory = os.path.dirname(path) or "."
    while True:
        temp = os.path.join(directory, f"{prefix}{secrets.token_hex(6)}{suffix}")
        try:
            fh = open(temp, "xb", opener=lambda name, flags: os.open(name, flags, mode))
            break
        except FileExistsError:
            continue
    try:
        with fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    sync_folder(directory)


def write_bytes(path: str, data: bytes) -> None:
    with writing(path, prefix="." + os.path.basename(path) + ".") as fh:
        fh.write(data)


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def sync_folder(directory: str) -> None:
    """Put a folder's entries (a rename into it) on disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
