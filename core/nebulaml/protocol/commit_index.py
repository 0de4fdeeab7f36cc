"""The commit index of a tier: one empty file per commit, whose name is its place in order.

    record_commit   the entry of a manifest about to be published, in the tier's
                    `INDEX_DIR`, written before the manifest (commit.py)
    forget_tags     remove the entries of tags just deleted (delete.py)
    newest          the newest committed checkpoints of a tier: one listing of the index
                    and the manifests of the few at its top
    above_newest    the folders at the top: where a restart looks for leftovers
    indexed_tags    the folders that have an entry: what a restarting job knows committed
    catalog         every committed checkpoint, kept while the folders and the index
                    are the same
    index_missing   write the entries a full listing found missing (a root an older
                    nebula wrote, a folder copied in by hand)

"Newest" is names.order_key: the step a tag names, then the manifest's commit sequence.
An entry's name is `<step + 1>.<sequence>-<tag>`, both numbers 20 digits, so names sort
as their checkpoints do (the commit time, a tie-break, aside): the reader takes the
names from the highest down, reads each one's manifest, and stops once the next name is
below the n-th newest found. (A tag too long for a name gets `-#<sha256>` instead, and
the file holds the tag.)

Why no committed checkpoint is missed: every manifest this version publishes (a commit,
a persist, `nebula copy`) has its entry, written before it (sequence.py reserved the
number the entry names), durably; so the highest entry of a tag is at least its
manifest's key. Entries are removed only all together for a tag whose folder is gone
(`forget_tags`, after a delete), so a tag never keeps a lower entry without its higher
one. An entry whose manifest never came (a commit that died) or whose folder is gone
(removed by hand) only costs a read. A tier with no entry at all (an older nebula's) is
listed in full, as before, and its entries written; so is a folder a full listing finds
without one (`index_missing`: `nm.list_checkpoints`, `nebula ls`).

A process keeps its last listing of a local tier's index and folders while the folder's
identity (inode, modification time) is unchanged and was already more than
`_SETTLED_NS` old when listed (a change within the file system's timestamp granularity
cannot hide behind it); its own writes drop it. An object store has no such identity:
init's questions share one listing (`pinned`), and each later question lists again, by
name only (`Store.list_file_names`). A listing handed on past init missed the checkpoint
a peer recovery had just had another rank commit (get_latest_checkpoint returned the
older one).

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage` and catalog.py.
Not for: publishing the manifest (commit.py), the sequence (sequence.py), or the full
listing (catalog.py's `list_committed`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

from nebulaml.errors import StorageError, UnsupportedSchemaError
from nebulaml.format.names import INDEX_DIR, MANIFEST_NAME, MAX_NAME_BYTES, order_key
from nebulaml.protocol.catalog import (
    CheckpointInfo,
    list_committed,
    read_committed,
    skip_unreadable,
    skip_unsupported,
)
from nebulaml.storage.store import MissingFileError, Store

log = logging.getLogger("nebulaml")

# How many times `newest` lists while an entry above the newest found did not read as
# committed (deleted meanwhile by retention or a prune), as catalog.list_committed.
_LIST_PASSES = 3
_DIGITS = 20
_PREFIX = 2 * _DIGITS + 1  # "<step + 1>.<sequence>"
_HASHED = "#"  # an entry of a tag too long for a name: `#<sha256>`, holding the tag
_REMOTE_WRITERS = 8  # entries an object store's listing writes at once
_SETTLED_NS = 2_000_000_000  # a folder changed this recently is listed again each time

Key = tuple[int, int]  # (step, sequence): order_key's first two


def entry_name(tag: str, sequence: int) -> str:
    """The index entry of `tag` committed with `sequence`.

    Example:
        >>> entry_name("global_step7", 12)
        '00000000000000000008.00000000000000000012-global_step7'
        >>> entry_name("best", 3)[:_PREFIX]
        '00000000000000000000.00000000000000000003'
    """
    step = order_key(tag)[0]
    prefix = f"{step + 1:0{_DIGITS}d}.{sequence:0{_DIGITS}d}"
    name = f"{prefix}-{tag}"
    if len(name.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES:
        return name
    digest = hashlib.sha256(tag.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{prefix}-{_HASHED}{digest}"


def parse_entry(name: str) -> tuple[Key, str] | None:
    """((step, sequence), tag) of an entry's name (the tag `#<sha256>` for a hashed
    one), or None for a name that is not an entry. The tag is not checked: an entry
    counts only for a committed tag of that name.

    Example:
        >>> parse_entry(entry_name("global_step7", 12)), parse_entry("x-y")
        (((7, 12), 'global_step7'), None)
    """
    head, tag = name[:_PREFIX], name[_PREFIX + 1 :]
    if name[_PREFIX : _PREFIX + 1] != "-" or not tag or head[_DIGITS] != ".":
        return None
    step, sequence = head[:_DIGITS], head[_DIGITS + 1 :]
    if not (step.isascii() and step.isdigit() and sequence.isascii() and sequence.isdigit()):
        return None
    return (int(step) - 1, int(sequence)), tag


def record_commit(store: Store, tag: str, sequence: int, *, durable: bool = True) -> None:
    """Write the entry of `tag`'s manifest of `sequence`, about to be published on
    `store` (before it: a manifest never lacks its entry). A failure fails the commit,
    as the manifest's would. `durable=False`: the entry of a manifest already there
    (`index_missing`), which a crash may lose: the tag then has none, as before."""
    name = entry_name(tag, sequence)
    data = tag.encode("utf-8", "surrogatepass") if name[_PREFIX + 1 :].startswith(_HASHED) else b""
    _drop(store)
    try:
        store.write_bytes((INDEX_DIR, name), data, durable=durable)
    except MissingFileError:  # the tier's first entry
        store.make_dir(INDEX_DIR)
        store.write_bytes((INDEX_DIR, name), data, durable=durable)


class _Index:
    """One listing of a tier's index: its entries' names, highest first, and (each
    worked out once asked for) the tags they name and the highest key of each (hashed
    names by `#<sha256>`)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self._keys: dict[str, Key] | None = None
        self._tags: set[str] | None = None

    @property
    def tags(self) -> set[str]:
        """The tags the entries name (a hashed one as `#<sha256>`): one pass, shared by
        a restart's questions."""
        if self._tags is None:
            self._tags = {name[_PREFIX + 1 :] for name in self.names}
        return self._tags

    @property
    def keys(self) -> dict[str, Key]:
        if self._keys is None:
            keys: dict[str, Key] = {}
            for name in self.names:
                parsed = parse_entry(name)
                if parsed is not None and parsed[0] > keys.get(parsed[1], (-2, -1)):
                    keys[parsed[1]] = parsed[0]
            self._keys = keys
        return self._keys


