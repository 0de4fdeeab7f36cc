"""Reading JSON that nebula did not necessarily write: bounded in size and nesting first.

Every JSON document nebula reads from a store (manifests, rank and writer markers, a
root's identity, a memory tier's record, an export's metadata) comes through `load_json`.
A file another process, a damaged disk or a hostile user wrote could be a few KB of
nested brackets, which Python's parser answers with a `RecursionError` far from here, or
gigabytes, or an integer of a million digits. So the size is checked, then the nesting
(by a linear scan of the bytes, strings skipped, before anything recursive runs), then
the parse; every failure is one `JsonBoundsError` (a `ValueError`) that the caller turns
into its own kind of corruption (a `ManifestError` for a manifest).

May import: nothing of nebulaml. Not for: what the document must contain (manifest.py
checks a manifest's fields; each reader its own).
"""

from __future__ import annotations

import json
from typing import Any

# Nebula's own documents nest four deep at most (a manifest's items' checksums).
MAX_DEPTH = 32
# A manifest or rank marker lists items: a few hundred bytes each.
MAX_MANIFEST_BYTES = 64 << 20
# A writer marker, a root's identity, a memory tier's record: a few hundred bytes.
MAX_RECORD_BYTES = 64 << 10

# Outside strings, only the brackets count: {} are read as [] (a mismatched pair is a
# parse error at that point anyway), everything else is dropped.
_SQUARE = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_CHUNK = 1 << 20  # split on quotes a piece at a time: a file of quotes stays small


class JsonBoundsError(ValueError):
    """A JSON document that is too large, too deep, or not valid JSON."""


def _brackets(data: bytes) -> bytes:
    """The brackets of JSON `data` that are not inside a string, in order, as [ and ]."""
    # Escapes go first (an escaped backslash, then an escaped quote): what is left of a
    # string is the text between two quotes.
    text = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    out = []
    inside = False
    for start in range(0, len(text), _CHUNK):
        parts = text[start : start + _CHUNK].split(b'"')
        outside = parts[1::2] if inside else parts[::2]
        out.append(b"".join(outside).translate(_SQUARE, _NOT_BRACKETS))
        inside ^= len(parts) % 2 == 0  # an odd number of quotes in this piece
    return b"".join(out)


def nesting_depth(data: bytes, limit: int = MAX_DEPTH) -> int:
    """How deep the arrays and objects of JSON `data` nest (brackets inside strings not
    counted), exactly up to `limit`; beyond it, some number above `limit`. Linear in
    `len(data)` (times `limit` at worst), with no recursion. For a document that is not
    valid JSON: at least as deep as a parser gets before it fails.

    Example:
        >>> nesting_depth(b'{"a": [1, {"b": "[[["}]}'), nesting_depth(b"3")
        (3, 0)
    """
    brackets = _brackets(data)
    # Each pass removes the innermost pairs: one level. What is left when none is
    # adjacent any more is closers no opener matched, then openers never closed.
    passes = 0
    while brackets and passes <= limit:
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            break
        brackets, passes = shorter, passes + 1
    return passes + brackets.count(b"[")


def load_json(
    data: bytes | str, *, max_bytes: int = MAX_RECORD_BYTES, max_depth: int = MAX_DEPTH
) -> Any:
    """Parse JSON `data` once it is known to be at most `max_bytes` long and to nest at
    most `max_depth` deep; anything else (too big, too deep, not UTF-8, not JSON, a
    number Python refuses) raises `JsonBoundsError` saying which, in words that follow
    "<what> is ...".

    Example:
        >>> load_json(b'{"id": "abc"}')
        {'id': 'abc'}
        >>> load_json(b"[" * 10_000)
        Traceback (most recent call last):
        ...
        nebulaml.format.jsonbounds.JsonBoundsError: nested more than 32 deep
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise JsonBoundsError(f"too large: {len(raw)} bytes (more than {max_bytes})")
    # A document with fewer brackets than the limit cannot nest deeper than it.
    if raw.count(b"[") + raw.count(b"{") > max_depth and nesting_depth(raw, max_depth) > max_depth:
        raise JsonBoundsError(f"nested more than {max_depth} deep")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise JsonBoundsError(f"not valid JSON (not UTF-8: {exc})") from exc
    except json.JSONDecodeError as exc:
        raise JsonBoundsError(f"not valid JSON ({exc})") from exc
    except (ValueError, RecursionError) as exc:  # e.g. an integer past Python's digit limit
        raise JsonBoundsError(f"not valid JSON ({exc})") from exc
