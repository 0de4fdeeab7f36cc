"""Copying checkpoints between roots on request: `nebula copy` and `nebula flush`.

    copy_checkpoint      one committed checkpoint of a root (from whichever of its tiers holds
                         it) to any root or to the other tier, verified at the destination
                         and resumable after an interruption
    persist_memory_tier  persist what a crashed job left in its memory tier, now, without
                         starting a session

Not for: the background persister of a running job (persister.py) or the commit protocol
itself (protocol/transfer.py, whose `copy_checkpoint` both use).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from nebulaml.config import private_default
from nebulaml.errors import CheckpointNotFoundError, NebulaError, RootNotFoundError, StorageError
from nebulaml.format.manifest import utc_now
from nebulaml.format.names import step_of, validate_name
from nebulaml.protocol.catalog import CheckpointInfo, list_committed, read_committed, tag_folders
from nebulaml.protocol.cowriters import copy_alongside
from nebulaml.protocol.history import append_rows, make_row
from nebulaml.protocol.leases import read_lease
from nebulaml.protocol.reuse import ReuseBook
from nebulaml.protocol.tiers import TierSet, adopt_memory_tier, tighten_root
from nebulaml.protocol.transfer import CopyResult
from nebulaml.runtime.locate import newest_first, tiers_for
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")

MEMORY, PERSISTENT = "memory", "persistent"
PathLike = str | os.PathLike[str]


def copy_checkpoint(
    root: PathLike,
    tag: str | None,
    dest: PathLike,
    *,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    verify_progress: Callable[[int, int], None] | None = None,
    private: bool | None = None,
) -> dict[str, Any]:
    """Copy the committed checkpoint `tag` of `root` to `dest`, verified, committed last.

    The source is whichever tier of `root` holds `tag` committed: this node's memory tier
    of `root` (preferred: it is the fastest) or `root` itself, but never `dest`. `tag=None`
    copies the newest committed checkpoint. `dest` is a root path or URL, or the word
    `"memory"` (this node's memory tier of `root`) or `"persistent"` (`root` itself); write
    `./memory` for a folder of that name.

    Every item is hashed while it is read from the source and again when it is read back
    from the destination; the manifest is published there (create-only) only after both
    match the source manifest. A rerun after an interruption keeps the items already at
    the destination whose size and checksum match (`skipped_bytes`). A different committed
    checkpoint of that tag at `dest` raises `CheckpointExistsError` unless `overwrite`; an
    identical one is left alone (`unchanged`). `progress(bytes_done, bytes_total)` is called
    as bytes are copied, and `verify_progress(bytes_done, bytes_total)` as they are read
    back from `dest` and checked (each item right after its copy). Nothing is recorded in
    the history file: a copy is not a save or a persist of the job. A copy into
    `"memory"` records `root` there, as a session does (`list_memory_tiers` names the
    root; `nebula gc` releases the copy once no job holds the tier, the checkpoint being
    on `root`).

    A local `dest` gets what any program's new files and folders get there (the umask);
    with `private` (None: `NEBULA_PRIVATE`) it is this user's alone, as a private root of
    `init` is: its folder 0700 (made so if it exists), what the copy writes 0600 and 0700.

    Returns a JSON-serialisable dict: `root`, `tag`, `source`, `source_tier`,
    `destination`, `destination_tier` (None for another root), `items`, `total_bytes`,
    `copied_items`, `copied_bytes`, `skipped_items`, `skipped_bytes`, `unchanged`,
    `committed_at`, `duration_s`. Raises `RootNotFoundError` or `CheckpointNotFoundError`.

    Example:
        >>> import nebulaml as nm, tempfile, torch
        >>> root = tempfile.mkdtemp()
        >>> nm.init(root, persistent_time_interval=0)
        >>> nm.Checkpoint("global_step5").save("model", {"w": torch.ones(2)})
        >>> nm.flush_persistence()
        True
        >>> nm.ops.copy_checkpoint(root, "global_step5", tempfile.mkdtemp())["copied_items"]
        ['model']
    """
    if tag is not None:
        validate_name("tag", tag)
    tiers = tiers_for(root, "copy_checkpoint")
    if not any(store.exists() for _tier, store in tiers.stores):
        raise RootNotFoundError(tiers.display)
    dst = _destination(tiers, dest, private_default() if private is None else private)
    source_tier, src = _source(tiers, tag, dst)
    t0 = time.perf_counter()
    # Under a read lease on the source: prune, retention and eviction leave it alone.
    with read_lease(src.store, src.tag) as readable:
        fresh = read_committed(src.store, src.tag) if readable else None
        if fresh is None:
            raise CheckpointNotFoundError(tiers.display, src.tag)  # deleted meanwhile
        # A live writer of the tag at `dst` (the job's persister, say) is waited for:
        # its committed copy of the same items is this one's (protocol/cowriters.py).
        result = copy_alongside(fresh, dst, overwrite=overwrite, resume=True, verify=True,
                                progress=progress, verify_progress=verify_progress,
                                reuse=_links(dst))  # fmt: skip
    return _report(tiers, source_tier, fresh, dst, result, time.perf_counter() - t0)


def persist_memory_tier(
    root: PathLike,
    progress: Callable[[int, int], None] | None = None,
    verify_progress: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Persist the newest checkpoint of this node's memory tier of `root` if `root` (the
    persistent tier) has nothing as new: what a crashed job left behind. Returns the tags
    persisted (none or one).

    This is what the next `nm.init(root)` on this node would do in the background, done
    now and synchronously, without starting a session: the copy is verified at `root`
    and committed there last, a rerun resumes an interrupted one, and one history row is
    appended. Retention is not applied: the job's `num_of_version_in_retention` is not
    known here (`nebula prune` applies a count you choose). The memory tier is left as it
    is. `progress(bytes_done, bytes_total)` is called as bytes are copied, and
    `verify_progress(bytes_done, bytes_total)` as they are read back from `root` and
    checked. Raises `RootNotFoundError` when neither `root` nor its memory tier exists,
    and `NebulaError` when the memory tier holds checkpoints it will not persist (stale:
    its root was deleted or made again since; or not yours alone).

    Example:
        >>> import nebulaml as nm, tempfile
        >>> nm.ops.persist_memory_tier(tempfile.mkdtemp())
        []
    """
    tiers = tiers_for(root, "persist_memory_tier")
    persistent = tiers.persistent
    assert persistent is not None  # a root was given
    if not any(store.exists() for _tier, store in tiers.stores):
        raise RootNotFoundError(tiers.display)
    if not tiers.memory_usable:
        # A stale memory tier (its root deleted or made again) or an unsafe one is never
        # flushed; one that holds checkpoints says so, so that nothing reads as done.
        if _holds_tags(tiers.memory):
            raise NebulaError(
                f"{tiers.memory.url}: {tiers.memory_note}: its checkpoints are not flushed to "
                f"{tiers.display} (nebula gc releases a stale memory tier)"
            )
        return []
    in_memory = list_committed(tiers.memory)
    if not in_memory:
        return []
    newest = in_memory[-1]
    persisted = list_committed(persistent)
    if persisted and persisted[-1].sort_key >= newest.sort_key:
        return []
    started_at, t0 = utc_now(), time.perf_counter()
    error: NebulaError | None = None
    # Under a read lease on the memory copy: a running job's eviction leaves it alone.
    with read_lease(tiers.memory, newest.tag) as readable:
        source = read_committed(tiers.memory, newest.tag) if readable else None
        if source is None:
            return []  # evicted meanwhile: the job that holds this memory tier runs
        try:
            # overwrite, as the persister does: the memory copy is newer than a same-named
            # persistent one (a tag re-saved with overwrite=True).
            copy_alongside(source, persistent, overwrite=True, resume=True, verify=True,
                           progress=progress, verify_progress=verify_progress,
                           reuse=_links(persistent))  # fmt: skip
        except NebulaError as exc:
            error = exc
            raise
        finally:
            _record(tiers, source, started_at, time.perf_counter() - t0, error)
    return [newest.tag]


def _links(dst: Store) -> ReuseBook | None:
    """For a copy into a local root: a reuse book, so that an item equal to its version
    in the newest checkpoint there (read and hashed first) is linked to it, not written
    again (protocol/reuse.py); a copy of several tags in turn costs a frozen item once.
    None elsewhere: a copy to an object store uploads each item whole, and one into a
    memory tier (not durable: its files are recycled) writes each item."""
    return ReuseBook() if dst.is_local and dst.durable else None


def _holds_tags(memory: Store) -> bool:
    """Whether the memory tier `memory` holds any tag folder (unreadable: as if it did)."""
    try:
        return bool(tag_folders(memory))
    except NebulaError:
        return True


def _destination(tiers: TierSet, dest: PathLike, private: bool) -> Store:
    if dest == MEMORY:
        if not tiers.memory_usable:
            raise StorageError(f"{tiers.memory.url}: {tiers.memory_note}")
        adopt_memory_tier(tiers)  # so that `nebula memory` and `gc` know its root
        return tiers.memory
    if dest == PERSISTENT:
        assert tiers.persistent is not None
        store = tiers.persistent
        if private and not store.private and store.is_local:
            store = Store(store.root, private=True)
    else:
        store = Store(dest, private=private)
    tighten_root(store)  # a private root's folder 0700; nothing otherwise
    return store


def _tier_of(tiers: TierSet, store: Store) -> str | None:
    for tier, candidate in tiers.stores:
        if candidate.url == store.url:
            return tier
    return None


def _source(tiers: TierSet, tag: str | None, dst: Store) -> tuple[str, CheckpointInfo]:
    """The tier and committed copy to read: a tier other than `dst`, fastest first; the
    destination's own copy only when no other tier holds the tag (then nothing is copied)."""
    if tag is None:
        ordered = newest_first(tiers, limit=1)
        if not ordered:
            raise CheckpointNotFoundError(tiers.display)
        copies = ordered[0]
    else:
        copies = []
        for tier, store in tiers.stores:
            info = read_committed(store, tag)
            if info is not None:
                copies.append((tier, info))
        if not copies:
            raise CheckpointNotFoundError(tiers.display, tag)
    elsewhere = [(tier, info) for tier, info in copies if info.store.url != dst.url]
    return (elsewhere or copies)[0]


def _report(
    tiers: TierSet,
    source_tier: str,
    src: CheckpointInfo,
    dst: Store,
    result: CopyResult,
    duration_s: float,
) -> dict[str, Any]:
    manifest = result.manifest
    return {
        "root": tiers.display,
        "tag": manifest.tag,
        "source": src.store.url,
        "source_tier": source_tier,
        "destination": dst.url,
        "destination_tier": _tier_of(tiers, dst),
        "items": [item.name for item in manifest.items],
        "total_bytes": manifest.total_bytes,
        "copied_items": list(result.copied_items),
        "copied_bytes": result.copied_bytes,
        "skipped_items": list(result.skipped_items),
        "skipped_bytes": result.skipped_bytes,
        "unchanged": result.unchanged,
        "committed_at": manifest.committed_at,
        "duration_s": round(duration_s, 6),
    }


def _record(
    tiers: TierSet,
    info: CheckpointInfo,
    started_at: str,
    duration_s: float,
    error: BaseException | None,
) -> None:
    row = make_row(
        tag=info.tag,
        step=step_of(info.tag),
        tier="persistent",
        rank=0,
        started_at=started_at,
        duration_s=duration_s,
        blocking_s=0.0,
        size_bytes=info.manifest.total_bytes,
        error=error,
    )
    try:
        append_rows(tiers.history_store, [row])
    except NebulaError as exc:
        # The history is a report: losing its row must not hide the persist's own outcome.
        log.warning("could not append a row to the checkpoint history: %s", exc)
