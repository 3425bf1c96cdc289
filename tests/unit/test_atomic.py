"""common/atomic.py: a file is replaced whole or left as it was, and no temporary file stays."""

from __future__ import annotations

import os

import pytest

from idlegrad.common import atomic


def test_a_write_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old")
    atomic.write_text(str(path), "new")
    assert path.read_text() == "new"
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_write_that_fails_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic.writing(str(path), ".checkpoint-", ".tmp") as fh:
            fh.write(b"half of the new")
            assert os.path.basename(fh.name).startswith(".checkpoint-")
            raise RuntimeError("killed mid-write")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["checkpoint.pt"]


def test_a_file_is_created_as_open_creates_it(tmp_path):
    """The umask applies, as to `open`: a mirror's web server may read what the owner publishes."""
    old = os.umask(0o022)
    try:
        atomic.write_bytes(str(tmp_path / "manifest.json"), b"{}")
        atomic.write_bytes(str(tmp_path / "key"), b"k")
        with atomic.writing(str(tmp_path / "secret"), mode=0o600) as fh:
            fh.write(b"s")
    finally:
        os.umask(old)
    assert (tmp_path / "manifest.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "secret").stat().st_mode & 0o777 == 0o600
