"""Text from the network as one line of plain text (`shown`), wherever it is printed or logged:
a worker's id, host or reason, a coordinator's reason. A newline or an ANSI escape in one would
forge a log line or drive the terminal; here each becomes U+FFFD. Used by the monitor's view, the
coordinator's events (coordinator/training.py) and the worker's logs of what the coordinator says.
"""

from __future__ import annotations

import unicodedata
from typing import Any

# A worker id (128 at most) fits whole; a longer value would only push the rest off the screen.
MAX_SHOWN = 200
_JOINERS = frozenset("\u200c\u200d")  # zero-width (non-)joiners: emoji and scripts need them


def _showable(char: str) -> bool:
    # Cc: C0, DEL and C1 (ESC and CSI start terminal escapes); Cf: bidi overrides that reorder
    # what is read; Zl, Zp: line breaks; Cs: lone surrogates, which no terminal can encode.
    return (unicodedata.category(char) not in ("Cc", "Cf", "Cs", "Zl", "Zp")
            or char in _JOINERS)


def shown(value: Any, limit: int = MAX_SHOWN) -> str:
    """A value from the network as one line of plain text: control and format characters become
    U+FFFD, and past `limit` characters it is cut with an ellipsis."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = text[:max(0, limit - 1)] + "\u2026"
    if text.isprintable():
        return text
    return "".join(c if _showable(c) else "\ufffd" for c in text)
