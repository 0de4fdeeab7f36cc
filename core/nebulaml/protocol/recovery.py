"""What a crash leaves on a tier, and what may be cleared.

    list_incomplete      tag folders nebula started (a rank or writer marker) but never
                         committed: the leftovers of crashed saves, persists and deletes
    remove_dead_writers  delete those whose writers all ran on this host and are gone
                         (`dead_leftovers`: which those are)
    suspects             the folders a restart looks at: the top, and what memory names
    discard_stale_parts  remove one rank's uncommitted parts written by another generation
                         of the job (before a restart): never completed by newer parts

A leftover whose writer is alive, or ran on another host (whose processes cannot be
checked from here), is left alone: `nebula prune --incomplete` judges those by a grace
period (ops/pruning.py).

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage`, catalog.py,
commit_index.py, delete.py and markers.py. Not for: what a restarted job persists again
(the session's recovery, runtime/session.py) or this user's other memory tiers
(ops/memory_tiers.py).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable

from nebulaml.errors import (
    NebulaError,
    StorageError,
    UnsupportedSchemaError,
)
from nebulaml.format.manifest import RankMarker, parse_marker
from nebulaml.format.names import MANIFEST_NAME, WRITER_PREFIX, marker_name
from nebulaml.protocol.catalog import is_tag, read_committed, skip_unreadable, tag_folders
from nebulaml.protocol.commit_index import above_newest
from nebulaml.protocol.delete import delete_checkpoint, delete_part
from nebulaml.protocol.markers import is_marker, read_writers, writer_alive
from nebulaml.storage.store import Store


def list_incomplete(store: Store, tags: Iterable[str] | None = None) -> list[str]:
    """Tag folders that nebula started but never committed (leftovers of crashed saves);
    `tags`: of those folders only (default: every one). A folder this user may not read
    is left out, said once (catalog's `skip_unreadable`), and so is one a newer nebula
    committed (a manifest of a schema this one cannot read).

    Example:
        >>> import tempfile
        >>> list_incomplete(Store(tempfile.mkdtemp()))
        []
    """
    out = []
    for tag in tag_folders(store) if tags is None else tags:
        try:
            files = store.list_files(tag)
            ours = any(is_marker(name) for name in files)
            if ours and read_committed(store, tag) is None:
                out.append(tag)
        except UnsupportedSchemaError:
            continue  # committed by a newer nebula: not a leftover to clear
        except StorageError as exc:
            if not skip_unreadable(store, tag, exc):
                raise
    return sorted(out)


def remove_dead_writers(store: Store, tags: Iterable[str] | None = None) -> list[str]:
    """Delete uncommitted tags whose writers ran on this host and are all gone; `tags`:
    among those only (`suspects`: what a restart looks at), default every folder.

    A tag being written by a live process, or by another host, is left alone.
    """
    removed = dead_leftovers(store, tags)
    for tag in removed:
        delete_checkpoint(store, tag)
    return removed


def dead_leftovers(store: Store, tags: Iterable[str] | None = None) -> list[str]:
    """The uncommitted tags whose writers ran on this host and are all gone (what
    `remove_dead_writers` deletes): saves that will never commit, a part whose other ranks
    never came among them; `tags`: among those only."""
    found = []
    host = socket.gethostname()
    for tag in list_incomplete(store, tags):
        if not any(n.startswith(WRITER_PREFIX) for n in store.list_files(tag)):
            continue  # not started by a writer we can judge
        writers = read_writers(store, tag)
        if not any(w.get("host") != host or writer_alive(w, host) for w in writers):
            found.append(tag)
    return found


def suspects(store: Store, named: Iterable[str] = ()) -> list[str]:
    """The tag folders of `store` that may hold a leftover of this node's last process,
    without looking into every folder: those at the top (commit_index.above_newest: a
    save, persist or copy under way writes the newest tag) and those `named` (the tags
    the node's memory tier holds: what it was persisting) that are there. Older
    leftovers (a retention's delete cut short) are the first retention's to clear
    (runtime/retirement.py) and `nebula prune --incomplete`'s."""
    there = {tag for tag in named if store.exists(tag)}
    # A folder whose name is no tag (not UTF-8, a reserved name) is none of nebula's.
    return sorted(tag for tag in set(above_newest(store)) | there if is_tag(tag))


def discard_stale_parts(
    store: Store,
    rank: int,
    generation: str | None,
    *,
    keep: Callable[[str, RankMarker], bool] = lambda _tag, _marker: False,
) -> list[str]:
    """Remove `rank`'s parts on `store` of uncommitted tags that another generation of the
    job wrote (a run before a restart): a checkpoint is committed only from parts of one
    generation, so such a part would never be; persisting it would only hold up the
    persister. Kept: a part `keep(tag, marker)` says still completes its checkpoint, and
    one a live process on this host is still writing. Returns the tags of the parts removed.
    """
    removed = []
    me = os.getpid()
    for tag in tag_folders(store):
        files = store.list_files(tag)
        if marker_name(rank) not in files or MANIFEST_NAME in files:
            continue
        try:
            where = store.display(tag, marker_name(rank))
            marker = parse_marker(store.read_bytes(tag, marker_name(rank)), where)
        except NebulaError:
            continue  # gone meanwhile, or not ours to judge
        if marker.generation == generation or keep(tag, marker):
            continue
        writers = read_writers(store, tag)
        if any(w.get("rank") == rank and w.get("pid") != me and writer_alive(w) for w in writers):
            continue
        delete_part(store, tag, rank)
        removed.append(tag)
    return removed
