"""What is committed on a tier: reading manifests and listing checkpoints.

A checkpoint is visible only when its manifest is present and valid and every file it
lists is there with its size ("committed or invisible": docs/architecture.md). A manifest of
a schema this nebula cannot read (a newer nebula's) leaves its tag out of listings with one
warning naming it and the nebula that reads it (`skip_unsupported`): committed, but not
this version's to load or delete; an unreadable one is reported with a warning and the tag
treated as not committed. A tag folder this user may not read (another user's, mode 000)
is left out of listings with one warning naming it (`skip_unreadable`): the others are
listed.

May import: `nebulaml.errors`, `nebulaml.format` and `nebulaml.storage`. Not for: writing
(commit.py), deleting (delete.py), or the leftovers of crashed saves (recovery.py).
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from nebulaml.errors import (
    InvalidNameError,
    ManifestError,
    NebulaError,
    StorageError,
    UnsupportedSchemaError,
    exception_chain,
)
from nebulaml.format.jsonbounds import MAX_MANIFEST_BYTES, JsonBoundsError, load_json
from nebulaml.format.manifest import Manifest, parse_manifest
from nebulaml.format.names import (
    MANIFEST_NAME,
    SEQUENCE_FILE,
    OrderKey,
    order_key,
    validate_name,
)
from nebulaml.storage.store import MissingFileError, Store

log = logging.getLogger("nebulaml")
_said: set[str] = set()  # what this process has said it ignores (a listing reads 3 times)
_SAID_MAX = 10_000


def _ignoring(message: str, *args: object, key: str | None = None) -> None:
    """Warn that a checkpoint is ignored, once per process for one message (or `key`): a
    listing reads a tier up to `_LIST_PASSES` times, and a command lists more than once."""
    text = message % args
    said = text if key is None else key
    if said in _said:
        log.debug("%s", text)
        return
    if len(_said) < _SAID_MAX:
        _said.add(said)
    log.warning("%s", text)


def is_unreadable(exc: StorageError) -> bool:
    """Whether `exc` is a permission refused (EACCES, EPERM): what this user may not read,
    as opposed to a store that fails."""
    return any(isinstance(cause, PermissionError) for cause in exception_chain(exc))


def skip_unreadable(store: Store, tag: str, exc: StorageError) -> bool:
    """Whether a listing goes on without `tag`, whose folder raised `exc`: True when this
    user may not read it (`is_unreadable`), said once per process and folder, naming it
    (a command lists a root several times, by several functions); False for any other
    failure, which the caller raises."""
    if not is_unreadable(exc):
        return False
    where = store.display(tag)
    _ignoring("tag folder %s skipped: it could not be read (%s)", where, exc,
              key=f"unreadable {where}")  # fmt: skip
    return True


def skip_unsupported(exc: UnsupportedSchemaError) -> None:
    """Say, once per process and manifest, that a listing goes on without the tag whose
    manifest raised `exc` (a schema this nebula cannot read), naming the tag and the
    nebula that reads it."""
    _ignoring("skipping checkpoint %r: %s", exc.tag, exc, key=f"unsupported {exc.where}")


_SEQUENCE_MAX_BYTES = 4096

# How many times `list_committed` lists the folders while newer ones are in flux.
_LIST_PASSES = 3
# Manifests an object store's listing reads at once: each is a request that waits on the
# service (a 1,000-tag Azure root read one at a time took 13 s in a fresh process).
_REMOTE_READERS = 8


@dataclass(frozen=True, slots=True, eq=False)
class CheckpointInfo:
    """One committed checkpoint on one tier."""

    store: Store
    manifest: Manifest

    @property
    def tag(self) -> str:
        return self.manifest.tag

    @property
    def committed_at(self) -> str:
        return self.manifest.committed_at

    @property
    def sequence(self) -> int:
        return self.manifest.sequence

    @property
    def sort_key(self) -> OrderKey:
        return self.manifest.sort_key


def read_manifest(store: Store, tag: str) -> Manifest | None:
    """The manifest of `tag` on `store` if present and valid, without checking its files.

    None when there is none; an unreadable one is reported with a warning and counts as
    none. Raises `UnsupportedSchemaError` for a manifest this version cannot read.
    """
    validate_name("tag", tag)
    where = store.display(tag, MANIFEST_NAME)
    try:
        manifest = parse_manifest(store.read_bytes(tag, MANIFEST_NAME), where)
    except UnsupportedSchemaError as exc:
        exc.tag = tag
        raise
    except MissingFileError:
        return None
    except ManifestError as exc:
        _ignoring("ignoring checkpoint %r: %s", tag, exc)
        return None
    if manifest.tag != tag:
        _ignoring("ignoring %s: it names tag %r", where, manifest.tag)
        return None
    return manifest


# Manifests this process has read, by root location and tag: the manifest file's identity
# when read (local: inode, size, mtime; an object store: size and the version its
# listing gives, an ETag), and the manifest. A committed manifest is never changed in
# place (a tag saved again is deleted and committed anew: another file), so while its
# identity is the same it need not be read, parsed and checked again: listing a local
# root of 10,000 checkpoints costs a few stats per tag, an Azure root one folder listing.
# Bounded by the tags that exist: each listing of a root's tags (`tag_folders`: retention
# after a persist, `list_committed`) drops those no longer there (`_forget_absent`), so a
# job that saves and retires tags for days keeps the manifests of what its roots hold
# (and of what its last retention deleted); `_MANIFESTS_MAX` bounds a process that reads
# many roots.
_MANIFESTS: dict[str, dict[str, tuple[tuple[Any, ...], Manifest]]] = {}
_MANIFESTS_MAX = 200_000
_manifests_lock = threading.Lock()


def _forget_absent(store: Store, tags: list[str]) -> None:
    """Drop the cached manifests of `store`'s root whose tags are not among `tags` (a
    listing of its folders): retired, pruned or evicted since they were read."""
    present = set(tags)
    with _manifests_lock:
        cached = _MANIFESTS.get(store.location)
        if cached is None:
            return
        for tag in [tag for tag in cached if tag not in present]:
            del cached[tag]
        if not cached:
            del _MANIFESTS[store.location]


def read_committed(
    store: Store, tag: str, listed: dict[str, tuple[int, str | None]] | None = None
) -> CheckpointInfo | None:
    """The committed checkpoint `tag` on `store`, or None if it is absent or incomplete
    (an item file missing or of the wrong size). `listed`: on an object store, the tag
    folder's files as a listing of the root just gave them (`Store.list_tree`).

    A manifest read before and not replaced since is not read again (a local root: its
    inode, size and mtime; an object store: its version in the folder's listing); its
    items' sizes are checked all the same (one stat each; the same listing).

    Raises `UnsupportedSchemaError` for a manifest this version cannot read.
    """
    if not is_tag(tag):
        validate_name("tag", tag)  # raises, saying why
    files: dict[str, int] | None = None  # the tag's folder, when listed here
    identity: tuple[Any, ...] | None
    if store.is_local:
        identity = store.file_identity(tag, MANIFEST_NAME)
    else:
        # An object store: one listing of the folder gives the manifest's version.
        if listed is None:
            listed = store.list_versions(tag)
        if listed is None:
            return _read_committed(store, tag)
        files = {name: size for name, (size, _) in listed.items()}
        entry = listed.get(MANIFEST_NAME)
        identity = None if entry is None or entry[1] is None else entry
    if identity is not None:
        with _manifests_lock:
            cached = _MANIFESTS.get(store.location, {}).get(tag)
        if cached is not None and cached[0] == identity:
            manifest = cached[1]
            sized = (
                (lambda f, n: _has_size(store, tag, f, n))
                if files is None
                else (lambda f, n: files.get(f) == n)
            )
            if all(sized(item.file, item.size_bytes) for item in manifest.items):
                return CheckpointInfo(store, manifest)
    info = _read_committed(store, tag, files)
    if info is not None and identity is not None:
        with _manifests_lock:
            if sum(map(len, _MANIFESTS.values())) >= _MANIFESTS_MAX:
                _MANIFESTS.clear()
            _MANIFESTS.setdefault(store.location, {})[tag] = (identity, info.manifest)
    return info


def _has_size(store: Store, tag: str, file: str, size: int) -> bool:
    identity = store.file_identity(tag, file)
    return identity is not None and identity[1] == size


def _read_committed(
    store: Store, tag: str, files: dict[str, int] | None = None
) -> CheckpointInfo | None:
    if files is None:
        files = store.list_files(tag)
    if MANIFEST_NAME not in files:
        return None
    if files[MANIFEST_NAME] > MAX_MANIFEST_BYTES:  # not read: too large to be one of ours
        where = store.display(tag, MANIFEST_NAME)
        _ignoring("ignoring checkpoint %r: %s is %d bytes, more than %d",
                  tag, where, files[MANIFEST_NAME], MAX_MANIFEST_BYTES)  # fmt: skip
        return None
    manifest = read_manifest(store, tag)
    if manifest is None:
        return None
    for item in manifest.items:
        size = files.get(item.file)
        if size != item.size_bytes:
            if size is not None:
                what = f"has {size} bytes, not {item.size_bytes}"
            elif store.exists(tag, item.file):  # a link, a FIFO, a folder in its place
                what = "is not a regular file"
            else:
                what = "is missing"
            _ignoring("ignoring checkpoint %r at %s: item file %r %s",
                      tag, store.url, item.file, what)  # fmt: skip
            return None
    return CheckpointInfo(store, manifest)


def tag_folders(store: Store, tree: dict[str, Any] | None = None) -> list[str]:
    """The folders of `store` whose names are tags (others are not folders nebula writes);
    `tree`: an object store's listing of its root (`Store.list_tree`), else it is listed.
    The cached manifests of its tags no longer there are dropped (`_forget_absent`).

    Example:
        >>> import tempfile
        >>> tag_folders(Store(tempfile.mkdtemp()))
        []
    """
    tags = [name for name in (store.list_dirs() if tree is None else tree) if is_tag(name)]
    _forget_absent(store, tags)
    return tags


@functools.lru_cache(maxsize=1 << 16)
def is_tag(name: str) -> bool:
    """Whether a folder name is a tag name (remembered: a root of 10,000 checkpoints is
    listed on every persist's retention)."""
    try:
        validate_name("tag", name)
    except InvalidNameError:
        return False
    return True


def list_committed(
    store: Store,
    unsupported: list[UnsupportedSchemaError] | None = None,
    unreadable: list[tuple[str, StorageError]] | None = None,
) -> list[CheckpointInfo]:
    """Committed checkpoints on `store`, oldest first (see names.order_key).

    A listing is not a snapshot: a tag listed may be deleted before its manifest is read,
    and a tag committed after the folders were listed is not in them. Retention, eviction
    and prune delete a tag once a newer one is committed, so while training saves and
    evicts, one pass can miss every tag at least as new as the newest and return an older
    one as the newest, or none (the concurrency campaign's "newest deleted"). So while a
    folder newer than the newest found did not read as committed (deleted meanwhile, or
    still being written), the folders are listed again and the newer ones read, up to
    `_LIST_PASSES` times in all.

    A manifest of a schema this version cannot read is left out, said once
    (`skip_unsupported`), or, when the caller passes an `unsupported` list (to look for
    another tier's readable copy, or to say it otherwise), appended to it and left out.
    A tag folder this user may not read is left out with one warning
    (`skip_unreadable`), and appended as (tag, error) to `unreadable` when the caller
    passes one (to report it).

    Example:
        >>> import tempfile
        >>> list_committed(Store(tempfile.mkdtemp()))
        []
    """
    found: dict[str, CheckpointInfo] = {}
    refused: set[str] = set()  # an unsupported schema or an unreadable folder, said once
    newest: OrderKey | None = None  # the sort key of the newest found so far
    for _ in range(_LIST_PASSES):
        unsettled: list[str] = []  # folders that did not read as committed
        # An object store: one listing of the whole root, not one per folder.
        tree = store.list_tree()
        folders = tag_folders(store) if tree is None else tag_folders(store, tree)
        todo = [
            tag
            for tag in folders
            if tag not in found
            and tag not in refused
            # a later pass looks only for what is newer than the newest
            and (newest is None or order_key(tag) > newest)
        ]
        for tag, info in _read_each(store, todo, tree):
            if isinstance(info, UnsupportedSchemaError):
                if unsupported is None:
                    skip_unsupported(info)
                else:
                    unsupported.append(info)
                refused.add(tag)
            elif isinstance(info, StorageError):
                if unreadable is not None:
                    unreadable.append((tag, info))
                refused.add(tag)
            elif info is not None:
                found[tag] = info
            else:
                unsettled.append(tag)
        newest = max((info.sort_key for info in found.values()), default=None)
        if not any(newest is None or order_key(tag) > newest for tag in unsettled):
            break
    return sorted(found.values(), key=lambda info: info.sort_key)


_Read = CheckpointInfo | UnsupportedSchemaError | StorageError | None


def _read_each(
    store: Store, tags: list[str], tree: dict[str, dict[str, tuple[int, str | None]]] | None
) -> list[tuple[str, _Read]]:
    """`read_committed` of each tag, in order (a schema this version cannot read, or a
    folder this user may not read, said by `skip_unreadable`: its error, not raised); an
    object store's (`tree`: its root's listing) several at once."""

    def one(tag: str) -> tuple[str, _Read]:
        try:
            return tag, read_committed(store, tag, None if tree is None else tree[tag])
        except UnsupportedSchemaError as exc:
            return tag, exc
        except StorageError as exc:
            if not skip_unreadable(store, tag, exc):
                raise
            return tag, exc

    if tree is not None and len(tags) > 1:
        with ThreadPoolExecutor(_REMOTE_READERS, thread_name_prefix="nebula-list") as pool:
            try:
                reads = [pool.submit(one, tag) for tag in tags]
            except RuntimeError:  # the interpreter is exiting (an exit persist): no thread
                reads = []
            if reads:
                return [read.result() for read in reads]
    return [one(tag) for tag in tags]


def highest_sequence(store: Store) -> int:
    """The highest commit sequence reserved on `store` (0: none): a commit there takes
    the next one (sequence.py's `reserve_sequence`).

    Read from the tier's `SEQUENCE_FILE`, one small read however many checkpoints the
    tier holds; only where it is missing or unreadable (a tier an older nebula wrote, or
    an operator's hand) are the manifests read (`scan_sequence`).
    """
    counted = read_sequence_file(store)
    return counted if counted is not None else scan_sequence(store)


def read_sequence_file(store: Store) -> int | None:
    """The sequence `SEQUENCE_FILE` records on `store`; None when it is missing or not a
    small JSON object with a non-negative integer `sequence`."""
    try:
        data = store.read_bytes(SEQUENCE_FILE)
        doc = load_json(data, max_bytes=_SEQUENCE_MAX_BYTES)
    except (MissingFileError, JsonBoundsError):
        return None
    except NebulaError as exc:  # not a regular file, a link: the scan answers
        log.debug("reading %s: %s", store.display(SEQUENCE_FILE), exc)
        return None
    value = doc.get("sequence") if isinstance(doc, dict) else None
    if type(value) is not int or value < 0:
        return None
    return value


def scan_sequence(store: Store) -> int:
    """The highest commit sequence of the checkpoints committed on `store`, from every
    manifest (0: none, or only schema 1 manifests); a manifest of a schema this version
    cannot read is passed over."""
    highest = 0
    for tag in store.list_dirs():
        try:
            info = read_committed(store, tag)
        except (InvalidNameError, UnsupportedSchemaError):
            continue
        if info is not None:
            highest = max(highest, info.sequence)
    return highest
