"""The commit index of a tier: one empty file per commit, whose name is its place in order,
and one per tag folder a writer began, in buckets by step (index_names.py).

    record_commit   the entry of a manifest about to be published, in its step's bucket
                    of the tier's `INDEX_DIR`, written before the manifest (commit.py)
    record_begun    the begun record of a tag folder, written before its writer marker
                    (commit.begin_tag): how a restart finds the folders at the top
    forget_tags     remove the entries and begun records of tags just deleted (delete.py)
    newest          the newest committed checkpoints of a tier: the highest buckets of
                    the index and the manifests of the few at its top
    above_newest    the folders at the top: where a restart looks for leftovers
    indexed_tags    the folders that have an entry: what a job knows committed
    catalog         every committed checkpoint, kept while the folders and the index
                    are the same
    index_missing   write the entries a full listing found missing (a root an older
                    nebula wrote, a folder copied in by hand)

"Newest" is names.order_key: the step a tag names, then the manifest's commit sequence.
An entry's name is `<step + 1>.<sequence>-<tag>`, both numbers 20 digits, so names sort
as their checkpoints do (the commit time, a tie-break, aside); it lies in the bucket of
its step, `.nebula-index/<first 14 digits>/<next 3>/`, so the names of the buckets from
the highest down, and of each bucket from the highest down, are every name in order
(index_walk.walk). The reader takes the names from the highest down, reads each one's
manifest, and stops once the next name is below the n-th newest found: it lists the
index's folder, the highest bucket of each level and its names, whatever the number of
checkpoints (at 10,000 tags of steps 1..10,000: 1 + 11 + 2 names, where a flat index
listed 10,000). (A tag too long for a name gets `-#<sha256>` instead, and the file holds
the tag.)

Why no committed checkpoint is missed: every manifest this version publishes (a commit,
a persist, `nebula copy`) has its entry, written before it (sequence.py reserved the
number the entry names), durably, in the bucket its name's digits say; so the highest
entry of a tag is at least its manifest's key, and the walk reaches it before any lower
name. Entries are removed only all together for a tag whose folder is gone
(`forget_tags`, after a delete), so a tag never keeps a lower entry without its higher
one. An entry whose manifest never came (a commit that died) or whose folder is gone
(removed by hand) only costs a read. A name outside the bucket its digits say (no
nebula writes one) is not read: it could be out of order. An older nebula wrote its
entries flat in `.nebula-index/` itself: the walk merges them in, in order, so such a
tier is read as before (and costs a listing of those names, until retention's deletes
have removed them). A tier with no entry at all (an older nebula's) is listed in full,
as before, and its entries written in buckets; so is a folder a full listing finds
without one (`index_missing`: `nm.list_checkpoints`, `nebula ls`).

Why no leftover at the top is missed: a folder that may hold one is either committed (an
entry) or begun by a writer: every writer of a tag folder on a tier other than the
memory tier (a persist, a save straight to the root, `nebula copy`, a resumed copy)
writes the tag's begun record `<step + 1>+<tag>`, durably, once the folder is there and
before it clears it or writes its writer marker (commit.begin_tag), and a dead writer's
leftover is judged by that marker only (an empty folder is no writer's leftover). So the
folders at or above the newest's step are the begun records and entries the walk meets
before the newest's step ends, each looked at (`Store.exists`, then recovery reads its
markers): no listing of the root's folders. A begun record is a hint, never trusted: its
folder may be empty (a crash before the marker), or be committed, or be another
writer's; recovery removes only a folder without a manifest whose writer markers all
name dead processes of this host, as before. A begun record stays until its tag is
deleted (`forget_tags`); one whose folder never came costs a stat while it is above the
newest. Where the newest itself has no begun record (a root an older nebula wrote,
clones, a folder copied in by hand), its writers may not have written them: the root's
folders are listed, as before.

Listings are kept by index_walk.py (a local folder's while it is unchanged and settled;
an object store's while `pinned`).

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage`, catalog.py,
index_names.py and index_walk.py. Not for: publishing the manifest (commit.py), the
sequence (sequence.py), or the full listing (catalog.py's `list_committed`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from nebulaml.errors import StorageError, UnsupportedSchemaError
from nebulaml.format.names import INDEX_DIR, MANIFEST_NAME, order_key, validate_name
from nebulaml.protocol.catalog import (
    CheckpointInfo,
    list_committed,
    read_committed,
    skip_unreadable,
    skip_unsupported,
)
from nebulaml.protocol.index_names import (
    DIGITS,
    HASHED,
    PREFIX,
    Key,
    begun_name,
    begun_path,
    bucket_of,
    entry_path,
    parse_begun,
    parse_entry,
    tag_key,
)
from nebulaml.protocol.index_walk import Folder, drop, folders, on_drop, walk
from nebulaml.protocol.index_walk import _listings as _listings  # tests: a fresh process
from nebulaml.protocol.index_walk import pinned as pinned
from nebulaml.storage.store import MissingFileError, Store

log = logging.getLogger("nebulaml")

# How many times `newest` lists while an entry above the newest found did not read as
# committed (deleted meanwhile by retention or a prune), as catalog.list_committed.
_LIST_PASSES = 3
_REMOTE_WRITERS = 8  # entries an object store's listing writes at once


def _write(store: Store, path: tuple[str, ...], data: bytes, durable: bool) -> None:
    drop(store)
    try:
        store.write_bytes(path, data, durable=durable)
    except MissingFileError:  # the bucket's first name
        store.make_dir(*path[:-1])
        store.write_bytes(path, data, durable=durable)


def _hashed_data(tag: str, name: str, sep_at: int) -> bytes:
    hashed = name[sep_at + 1 :].startswith(HASHED)
    return tag.encode("utf-8", "surrogatepass") if hashed else b""


def record_commit(store: Store, tag: str, sequence: int, *, durable: bool = True) -> None:
    """Write the entry of `tag`'s manifest of `sequence`, about to be published on
    `store` (before it: a manifest never lacks its entry), in its step's bucket. A
    failure fails the commit, as the manifest's would. `durable=False`: the entry of a
    manifest already there (`index_missing`), which a crash may lose: the tag then has
    none, as before.

    Example:
        >>> import tempfile
        >>> store = Store(tempfile.mkdtemp())
        >>> record_commit(store, "global_step7", 12)
        >>> [info for info in newest(store)]  # an entry without its manifest: not committed
        []
    """
    path = entry_path(tag, sequence)
    _write(store, path, _hashed_data(tag, path[-1], PREFIX), durable)


def record_begun(store: Store, tag: str) -> None:
    """Write, durably, that a writer begins `tag`'s folder on `store`: before it clears
    the folder or writes its writer marker (commit.begin_tag), so that a restart finds a
    dead writer's leftover at the top without listing the root (the module's docstring).
    Written again by each writer of the tag: one file, replaced.

    Example:
        >>> import tempfile
        >>> store = Store(tempfile.mkdtemp())
        >>> record_begun(store, "global_step7")
        >>> store.exists(*begun_path("global_step7"))
        True
    """
    path = begun_path(tag)
    _write(store, path, _hashed_data(tag, path[-1], DIGITS), True)


_catalogs_lock = threading.Lock()


def _tag_of(store: Store, name: str, folder: Folder, tag: str) -> str | None:
    """The tag a name names (`tag`, or a hashed name's file); None if unreadable."""
    if not tag.startswith(HASHED):
        return tag
    try:
        return store.read_bytes(*folder, name).decode("utf-8", "surrogatepass")
    except (StorageError, UnicodeDecodeError):
        return None


def forget_tags(store: Store, tags: Iterable[str]) -> None:
    """Remove every entry and begun record of `tags`, whose folders were just deleted
    from `store`: in each tag's bucket, and the flat entries of an older nebula. Best
    effort: a name left behind costs a reader one read (its folder is gone)."""
    gone = set(tags)
    if not gone:
        return
    drop(store)
    keys = gone | {tag_key(tag) for tag in gone}
    keys |= {begun_name(tag)[DIGITS + 1 :] for tag in gone}
    places: set[Folder] = {(INDEX_DIR,)}
    places |= {(INDEX_DIR, *bucket_of(begun_name(tag))) for tag in gone}
    try:
        for folder in sorted(places):
            for name in store.list_file_names(*folder):
                parsed = parse_entry(name)
                named = parsed[1] if parsed is not None else (parse_begun(name) or (0, ""))[1]
                if named in keys:
                    store.remove(*folder, name, durable=False)
    except StorageError as exc:
        log.debug("could not remove the index entries of %s: %s", sorted(gone), exc)
    drop(store)


def newest(
    store: Store,
    n: int = 1,
    unsupported: list[UnsupportedSchemaError] | None = None,
) -> list[CheckpointInfo]:
    """The `n` newest committed checkpoints on `store`, newest first: what
    `list_committed(store)[-n:]` holds, from the highest buckets of the index and the
    manifests at its top (the module's docstring says why none is missed). A manifest of
    a schema this version cannot read, or a folder this user may not read, is skipped as
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
        seen: set[str] = set()
        top: list[Key] = []  # the keys of the n newest found, highest first
        unsettled: dict[str, Key] = {}  # entries that did not read as committed
        any_entry = False
        for name, folder in walk(store):
            parsed = parse_entry(name)
            if parsed is None:
                continue  # a begun record
            any_entry = True
            key, named = parsed
            if len(top) == n and key < top[-1]:
                break  # every entry below is older than the n newest found
            tag = _tag_of(store, name, folder, named)
            if tag is None or tag in seen:
                continue
            seen.add(tag)
            info = found.get(tag) or _read(store, tag, unsupported)
            if info is None:
                unsettled[name] = key
                continue
            found[tag] = info
            top = sorted([*top, info.sort_key[:2]], reverse=True)[:n]
        if not any_entry:
            if not folders(store):
                return []
            committed = list_committed(store, unsupported)
            index_missing(store, committed)
            return committed[::-1][:n]
        floor = top[-1] if len(top) == n else None
        above = {name for name, key in unsettled.items() if floor is None or key > floor}
        if not above or above <= previous:
            break  # none, or the same as before: a dead commit's, a folder removed by hand
        # Above the n-th newest, a tag did not read as committed: deleted since the
        # listing, and a newer one may have been committed meanwhile: list again.
        previous = above
        drop(store)
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
    (`newest`): one begun by a writer (a begun record) whose step is at least the
    newest's (a save or persist under way or cut short writes the newest tag), one whose
    entry is at least the newest's (itself; a commit that died between its entry and its
    manifest), each there; every folder when nothing is committed, or when the newest
    has no begun record (its writers may not write them: an older nebula's root). From
    the index's highest buckets and a look at each: no listing of the root's folders
    (the module's docstring says why none is missed). The entries above the newest whose
    folders are gone (removed by hand: a job rolled back) are removed, so that the tags
    can be saved again.

    Example:
        >>> import tempfile
        >>> above_newest(Store(tempfile.mkdtemp()))
        []
    """
    top = newest(store, 1)
    if not top:
        return folders(store)
    key = top[0].sort_key[:2]
    entries: list[tuple[str, Folder, str]] = []  # at or above the newest: name, folder, tag
    begun: set[str] = set()  # the tags begun at or above the newest's step
    for name, folder in walk(store):
        parsed = parse_entry(name)
        if parsed is not None:
            if parsed[0][0] < key[0]:
                break  # every name below is of a lower step
            if parsed[0] >= key:
                entries.append((name, folder, parsed[1]))
            continue  # an entry of the newest's step below it: its begun records follow
        started = parse_begun(name)
        if started is None:
            continue
        if started[0] < key[0]:
            break
        begun.add(_tag_of(store, name, folder, started[1]) or "")
    if top[0].tag not in begun:
        return _above_by_listing(store, key, top[0].tag, entries)
    tags = {_tag_of(store, name, folder, tag) or "" for name, folder, tag in entries}
    present = {tag for tag in tags | begun | {top[0].tag} if _there(store, tag)}
    _remove_orphans(store, entries, present)
    return sorted(present)


def _there(store: Store, tag: str) -> bool:
    """Whether `tag` is a tag's name and its folder is on `store` (a name from the index
    is a hint: one no writer could have made is never looked up)."""
    try:
        validate_name("tag", tag)
    except ValueError:
        return False
    try:
        return store.exists(tag)
    except StorageError:
        return True  # looked at by recovery, which says why it cannot


def _above_by_listing(
    store: Store, key: Key, newest_tag: str, entries: list[tuple[str, Folder, str]]
) -> list[str]:
    """`above_newest` from a listing of the root's folders: those without an entry whose
    step is at least the newest's, and those whose entry is at least the newest's."""
    present = set(folders(store))
    named = indexed_tags(store)
    out = {_tag_of(store, name, folder, tag) or "" for name, folder, tag in entries}
    # A folder without an entry: a save or persist under way, or cut short, or a tag an
    # older nebula committed (read by the caller, as every folder was).
    out |= {tag for tag in present if tag not in named and order_key(tag)[0] >= key[0]}
    out |= {newest_tag}
    _remove_orphans(store, entries, present)
    return sorted(out & present)


def _remove_orphans(
    store: Store, entries: list[tuple[str, Folder, str]], present: set[str]
) -> None:
    """Remove the entries above the newest whose folders are not `present` (removed by
    hand), so that the tags can be saved again."""
    orphans = [
        (name, folder)
        for name, folder, tag in entries
        if not tag.startswith(HASHED) and tag not in present
    ]
    with contextlib.suppress(StorageError):
        for name, folder in orphans:
            store.remove(*folder, name, durable=False)
    if orphans:
        drop(store)


def indexed_tags(store: Store) -> set[str]:
    """The tags `store`'s index names: committed as far as it tells (a commit that died
    between its entry and its manifest, a folder removed by hand below the newest
    aside), from a walk of the whole index. A hashed entry (a tag too long for a name)
    counts once its file is read.

    Example:
        >>> import tempfile
        >>> store = Store(tempfile.mkdtemp())
        >>> record_commit(store, "global_step7", 12)
        >>> indexed_tags(store)
        {'global_step7'}
    """
    tags: set[str] = set()
    for name, folder in walk(store):
        parsed = parse_entry(name)
        if parsed is not None:
            tags.add(_tag_of(store, name, folder, parsed[1]) or "")
    tags.discard("")
    return tags


# The full catalog of each tier this process listed (`catalog`), by the folder names and
# index names it was listed under: (names, entries, checkpoints, unsupported schemas).
_Catalog = tuple[list[str], list[str], list[CheckpointInfo], list[UnsupportedSchemaError]]
_catalogs: dict[str, _Catalog] = {}


def _forget_catalog(location: str) -> None:
    with _catalogs_lock:
        _catalogs.pop(location, None)


on_drop.append(_forget_catalog)


def _names(store: Store) -> list[str]:
    """Every name of `store`'s index, highest first (a whole walk)."""
    return [name for name, _folder in walk(store)]


def catalog(
    store: Store, unsupported: list[UnsupportedSchemaError] | None = None
) -> list[CheckpointInfo]:
    """Every committed checkpoint on `store`, oldest first (catalog.list_committed), kept
    by this process while the tier's folder names and index entries are the same (two
    listings; its own commits and deletes drop it): the first call reads each manifest,
    a later one nothing. What it finds without an entry is indexed (`index_missing`).
    `unsupported`: as list_committed's, the same each time."""
    listed_folders, names = folders(store), _names(store)
    with _catalogs_lock:
        kept = _catalogs.get(store.location)
    if (
        kept is not None
        and kept[0] == listed_folders
        and kept[1] == names
        and _manifests_there(store, [info.tag for info in kept[2]])
    ):
        refused = kept[3]
        listed = list(kept[2])
    else:
        refused = []
        listed = list_committed(store, refused)
        index_missing(store, listed)
        listed_folders, names = folders(store), _names(store)
        with _catalogs_lock:
            _catalogs[store.location] = (listed_folders, names, list(listed), refused)
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
    keys: dict[str, Key] = {}
    for name, _folder in walk(store):
        parsed = parse_entry(name)
        if parsed is not None and parsed[0] > keys.get(parsed[1], (-2, -1)):
            keys[parsed[1]] = parsed[0]
    missing = [
        info for info in committed if keys.get(tag_key(info.tag), (-2, -1)) < info.sort_key[:2]
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
    drop(store)
