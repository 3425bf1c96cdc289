"""What needs no model imports no torch: `idlegrad simulate` with costless gradients, and the
coordinator's configuration check. Each runs in a fresh interpreter, which then looks at what
was imported (torch takes seconds to import, and a machine that only plans need not have it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports_torch(code: str) -> bool:
    done = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint('torch' in sys.modules)"],
        cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1] == "True"


def test_a_costless_simulation_imports_no_torch():
    assert not imports_torch((
        "from idlegrad.cli.main import main\n"
        "assert main(['simulate', '--workers', '3', '--duration', '2', '--modes', 'none,sync',"
        " '--eval-every', '0.5']) == 0\n"))


def test_the_configuration_check_imports_no_torch(tmp_path):
    assert not imports_torch((
        "from idlegrad.coordinator.config import CoordinatorConfig, check\n"
        f"check(CoordinatorConfig(job='digits', insecure=True, checkpoint_dir={str(tmp_path)!r},"
        " task='local:4', redundancy='replicate:2'))\n"))
