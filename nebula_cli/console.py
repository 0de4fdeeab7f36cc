"""Where a command's output goes: data on stdout (a table, or one JSON document with
--json), everything else on stderr (progress, retries, warnings, hints), and never raw
what a file someone else wrote says (`printable`).

May import: the standard library and rich.
Not for: laying out tables (tables.py), error lines and exit codes (exits.py) or progress
(progress.py).
"""

from __future__ import annotations

import contextvars
import json
import sys
import unicodedata
from typing import Any

from rich.console import Console


def stdout() -> Console:
    """The data console (built per call so that CliRunner's captured streams are used)."""
    return Console(file=sys.stdout, soft_wrap=True)


def stderr() -> Console:
    """The diagnostics console: progress, warnings, hints."""
    return Console(file=sys.stderr, soft_wrap=True)


def printable(text: str) -> str:
    """`text` with every control or format character escaped (`\\x1b`, `\\u202e`), and
    each byte of a name that is not UTF-8 as `\\xff`, line breaks and tabs kept: what a
    file someone else wrote says (a label, a host, a tag) never reaches the terminal as
    an escape sequence or raw bytes.

    Example:
        >>> printable("best\\x1b[2J") == "best\\\\x1b[2J"
        True
    """
    if text.isprintable():
        return text
    out = []
    for c in text:
        category = unicodedata.category(c)
        if 0xDC80 <= ord(c) <= 0xDCFF:  # a byte of a name that is not UTF-8 (surrogateescape)
            out.append(f"\\x{ord(c) - 0xDC00:02x}")
        elif c in "\n\t" or category not in ("Cc", "Cf", "Cs"):
            out.append(c)
        else:
            out.append(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
    return "".join(out)


# Whether the running command was given --json ("wanted") and has written its document
# ("written"): one that fails before it has writes an error object instead (exits.py).
JSON_STATE: contextvars.ContextVar[dict[str, bool] | None] = contextvars.ContextVar(
    "nebula_json_state", default=None
)


def emit_json(doc: Any) -> None:
    """Write exactly one JSON document to stdout."""
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    state = JSON_STATE.get()
    if state is not None:
        state["written"] = True
