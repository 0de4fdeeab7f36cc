"""Verifying checkpoints: every copy of every item, re-read and checked against its manifest.

Unlike listing (catalog.py), which hides a tag whose manifest is unreadable or whose files
are missing, or whose folder this user may not read, verification reports each such copy
as a failure: that is what it is for.
Items are hashed while they are read, in chunks, so memory stays flat for any item size.

Not for: repairing anything, or choosing which copy to load (checkpoint.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nebulaml.errors import (
    CheckpointNotFoundError,
    InvalidNameError,
    ManifestError,
    StorageError,
    UnsupportedSchemaError,
)
from nebulaml.format.checksum import KNOWN_CHECKSUM_ALGOS, hash_stream, unknown_algo
from nebulaml.format.manifest import ItemEntry, Manifest
from nebulaml.format.names import MANIFEST_NAME, RANK_PREFIX, OrderKey, order_key, validate_name
from nebulaml.ops.inspection import list_tag_again, read_manifest_strict
from nebulaml.protocol.catalog import is_unreadable
from nebulaml.protocol.leases import delete_claims, read_lease
from nebulaml.runtime.locate import check_root, tiers_for
from nebulaml.storage.store import MissingFileError, Store

PathLike = str | os.PathLike[str]
Progress = Callable[[int, int], None]

_CHUNK_BYTES = 8 << 20
_TIER_ORDER = {"memory": 0, "persistent": 1}


@dataclass(frozen=True, slots=True)
class _Copy:
    """One tier's copy of one tag, as found before any item is read."""

    tier: str
    store: Store
    tag: str
    files: dict[str, int]
    manifest: Manifest | None
    error: ManifestError | StorageError | None  # a StorageError: a folder it may not read

    @property
    def sort_key(self) -> OrderKey:
        return self.manifest.sort_key if self.manifest else order_key(self.tag)

    def to_read(self) -> list[ItemEntry]:
        """Items whose file is there with its recorded size: the ones worth hashing."""
        if self.manifest is None:
            return []
        return [
            item
            for item in self.manifest.items
            if self.files.get(item.file) == item.size_bytes
            and item.checksum_algo in KNOWN_CHECKSUM_ALGOS
        ]


def verify_checkpoints(
    root: PathLike, tag: str | None = None, progress: Progress | None = None
) -> list[dict[str, Any]]:
    """Re-read every item of every checkpoint at `root` (or only `tag`), on every tier
    (the root and its memory tier on this node), and check sizes and checksums.

    Returns one JSON-serialisable dict per item per tier, newest tag first: `tag`, `tier`,
    `item` (None for the manifest itself, the marker's name for a rank marker that is no
    regular file, `"corrupt"`), `file` (where it is), `status` (`"ok"`,
    `"corrupt"`, `"missing"`, `"unchecked"`: committed, but a delete of it is claimed
    and did not end, so it was not read, `"unreadable"`: a tag folder this user may
    not read, `file` naming the folder, or `"unsupported"`: a manifest of a schema this
    nebula cannot read, a newer nebula's, its items not read), `expected` and `actual`
    (e.g. `"1829 bytes with xxh3_64 9f3c..."`), and the same as objects,
    `expected_checksum` and `actual_checksum`: `{size_bytes, algo, checksum}` (a field
    None where it is not known; the object None for no file, or for a manifest). Where
    two tiers hold one tag with different bytes for an item, one more dict says so:
    `tier` `"memory+persistent"`, `status` `"differs"`, `file` naming both.
    A manifest that is present but unreadable or invalid is a `"corrupt"`
    result; folders without a manifest (saves that never committed) are not checkpoints
    and are skipped. `progress(bytes_done, bytes_total)` is called as bytes are read.
    Raises `RootNotFoundError`, and `CheckpointNotFoundError` if `tag` has a manifest on
    no tier.

    Example:
        >>> import nebulaml as nm, tempfile
        >>> root = tempfile.mkdtemp()
        >>> nm.init(root)
        >>> nm.Checkpoint("global_step1").save("model", {"lr": 0.5})
        >>> nm.flush_persistence()  # on both tiers now
        True
        >>> [(r["tier"], r["item"], r["status"]) for r in nm.ops.verify_checkpoints(root)]
        [('memory', 'model', 'ok'), ('persistent', 'model', 'ok')]
    """
    if tag is not None:
        validate_name("tag", tag)
    location = check_root(root)
    copies = _find_copies(root, tag)
    if tag is not None and not copies:
        raise CheckpointNotFoundError(location, tag)
    newest: dict[str, OrderKey] = {}
    for copy in copies:
        newest[copy.tag] = max(newest.get(copy.tag, copy.sort_key), copy.sort_key)
    copies.sort(key=lambda c: _TIER_ORDER.get(c.tier, len(_TIER_ORDER)))
    copies.sort(key=lambda c: newest[c.tag], reverse=True)
    total = sum(item.size_bytes for copy in copies for item in copy.to_read())
    done = 0
    if progress is not None:
        progress(0, total)

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    results: list[dict[str, Any]] = []
    for copy in copies:
        results.extend(_verify_copy(copy, advance))
    # Each copy can be sound and still not be the same checkpoint as another tier's (a
    # memory tier left by an earlier root of that name): a load would depend on the tier.
    for difference in _compare_tiers(copies):
        same = [i + 1 for i, r in enumerate(results) if r["tag"] == difference["tag"]]
        results.insert(max(same, default=len(results)), difference)
    return results


