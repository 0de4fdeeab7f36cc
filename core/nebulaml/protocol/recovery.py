"""What a crash leaves on a tier, and what may be cleared (DESIGN.md §4).

    list_incomplete      tag folders nebula started (a rank or writer marker) but never
                         committed: the leftovers of crashed saves, persists and deletes
    remove_dead_writers  delete those whose writers all ran on this host and are gone

A leftover whose writer is alive, or ran on another host (whose processes cannot be
checked from here), is left alone: `nebula prune --incomplete` judges those by a grace
period (ops/pruning.py).

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage`, catalog.py,
delete.py and markers.py. Not for: what a restarted job persists again (the session's
recovery, runtime/session.py) or this user's other memory tiers (ops/memory_tiers.py).
"""

from __future__ import annotations

import socket

from nebulaml.errors import InvalidNameError
from nebulaml.format.names import WRITER_PREFIX, validate_name
from nebulaml.protocol.catalog import read_committed
from nebulaml.protocol.delete import delete_checkpoint
from nebulaml.protocol.markers import is_marker, read_writers, writer_alive
from nebulaml.storage.store import Store


def list_incomplete(store: Store) -> list[str]:
    """Tag folders that nebula started but never committed (leftovers of crashed saves).

    Example:
        >>> import tempfile
        >>> list_incomplete(Store(tempfile.mkdtemp()))
        []
    """
    out = []
    for tag in store.list_dirs():
        try:
            validate_name("tag", tag)
        except InvalidNameError:
            continue
        files = store.list_files(tag)
        ours = any(is_marker(name) for name in files)
        if ours and read_committed(store, tag) is None:
            out.append(tag)
    return sorted(out)


def remove_dead_writers(store: Store) -> list[str]:
    """Delete uncommitted tags whose writers ran on this host and are all gone.

    A tag being written by a live process, or by another host, is left alone.
    """
    removed = []
    host = socket.gethostname()
    for tag in list_incomplete(store):
        if not any(n.startswith(WRITER_PREFIX) for n in store.list_files(tag)):
            continue  # not started by a writer we can judge
        writers = read_writers(store, tag)
        if not any(w.get("host") != host or writer_alive(w, host) for w in writers):
            delete_checkpoint(store, tag)
            removed.append(tag)
    return removed
