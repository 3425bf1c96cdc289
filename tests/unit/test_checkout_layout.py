"""A checkout is importable as `idlegrad` by itself: run from the repository root (the demo's
processes, `python -m idlegrad.cli`), its `idlegrad/` folder shadows an installed copy, and the
subpackages must then be found in the top-level folders (a non-editable install's demo failed
with "No module named idlegrad.cli")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_checkout_alone_imports_its_subpackages():
    # -S: no site-packages, so no installed or editable idlegrad to fall back on
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
            "import idlegrad.common.errors as m; print(m.__file__)")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == ROOT / "common" / "errors.py"
