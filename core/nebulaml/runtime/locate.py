"""Finding things on a root's tiers: the tiers themselves, a checkpoint, one of its items.

    tiers_for     the tiers of a root on this node, or of the live session
    check_root    a root's canonical location; `RootNotFoundError` if no tier of it exists
    newest_first  every tier's committed checkpoints (or the few newest), newest first,
                  each with its copies
    find_copy     the fastest tier's copy of a tag, or of one of its items, that works,
                  else the error that says why none does
    asking        the deadline for a question to a tier the session knows is failing
    out_of_reach  whether a tier's failure is the tier out of reach (down, hanging): the
                  tier is passed over, said once, and what the others hold is the answer

A store that is down or hangs does not keep a job from its own node's checkpoints (issue
#43): listings, the latest, a tag, a load answer from the tiers that answer, so a job
restarted during an outage resumes from its memory tier. A persistent tier the session
knows is failing is given `FAILING_TIER_WAIT_S` to answer; any other at most its store's
call deadline (storage/deadline.py).

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
import threading
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
    StorageError,
    UnsupportedSchemaError,
)
from nebulaml.format.manifest import ItemEntry, Manifest
from nebulaml.protocol.catalog import (
    CheckpointInfo,
    read_committed,
    read_manifest,
    skip_unsupported,
)
from nebulaml.protocol.commit_index import catalog, newest
from nebulaml.protocol.leases import read_lease
from nebulaml.protocol.tiers import TierSet, open_tiers
from nebulaml.runtime import session as _session
from nebulaml.runtime.outage import may_pass
from nebulaml.storage.deadline import within
from nebulaml.storage.store import MissingFileError, Store

PathLike = str | os.PathLike[str]
T = TypeVar("T")
log = logging.getLogger("nebulaml")

# How long a question to a persistent tier waits while the session knows it is failing
# (down, hanging, never reached): a restart during an outage resumes from its memory tier
# within seconds.
FAILING_TIER_WAIT_S = 2.0


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
        raise RootNotFoundError(tiers.display, missing_container(tiers.persistent))
    return tiers.display


def missing_container(store: Store | None) -> str | None:
    """Why an object-store root is not there, when it is because its container (bucket)
    does not exist: a mistyped container reads otherwise as a root never written to."""
    if store is None or store.is_local or store.fs is None:
        return None
    top = store.root.strip("/").split("/")[0]
    try:
        if not top or store.fs.exists(top):
            return None
    except Exception:  # noqa: BLE001 - a question for the message only
        return None
    return f"its container {top!r} does not exist"  # a bucket, on S3 and GCS


_unseen: set[str] = set()  # the stores said to be out of reach, until one answers again
_unseen_lock = threading.Lock()


def asking(tiers: TierSet, store: Store) -> contextlib.AbstractContextManager[None]:
    """The deadline for a question to `store`, one of `tiers`: `FAILING_TIER_WAIT_S` when
    it is the live session's persistent tier and its persister knows that tier is
    failing (or never reached it); else none beyond the store's own call deadline."""
    live = _session.live()
    if live is not None and store is live.tiers.persistent and live.persister.failing():
        return within(FAILING_TIER_WAIT_S)
    return contextlib.nullcontext()


def out_of_reach(tier: str, store: Store, exc: BaseException) -> bool:
    """Whether `exc`, raised by `store` (tier `tier`), is that tier out of reach (down,
    hanging: a failure that may pass, other than a file gone), to be passed over for
    the tiers that answer. Said once per store, until it answers again (`answered`).
    The memory tier is never passed over: it is this node's own."""
    if tier == "memory" or isinstance(exc, MissingFileError) or not may_pass(exc):
        return False
    with _unseen_lock:
        first = store.url not in _unseen
        _unseen.add(store.url)
    if first:
        log.warning(
            "the %s tier %s does not answer (%s): answering from this node's memory tier "
            "without it", tier, store.url, exc,
        )  # fmt: skip
    return True


def answered(store: Store) -> None:
    """`store` answered: the next time it does not, that is said again."""
    if _unseen:
        with _unseen_lock:
            _unseen.discard(store.url)


def newest_first(
    tiers: TierSet, limit: int | None = None
) -> list[list[tuple[str, CheckpointInfo]]]:
    """Committed checkpoints on every tier, newest first; each entry lists a tag's copies
    as (tier, info), fastest tier first. Package-internal, like `tiers_for`.

    `limit`: the `limit` newest only, found from each tier's commit index (the few
    manifests at its top: commit_index.newest), not by reading every manifest; the copies
    of those tags on the other tiers are looked up one by one.

    A copy of a schema this version cannot read is passed over: said as damaged where
    another tier holds a readable copy of that tag, else as a newer nebula's checkpoint
    (catalog's `skip_unsupported`), and raised only when no tier holds anything readable
    (a newer nebula's root is not an empty one to start over in). A persistent tier out
    of reach is passed over (`out_of_reach`): the others answer.
    """
    found: dict[str, list[tuple[str, CheckpointInfo]]] = {}
    unsupported: list[UnsupportedSchemaError] = []
    answering: list[tuple[str, Store]] = []
    for tier, store in tiers.stores:
        try:
            with asking(tiers, store):
                if limit is None:
                    listed = catalog(store, unsupported)  # kept while the tier is the same
                else:
                    listed = newest(store, limit, unsupported)
        except StorageError as exc:
            if not out_of_reach(tier, store, exc):
                raise
            continue
        answered(store)
        answering.append((tier, store))
        for info in listed:
            found.setdefault(info.tag, []).append((tier, info))
    if limit is not None:
        _other_copies(tiers, answering, found)
    for newer in unsupported:
        if newer.tag in found:
            log.warning("%s; using another tier's copy", newer)
        elif found:
            skip_unsupported(newer)
        else:
            raise newer
    ordered = sorted(found.values(), key=lambda copies: copies[0][1].sort_key, reverse=True)
    return ordered if limit is None else ordered[:limit]


def _other_copies(
    tiers: TierSet,
    stores: list[tuple[str, Store]],
    found: dict[str, list[tuple[str, CheckpointInfo]]],
) -> None:
    """Add to each tag of `found` its copies on the tiers (of `stores`, fastest first)
    whose newest it was not among, keeping the fastest first."""
    for tag, copies in found.items():
        have = {tier for tier, _ in copies}
        for tier, store in stores:
            if tier in have:
                continue
            try:
                with asking(tiers, store):
                    info = read_committed(store, tag)
            except (UnsupportedSchemaError, StorageError):
                continue
            if info is not None:
                copies.append((tier, info))
        order = [tier for tier, _ in stores]
        copies.sort(key=lambda copy: order.index(copy[0]))


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
    over for the next tier's, and so is a tier out of reach (`out_of_reach`); any other
    error is raised at once.

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
        try:
            with contextlib.ExitStack() as stack:
                with asking(tiers, store):  # the lease and the manifest: a failing tier's
                    held = read_lease(store, tag) if lease else contextlib.nullcontext(True)
                    if not stack.enter_context(held):
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
        except StorageError as exc:
            if not out_of_reach(tier, store, exc):
                raise
            failures.append(exc)
    for kind in report:
        for failure in failures:
            if isinstance(failure, kind):
                raise failure
    if not found_tag:
        raise CheckpointNotFoundError(root or tiers.display, tag)
    assert item is not None
    raise ItemNotFoundError(tag, item, available)