_listings: dict[tuple[str, str], tuple[tuple[int, int], object]] = {}
_listings_lock = threading.Lock()


def _drop(store: Store) -> None:
    """Forget this process's listings of `store` (it is about to change them)."""
    with _listings_lock:
        for what in ("index", "folders"):
            _listings.pop((store.location, what), None)
        _catalogs.pop(store.location, None)
        for key in [key for key in _pins if key[1] == store.location]:
            del _pins[key]


# The full catalog of each tier this process listed (`catalog`), by the folder names and
# index entries it was listed under: (names, entries, checkpoints, unsupported schemas).
_Catalog = tuple[list[str], list[str], list[CheckpointInfo], list[UnsupportedSchemaError]]
_catalogs: dict[str, _Catalog] = {}


# Listings a thread reuses while it is `pinned()`: (thread, location, what).
_pins: dict[tuple[int, str, str], object] = {}
_pinning: set[int] = set()  # the threads pinned


@contextlib.contextmanager
def pinned() -> Iterator[None]:
    """Within: this thread lists each tier's index and folders once, and answers every
    question from that listing, as of the moment it listed (a restart's: the dead
    writers' recovery, what the root holds, the resume). A write by this process to a
    tier's index (`record_commit`, `forget_tags`) drops the tier's. An object store
    has no folder identity to keep a listing by: without this each question lists."""
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


def _kept(store: Store, what: str, parts: tuple[str, ...], fresh: object) -> object:
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


def _kept_by_identity(store: Store, what: str, parts: tuple[str, ...], fresh: object) -> object:
    identity = store.folder_identity(*parts)
    key = (store.location, what)
    if identity is not None:
        with _listings_lock:
            kept = _listings.get(key)
        if kept is not None and kept[0] == identity:
            return kept[1]
    listed = fresh()  # type: ignore[operator]
    if identity is not None and time.time_ns() - identity[1] > _SETTLED_NS:
        with _listings_lock:
            _listings[key] = (identity, listed)
    return listed


def _index(store: Store) -> _Index:
    def fresh() -> _Index:
        try:
            names = store.list_file_names(INDEX_DIR)
        except MissingFileError:
            names = []
        # What has an entry's shape (its numbers are read when asked: parse_entry).
        names = [name for name in names if name[_PREFIX : _PREFIX + 1] == "-"]
        names.sort(reverse=True)
        return _Index(names)

    found = _kept(store, "index", (INDEX_DIR,), fresh)
    assert isinstance(found, _Index)
    return found


def _folders(store: Store) -> list[str]:
    found = _kept(store, "folders", (), store.list_dirs)
    assert isinstance(found, list)
    return found


