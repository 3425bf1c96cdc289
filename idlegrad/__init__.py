"""idlegrad: train PyTorch models on idle computers.

The subpackages live in the repository's top-level folders (cli/, common/, coordinator/, worker/,
monitor/) and are installed under this namespace by pyproject.toml's package-dir table.
"""

__version__ = "0.1.0"