def _fields(size: int | None, algo: str | None = None, checksum: str | None = None
            ) -> dict[str, Any]:  # fmt: skip
    return {"size_bytes": size, "algo": algo, "checksum": checksum}


def _entry_fields(item: ItemEntry | None) -> dict[str, Any] | None:
    return None if item is None else _fields(item.size_bytes, item.checksum_algo, item.checksum)


def _describe(item: ItemEntry | None) -> str:
    if item is None:
        return "no such item"
    return f"{item.size_bytes} bytes with {item.checksum_algo} {item.checksum}"


def _compare_tiers(copies: list[_Copy]) -> list[dict[str, Any]]:
    """A `"differs"` result for every item that two tiers hold with other bytes under one
    tag (or that only one of them lists), naming both copies."""
    by_tag: dict[str, list[_Copy]] = {}
    for copy in copies:
        if copy.manifest is not None:
            by_tag.setdefault(copy.tag, []).append(copy)
    out = []
    for tag, group in by_tag.items():
        first = group[0]
        assert first.manifest is not None
        mine = {item.name: item for item in first.manifest.items}
        for other in group[1:]:
            assert other.manifest is not None
            theirs = {item.name: item for item in other.manifest.items}
            for name in sorted(set(mine) | set(theirs)):
                a, b = mine.get(name), theirs.get(name)
                if a is not None and b is not None and (a.size_bytes, a.checksum_algo,
                                                        a.checksum) == (b.size_bytes,
                                                        b.checksum_algo, b.checksum):  # fmt: skip
                    continue
                where_a = first.store.display(tag, a.file if a else name)
                where_b = other.store.display(tag, b.file if b else name)
                out.append(
                    {
                        "tag": tag,
                        "tier": f"{first.tier}+{other.tier}",
                        "item": name,
                        "file": f"{where_a} ({first.tier}) and {where_b} ({other.tier})",
                        "status": "differs",
                        "expected": f"{other.tier}: {_describe(b)}",
                        "actual": f"{first.tier}: {_describe(a)}",
                        "expected_checksum": _entry_fields(b),
                        "actual_checksum": _entry_fields(a),
                    }
                )
    return out


def _find_copies(root: PathLike, tag: str | None) -> list[_Copy]:
    copies = []
    for tier, store in tiers_for(root, "verify_checkpoints").stores:
        for name in [tag] if tag is not None else store.list_dirs():
            try:
                validate_name("tag", name)
            except InvalidNameError:
                continue  # not a folder nebula writes
            try:
                copy = _find_copy(tier, store, name)
            except StorageError as exc:
                if not is_unreadable(exc):
                    raise
                # A folder this user may not read: a failure, and the others are checked.
                copy = _Copy(tier, store, name, {}, None, exc)
            if copy is not None:
                copies.append(copy)
    return copies


def _find_copy(tier: str, store: Store, name: str) -> _Copy | None:
    """The copy of tag `name` on `store`; None where it is not a checkpoint (never
    committed there, or deleted while we looked)."""
    files = store.list_files(name)
    if MANIFEST_NAME not in files and store.exists(name, MANIFEST_NAME):
        # Committed just now, between the two looks; or a scan that missed it (a
        # folder's entries changing under a scan may be skipped by it).
        files = list_tag_again(store, name)
    if MANIFEST_NAME not in files and _regular_after_all(store, name):
        files = list_tag_again(store, name)  # a commit or an evict under our looks
    if MANIFEST_NAME not in files:
        if store.exists(name, MANIFEST_NAME) and not _regular_after_all(store, name):
            # A folder, FIFO or link in the manifest's place: not a save that never
            # committed, a checkpoint that cannot be checked (corrupt, exit 1).
            where = store.display(name, MANIFEST_NAME)
            bad = ManifestError(where, "not a regular file; nebula reads only its own")
            return _Copy(tier, store, name, files, None, bad)
        return None  # never committed here: not a checkpoint (see `nebula ls --all`)
    try:
        manifest, error = read_manifest_strict(store, name), None
    except ManifestError as exc:
        manifest, error = None, exc
    if manifest is None and error is None:
        return None  # deleted while we looked
    return _Copy(tier, store, name, files, manifest, error)


def _regular_after_all(store: Store, tag: str) -> bool:
    """Whether `tag`'s manifest is, at this look, a regular file (a local root: its
    identity, from lstat), so that a scan or a look that raced a commit or an eviction
    is not taken for a FIFO or a folder in its place. Elsewhere False: the looks before
    decide."""
    return store.file_identity(tag, MANIFEST_NAME) is not None


