"""`Checkpoint`: the seed's handle to one tag, for saving items and loading them back.

Saving snapshots each object into the memory tier and returns once the caller may mutate
it again; committing publishes the manifest there and hands the tag to the persister.
Loading reads the fastest tier that holds the tag, verifies size and checksum before
anything is unpickled, and falls back to another tier's copy on a mismatch.

Not for: listing checkpoints or process-wide configuration (api.py, session.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from nebulaml.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    ItemNotFoundError,
    MemoryBudgetError,
    MemoryTierFullError,
    SnapshotChangedError,
    StorageFullError,
    TooManyItemsError,
    UnsupportedSchemaError,
    memory_tier_advice,
)
from nebulaml.format.checksum import verify_bytes
from nebulaml.format.manifest import KNOWN_CHECKSUM_ALGOS, ItemEntry, Manifest, utc_now
from nebulaml.format.names import step_of, validate_name
from nebulaml.format.serialization import (
    MapLocation,
    estimate_bytes,
    read_item,
    read_item_local,
    to_saveable,
)
from nebulaml.protocol.catalog import read_committed, read_manifest
from nebulaml.protocol.commit import (
    await_commit,
    begin_tag,
    commit_rank,
    copy_item,
    delete_checkpoint,
    delete_part,
    write_item,
    writer_marker_name,
)
from nebulaml.protocol.history import HistoryRow, make_row
from nebulaml.protocol.leases import read_lease
from nebulaml.protocol.tiers import TierSet
from nebulaml.runtime import session as _session
from nebulaml.runtime.budget import RECORDS_ROOM_BYTES, Shortfall
from nebulaml.runtime.fence import Taken
from nebulaml.runtime.slots import write_snapshot
from nebulaml.runtime.snapshot import Layout, cuda_ready_event
from nebulaml.storage.store import MissingFileError, Store

log = logging.getLogger("nebulaml")

MANUAL_COMMIT = -2


class Checkpoint:
    """A handle to the checkpoint `tag`.

    `num_of_files=k > 0` commits by itself after `k` saves (the default, 1, commits after
    the first); `num_of_files=-2` commits only when `commit()` is called. A committed
    tag is not written again unless `overwrite=True`. `labels` (e.g. `["best"]`) are
    recorded in the manifest, and labelled checkpoints are kept by retention.

    Example:
        >>> import nebulaml as nm, tempfile
        >>> nm.init(tempfile.mkdtemp(), persistent_time_interval=0)
        >>> ckpt = nm.Checkpoint("global_step5", 2)
        >>> ckpt.save("model", {"w": 1})
        >>> ckpt.save("optimizer", {"lr": 0.1})   # the second save commits
        >>> nm.get_latest_checkpoint().load("optimizer")
        {'lr': 0.1}
    """

    def __init__(
        self,
        tag: str,
        num_of_files: int = 1,
        *,
        overwrite: bool = False,
        labels: Iterable[str] = (),
    ) -> None:
        self.tag: str = validate_name("tag", tag)
        if not isinstance(num_of_files, int) or isinstance(num_of_files, bool) or num_of_files == 0:
            raise InvalidArgumentError(
                f"num_of_files must be a positive int (commit after that many saves) or "
                f"{MANUAL_COMMIT} (commit on commit()), not {num_of_files!r}"
            )
        self.num_of_files = num_of_files
        self.overwrite = overwrite
        self.labels: tuple[str, ...] = tuple(validate_name("label", x) for x in labels)
        self._items: list[ItemEntry] = []
        self._names: list[str] = []  # saved, or queued by a lazy save
        self._committed = False
        self._sealed = False  # a lazy commit is queued
        self._lazy_error: BaseException | None = None
        self._begun = False
        self._tiers: TierSet | None = None  # bound by the first save, or by get_checkpoint
        self._store: Store | None = None  # where the items go: memory, or streamed
        self._memory_full = False  # the memory tier had no room for the writer marker
        self._started_at = ""
        self._t0 = 0.0
        self._blocking_s = 0.0

    @classmethod
    def _committed_handle(cls, tag: str, tiers: TierSet) -> Checkpoint:
        handle = cls(tag)
        handle._tiers = tiers
        handle._committed = True
        return handle

    def __repr__(self) -> str:
        state = "committed" if self._committed else f"{len(self._items)} item(s) saved"
        return f"Checkpoint({self.tag!r}, {state})"

    # saving --------------------------------------------------------------------------
    def save(self, name: str, obj: Any) -> None:
        """Snapshot `obj` as the item `name`; `obj` may be mutated once this returns.

        Modules, optimizers and other objects with `state_dict()` are saved as their
        state dict, so every item loads with `torch.load(path, weights_only=True)`.
        """
        # A lazy save queues behind the earlier ones rather than waiting for them.
        session = _session.current("Checkpoint.save", fence=False)
        session.persister.raise_pending_error()
        validate_name("item", name)
        t0 = time.perf_counter()
        if self._committed or self._sealed:
            if self.num_of_files > 0 and self._names:
                raise TooManyItemsError(self.tag, self.num_of_files)
            raise CheckpointExistsError(session.tiers.display, self.tag)
        if name in self._names:
            raise InvalidArgumentError(f"checkpoint {self.tag!r} already has an item {name!r}")
        if session.snapshots is not None:
            session.snapshots.raise_error()  # an earlier lazy save's failure, once
        if not self._begun:
            self._begin(session, t0)
        self._names.append(name)
        if session.snapshots is None:
            self._items.append(self._write(session, name, obj))
        else:
            # Lazy: the copy (hashed on the way) runs in the background; the fence before
            # optimizer.step() waits for it. The state dicts are taken now, and the small
            # tensors copied; the large ones are read later, and must not have changed.
            saveable = to_saveable(obj)
            small = session.snapshots.small
            taken = small.take(name, saveable)
            ready = cuda_ready_event(saveable)

            def copy() -> None:
                try:
                    entry = self._write(session, name, saveable, ready, taken)
                    changed = taken.changed()
                    if changed:
                        raise SnapshotChangedError(self.tag, name, changed)
                    self._items.append(entry)
                except BaseException as exc:
                    self._lazy_error = exc  # the checkpoint is incomplete: never committed
                    raise
                finally:
                    small.give_back(name, taken)

            session.snapshots.submit(copy, copies=True, hold=True)  # until the commit
        self._blocking_s += time.perf_counter() - t0
        if self.num_of_files > 0 and len(self._names) == self.num_of_files:
            self.commit()

    def _begin(self, session: _session.Session, t0: float) -> None:
        tiers = session.tiers
        persistent = tiers.persistent
        if not self.overwrite and persistent and read_committed(persistent, self.tag):
            raise CheckpointExistsError(tiers.persistent.url, self.tag)
        self._started_at, self._t0 = utc_now(), t0
        if self.overwrite:
            session.persister.release(self.tag)  # never rewrite what is being copied
        try:
            begin_tag(
                tiers.memory,
                self.tag,
                rank=session.rank,
                overwrite=self.overwrite,
                world_size=session.world_size,
            )
        except StorageFullError:
            self._memory_full = True  # the first item goes to the persistent tier (_write)
        self._tiers = tiers
        self._store = tiers.memory
        self._begun = True

    def _write(
        self,
        session: _session.Session,
        name: str,
        obj: Any,
        ready: Any = None,
        taken: Taken | None = None,
    ) -> ItemEntry:
        """Write one item: into a reused memory-tier buffer when its layout maps exactly
        (snapshot.py), else with torch.save; to the persistent tier once this checkpoint
        does not fit the memory tier (its budget or its filesystem: budget.py). The copy
        is done when this returns (`obj` may change); returns the item's entry. A lazy
        save's small storages are read from what it took at the save (fence.py)."""
        if self._store is session.tiers.memory:
            layout = session.layouts.plan(name, obj)
            size = layout.size_bytes if layout is not None else estimate_bytes(obj)
            if self._memory_full:
                short = session.budget.filesystem_full(size)
            else:
                short = session.budget.make_room(name, size)
            if short is None:
                try:
                    return self._write_memory(session, name, obj, layout, ready, taken)
                except StorageFullError:
                    # Another process took the room meanwhile: as if there had been none.
                    short = session.budget.filesystem_full(size)
            self._stream(session, f"item {name!r}", short)
        assert self._store is not None
        if taken is not None:
            obj = taken.substitute(obj)
        return write_item(self._store, self.tag, name, obj, rank=session.rank)

    def _write_memory(
        self,
        session: _session.Session,
        name: str,
        obj: Any,
        layout: Layout | None,
        ready: Any,
        taken: Taken | None,
    ) -> ItemEntry:
        if layout is None:
            if taken is not None:
                obj = taken.substitute(obj)
            return write_item(session.tiers.memory, self.tag, name, obj, rank=session.rank)
        if taken is not None:
            layout = taken.on_copies(layout)
        return write_snapshot(session.pool, self.tag, name, layout, rank=session.rank, ready=ready)

    def _stream(self, session: _session.Session, what: str, short: Shortfall) -> None:
        """Move this checkpoint to the persistent tier, since `what` (an item, or the
        commit's records) does not fit the memory tier (`short`): it is written and
        committed there directly, the items saved so far copied over first. Says so once:
        the checkpoint stays there."""
        persistent, memory = session.tiers.persistent, session.tiers.memory
        why = None
        if persistent is None:
            why = "there is no persistent tier"
        elif session.world_size > 1:
            why = "streaming to the persistent tier needs one rank"
        if why is not None:
            if short.limit_bytes is not None:
                raise MemoryBudgetError(self.tag, short.size_bytes, short.limit_bytes, why)
            free = short.free_bytes or 0
            raise MemoryTierFullError(self.tag, short.size_bytes, free, short.path, why)
        assert persistent is not None
        if short.limit_bytes is not None:
            log.warning(
                "checkpoint %r does not fit the memory budget (%d bytes, "
                "NEBULA_MEMORY_BUFFER_SIZE): %s needs %d bytes; writing it to %s directly",
                self.tag,
                short.limit_bytes,
                what,
                short.size_bytes,
                persistent.url,
            )
        else:
            total = sum(item.size_bytes for item in self._items) + short.size_bytes
            log.warning(
                "checkpoint %r does not fit the memory tier: %s needs %d bytes (the "
                "checkpoint %d so far), and %s has %d bytes free; writing the checkpoint to "
                "%s directly, slower than into memory. To keep checkpoints in memory, %s",
                self.tag,
                what,
                short.size_bytes,
                total,
                short.path,
                short.free_bytes or 0,
                persistent.url,
                memory_tier_advice(total),
            )
        begin_tag(persistent, self.tag, rank=session.rank, overwrite=self.overwrite)
        for item in self._items:
            copy_item(memory, persistent, self.tag, item, lambda _n: None)
        delete_checkpoint(memory, self.tag, discard=session.pool.recycle)
        self._store = persistent

    def commit(self) -> bool:
        """Commit the saved items in the memory tier and queue the persist; returns True.

        Committing twice, or a handle with nothing saved, is a no-op.
        """
        if self._committed or self._sealed:
            return True
        # A pending background failure is left for the next call: the items are written,
        # and the checkpoint must not be lost to an older persist's error.
        session = _session.current("Checkpoint.commit", raise_pending=False, fence=False)
        if session.snapshots is not None:
            self._sealed = True  # no more saves; the commit runs after the copies
            session.snapshots.submit(lambda: self._commit_lazily(session), copies=False)
            return True
        return self._commit_now(session)

    def _commit_lazily(self, session: _session.Session) -> None:
        if self._lazy_error is None:
            self._commit_now(session)
            return
        # An item's snapshot failed (raised once, by the next call into nebula): the
        # rest is removed, and the previous checkpoint stays the newest.
        store = self._store
        if store is None:
            return
        if session.world_size > 1:
            delete_part(store, self.tag, session.rank)
        else:
            memory = store is session.tiers.memory
            delete_checkpoint(store, self.tag, discard=session.pool.recycle if memory else None)

    def _commit_now(self, session: _session.Session) -> bool:
        t0 = time.perf_counter()
        if not self._begun:
            if session.world_size == 1:
                return True  # nothing saved, nothing to commit
            # Every rank's part makes the checkpoint, also the empty part of a rank that
            # saved nothing (DeepSpeed calls commit() on every rank).
            self._begin(session, t0)
        if self._store is not None and self._store is session.tiers.persistent:
            return self._commit_streamed(session, t0)
        memory = session.tiers.memory
        try:
            manifest = self._commit_part(session, memory)
        except StorageFullError:
            if session.world_size > 1 or session.tiers.persistent is None:
                raise
            # No room left for the manifest (another process took it): commit it there.
            short = session.budget.filesystem_full(RECORDS_ROOM_BYTES)
            self._stream(session, "its manifest", short)
            return self._commit_streamed(session, t0)
        if manifest is None and session.ranks.all_local:
            # The other ranks share this memory tier: wait (bounded) until their parts
            # are there and the checkpoint is committed, so that it loads on every rank.
            manifest = await_commit(
                memory,
                self.tag,
                world_size=session.world_size,
                timeout_s=session.config.rank_timeout_s,
            )
        row = self._finish_commit(session, memory, "memory", t0)
        # This rank's part is committed (on a node without the other ranks, the memory
        # tier never holds the whole): it is what this rank's persister copies.
        session.persister.notify_committed(self.tag, row, labels=self.labels)
        return True

    def _commit_part(self, session: _session.Session, store: Store) -> Manifest | None:
        """Publish this rank's part of the tag on `store` (commit.commit_rank): the
        manifest if this call committed the tag, None while other ranks' parts are due."""
        return commit_rank(
            store,
            self.tag,
            rank=session.rank,
            world_size=session.world_size,
            items=self._items,
            created_at=self._started_at,
            labels=self.labels,
        )

    def _commit_streamed(self, session: _session.Session, t0: float) -> bool:
        persistent = session.tiers.persistent
        assert persistent is not None
        self._commit_part(session, persistent)
        row = self._finish_commit(session, persistent, "persistent", t0)
        session.persister.notify_streamed(self.tag, row)
        return True

    def _finish_commit(
        self, session: _session.Session, store: Store, tier: str, t0: float
    ) -> HistoryRow:
        """After the commit on `store`: drop this rank's writer marker, mark the handle
        committed, and give the history row of the save."""
        store.remove(self.tag, writer_marker_name(session.rank))
        self._committed = True
        self._blocking_s += time.perf_counter() - t0
        return make_row(
            tag=self.tag,
            step=step_of(self.tag),
            tier=tier,
            rank=session.rank,
            started_at=self._started_at,
            duration_s=time.perf_counter() - self._t0,
            blocking_s=self._blocking_s,
            size_bytes=sum(item.size_bytes for item in self._items),
        )

    # loading -------------------------------------------------------------------------
    def load(
        self,
        name: str,
        map_location: MapLocation = None,
        weights_only: bool | None = True,
    ) -> Any:
        """Load the item `name` of this committed checkpoint.

        Reads the fastest tier that holds it and verifies size and checksum before
        unpickling; on a mismatch it tries the next tier, else raises
        `CorruptCheckpointError`. With `weights_only=True` (the default; None means True)
        a pickle that would execute code raises `UnsafeCheckpointError`. Each copy is read
        under a read lease (leases.py): no prune, retention or eviction deletes it meanwhile.
        """
        validate_name("item", name)
        tiers = self._tiers
        if tiers is None:
            tiers = _session.current("Checkpoint.load").tiers
        else:
            _session.current_or_none()
        found_tag = False
        available: list[str] = []
        corrupt: list[CorruptCheckpointError] = []
        unsupported: UnsupportedSchemaError | None = None
        for _tier, store in tiers.stores:
            # A read lease keeps prune, retention and eviction off this copy while we read
            # it; not readable: it is gone, or being deleted, from this tier.
            with read_lease(store, self.tag) as readable:
                if not readable:
                    continue
                # The manifest alone, not read_committed: an item of the wrong size must be
                # reported as corrupt (and the next tier tried), not as a missing checkpoint.
                try:
                    manifest = read_manifest(store, self.tag)
                except UnsupportedSchemaError as exc:
                    unsupported = unsupported or exc  # raised if no tier has a readable copy
                    continue
                if manifest is None:
                    continue
                found_tag = True
                entry = manifest.item(name)
                if entry is None:
                    available = [item.name for item in manifest.items]
                    continue
                where = store.display(self.tag, entry.file)
                try:
                    local_reads = weights_only in (True, None)
                    known = entry.checksum_algo in KNOWN_CHECKSUM_ALGOS
                    algo = entry.checksum_algo if local_reads and known else None
                    with store.read_local(self.tag, entry.file, algo=algo) as local:
                        if local is not None and local_reads:
                            verify_bytes(where, entry, local.view, checksum=local.checksum)
                            return read_item_local(
                                local.path,
                                local.buffer,
                                local.view,
                                where,
                                map_location=map_location,
                            )
                    data = store.read_bytes(self.tag, entry.file)
                    verify_bytes(where, entry, data)
                except CorruptCheckpointError as exc:
                    corrupt.append(exc)
                    continue
                except MissingFileError:
                    continue  # removed behind nebula's back (not by a delete); next tier
            return read_item(data, where, map_location=map_location, weights_only=weights_only)
        if corrupt:
            raise corrupt[0]
        if unsupported is not None:
            raise unsupported
        if not found_tag:
            raise CheckpointNotFoundError(tiers.display, self.tag)
        raise ItemNotFoundError(self.tag, name, available)
