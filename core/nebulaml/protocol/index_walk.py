"""Reading a tier's commit index (commit_index.py): the listings a process keeps, and
the walk over the index's names from the highest down.

    walk      every entry and begun record, highest first, each bucket listed only once
              the walk reaches it (index_names.py: the buckets), with the flat entries an
              older nebula wrote merged in
    listing   one folder's listing, kept while the folder is unchanged, or while pinned
    pinned    within: this thread lists each folder once (a restart's questions)
    drop      forget this process's listings of a tier (it is about to change them)

A process keeps its last listing of a local folder while the folder's identity (inode,
modification time) is unchanged and was already more than `_SETTLED_NS` old when listed
(a change within the file system's timestamp granularity cannot hide behind it); its own
writes drop it. An object store has no such identity: init's questions share one
listing of each folder (`pinned`), and each later question lists again, by name only
(`Store.list_file_names`). A listing handed on past init missed the checkpoint a peer
recovery had just had another rank commit (get_latest_checkpoint returned the older one).

May import: `nebulaml.format`, `nebulaml.storage` and index_names.py.
"""

from __future__ import annotations

import contextlib
import heapq
import threading
import time
from collections.abc import Callable, Iterator

from nebulaml.format.names import INDEX_DIR
from nebulaml.protocol.index_names import BEGUN, DIGITS, PREFIX, in_bucket, is_bucket
from nebulaml.storage.store import MissingFileError, Store

_SETTLED_NS = 2_000_000_000  # a folder changed this recently is listed again each time

Folder = tuple[str, ...]  # the parts of an index folder: (INDEX_DIR,) or a bucket's

_listings: dict[tuple[str, str], tuple[tuple[int, int], object]] = {}
_listings_lock = threading.Lock()
# Listings a thread reuses while it is `pinned()`: (thread, location, what).
_pins: dict[tuple[int, str, str], object] = {}
_pinning: set[int] = set()  # the threads pinned
# Called by `drop` (commit_index.py's kept catalogs): forget what was kept of a location.
on_drop: list[Callable[[str], None]] = []


def drop(store: Store) -> None:
    """Forget this process's listings of `store` (it is about to change them)."""
    with _listings_lock:
        for listed in [key for key in _listings if key[0] == store.location]:
            del _listings[listed]
        for pin in [key for key in _pins if key[1] == store.location]:
            del _pins[pin]
    for forget in on_drop:
        forget(store.location)


@contextlib.contextmanager
def pinned() -> Iterator[None]:
    """Within: this thread lists each folder of each tier's index, and its folders, once,
    and answers every question from that listing, as of the moment it listed (a
    restart's: the dead writers' recovery, what the root holds, the resume). A write by
    this process to a tier's index (`record_commit`, `forget_tags`) drops the tier's. An
    object store has no folder identity to keep a listing by: without this each question
    lists.

    Example:
        >>> with pinned():
        ...     pass
    """
    me = threading.get_ident()
    with _listings_lock:
        _pinning.add(me)
    try:
        yield
    finally:
        with _listings_lock:
            _pinning.discard(me)
            for key in [key for key in _pins if key[0] == me]:
                del _pins[key]


def listing(store: Store, what: str, parts: Folder, fresh: Callable[[], object]) -> object:
    """The listing `what` of folder `parts` kept for `store`, or what `fresh()` lists
    (kept when the folder has not changed for `_SETTLED_NS`, or while pinned)."""
    pin = (threading.get_ident(), store.location, what)
    with _listings_lock:
        if pin in _pins:
            return _pins[pin]
    listed = _kept_by_identity(store, what, parts, fresh)
    with _listings_lock:
        if pin[0] in _pinning:
            _pins[pin] = listed
    return listed


def _kept_by_identity(
    store: Store, what: str, parts: Folder, fresh: Callable[[], object]
) -> object:
    identity = store.folder_identity(*parts)
    key = (store.location, what)
    if identity is not None:
        with _listings_lock:
            kept = _listings.get(key)
        if kept is not None and kept[0] == identity:
            return kept[1]
    listed = fresh()
    if identity is not None and time.time_ns() - identity[1] > _SETTLED_NS:
        with _listings_lock:
            _listings[key] = (identity, listed)
    return listed


def _names(store: Store, parts: Folder, keep: Callable[[str], bool]) -> list[str]:
    """The file names of index folder `parts` that `keep` keeps, highest first (kept)."""

    def fresh() -> list[str]:
        try:
            names = store.list_file_names(*parts)
        except MissingFileError:
            names = []
        return sorted((name for name in names if keep(name)), reverse=True)

    found = listing(store, "files:" + "/".join(parts), parts, fresh)
    assert isinstance(found, list)
    return found


def _buckets(store: Store, parts: Folder, level: int) -> list[str]:
    """The buckets of `level` in index folder `parts`, highest first (kept)."""

    def fresh() -> list[str]:
        try:
            names = store.list_dirs(*parts)
        except MissingFileError:
            names = []
        return sorted((name for name in names if is_bucket(name, level)), reverse=True)

    found = listing(store, "dirs:" + "/".join(parts), parts, fresh)
    assert isinstance(found, list)
    return found


def folders(store: Store) -> list[str]:
    """The tag folders of `store` (kept as the index's listings are)."""
    found = listing(store, "folders", (), store.list_dirs)
    assert isinstance(found, list)
    return found


def _is_entry(name: str) -> bool:
    return name[PREFIX : PREFIX + 1] == "-"


def _is_record(name: str) -> bool:
    """An entry or a begun record (its numbers are read when asked: index_names.py)."""
    return name[PREFIX : PREFIX + 1] == "-" or name[DIGITS : DIGITS + 1] == BEGUN


def _first(pair: tuple[str, Folder]) -> str:
    return pair[0]


def walk(store: Store) -> Iterator[tuple[str, Folder]]:
    """(name, folder) of every entry and begun record of `store`'s index, highest name
    first, each bucket listed once the walk reaches it: who stops at the top lists the
    index's folder, the highest L1 bucket and the highest L2 bucket. The flat entries an
    older nebula wrote in the index's folder are merged in. A name outside its own bucket
    (not written by nebula) is not read: it would be out of order.

    Example:
        >>> import tempfile
        >>> list(walk(Store(tempfile.mkdtemp())))
        []
    """
    flat = _names(store, (INDEX_DIR,), _is_entry)
    top = ((name, (INDEX_DIR,)) for name in flat)
    return heapq.merge(top, _bucketed(store), key=_first, reverse=True)


def _bucketed(store: Store) -> Iterator[tuple[str, Folder]]:
    for l1 in _buckets(store, (INDEX_DIR,), 1):
        for l2 in _buckets(store, (INDEX_DIR, l1), 2):
            folder = (INDEX_DIR, l1, l2)
            for name in _names(store, folder, _is_record):
                if in_bucket(name, (l1, l2)):
                    yield name, folder
