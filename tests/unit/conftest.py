"""Fixtures shared by the unit tests."""

from __future__ import annotations

import logging
from typing import NamedTuple

import pytest

from idlegrad.cli.main import main


class CliRun(NamedTuple):
    code: int
    out: str
    err: str

    def one_line_error(self) -> str:
        """The front door's promise for bad input: one line on stderr that says error, never a
        traceback. Returns that line."""
        assert "Traceback" not in self.err
        lines = [line for line in self.err.splitlines() if line.strip()]
        assert len(lines) == 1, self.err
        assert "error" in lines[0], self.err
        return lines[0]


@pytest.fixture
def run_cli(capsys):
    """`run_cli(argv)` runs `idlegrad ARGV` in this process and returns its (code, out, err)."""

    def run(argv) -> CliRun:
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse leaves through SystemExit
            code = exc.code
        out, err = capsys.readouterr()
        return CliRun(code, out, err)

    # main() configures the root logger; leave it as it was for the other tests.
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield run
    root.handlers[:] = handlers
    root.setLevel(level)
