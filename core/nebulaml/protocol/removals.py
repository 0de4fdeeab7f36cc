"""The removals a rank has yet to finish: checkpoints it deleted from some tiers, not all.

A framework removes a checkpoint (its rotation, `remove_checkpoint`) while the session
deletes it from every tier; when the session ends first (killed, or its store down), the
tags left are recorded in the memory tier (`REMOVALS_PREFIX<rank>.json`), and the next
session of that rank deletes them.

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage` and tier_identity.py.
Not for: the delete itself (delete.py) or when it runs (runtime/persister.py,
runtime/session.py).
"""

from __future__ import annotations

import contextlib
import json

from nebulaml.errors import InvalidNameError
from nebulaml.format.names import REMOVALS_PREFIX, validate_name
from nebulaml.protocol.tier_identity import read_json_object
from nebulaml.storage.store import Store


def read_removals(memory: Store, rank: int) -> list[str]:
    """The checkpoints a framework removed that rank `rank`'s session had not yet deleted
    from every tier when it ended (killed, or its store down): the next session of that
    rank deletes them. Names that are not tag names are ignored.

    Example:
        >>> import tempfile
        >>> memory = Store(tempfile.mkdtemp(), durable=False, private=True)
        >>> write_removals(memory, 0, ["epoch=0-step=4"])
        >>> read_removals(memory, 0), read_removals(memory, 1)
        (['epoch=0-step=4'], [])
    """
    doc = read_json_object(memory, f"{REMOVALS_PREFIX}{rank}.json")
    tags = doc.get("tags") if doc is not None else None
    if not isinstance(tags, list):
        return []
    valid = []
    for tag in tags:
        with contextlib.suppress(InvalidNameError):
            valid.append(validate_name("tag", tag))
    return valid


def write_removals(memory: Store, rank: int, tags: list[str]) -> None:
    """Record the removals rank `rank` has yet to finish (`read_removals`); none: the
    record goes."""
    name = f"{REMOVALS_PREFIX}{rank}.json"
    if tags:
        memory.publish((name,), json.dumps({"tags": tags}).encode(), create_only=False)
    else:
        memory.remove(name)
