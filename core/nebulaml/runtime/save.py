"""Saving a checkpoint: `Checkpoint.save` and `Checkpoint.commit`'s pipeline, one rank's.

The pipeline reads in two methods, each step named as in runtime/steps.py (and traced):

    SaveJob.add (each item)   begin     the tag's folder in the memory tier, this rank's
                                        writer marker in it (_begin)
                              claim     the item's name, when ranks share the folder
                              room      room in the memory tier (budget.py), else the
                                        checkpoint moves to the persistent tier
                                        (_move_to_persistent_tier: the items so far
                                        copied there, and the rest written there)
                              snapshot  the bytes copied: into a reused buffer when the
                                        layout maps exactly (snapshot.py, slots.py), else
                                        with torch.save
    SaveJob.commit            publish   this rank's part (commit.commit_rank); the last
                                        part publishes the manifest
                              await ranks  the other ranks' parts, on a shared memory tier
                              record    the writer marker dropped, the history row made
                              hand over the persister told (persister.notify_committed);
                                        after the eviction it runs, the next save is
                                        prepared (_prepare_next_save); with peer
                                        replicas, the part handed to the sender too
                                        (session.replicate: it returns at once)

A lazy save (fence.py) runs `room` and `snapshot` on the snapshot worker and returns at
once. What follows the hand-over (persist, retain, evict, history) runs on the
persister's thread.

May import: every layer below runtime, and the runtime modules a save uses (session,
budget, crew, fence, lazy_watch, slots, snapshot). Not for: the user's checks on the
handle (checkpoint.py), persisting (persister.py), or loading (load.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from nebulaml.errors import (
    CheckpointExistsError,
    InvalidArgumentError,
    MemoryBudgetError,
    MemoryTierFullError,
    RankTimeoutError,
    SnapshotChangedError,
    StorageError,
    StorageFullError,
    memory_tier_advice,
)
from nebulaml.format.manifest import ItemEntry, Manifest, utc_now
from nebulaml.format.names import step_of, writer_marker_name
from nebulaml.format.serialization import estimate_bytes, to_saveable
from nebulaml.protocol.commit import (
    await_commit,
    begin_tag,
    claim_item,
    commit_rank,
    write_item,
)
from nebulaml.protocol.delete import delete_checkpoint, delete_part
from nebulaml.protocol.history import HistoryRow, make_row
from nebulaml.protocol.tiers import TierSet
from nebulaml.protocol.transfer import copy_item
from nebulaml.runtime.budget import RECORDS_ROOM_BYTES, Shortfall
from nebulaml.runtime.crew import QUIET
from nebulaml.runtime.fence import Taken, spelt
from nebulaml.runtime.lazy_watch import SaveWatch, watchable
from nebulaml.runtime.session import Session
from nebulaml.runtime.slots import SlotPool
from nebulaml.runtime.snapshot import Layout, cuda_ready_event, fill
from nebulaml.runtime.steps import trace
from nebulaml.runtime.unchanged import start_audits
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")


class SaveJob:
    """One checkpoint's save on this rank, from its first item to its commit.

    A `Checkpoint` holds one, and checks the user's calls before it hands them over.
    `names` are the items saved (or queued by a lazy save), `items` their entries once
    written; `tiers` is where the checkpoint is, bound by the first save (or by
    `mark_committed`).
    """

    def __init__(
        self,
        tag: str,
        *,
        overwrite: bool,
        labels: tuple[str, ...],
        ranks: tuple[int, ...] | None = None,
    ) -> None:
        self.tag = tag
        self.overwrite = overwrite
        self.labels = labels
        self.ranks = ranks  # the ranks that write it (`Checkpoint(ranks=)`); None: all
        self._generation: str | None = None  # the job's, when the first save began
        self.items: list[ItemEntry] = []
        self.names: list[str] = []  # saved, or queued by a lazy save
        self.committed = False
        self.sealed = False  # a lazy commit is queued
        self.tiers: TierSet | None = None
        self._lazy_error: BaseException | None = None
        self._begun = False
        self._store: Store | None = None  # where the items go: memory, or streamed
        self._memory_full = False  # the memory tier had no room for the writer marker
        self._started_at = ""
        self._t0 = 0.0
        self._blocking_s = 0.0
        self._reused = 0  # bytes of tensors the snapshot did not copy (unchanged.py)
        self._copied_now = False  # an item the default copied at save() (`_copy_now`)

    def mark_committed(self, tiers: TierSet) -> None:
        """This is a checkpoint committed before, on `tiers`: nothing is saved into it."""
        self.tiers = tiers
        self.committed = True

    def writers(self, session: Session) -> tuple[int, ...]:
        """The ranks that write this checkpoint: those it names, or every rank."""
        world_size = session.world_size
        if self.ranks is None:
            return tuple(range(world_size))
        beyond = [r for r in self.ranks if r >= world_size]
        if beyond:
            raise InvalidArgumentError(
                f"checkpoint {self.tag!r} names rank(s) {beyond} (ranks={list(self.ranks)}), "
                f"and this job has {world_size} process(es)"
            )
        return self.ranks

    def add(self, session: Session, name: str, obj: Any, t0: float) -> None:
        """Write item `name` (or, lazily, queue its copy); the save began at `t0`. The
        low-priority threads (audits, evictions) wait while it runs (crew.QUIET)."""
        with QUIET.saving():
            self._add(session, name, obj, t0)

    def _add(self, session: Session, name: str, obj: Any, t0: float) -> None:
        """The save of one item: its steps, in order (steps.SAVE)."""
        self._check_rank(session, name)
        # An earlier lazy save of this tag, not committed yet: this one would begin in the
        # folder it writes (an overwrite). It ends first; its failure, if any, is raised
        # by the next call as ever.
        snapshots = session.snapshots
        if not self._begun and snapshots is not None and snapshots.busy_with(self.tag):
            snapshots.wait(raise_error=False)
        if not self._begun:
            trace("begin", self.tag)
            self._begin(session, t0)
        if self._shares_folder(session):
            trace("claim", self.tag)
            claim_item(
                session.tiers.memory,
                self.tag,
                name,
                rank=session.rank,
                claimed=self.names,
                started_at=self._started_at,
            )
        self.names.append(name)
        if session.snapshots is None:
            self.items.append(self._write(session, name, obj))  # room, snapshot
        else:
            self._write_lazily(session, name, obj)  # room, snapshot: in the background
        self._blocking_s += time.perf_counter() - t0

    def _check_rank(self, session: Session, name: str) -> None:
        """An earlier lazy save's failure is raised (once); a rank this checkpoint does not
        name may not save into it."""
        if session.snapshots is not None:
            session.snapshots.raise_error()
        writers = self.writers(session)
        if session.rank not in writers:
            raise InvalidArgumentError(
                f"rank {session.rank} saves item {name!r} into checkpoint {self.tag!r}, which "
                f"rank(s) {', '.join(map(str, writers))} write (ranks=); only those save "
                f"into it, and the other ranks need not call anything"
            )

    def _shares_folder(self, session: Session) -> bool:
        """Other ranks write this tag's memory-tier folder too: each item name is claimed
        first, so that two ranks never write one item (ItemCollisionError, naming both)."""
        shared = len(self.writers(session)) > 1 and session.ranks.local_world_size > 1
        return shared and not self._memory_full and self._store is session.tiers.memory

    def _write_lazily(self, session: Session, name: str, obj: Any) -> None:
        """Lazy: the copy (hashed on the way) runs in the background; the fence before
        optimizer.step() waits for it. The state dicts are taken now, and the small tensors
        copied; the large ones are read later, and must not have changed. By default
        ("auto"), an item whose later copy could miss a write, or that needs room made
        first, is copied before this returns (`_copy_now`), as without lazy saves."""
        snapshots = session.snapshots
        assert snapshots is not None
        saveable = to_saveable(obj)
        small = snapshots.small
        taken = small.take(name, saveable)
        large = taken.large()
        now = session.lazy_auto and self._copy_now(session, large) is not None
        # Every write to the large tensors, by anything, until they are copied (where the
        # kernel can tell: lazy_watch.py); the version counters are read all the same.
        watching = None if now else snapshots.watch.begin(large, spelt)
        if session.lazy_auto and watching is None and large and not now:
            now = True  # the kernel refused this watch: nothing would see a write
        ready = cuda_ready_event(saveable)

        def copy() -> None:
            try:
                entry = self._write(session, name, saveable, ready, taken, watching)
                changed = taken.changed()
                if watching is not None and not watching.checked:
                    changed += watching.check()  # written by torch.save: no buffer to read
                if changed:
                    raise SnapshotChangedError(self.tag, name, sorted(set(changed)))
                self.items.append(entry)
            except BaseException as exc:
                self._lazy_error = exc  # the checkpoint is incomplete: never committed
                if session.lazy_auto and isinstance(exc, SnapshotChangedError):
                    refuse_lazy_saves(session, exc)  # said, and not raised: see there
                    return
                raise
            finally:
                if watching is not None:
                    watching.end()
                    if snapshots.watch.collapse_due():  # once per storage, after the commit
                        snapshots.submit(snapshots.watch.collapse_new, copies=False)
                small.give_back(name, taken)

        # Held (not `now`) until the commit is queued.
        snapshots.submit(copy, copies=True, hold=not now, tag=self.tag)
        if now:
            self._copied_now = True
            snapshots.wait(copies_only=True)  # its failure raised here, by save()

    def _copy_now(self, session: Session, large: list[tuple[Any, Any]]) -> str | None:
        """Why the default ("auto") copies this item before save() returns, or None (its
        copy may wait until the next optimizer step):

        - no torch optimizer has stepped in this session: the loop changes its tensors
          some other way (or has not begun), and nothing would make it wait for the copy;
        - a lazy copy of this session was found changed (`SnapshotChangedError`): the
          loop writes its saved tensors outside the optimizer step;
        - several processes (their commit is agreed at save());
        - a tensor whose writes the kernel cannot show here (lazy_watch.py);
        - too little room in the memory tier to be sure it fits as it stands (its room is
          made at save(), and a `MemoryBudgetError` raised there)."""
        assert session.snapshots is not None
        if session.lazy_refused is not None:
            return session.lazy_refused
        if not session.snapshots.stepped:
            return "no torch optimizer has stepped in this session"
        if session.world_size > 1:
            return f"a job of {session.world_size} processes"
        unseen = [place for place, tensor in large if not watchable(tensor)]
        if unseen:
            return f"{spelt(unseen[0])} is not in this process's own memory"
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for _p, t in large}
        if not session.budget.roomy(sum(storages.values())):
            return "the memory tier may have no room for it"
        return None

    def commit(self, session: Session) -> bool:
        """Commit now, or (lazy) once the queued copies are done; returns True."""
        if session.snapshots is not None:
            self.sealed = True  # no more saves; the commit runs after the copies
            session.snapshots.submit(
                lambda: self._commit_lazily(session), copies=False, tag=self.tag
            )
            if session.lazy_auto and self._copied_now:
                # An item had to be copied at save() (`_copy_now`): its checkpoint is
                # committed now too, as without lazy saves.
                session.snapshots.wait()
            return True
        try:
            with QUIET.saving():
                return self._commit_now(session)
        finally:
            start_audits()  # of this checkpoint's fills: between saves, not beside one

    def _begin(self, session: Session, t0: float) -> None:
        # The last commit's eviction, if the persister's thread has not run it yet: this
        # save's buffers are the evicted copy's (slots.py), and its room is theirs.
        session.persister.settle_eviction()
        tiers = session.tiers
        persistent = tiers.persistent
        # What the persistent tier holds, as the session knows it: never a request to the
        # store on the training thread (it may be down, or slow).
        if not self.overwrite and persistent and session.persister.holds(self.tag):
            raise CheckpointExistsError(persistent.url, self.tag)
        self._started_at, self._t0 = utc_now(), t0
        # The job's generation (agreed with the other ranks at the first save), and which
        # save of this tag: this part is committed only with parts of the same run and
        # restart of the job, and of the same save of the tag.
        self._generation = session.part_generation(self.tag)
        if self.overwrite:
            session.persister.release(self.tag)  # never rewrite what is being copied
        try:
            # This process's writer marker, linked into a new tag folder (slots.py).
            try:
                marker: tuple[str, ...] | None = session.pool.writer_marker(session.rank)
            except StorageError:
                marker = None  # begin_tag writes it, and says why it cannot
            if not begin_tag(
                tiers.memory,
                self.tag,
                rank=session.rank,
                overwrite=self.overwrite,
                world_size=session.world_size,
                marker=marker,
                announce=False,  # the memory tier: no begun record (commit_index.py)
            ):
                session.pool.forget_writer_marker(session.rank)
        except StorageFullError:
            self._memory_full = True  # the first item goes to the persistent tier (_write)
        self.tiers = tiers
        self._store = tiers.memory
        self._begun = True

    def _write(
        self,
        session: Session,
        name: str,
        obj: Any,
        ready: Any = None,
        taken: Taken | None = None,
        watching: SaveWatch | None = None,
    ) -> ItemEntry:
        """Write one item (steps `room`, then `snapshot`): into a reused memory-tier
        buffer when its layout maps exactly (snapshot.py), else with torch.save; to the
        persistent tier once this checkpoint does not fit the memory tier (its budget or
        its filesystem: budget.py). The copy is done when this returns (`obj` may
        change); returns the item's entry. A lazy save's small storages are read from what
        it took at the save (fence.py)."""
        trace("room", self.tag)
        layout, size = self._make_room(session, name, obj)
        trace("snapshot", self.tag)
        if self._store is session.tiers.memory:
            try:
                return self._write_memory(session, name, obj, layout, ready, taken, watching)
            except StorageFullError:
                # Another process took the room meanwhile: as if there had been none.
                short = session.budget.filesystem_full(size)
                self._move_to_persistent_tier(session, f"item {name!r}", short)
        assert self._store is not None
        if taken is not None:
            obj = taken.substitute(obj)
        return write_item(self._store, self.tag, name, obj, rank=session.rank)

    def _make_room(self, session: Session, name: str, obj: Any) -> tuple[Layout | None, int]:
        """Room for item `name` in the memory tier (budget.py: free buffers, evicted
        copies); where there is none, the checkpoint moves to the persistent tier. Returns
        the item's layout (None: torch.save writes it) and size."""
        if self._store is not session.tiers.memory:
            return None, 0  # moved already: written to the persistent tier
        layout = session.layouts.plan(name, obj)
        size = layout.size_bytes if layout is not None else estimate_bytes(obj)
        short: Shortfall | None
        if self._memory_full:
            short = session.budget.filesystem_full(size)
        else:
            short = session.budget.make_room(name, size)
        if short is not None:
            self._move_to_persistent_tier(session, f"item {name!r}", short)
        return layout, size

    def _write_memory(
        self,
        session: Session,
        name: str,
        obj: Any,
        layout: Layout | None,
        ready: Any,
        taken: Taken | None,
        watching: SaveWatch | None = None,
    ) -> ItemEntry:
        if layout is None:
            if taken is not None:
                obj = taken.substitute(obj)
            return write_item(session.tiers.memory, self.tag, name, obj, rank=session.rank)
        if taken is not None:
            layout = taken.on_copies(layout)
        before = session.pool.reused_bytes
        entry = write_snapshot(session.pool, self.tag, name, layout, rank=session.rank,
                               ready=ready, watching=watching)  # fmt: skip
        self._reused += session.pool.reused_bytes - before  # what the buffer held already
        return entry

    def _move_to_persistent_tier(self, session: Session, what: str, short: Shortfall) -> None:
        """Move this checkpoint to the persistent tier, since `what` (an item, or the
        commit's records) does not fit the memory tier (`short`): it is written and
        committed there directly, the items saved so far copied over first. Says so once:
        the checkpoint stays there."""
        persistent, memory = session.tiers.persistent, session.tiers.memory
        why = None
        if persistent is None:
            why = "there is no persistent tier"
        elif len(self.writers(session)) > 1:
            why = "streaming to the persistent tier needs a checkpoint that one rank writes"
        elif session.persister.failing():
            # The memory tier holds what is not durable yet (the newest acknowledged and
            # the labelled checkpoints: never dropped); the save must not wait on the store.
            status = session.persister.status()
            why = (
                f"the persistent tier fails ({status['last_error']}), and the memory tier "
                f"keeps {', '.join(map(str, status['pending']))} until they are durable"  # type: ignore[call-overload]
            )
        if why is not None:
            if short.limit_bytes is not None:
                raise MemoryBudgetError(self.tag, short.size_bytes, short.limit_bytes, why)
            free = short.free_bytes or 0
            raise MemoryTierFullError(self.tag, short.size_bytes, free, short.path, why)
        assert persistent is not None
        # Said once per session and kind (the budget, the filesystem), then at debug: a
        # job whose checkpoints do not fit streams every one of them.
        kind = "budget" if short.limit_bytes is not None else "filesystem"
        say = log.debug if kind in session.streamed else log.warning
        session.streamed.add(kind)
        if short.limit_bytes is not None:
            say(
                "checkpoint %r does not fit the memory budget (%d bytes, "
                "NEBULA_MEMORY_BUFFER_SIZE): %s needs %d bytes; writing it to %s directly",
                self.tag,
                short.limit_bytes,
                what,
                short.size_bytes,
                persistent.url,
            )
        else:
            total = sum(item.size_bytes for item in self.items) + short.size_bytes
            say(
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
        for item in self.items:
            copy_item(memory, persistent, self.tag, item, lambda _n: None)
        delete_checkpoint(memory, self.tag, discard=session.pool.recycle)
        self._store = persistent

    def _commit_lazily(self, session: Session) -> None:
        try:
            self._commit_or_discard(session)
        finally:
            start_audits()

    def _commit_or_discard(self, session: Session) -> None:
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

    def _commit_now(self, session: Session) -> bool:
        """The commit of this rank's part: its steps, in order (steps.COMMIT)."""
        t0 = time.perf_counter()
        if not self._begun:
            if session.world_size == 1 or session.rank not in self.writers(session):
                return True  # nothing saved, nothing to commit (or not this rank's)
            # Every writing rank's part makes the checkpoint, also the empty part of a
            # rank that saved nothing (DeepSpeed calls commit() on every rank).
            trace("begin", self.tag)
            self._begin(session, t0)
        if self._store is not None and self._store is session.tiers.persistent:
            return self._commit_streamed(session, t0)
        memory = session.tiers.memory
        trace("publish", self.tag)
        try:
            manifest = self._commit_part(session, memory)
        except StorageFullError:
            if len(self.writers(session)) > 1 or session.tiers.persistent is None:
                raise
            # No room left for the manifest (another process took it): commit it there.
            short = session.budget.filesystem_full(RECORDS_ROOM_BYTES)
            self._move_to_persistent_tier(session, "its manifest", short)
            return self._commit_streamed(session, t0)
        # A part that committed the tag removed its writer marker with the commit.
        marker_left = manifest is None
        if manifest is None and session.ranks.all_local:
            # The other ranks share this memory tier: wait (bounded) until their parts
            # are there and the checkpoint is committed, so that it loads on every rank.
            trace("await ranks", self.tag)
            try:
                manifest = await_commit(
                    memory,
                    self.tag,
                    world_size=session.world_size,
                    ranks=self.ranks,
                    generation=self._generation,
                    timeout_s=session.config.rank_timeout_s,
                    sequence_floor=session.persister.sequence_floor(memory),
                    slow=self._say_waiting(session),
                )
            except RankTimeoutError:
                # Every rank shares this memory tier, and the missing parts never came: the
                # checkpoint cannot commit. This rank's part goes now, not left in RAM for
                # gc or a restart to find.
                delete_part(memory, self.tag, session.rank, discard=session.pool.recycle)
                raise
        trace("record", self.tag)
        row = self._finish_commit(session, memory, "memory", t0, marker_left=marker_left)
        # This rank's part is committed (on a node without the other ranks, the memory
        # tier never holds the whole): it is what this rank's persister copies.
        trace("hand over", self.tag)
        used = manifest.sequence if manifest is not None and not marker_left else None
        session.persister.notify_committed(
            self.tag,
            row,
            labels=self.labels,
            leader=min(self.writers(session)),
            after_eviction=self._prepare_next_save(session, used),
        )
        # Peer replicas: the part goes to the partner node on the sender's thread (returns
        # at once; a no-op without replication).
        session.replicate(self.tag)
        return True

    def _say_waiting(self, session: Session) -> Callable[[list[int], float], None]:
        """What a save that waits for other ranks' parts says, a few seconds in (it may
        wait `rank_timeout_s`): who it waits for, and `ranks=` when none were named."""

        def say(missing: list[int], waited_s: float) -> None:
            saved = [r for r in self.writers(session) if r not in missing]
            hint = ""
            if self.ranks is None:
                hint = (
                    f"; if only rank(s) {', '.join(map(str, saved))} save this checkpoint, "
                    f"say so: nm.Checkpoint({self.tag!r}, ranks={saved})"
                )
            log.warning(
                "checkpoint %r: save() has waited %.0f s for rank(s) %s to save their part, "
                "and waits up to rank_timeout_s (%.0f s) before it fails%s",
                self.tag,
                waited_s,
                ", ".join(map(str, missing)),
                session.config.rank_timeout_s,
                hint,
            )

        return say

    def _prepare_next_save(self, session: Session, used: int | None) -> Callable[[], None]:
        """What the persister runs once it has evicted the copies this commit supersedes
        (their buffers are reused): the next save's buffers made while training runs (the
        cold start: slots.py), and the commit sequence of this process's next commit on
        the memory tier reserved after `used`, the one this commit took (None: another
        rank's commit published the manifest)."""
        items = list(self.items)

        def prepare_next_save() -> None:
            try:
                session.pool.prepare(items, fits=session.budget.spare_fits)
            finally:
                if used is not None:
                    session.sequences.reserve_after(used)

        return prepare_next_save

    def _commit_part(self, session: Session, store: Store) -> Manifest | None:
        """Publish this rank's part of the tag on `store` (commit.commit_rank): the
        manifest if this call committed the tag, None while other ranks' parts are due."""
        return commit_rank(
            store,
            self.tag,
            rank=session.rank,
            world_size=session.world_size,
            items=self.items,
            created_at=self._started_at,
            labels=self.labels,
            ranks=self.ranks,
            generation=self._generation,
            sequence_floor=session.persister.sequence_floor(store),
            reserved=session.sequences if store is session.tiers.memory else None,
        )

    def _commit_streamed(self, session: Session, t0: float) -> bool:
        """The commit of a checkpoint moved to the persistent tier: it is durable once
        published (persister.notify_streamed records it, and retires older copies)."""
        persistent = session.tiers.persistent
        assert persistent is not None
        trace("publish", self.tag)
        self._commit_part(session, persistent)
        trace("record", self.tag)
        row = self._finish_commit(session, persistent, "persistent", t0)
        trace("hand over", self.tag)
        session.persister.notify_streamed(self.tag, row, leader=session.rank)
        return True

    def _finish_commit(
        self, session: Session, store: Store, tier: str, t0: float, *, marker_left: bool = True
    ) -> HistoryRow:
        """After the commit on `store`: drop this rank's writer marker (unless the commit
        did: not `marker_left`), mark the save committed, and give the history row of the
        save."""
        if marker_left:
            store.remove(self.tag, writer_marker_name(session.rank))
        self.committed = True
        self._blocking_s += time.perf_counter() - t0
        size = sum(item.size_bytes for item in self.items)
        return make_row(
            tag=self.tag,
            step=step_of(self.tag),
            tier=tier,
            rank=session.rank,
            started_at=self._started_at,
            duration_s=time.perf_counter() - self._t0,
            blocking_s=self._blocking_s,
            size_bytes=size,
            bytes_written=size - self._reused,
            bytes_reused=self._reused,
        )


def refuse_lazy_saves(session: Session, error: SnapshotChangedError) -> None:
    """The default ("auto") deferred a copy, and the loop changed a saved tensor before it
    was taken, outside an optimizer step: that checkpoint is not committed (the previous
    one stays the newest), and every later save of the session copies at save(). Said
    once, as a warning; not raised, since the loop did nothing the synchronous default
    ever refused."""
    session.lazy_refused = "a saved tensor was changed outside an optimizer step"
    log.warning(
        "%s. From now on, this session's saves copy at save() (lazy_snapshot=False does "
        "so from the start; lazy_snapshot=True raises this instead)",
        error,
    )


def write_snapshot(
    pool: SlotPool,
    tag: str,
    name: str,
    layout: Layout,
    *,
    rank: int,
    ready: Any = None,
    watching: SaveWatch | None = None,
) -> ItemEntry:
    """Copy the item laid out by `layout` into its reused buffer in `tag`, hashing it on
    the way (snapshot.fill); the copy is done when this returns (the caller's tensors may
    change). Returns the item's manifest entry. `watching`: a lazy save's watch, checked
    against the buffer after the copy (`SnapshotChangedError` for what was written)."""
    buffer = pool.open_item(tag, name, layout.size_bytes)
    if not layout.on_host():
        buffer.pin()  # once per buffer: it is reused from one checkpoint to the next
    memory = buffer.memory if pool.reuse_unchanged else None
    label = f"item {name!r} of checkpoint {tag!r}"
    digest = fill(buffer.tensor, buffer.view, layout, ready=ready, memory=memory, label=label)
    if watching is not None:
        changed = watching.check(buffer.view, layout)
        if changed:
            raise SnapshotChangedError(tag, name, changed)
    if memory is not None:
        pool.count_reused(memory.reused_bytes)
    return ItemEntry.written(
        name,
        rank=rank,
        size_bytes=layout.size_bytes,
        checksum=digest,
        tensor_bytes=layout.tensor_bytes,
    )
