"""Finding things on a root's tiers: the tiers themselves, a checkpoint, one of its items.

    tiers_for     the tiers of a root on this node, or of the live session
    check_root    a root's canonical location; `RootNotFoundError` if no tier of it exists
    newest_first  every tier's committed checkpoints, newest first, each with its copies
    find_copy     the fastest tier's copy of a tag, or of one of its items, that works,
                  else the error that says why none does

Every function that finds a tag or an item on a root goes through here: loading an item
(load.py), describing one (ops/inspection.py), and the public functions that find a
checkpoint (api.py); the tiers are always tried fastest first (`TierSet.stores`).

May import: every layer below runtime, and runtime.session (the live session's tiers).
Not for: reading an item's bytes (load.py), listing what a tier holds (protocol/catalog.py)
or the public functions themselves (api.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from nebulaml.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ItemNotFoundError,
    ManifestError,
    NebulaError,
    RootNotFoundError,
    UnsupportedSchemaError,
)
from nebulaml.format.manifest import ItemEntry, Manifest
from nebulaml.protocol.catalog import CheckpointInfo, list_committed, read_manifest
from nebulaml.protocol.leases import read_lease
from nebulaml.protocol.tiers import TierSet, open_tiers
from nebulaml.runtime import session as _session
from nebulaml.storage.store import MissingFileError, Store

PathLike = str | os.PathLike[str]
T = TypeVar("T")
log = logging.getLogger("nebulaml")


def tiers_for(persist_path: PathLike | None, what: str) -> TierSet:
    """The tiers of `persist_path` on this node, or of the session when it is None
    (`NotInitializedError` names `what` if there is none). The live session's own tiers
    when `persist_path` is its persistent root, after its last commit's eviction of the
    copies it superseded (which runs on a thread of its own: a listing by this process
    right after a save sees what retention keeps). Package-internal."""
    if persist_path is None:
        own = _session.current(what)
        own.persister.settle_eviction()  # this process reads its tiers as of its commits
        return own.tiers
    live = _session.current_or_none()
    options: dict[str, Any] = {}
    if live is not None:
        options = dict(live.config.storage_options)
        persistent = live.tiers.persistent
        if persistent is not None and Store(persist_path, options).location == persistent.location:
            live.persister.settle_eviction()
            return live.tiers
    return open_tiers(persist_path, options)


def check_root(persist_path: PathLike) -> str:
    """Raise `RootNotFoundError` unless the root, or its memory tier on this node, exists;
    return the root's canonical location.

    Example:
        >>> import nebulaml as nm
        >>> nm.check_root("/no/such/root")
        Traceback (most recent call last):
        ...
        nebulaml.errors.RootNotFoundError: /no/such/root: no such checkpoint root
    """
    tiers = tiers_for(persist_path, "check_root")
    if not any(store.exists() for _tier, store in tiers.stores):
        raise RootNotFoundError(tiers.display)
    return tiers.display


def newest_first(tiers: TierSet) -> list[list[tuple[str, CheckpointInfo]]]:
    """Committed checkpoints on every tier, newest first; each entry lists a tag's copies
    as (tier, info), fastest tier first. Package-internal, like `tiers_for`.

    A copy of a schema this version cannot read is an error, unless another tier holds a
    readable copy of that tag (then the unreadable one is damaged, and said so).
    """
    found: dict[str, list[tuple[str, CheckpointInfo]]] = {}
    unsupported: list[UnsupportedSchemaError] = []
    for tier, store in tiers.stores:
        for info in list_committed(store, unsupported):
            found.setdefault(info.tag, []).append((tier, info))
    for exc in unsupported:
        if not any(copies for tag, copies in found.items() if f"/{tag}/" in exc.where):
            raise exc
        log.warning("%s; using another tier's copy", exc)
    return sorted(found.values(), key=lambda copies: copies[0][1].sort_key, reverse=True)


@dataclass(frozen=True, slots=True)
class Copy:
    """One tier's copy of a tag, as `find_copy` hands it over: the tier, its store, the
    tag's manifest there, and the entry of the item asked for (None when none was)."""

    tier: str
    store: Store
    manifest: Manifest
    entry: ItemEntry | None


# What `find_copy` passes over for the next tier's copy: a manifest that does not read,
# an item file that does not match it (or is gone).
_MANIFEST_FAILURES = (ManifestError,)
_COPY_FAILURES = (CorruptCheckpointError, MissingFileError)


def find_copy(
    tiers: TierSet,
    tag: str,
    use: Callable[[Copy], T],
    *,
    item: str | None = None,
    manifest: Callable[[Store, str], Manifest | None] = read_manifest,
    lease: bool = False,
    report: tuple[type[NebulaError], ...] = (NebulaError,),
    root: str | None = None,
) -> T:
    """`use(copy)` on the fastest tier's copy of `tag` (of its item `item`, when given)
    for which it works.

    Each tier in turn, fastest first: the tag's manifest there (`manifest(store, tag)`;
    None: the tier has no copy), the item's entry in it, then `use`. With `lease`, all of
    it under a read lease: no prune, retention or eviction deletes that copy meanwhile,
    and a copy being deleted is passed over. A copy whose manifest raises `ManifestError`,
    or on which `use` raises `CorruptCheckpointError` or `MissingFileError`, is passed
    over for the next tier's; any other error is raised at once.

    When no copy works, raises the first failure of the first kind in `report` that
    occurred (default: the first failure), else `CheckpointNotFoundError` (naming `root`,
    default the tiers') when no tier holds the tag, else `ItemNotFoundError` with the
    items the tag has.

    Example:
        >>> import nebulaml as nm, tempfile
        >>> nm.init(tempfile.mkdtemp())
        >>> nm.Checkpoint("global_step1").save("model", {"w": 1})
        >>> tiers = tiers_for(None, "example")
        >>> find_copy(tiers, "global_step1", lambda copy: copy.tier, item="model")
        'memory'
        >>> try:
        ...     find_copy(tiers, "global_step1", lambda copy: copy.tier, item="optim")
        ... except nm.ItemNotFoundError as exc:
        ...     print(exc)
        checkpoint 'global_step1' has no item 'optim'; its items: 'model'
    """
    failures: list[NebulaError] = []
    found_tag = False
    available: list[str] = []
    for tier, store in tiers.stores:
        held = read_lease(store, tag) if lease else contextlib.nullcontext(True)
        with held as readable:
            if not readable:
                continue  # gone from this tier, or being deleted
            try:
                found = manifest(store, tag)
            except _MANIFEST_FAILURES as exc:
                failures.append(exc)
                continue
            if found is None:
                continue
            found_tag = True
            entry = None
            if item is not None:
                entry = found.item(item)
                if entry is None:
                    available = [each.name for each in found.items]
                    continue
            try:
                return use(Copy(tier, store, found, entry))
            except _COPY_FAILURES as exc:
                failures.append(exc)
    for kind in report:
        for failure in failures:
            if isinstance(failure, kind):
                raise failure
    if not found_tag:
        raise CheckpointNotFoundError(root or tiers.display, tag)
    assert item is not None
    raise ItemNotFoundError(tag, item, available)
