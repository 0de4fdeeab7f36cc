"""Markers: the small files in a tag folder that say who wrote what.

    .rank-<r>.json    rank r's part is written: the items it lists (format/manifest.py's
                      `RankMarker`); the manifest follows once every rank's is there
    .writer-<r>.json  who is writing rank r's part (host, pid, started_at), from the
                      moment it starts until the part is committed or deleted

A tag folder with either was started by nebula (`is_marker`); without a manifest it is a
leftover (recovery.py), whose writer markers tell a live writer from a dead one. The names
are spelled in format/names.py (`marker_name`, `writer_marker_name`); this module reads
and writes what is in them.

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage`, catalog.py and
leases.py. Not for: the order in which markers are written (commit.py, transfer.py,
delete.py) or the leases of readers and deleters (leases.py).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from nebulaml.errors import NebulaError
from nebulaml.format.jsonbounds import MAX_MANIFEST_BYTES, load_json
from nebulaml.format.manifest import parse_marker, utc_now
from nebulaml.format.names import RANK_PREFIX, WRITER_PREFIX, marker_name
from nebulaml.protocol.catalog import tag_folders
from nebulaml.protocol.leases import process_alive
from nebulaml.storage.store import Store

MARKER_PREFIXES = (RANK_PREFIX, WRITER_PREFIX)


def is_marker(name: str) -> bool:
    """Whether a file in a tag folder is a rank or writer marker: nebula started the tag.

    Example:
        >>> is_marker(".writer-0.json"), is_marker(".rank-1.json"), is_marker("model")
        (True, True, False)
    """
    return name.startswith(MARKER_PREFIXES)


def _host() -> str:
    return socket.gethostname()


def writer_record(
    rank: int,
    items: list[str] | None = None,
    started_at: str | None = None,
    *,
    deleting: bool = False,
    generation: str | None = None,
) -> bytes:
    """The content of this process's writer marker for `rank`: host, pid, rank, started_at,
    and (a save of several ranks sharing a tier) the names of the items it claimed;
    `deleting`: the marker is a deleter's claim (delete.py), not a save's; `generation`:
    the run whose part it writes (a persist's claim, transfer.copy_part)."""
    doc: dict[str, Any] = {
        "host": _host(),
        "pid": os.getpid(),
        "rank": rank,
        "started_at": started_at or utc_now(),
    }
    if items is not None:
        doc["items"] = items
    if deleting:
        doc["deleting"] = True
    if generation is not None:
        doc["generation"] = generation
    return json.dumps(doc).encode()


def claimed_items(store: Store, tag: str, name: str) -> dict[str, Any] | None:
    """The writer marker `name` of `tag` as a dict (with the item names it claimed under
    "items"), or None when it is gone or unreadable."""
    try:
        doc = load_json(store.read_bytes(tag, name), max_bytes=MAX_MANIFEST_BYTES)
    except (NebulaError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def read_writers(
    store: Store, tag: str, files: dict[str, int] | None = None
) -> list[dict[str, Any]]:
    """The writer markers of an uncommitted tag: host, pid, rank, started_at, deleting
    (unreadable markers are skipped: they only describe, they decide nothing here).
    `files`: the tag's folder as the caller has just listed it."""
    writers = []
    if files is None:
        files = store.list_files(tag)
    for name in sorted(files):
        if not name.startswith(WRITER_PREFIX) or files[name] > MAX_MANIFEST_BYTES:
            continue
        try:
            doc = load_json(store.read_bytes(tag, name), max_bytes=MAX_MANIFEST_BYTES)
        except (NebulaError, ValueError):
            continue
        if isinstance(doc, dict):
            keys = ("host", "pid", "rank", "started_at", "deleting")
            writers.append({k: doc.get(k) for k in keys})
    return writers


def writer_alive(writer: dict[str, Any], host: str | None = None) -> bool:
    """Whether a writer marker (see `read_writers`) names a live process on this host.

    A writer on another host cannot be checked from here: it counts as not alive on this
    host, and callers decide what that means (recovery leaves it alone; prune waits for a
    grace period).
    """
    if writer.get("host") != (host or _host()):
        return False
    pid = writer.get("pid")
    return isinstance(pid, int) and not isinstance(pid, bool) and process_alive(pid)


def describe_writer(writer: dict[str, Any]) -> str:
    """'pid 123 on node1' for messages."""
    return f"pid {writer.get('pid')} on {writer.get('host')}"


def own_parts(store: Store, rank: int) -> list[tuple[str, str]]:
    """(tag, created_at) of every tag on `store` that holds this rank's marker."""
    out = []
    for tag in tag_folders(store):
        if marker_name(rank) not in store.list_files(tag):
            continue
        try:
            where = store.display(tag, marker_name(rank))
            marker = parse_marker(store.read_bytes(tag, marker_name(rank)), where)
        except (NebulaError, ValueError):
            continue  # removed meanwhile, or not readable: not a part to keep or evict
        out.append((tag, marker.created_at))
    return out
