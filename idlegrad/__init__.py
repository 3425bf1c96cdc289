"""idlegrad: train PyTorch models on idle computers.

The subpackages live in the repository's top-level folders (cli/, common/, coordinator/, worker/,
monitor/) and are installed under this namespace by pyproject.toml's package-dir table.
"""

__version__ = "0.1.0"

import os as _os

# Run from a checkout, the repository root is on sys.path (`python -m idlegrad.cli`, the demo's
# processes, pytest) and this folder shadows an installed idlegrad; the subpackages are the
# checkout's top-level folders, so they are looked for there too.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (_os.path.isfile(_os.path.join(_root, "pyproject.toml"))
        and _os.path.isdir(_os.path.join(_root, "cli"))):
    __path__.append(_root)
