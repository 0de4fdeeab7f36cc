"""A manifest as a later nebula might write it, for the tests of a root that holds one
(tests/core/test_newer_schema.py, tests/cli/test_newer_schema.py)."""

from __future__ import annotations

import json
from pathlib import Path


def make_newer(root: Path, tag: str, schema: int = 99, writer: str | None = "9.1.0") -> None:
    """`tag`'s manifest as a later nebula might write it: schema `schema`, by `writer`."""
    path = root / tag / "manifest.json"
    doc = json.loads(path.read_text())
    doc["schema_version"] = schema
    doc["a_field_of_schema_99"] = {"x": 1}
    if writer is None:
        del doc["producer"]
    else:
        doc["producer"]["nebula_version"] = writer
    path.write_text(json.dumps(doc))