def _result(copy: _Copy, item: str | None, file: str, status: str, expected: str,
            actual: str, expected_checksum: dict[str, Any] | None = None,
            actual_checksum: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    return {
        "tag": copy.tag,
        "tier": copy.tier,
        "item": item,
        "file": file,
        "status": status,
        "expected": expected,
        "actual": actual,
        "expected_checksum": expected_checksum,
        "actual_checksum": actual_checksum,
    }


def _verify_copy(copy: _Copy, advance: Callable[[int], None]) -> list[dict[str, Any]]:
    store, tag = copy.store, copy.tag
    if isinstance(copy.error, StorageError):
        return [_result(copy, None, store.display(tag), "unreadable",
                        "a tag folder it may read", str(copy.error))]  # fmt: skip
    if copy.manifest is None:
        assert copy.error is not None
        where = store.display(tag, MANIFEST_NAME)
        if isinstance(copy.error, UnsupportedSchemaError):  # a newer nebula's, not damage
            return [_result(copy, None, where, "unsupported", "a manifest schema this nebula "
                            "reads", copy.error.why)]  # fmt: skip
        return [_result(copy, None, where, "corrupt", "a valid manifest", copy.error.why)]
    # Under a read lease: prune, retention and eviction leave the copy alone meanwhile.
    with read_lease(store, tag) as readable:
        if readable:
            return _verify_items(copy, copy.manifest, advance) + _planted_markers(copy)
    if not store.exists(tag, MANIFEST_NAME):
        return []  # deleted (evicted) since it was listed
    # Still committed, but a delete of it is claimed and did not end: it was not read
    # (never "ok" by omission: a planted claim would hide the newest checkpoint).
    claims = delete_claims(store, tag)
    who = ", ".join(c.describe() for c in claims) or "another process"
    where = store.display(tag, MANIFEST_NAME)
    return [_result(copy, None, where, "unchecked", "a checkpoint it may read",
                    f"not read: a delete of it is claimed by {who}")]  # fmt: skip


def _verify_items(
    copy: _Copy, manifest: Manifest, advance: Callable[[int], None]
) -> list[dict[str, Any]]:
    store, tag = copy.store, copy.tag
    out = []
    relisted = False
    for item in manifest.items:
        where = store.display(tag, item.file)
        expected = f"{item.size_bytes} bytes with {item.checksum_algo} {item.checksum}"
        want = _entry_fields(item)
        size = copy.files.get(item.file)
        if size is None and not relisted:
            # A scan may skip a file while the folder's entries change (leases come and
            # go): look again once before calling any item missing.
            copy.files.update(store.list_files(tag))
            relisted, size = True, copy.files.get(item.file)
        if size is None and store.exists(tag, item.file):  # a FIFO, a link, a folder
            why = "not a regular file; nebula reads only its own"
            out.append(_result(copy, item.name, where, "corrupt", expected, why, want))
            continue
        if size is None:
            out.append(_result(copy, item.name, where, "missing", expected, "no such file", want))
            continue
        if size != item.size_bytes:
            out.append(_result(copy, item.name, where, "corrupt", expected, f"{size} bytes", want,
                               _fields(size)))  # fmt: skip
            continue
        if item.checksum_algo not in KNOWN_CHECKSUM_ALGOS:
            actual = unknown_algo(item.checksum_algo)
            out.append(_result(copy, item.name, where, "corrupt", expected, actual, want,
                               _fields(size, item.checksum_algo)))  # fmt: skip
            continue
        try:
            size, checksum = _hash_file(store, tag, item, advance)
        except MissingFileError:
            if not store.exists(tag, MANIFEST_NAME):
                return []  # the copy was deleted (evicted) while we read it
            out.append(_result(copy, item.name, where, "missing", expected, "no such file", want))
            continue
        actual = f"{size} bytes with {item.checksum_algo} {checksum}"
        ok = size == item.size_bytes and checksum == item.checksum
        out.append(_result(copy, item.name, where, "ok" if ok else "corrupt", expected, actual,
                           want, _fields(size, item.checksum_algo, checksum)))  # fmt: skip
    return out


def _planted_markers(copy: _Copy) -> list[dict[str, Any]]:
    """A `"corrupt"` result for each rank marker of the copy that is no regular file (a
    FIFO, a link, a folder: what nebula never writes, so another hand's); it is not read."""
    store, tag = copy.store, copy.tag
    why = "not a regular file; nebula reads only its own"
    return [
        _result(copy, name, store.display(tag, name), "corrupt", "a regular file", why)
        for name in sorted(store.list_non_files(tag))
        if name.startswith(RANK_PREFIX)
    ]


def _hash_file(
    store: Store, tag: str, item: ItemEntry, advance: Callable[[int], None]
) -> tuple[int, str]:
    with store.open_read(tag, item.file) as stream:
        return hash_stream(stream, _CHUNK_BYTES, item.checksum_algo, advance)
