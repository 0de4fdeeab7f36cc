"""Reused snapshot buffers: the memory tier's item files, kept mapped and recycled.

Copying into memory that is already mapped and touched runs at about 14 GB/s on a 2-core
machine; into fresh pages at 1-3 GB/s (docs/benchmarks.md, "the fast path"). So an item
file of the memory tier is not deleted when its checkpoint is evicted: it moves into the
pool (`<memory root>/.slots/`), and the next save of an item takes it back (a rename, so
the pages and this process's mapping of them survive) and overwrites it in place.

The pool keeps as many free files of an item as the job has lately needed buffers of it
at once, less those in checkpoints (`Need`): two in all where each checkpoint is evicted
by the next commit (the newest committed copy and the one being filled), three where a
persist of the one before is still in flight at the next save (a persist that runs while
the next steps do), never more than a byte limit when a memory budget is set, and none
with `spare_buffers=False` (each save faults in fresh pages: the tier holds checkpoints
only between saves). A file is only ever written in place while it is in no committed
checkpoint: it left its old tag through the delete protocol (manifest first) before it
came here.

One module, though a long one: the pool's files, this process's mappings of them and
the spares prepared in the background share one lock and one set of invariants (a file is
mapped, free, or in a checkpoint, never two at once).

The cold start (issue #22): a job's first save has no buffer to reuse, and neither has its
second (the first is the newest committed copy). So a new buffer's pages are faulted in by
two threads before the copy (pages.py), and after a commit the pool makes a *spare* for
each item whose only copy is that checkpoint's (`prepare`): a pool file allocated,
populated and mapped by a low-priority thread while training runs, where the memory
budget and the filesystem hold one more buffer (budget.py). The second save takes it as
it would a recycled one (waiting for the rest, and helping, if it is not done yet); from
the third save on, evicted checkpoints' files come back as before.

It also keeps each live process's writer marker file (`<memory root>/.writers/`), which
a save links into the tag it begins (protocol.commit.begin_tag) instead of writing one.

A tier's files are reached through storage/ (`Store` and its backends), except where a
descriptor of one's own is needed (`os.open`): this module opens and maps the pool's files,
protocol/memory_tier.py the tier's lock files (tier_lifetime.py's hold, rank_presence.py's
claims), protocol/holds.py a job's claim lock on the tier, and protocol/cowriters.py a
copy's lock on its destination tag. This module deals only with the memory tier, which is
always a local folder.

Not for: what goes into a buffer (snapshot.py) or when a checkpoint is evicted
(persister.py).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from nebulaml._threads import start as start_thread
from nebulaml.format.manifest import ItemEntry
from nebulaml.format.names import SLOTS_DIR, WRITER_PREFIX, WRITERS_DIR, validate_name
from nebulaml.protocol.leases import process_alive
from nebulaml.protocol.markers import writer_record
from nebulaml.runtime.buffer_need import Need
from nebulaml.runtime.pages import Population, lower_priority, populate
from nebulaml.runtime.unchanged import BufferMemory
from nebulaml.storage.failures import translate_errors
from nebulaml.storage.mapped_reads import claim_unused
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")

POOL_DIR = SLOTS_DIR
# An item smaller than this gets no spare: its fresh pages cost less than a thread.
SPARE_MIN_BYTES = 1 << 20


@dataclass(eq=False)
class MappedFile:
    """One item file mapped into this process: `tensor` (uint8) and `view` over its bytes."""

    fd: int
    size_bytes: int
    mm: mmap.mmap
    view: memoryview
    tensor: Any = field(repr=False)
    pinned: bool = False
    # What its last fill put there (unchanged.py): the next fill skips what is still so.
    memory: BufferMemory = field(default_factory=BufferMemory, repr=False)

    @classmethod
    def open(cls, fd: int, size_bytes: int) -> MappedFile:
        """Map `fd` (shared); its pages are faulted in by the caller (pages.populate)."""
        import torch

        mm = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED)
        return cls(fd, size_bytes, mm, memoryview(mm), torch.frombuffer(mm, dtype=torch.uint8))

    def unlinked(self) -> bool:
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True

    def pin(self) -> None:
        """Page-lock the mapping once, for CUDA copies into it (a no-op without CUDA)."""
        if not self.pinned:
            from nebulaml.runtime.snapshot import pin

            self.pinned = pin(self.tensor)

    def close(self, *, close_fd: bool = True) -> None:
        self.memory.settle()  # its audit reads the mapping
        self.memory.record = None
        if self.pinned:
            from nebulaml.runtime.snapshot import unpin

            unpin(self.tensor)
            self.pinned = False
        self.tensor = None
        self.view.release()
        with contextlib.suppress(BufferError):
            self.mm.close()  # a BufferError: a caller still holds a view; GC unmaps it
        if close_fd:
            with contextlib.suppress(OSError):
                os.close(self.fd)


@dataclass(eq=False)
class _Spare:
    """A pool file being made for the next save of item `name` (SlotPool.prepare)."""

    name: str
    path: str
    fd: int
    size_bytes: int
    key: tuple[int, int]  # (st_dev, st_ino)
    allocated: bool = False  # posix_fallocate done: its bytes are the filesystem's
    cancelled: bool = False
    mapped: MappedFile | None = None
    population: Population | None = None
    mapped_event: threading.Event = field(default_factory=threading.Event)  # or given up
    finished: threading.Event = field(default_factory=threading.Event)  # ready, or gone


def _close(thing: MappedFile | int) -> None:
    """Close a mapping (and its descriptor), or a descriptor."""
    if isinstance(thing, int):
        with contextlib.suppress(OSError):
            os.close(thing)
    else:
        thing.close()


class SlotPool:
    """The reusable item files of one memory tier, and this process's mappings of them.

    Example:
        >>> import tempfile, torch
        >>> pool = SlotPool(Store(tempfile.mkdtemp(), durable=False))
        >>> pool.store.make_dir("t1")
        >>> f = pool.open_item("t1", "model", 64)
        >>> f.view[0] = 7
        >>> pool.recycle("t1", "model")        # the tag is gone; its file waits in the pool
        True
        >>> pool.store.make_dir("t2")
        >>> pool.open_item("t2", "model", 64) is f   # same pages, same mapping
        True
        >>> pool.close()
    """

    def __init__(
        self,
        store: Store,
        *,
        limit_bytes: int | None = None,
        reuse_unchanged: bool = True,
        spares: bool = True,
    ) -> None:
        root = store.local_path()
        if root is None:
            raise ValueError(f"{store.url}: the memory tier must be a local folder")
        self.store = store
        self.limit_bytes = limit_bytes
        # False (`spare_buffers=False`): no free file kept or made; each save's buffer is new.
        self.spares = spares
        self.need = Need()
        # A fill skips the storages its buffer still holds (unchanged.py); how many bytes
        # the fills of this pool did not copy.
        self.reuse_unchanged = reuse_unchanged
        self.reused_bytes = 0
        self._root = root
        self._pool = os.path.join(root, POOL_DIR)
        self._maps: dict[tuple[int, int], MappedFile] = {}
        self._opened: dict[str, int] = {}  # item name: the size of its last buffer
        # The pool files `free_bytes` last listed: (name, size, entries), for `open_item`.
        self._peeked: tuple[str, int, list[os.DirEntry[str]]] | None = None
        self._spares: dict[str, _Spare] = {}  # by item name, while being made
        self._markers: dict[int, str] = {}  # by rank: this process's writer marker file
        self._closed = False  # no spare is made once the pool is closed
        # The training thread fills buffers while the persister thread recycles them and
        # spare buffers are made in threads of their own.
        self._lock = threading.RLock()
        # What is dropped under the lock (mappings, descriptors), closed once it is let go.
        self._doomed: list[MappedFile | int] | None = None
        store.mapped = self.view_of  # the persister reads the files through our mappings

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The pool's lock. What is dropped while it is held (a mapping, a descriptor) is
        closed once the outermost holder lets it go: the last close of a large file frees
        its pages (tens of ms for a few hundred MB), and a save that needs the lock (its
        buffer, the budget's look at the pool) must not wait for that."""
        doomed: list[MappedFile | int] | None = None
        try:
            with self._lock:
                outer = self._doomed is None
                if outer:
                    self._doomed = []
                try:
                    yield
                finally:
                    if outer:
                        doomed, self._doomed = self._doomed, None
        finally:  # also when the body raised; each closed even if one before fails
            with contextlib.ExitStack() as closing:
                for thing in doomed or ():
                    closing.callback(_close, thing)

    def _dispose(self, thing: MappedFile | int) -> None:
        """Close `thing` (a mapping, or a descriptor) once the lock is let go; now if it
        is not held."""
        with self._locked():
            assert self._doomed is not None
            self._doomed.append(thing)

    # filling ---------------------------------------------------------------------------
    def settle_audits(self) -> None:
        """Wait for the background audits of every buffer's last fill (unchanged.py)."""
        with self._locked():
            maps = list(self._maps.values())
        for mapped in maps:
            mapped.memory.settle()

    def count_reused(self, n: int) -> None:
        """Add `n` bytes a fill did not copy (its buffer held them) to `reused_bytes`."""
        with self._locked():
            self.reused_bytes += n

    def open_item(self, tag: str, name: str, size_bytes: int) -> MappedFile:
        """The file of item `name` in `tag`, `size_bytes` long and mapped: a pool file of
        that name if there is one (its pages already touched), else a new file."""
        validate_name("item", name)
        dest = self.store.local_path(tag, name)
        assert dest is not None
        self._await_spare(name)
        with self._locked(), translate_errors(self.store.display(tag, name)):
            peeked, self._peeked = self._peeked, None
            if peeked is not None and peeked[:2] == (name, size_bytes):
                candidates = peeked[2]  # free_bytes just listed them (the budget's look)
            else:
                candidates = self._free_files(name, size_bytes)
            for candidate in candidates:
                try:
                    os.rename(candidate.path, dest)  # atomic: another rank may take it first
                except FileNotFoundError:
                    continue
                # A pool file's name is never given to another file, so the file moved is
                # the one listed; mapped already, it needs no opening (the mapping holds
                # its inode: no other file has that number meanwhile).
                st = candidate.stat(follow_symlinks=False)
                mapped = self._maps.get((st.st_dev, st.st_ino))
                if mapped is not None and mapped.size_bytes == size_bytes == st.st_size:
                    self._opened[name] = size_bytes
                    self.need.saw(name, self._copies(name))
                    return mapped
                break
            fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                mapped = self._map(fd, size_bytes)
                self._opened[name] = size_bytes
                self.need.saw(name, self._copies(name))
                return mapped
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(dest)  # no partial item left behind
                raise

    def _map(self, fd: int, size_bytes: int) -> MappedFile:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        mapped = self._maps.get(key)
        if mapped is not None and mapped.size_bytes == size_bytes and st.st_size == size_bytes:
            os.close(fd)
            return mapped
        if mapped is not None:
            self._drop(key)
        if st.st_size != size_bytes:
            os.ftruncate(fd, size_bytes)
        mapped = MappedFile.open(fd, size_bytes)
        try:
            # Allocated now, so that a full RAM disk is an ENOSPC here (StorageFullError),
            # not a SIGBUS when the copy touches a page that has no room; and faulted in
            # writable, by two threads that allocate a chunk each in turn: faster than
            # by the copy (pages.py). (mmap's MAP_POPULATE maps a file's pages read-only:
            # the copy then faults each one again.)
            populate(mapped.tensor.data_ptr(), size_bytes, fd=fd)
        except BaseException:
            mapped.close(close_fd=False)  # the caller closes the descriptor
            raise
        self._maps[key] = mapped
        return mapped

    def view_of(self, st_dev: int, st_ino: int, size_bytes: int) -> memoryview | None:
        """A read-only view of this pool's mapping of the file (st_dev, st_ino) when it has
        one of `size_bytes`, else None. Its pages are mapped already: reading them faults
        nothing in. The caller releases it; until then the memory stays mapped, even if the
        pool drops the file meanwhile (`MappedFile.close` leaves a mapping with views to
        the garbage collector)."""
        with self._locked():
            mapped = self._maps.get((st_dev, st_ino))
            if mapped is None or mapped.size_bytes != size_bytes or mapped.tensor is None:
                return None
            return mapped.view.toreadonly()

    def leaves_of(self, tag: str, name: str) -> list[bytes] | None:
        """The digest of each 1 MiB piece of item `name` in `tag` as its last fill hashed
        them (unchanged.FillRecord), when this pool maps that very file and the fill is
        done; else None. Evidence only: the caller checks it against the item's checksum
        (a replica's sender sends only the pieces that changed: runtime/replica_delta.py)."""
        path = self.store.local_path(tag, name)
        if path is None:
            return None
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return None
        with self._locked():
            mapped = self._maps.get((st.st_dev, st.st_ino))
            record = None if mapped is None else mapped.memory.record
            if record is None or record.size_bytes != st.st_size or b"" in record.leaves:
                return None
            return list(record.leaves)

    def _free_files(self, name: str, size_bytes: int) -> list[os.DirEntry[str]]:
        """Pool files for `name` (regular files, their status read), the one of the right
        size first."""
        try:
            entries = list(os.scandir(self._pool))
        except FileNotFoundError:
            return []
        mine = []
        for entry in entries:
            if entry.name.rsplit(".", 1)[0] != name:
                continue
            with contextlib.suppress(FileNotFoundError):  # taken meanwhile
                if stat.S_ISREG(entry.stat(follow_symlinks=False).st_mode):
                    mine.append(entry)
        mine.sort(key=lambda e: e.stat(follow_symlinks=False).st_size != size_bytes)
        return mine

    # writer markers --------------------------------------------------------------------
    def writer_marker(self, rank: int) -> tuple[str, ...]:
        """Where (parts on the pool's store, in `.writers/`) a file holds this process's
        writer marker for `rank` (protocol.markers.writer_record), written on first use:
        a save links it into its new tag folder (commit.begin_tag) instead of writing one
        there. Those of dead processes are removed then. `forget_writer_marker` when the
        link failed (the file gone: another hand's)."""
        pid = os.getpid()  # a forked child writes its own
        name = f"{WRITER_PREFIX}{rank}-{pid}.json"
        if self._markers.get(rank) != name:
            self._sweep_markers()
            self.store.make_dir(WRITERS_DIR)
            self.store.publish((WRITERS_DIR, name), writer_record(rank), create_only=False)
            self._markers[rank] = name
        return (WRITERS_DIR, name)

    def forget_writer_marker(self, rank: int) -> None:
        """The marker file of `rank` is gone: the next `writer_marker` writes it again."""
        self._markers.pop(rank, None)

    def _sweep_markers(self) -> None:
        """Remove the writer marker files of processes that are gone."""
        try:
            entries = list(os.scandir(os.path.join(self._root, WRITERS_DIR)))
        except FileNotFoundError:
            return
        for entry in entries:
            if not entry.name.startswith(WRITER_PREFIX):
                continue
            pid = entry.name.removesuffix(".json").rsplit("-", 1)[-1]
            if not pid.isdigit() or not process_alive(int(pid)):
                self._unlink(entry.path)

    # recycling -------------------------------------------------------------------------
    def recycle(self, tag: str, name: str) -> bool:
        """Move the file of item `name` out of `tag` into the pool (True), or delete it when
        the pool already has one for that name or is over its limit (False). Call only once
        the tag's manifest is gone."""
        validate_name("item", name)
        path = self.store.local_path(tag, name)
        assert path is not None
        with self._locked():
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except FileNotFoundError:
                return False
            except OSError:  # not a file nebula wrote (a link, a FIFO): not for reuse
                self._unlink(path)
                return False
            try:
                size = os.fstat(fd).st_size
                # A load has it mapped (storage.read_local): reusing it would write the
                # next save under the loaded tensors. Removed, it lives on until unmapped.
                if not claim_unused(fd) or not self._room_for(name, size):
                    self._unlink(path)
                    return False
                os.makedirs(self._pool, mode=0o700, exist_ok=True)
                try:
                    os.rename(path, os.path.join(self._pool, f"{name}.{uuid.uuid4().hex[:12]}"))
                except FileNotFoundError:
                    return False
                return True
            finally:
                self._dispose(fd)  # the last reference to a removed file: its pages go

    def _room_for(self, name: str, size_bytes: int) -> bool:
        """Whether the file of `name` leaving its checkpoint stays as a free file: the
        job's need of that item's buffers is not met by the free files and the copies
        in checkpoints (this one's counted among them, as it still is), within the limit."""
        if not self.spares:
            return False
        try:
            entries = [e for e in os.scandir(self._pool) if e.is_file()]
        except FileNotFoundError:
            entries = []
        free = sum(e.name.rsplit(".", 1)[0] == name for e in entries)
        if free + self._copies(name) > self.need.of(name):
            return False
        if self.limit_bytes is None:
            return True
        return self.pool_bytes() + size_bytes <= self.limit_bytes

    def pool_bytes(self) -> int:
        """Bytes the free files hold."""
        try:
            return sum(e.stat().st_size for e in os.scandir(self._pool) if e.is_file())
        except FileNotFoundError:
            return 0

    def free_bytes(self, name: str, size_bytes: int) -> int:
        """Size of the pool file `open_item(tag, name, size_bytes)` would take (0: none).
        That call takes its candidates from this list: one that is gone meanwhile (taken
        by another rank) is passed over there, as one taken after it looked."""
        entries = self._free_files(name, size_bytes)
        self._peeked = (name, size_bytes, entries)
        return entries[0].stat(follow_symlinks=False).st_size if entries else 0

    def trim(self, keep_name: str | None = None) -> int:
        """Delete the free files (but those of item `keep_name`); returns the bytes freed."""
        self._cancel_spares(keep_name)
        try:
            entries = [e for e in os.scandir(self._pool) if e.is_file()]
        except FileNotFoundError:
            return 0
        freed = 0
        for entry in entries:
            if keep_name is not None and entry.name.rsplit(".", 1)[0] == keep_name:
                continue
            with contextlib.suppress(FileNotFoundError):
                freed += entry.stat().st_size
            self._unlink(entry.path)
        return freed

    def usage_bytes(self) -> int:
        """Bytes the whole memory tier holds: checkpoints, files being written, the pool."""
        root = self.store.local_path()
        assert root is not None
        total = 0
        for folder, _dirs, files in os.walk(root):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(folder, name)).st_size
        return total

    def _unlink(self, path: str) -> None:
        with self._locked(), contextlib.suppress(FileNotFoundError):
            st = os.lstat(path)
            os.unlink(path)
            # Our mapping would keep the pages alive after the name is gone.
            self._drop((st.st_dev, st.st_ino))

    # spare buffers ---------------------------------------------------------------------
    def prepare(self, items: Iterable[ItemEntry], fits: Callable[[int], bool]) -> list[str]:
        """Start making, in the background, a spare pool file for the next save of each
        of `items` (a committed checkpoint's) whose buffer this pool filled, where the
        pool has no free file of it (and `spares` is on): the next save then finds its
        buffer allocated, populated and mapped (pages.py) instead of faulting in fresh
        pages itself. `fits(size_bytes)` says whether the memory budget
        and the filesystem hold one more buffer (budget.MemoryBudget.spare_fits): one
        they do not is not made. A spare is a pool file from the start (counted in
        `pool_bytes` and the tier's usage; its unallocated bytes in `unallocated_bytes`)
        and is taken, or awaited, by `open_item`; `trim` cancels it. Returns the names of
        the items whose spare is being made. Two copies left after the eviction (a
        persist still holds the one before) get one too: the next save needs a third
        buffer, and faulting it in there cost that save 2-7x its steady time."""
        self._sweep()  # after the eviction: its files' pages go once no mapping holds them
        started = []
        for item in items:
            name, size = item.name, item.size_bytes
            if size < SPARE_MIN_BYTES:
                continue
            with self._locked():
                if self._closed or self._opened.get(name) != size or name in self._spares:
                    continue  # not a buffer of this pool's, or one is being made
                if not self.spares or self._free_files(name, size) or not fits(size):
                    continue
                spare = self._new_spare(name, size)
                if spare is None:
                    continue
                self._spares[name] = spare
            start_thread(
                threading.Thread(
                    target=self._make_spare,
                    args=(spare,),
                    name=f"nebula-spare-{name}",
                    daemon=True,
                )
            )
            started.append(name)
        return started

    def _new_spare(self, name: str, size_bytes: int) -> _Spare | None:
        path = os.path.join(self._pool, f"{name}.{uuid.uuid4().hex[:12]}")
        try:
            os.makedirs(self._pool, mode=0o700, exist_ok=True)
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(path, flags, 0o600)
        except OSError:
            return None
        try:
            os.ftruncate(fd, size_bytes)  # its size counts in the budget from now on
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            self._unlink(path)
            return None
        return _Spare(name, path, fd, size_bytes, (st.st_dev, st.st_ino))

    def _make_spare(self, spare: _Spare) -> None:
        """A spare's thread: allocate, map, populate, then hand the mapping to the pool
        (or, cancelled or failed, remove the file)."""
        lower_priority()
        adopted = False
        try:
            try:
                os.posix_fallocate(spare.fd, 0, spare.size_bytes)
            except OSError as exc:  # no room after all (another process took it)
                log.debug("no spare buffer for %r: %s", spare.name, exc)
                return
            with self._locked():
                spare.allocated = True
                if spare.cancelled:
                    return
                spare.mapped = MappedFile.open(spare.fd, spare.size_bytes)
                address = spare.mapped.tensor.data_ptr()
                spare.population = Population(address, spare.size_bytes)
            spare.mapped_event.set()
            spare.population.work()
            spare.population.wait()
            with self._locked():
                if spare.cancelled or not spare.population.done() or spare.mapped.unlinked():
                    return
                self._maps[spare.key] = spare.mapped
                adopted = True
        except Exception as exc:  # noqa: BLE001 - a spare is an optimisation, never a failure
            log.debug("no spare buffer for %r: %s", spare.name, exc)
        finally:
            if not adopted and spare.population is not None:
                spare.population.cancel()  # no thread touches the mapping any more
            with self._locked():
                if not adopted:
                    # (The mapping closes the fd too.)
                    self._dispose(spare.mapped if spare.mapped is not None else spare.fd)
                    with contextlib.suppress(FileNotFoundError):
                        st = os.lstat(spare.path)
                        if (st.st_dev, st.st_ino) == spare.key:  # not another one's by now
                            os.unlink(spare.path)
                if self._spares.get(spare.name) is spare:
                    del self._spares[spare.name]
            spare.mapped_event.set()
            spare.finished.set()

    def _await_spare(self, name: str) -> None:
        """Until the spare of `name` being made (if any) is ready or gone, populating its
        remaining pages in this thread (and a helper) meanwhile."""
        with self._locked():
            spare = self._spares.get(name)
        if spare is None:
            return
        spare.mapped_event.wait()
        if spare.population is not None:
            spare.population.run()
        spare.finished.wait()

    def _cancel_spares(self, keep_name: str | None = None) -> None:
        """Stop making the spares (but that of `keep_name`); their files are removed."""
        with self._locked():
            doomed = [s for n, s in self._spares.items() if n != keep_name]
            for spare in doomed:
                spare.cancelled = True
                if spare.population is not None:
                    spare.population.cancelled = True
        for spare in doomed:
            spare.finished.wait()

    def wait_spares(self, timeout_s: float | None = None) -> bool:
        """Until no spare is being made (True), or `timeout_s` passed (False)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._locked():
                spares = list(self._spares.values())
            if not spares:
                return True
            for spare in spares:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not spare.finished.wait(left):
                    return False

    def unallocated_bytes(self) -> int:
        """Bytes of spares not allocated yet: counted in the pool's size, not yet in its
        filesystem's free space (budget.py subtracts them)."""
        with self._locked():
            return sum(s.size_bytes for s in self._spares.values() if not s.allocated)

    def _copies(self, name: str) -> int:
        """How many tag folders of the memory tier hold an item `name`."""
        root = self.store.local_path()
        assert root is not None
        count = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(root):
                if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                    continue
                count += os.path.lexists(os.path.join(entry.path, name))
        return count

    # mappings --------------------------------------------------------------------------
    def _sweep(self) -> None:
        """Forget mappings of files deleted meanwhile (by eviction, prune, recovery): the
        pages of a deleted file stay in RAM while a mapping holds them. (An open mapping
        also keeps the file's inode, so no new file takes its number meanwhile.)"""
        with self._locked():
            for key in [k for k, m in list(self._maps.items()) if m.unlinked()]:
                self._drop(key)

    def _drop(self, key: tuple[int, int]) -> None:
        with self._locked():
            mapped = self._maps.pop(key, None)
            if mapped is not None:
                self._dispose(mapped)

    def close(self) -> None:
        """Unmap everything (the files stay, but spares being made)."""
        with self._locked():
            self._closed = True
        self._cancel_spares()
        with self._locked():
            for key in list(self._maps):
                self._drop(key)
            markers, self._markers = self._markers, {}
        pid = os.getpid()
        for name in markers.values():
            if name.endswith(f"-{pid}.json"):  # a forked child's parent keeps its own
                self._unlink(os.path.join(self._root, WRITERS_DIR, name))
