"""Which root a memory tier belongs to, and whether it may be read as that root's.

Every persistent root carries an identity (`ROOT_ID_FILE`, a random id made when nebula
first opens it: `root_identity`), and the memory tier records the root it belongs to
(`ROOT_INFO_FILE`: its URL, location and identity; `read_record`, `write_record`). A
memory tier whose root is gone, or was created again since, is *stale*: never listed,
loaded, flushed or copied, and released by the next `init` of that root; one that is not
this user's alone is *unsafe* (`judge_memory_tier` says which).

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage` and memory_tier.py.
Not for: where a tier lives or its privacy (memory_tier.py), who holds it (tier_lifetime.py)
or acting on a stale tier (tiers.py, ops/memory_tiers.py).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from typing import Any

from nebulaml.errors import CommitConflictError, NebulaError, UnsafeMemoryTierError
from nebulaml.format.jsonbounds import JsonBoundsError, load_json
from nebulaml.format.manifest import utc_now
from nebulaml.format.names import ROOT_ID_FILE, ROOT_INFO_FILE
from nebulaml.protocol.memory_tier import check_private_dir
from nebulaml.storage.store import MissingFileError, Store

_RECORD_MAX_BYTES = 64 << 10  # a record is a few hundred bytes; more is not ours

# States of a memory tier (`TierSet.memory_state`, `nebula memory`).
OK, STALE, UNSAFE, ORPHANED = "ok", "stale", "unsafe", "orphaned"


@dataclass(frozen=True, slots=True)
class TierRecord:
    """What a memory tier records of its root: its URL, location and identity."""

    persistent: str | None
    location: str | None
    root_id: str | None


def read_json_object(store: Store, name: str) -> dict[str, Any] | None:
    """A small JSON object file of `store`'s root; None if missing or not such a file."""
    try:
        data = store.read_bytes(name)
    except MissingFileError:
        return None
    try:
        doc = load_json(data, max_bytes=_RECORD_MAX_BYTES)
    except JsonBoundsError:
        return None
    return doc if isinstance(doc, dict) else None


def root_identity(
    persistent: Store, *, create: bool = False, new_id: str | None = None
) -> str | None:
    """The identity of a persistent root; None when it has none (and `create` is False).
    With `create`, a root without one gets one (`new_id`, else a new random one),
    create-only: of several ranks or jobs opening a new root at once, all end up with the
    same."""
    doc = read_json_object(persistent, ROOT_ID_FILE)
    if doc is not None and isinstance(doc.get("id"), str):
        return str(doc["id"])
    if not create:
        return None
    new = {"id": new_id or uuid.uuid4().hex, "created_at": utc_now()}
    try:
        persistent.publish((ROOT_ID_FILE,), json.dumps(new).encode(), create_only=True)
        return str(new["id"])
    except CommitConflictError:
        doc = read_json_object(persistent, ROOT_ID_FILE)
        if doc is None or not isinstance(doc.get("id"), str):
            raise
        return str(doc["id"])


def read_record(memory: Store) -> TierRecord | None:
    """The memory tier's record of its root, or None (missing or unreadable)."""
    doc = read_json_object(memory, ROOT_INFO_FILE)
    if doc is None:
        return None

    def text(key: str) -> str | None:
        value = doc.get(key)
        return value if isinstance(value, str) else None

    return TierRecord(text("persistent"), text("location"), text("root_id"))


def write_record(memory: Store, persistent: Store | None, root_id: str | None) -> None:
    """Record which root (URL, location, identity) a memory tier belongs to."""
    doc = {
        "persistent": persistent.url if persistent else None,
        "location": persistent.location if persistent else None,
        "root_id": root_id,
    }
    memory.publish((ROOT_INFO_FILE,), json.dumps(doc).encode(), create_only=False)


def judge_memory_tier(memory: Store, persistent: Store | None) -> tuple[str, str | None]:
    """(state, why): whether a memory tier may be read as its root's (see the module
    docstring). A folder that does not exist yet is `OK` (there is nothing in it)."""
    base, folder = os.path.dirname(memory.root), memory.root
    try:
        if not check_private_dir(base) or not check_private_dir(folder):
            return OK, None
    except UnsafeMemoryTierError as exc:
        return UNSAFE, str(exc)
    if persistent is None:
        return OK, None
    record = read_record(memory)
    if record is None or record.root_id is None:
        return OK, None  # an older nebula's, or a tier whose record did not fit
    try:
        current = root_identity(persistent)
    except NebulaError as exc:
        return STALE, f"cannot read the identity of {persistent.url} ({exc})"
    if current is None:
        return STALE, f"its root {persistent.url} is gone"
    if current != record.root_id:
        return STALE, f"its root {persistent.url} was deleted and created again since"
    return OK, None