def _tag_of(store: Store, name: str, tag: str) -> str | None:
    """The tag entry `name` names (`tag`, or a hashed entry's file); None if unreadable."""
    if not tag.startswith(_HASHED):
        return tag
    try:
        return store.read_bytes(INDEX_DIR, name).decode("utf-8", "surrogatepass")
    except (StorageError, UnicodeDecodeError):
        return None


def forget_tags(store: Store, tags: Iterable[str]) -> None:
    """Remove every entry of `tags`, whose folders were just deleted from `store`. Best
    effort: an entry left behind costs a reader one read (its folder is gone)."""
    gone = set(tags)
    if not gone:
        return
    _drop(store)
    hashed = {entry_name(tag, 0)[_PREFIX + 1 :] for tag in gone}
    try:
        for name in store.list_file_names(INDEX_DIR):
            parsed = parse_entry(name)
            if parsed is not None and (parsed[1] in gone or parsed[1] in hashed):
                store.remove(INDEX_DIR, name, durable=False)
    except StorageError as exc:
        log.debug("could not remove the index entries of %s: %s", sorted(gone), exc)
    _drop(store)


def newest(
    store: Store,
    n: int = 1,
    unsupported: list[UnsupportedSchemaError] | None = None,
) -> list[CheckpointInfo]:
    """The `n` newest committed checkpoints on `store`, newest first: what
    `list_committed(store)[-n:]` holds, from one listing of the index and the manifests
    at its top (the module's docstring says why none is missed). A manifest of a schema
    this version cannot read, or a folder this user may not read, is skipped as
    `list_committed` skips it (`unsupported`: the same). A tier without an index (an
    older nebula's) is listed in full (`list_committed`) and its entries written.

    Example:
        >>> import tempfile
        >>> newest(Store(tempfile.mkdtemp()))
        []
    """
    found: dict[str, CheckpointInfo] = {}
    previous: set[str] = set()  # the entries of the last pass that did not read
    for _ in range(_LIST_PASSES):
        index = _index(store)
        if not index.names:
            if not _folders(store):
                return []
            committed = list_committed(store, unsupported)
            index_missing(store, committed)
            return committed[::-1][:n]
        seen: set[str] = set()
        top: list[Key] = []  # the keys of the n newest found, highest first
        unsettled: dict[str, Key] = {}  # entries that did not read as committed
        for name in index.names:
            key, named = parse_entry(name) or ((-1, -1), "")
            if len(top) == n and key < top[-1]:
                break  # every entry below is older than the n newest found
            tag = _tag_of(store, name, named)
            if tag is None or tag in seen:
                continue
            seen.add(tag)
            info = found.get(tag) or _read(store, tag, unsupported)
            if info is None:
                unsettled[name] = key
                continue
            found[tag] = info
            top = sorted([*top, info.sort_key[:2]], reverse=True)[:n]
        floor = top[-1] if len(top) == n else None
        above = {name for name, key in unsettled.items() if floor is None or key > floor}
        if not above or above <= previous:
            break  # none, or the same as before: a dead commit's, a folder removed by hand
        # Above the n-th newest, a tag did not read as committed: deleted since the
        # listing, and a newer one may have been committed meanwhile: list again.
        previous = above
        _drop(store)
    return sorted(found.values(), key=lambda info: info.sort_key, reverse=True)[:n]


def _read(
    store: Store, tag: str, unsupported: list[UnsupportedSchemaError] | None
) -> CheckpointInfo | None:
    """`read_committed`; None (said as list_committed says it) for a newer schema or a
    folder this user may not read, and for a name that is no tag."""
    try:
        return read_committed(store, tag)
    except UnsupportedSchemaError as exc:
        if unsupported is None:
            skip_unsupported(exc)
        else:
            unsupported.append(exc)
    except StorageError as exc:
        if not skip_unreadable(store, tag, exc):
            raise
    except ValueError:  # InvalidNameError: an entry no commit wrote
        pass
    return None


def above_newest(store: Store) -> list[str]:
    """The tag folders of `store` that may be newer than its newest committed checkpoint
    (`newest`): one without an entry whose step is at least the newest's (a save or
    persist under way or cut short writes the newest tag), one whose entry is at least
    the newest's (itself; a commit that died between its entry and its manifest); every
    folder when nothing is committed. One listing of the folders and one of the index.
    The entries above the newest whose folders are gone (removed by hand: a job rolled
    back) are removed, so that the tags can be saved again."""
    top = newest(store, 1)
    index = _index(store)  # before the folders: an entry written since is not removed
    folders = _folders(store)
    if not top:
        return folders
    key = top[0].sort_key[:2]
    present = set(folders)
    orphans = [
        name
        for name in index.names[: _above(index.names, key)]
        if (parsed := parse_entry(name)) is not None
        and not parsed[1].startswith(_HASHED)
        and parsed[1] not in present
    ]
    with contextlib.suppress(StorageError):
        for name in orphans:
            store.remove(INDEX_DIR, name, durable=False)
    if orphans:
        _drop(store)
    named = index.tags  # the tags with an entry
    above = index.names[: _above(index.names, key)]  # their entries at or above the newest
    out = {_tag_of(store, name, name[_PREFIX + 1 :]) or "" for name in above}
    # A folder without an entry: a save or persist under way, or cut short, or a tag an
    # older nebula committed (read by the caller, as every folder was).
    out |= {tag for tag in folders if tag not in named and order_key(tag)[0] >= key[0]}
    out |= {top[0].tag}
    return sorted(out & present)


def _above(names: list[str], key: Key) -> int:
    """How many of `names` (highest first) are entries at or above `key`."""
    count = 0
    for name in names:
        parsed = parse_entry(name)
        if parsed is not None and parsed[0] < key:
            break
        count += 1
    return count


def indexed_tags(store: Store) -> set[str]:
    """The tags `store`'s index names: committed as far as it tells (a commit that died
    between its entry and its manifest, a folder removed by hand below the newest
    aside), from one listing of the index. A hashed entry (a tag too long for a name)
    counts once its file is read."""
    index = _index(store)
    tags = set(index.tags)
    hashed = {tag for tag in tags if tag.startswith(_HASHED)}
    if hashed:
        tags -= hashed
        for name in index.names:
            if name[_PREFIX + 1 :] in hashed:
                tags.add(_tag_of(store, name, name[_PREFIX + 1 :]) or "")
    tags.discard("")
    return tags


def catalog(
    store: Store, unsupported: list[UnsupportedSchemaError] | None = None
) -> list[CheckpointInfo]:
    """Every committed checkpoint on `store`, oldest first (catalog.list_committed), kept
    by this process while the tier's folder names and index entries are the same (two
    listings; its own commits and deletes drop it): the first call reads each manifest,
    a later one nothing. What it finds without an entry is indexed (`index_missing`).
    `unsupported`: as list_committed's, the same each time."""
    folders, names = _folders(store), _index(store).names
    with _listings_lock:
        kept = _catalogs.get(store.location)
    if (
        kept is not None
        and kept[0] == folders
        and kept[1] == names
        and _manifests_there(store, [info.tag for info in kept[2]])
    ):
        refused = kept[3]
        listed = list(kept[2])
    else:
        refused = []
        listed = list_committed(store, refused)
        index_missing(store, listed)
        folders, names = _folders(store), _index(store).names
        with _listings_lock:
            _catalogs[store.location] = (folders, names, list(listed), refused)
    for exc in refused:
        if unsupported is None:
            skip_unsupported(exc)
        else:
            unsupported.append(exc)
    return listed


def _manifests_there(store: Store, tags: list[str]) -> bool:
    """Whether each of `tags` still has its manifest on `store`: a delete by another
    process removes the manifest first and the folder and its entry last, and a catalog
    kept meanwhile said the tag was committed while no tier held it (the concurrency
    campaign). One stat per tag on a local tier, one listing of the root elsewhere."""
    tree = store.list_tree()
    if tree is not None:
        return all(MANIFEST_NAME in tree.get(tag, {}) for tag in tags)
    if not store.is_local:
        return False  # no cheap look: list in full
    try:
        return all(store.exists(tag, MANIFEST_NAME) for tag in tags)
    except StorageError:
        return False


def index_missing(store: Store, committed: list[CheckpointInfo]) -> None:
    """Write the entries of the checkpoints of `committed` (a full listing of `store`)
    that have none: a tier an older nebula wrote, a folder copied in by hand. Best
    effort: a store this reader may not write to is listed in full again next time."""
    keys = _index(store).keys
    missing = [
        info
        for info in committed
        if keys.get(entry_name(info.tag, 0)[_PREFIX + 1 :], (-2, -1)) < info.sort_key[:2]
    ]
    if not missing:
        return

    def write(info: CheckpointInfo) -> None:
        record_commit(store, info.tag, info.sequence, durable=False)

    try:
        write(missing[0])  # the folder, once
        if store.is_local or len(missing) <= 2:
            for info in missing[1:]:
                write(info)
        else:
            with ThreadPoolExecutor(_REMOTE_WRITERS, thread_name_prefix="nebula-index") as pool:
                list(pool.map(write, missing[1:]))
    except (StorageError, RuntimeError) as exc:  # RuntimeError: the interpreter exiting
        log.debug("could not index %s: %s", store.url, exc)
    _drop(store)
