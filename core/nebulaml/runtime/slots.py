"""Reused snapshot buffers: the memory tier's item files, kept mapped and recycled.

Copying into memory that is already mapped and touched runs at about 14 GB/s on a 2-core
machine; into fresh pages at 1-3 GB/s (DESIGN.md §8). So an item file of the memory tier is
not deleted when its checkpoint is evicted: it moves into the pool (`<memory
root>/.slots/`), and the next save of an item takes it back (a rename, so the pages and
this process's mapping of them survive) and overwrites it in place.

The pool keeps at most one free file per item name (two snapshot slots in all: the newest
committed copy and the one being filled), and never more than a byte limit when a memory
budget is set. A file is only ever written in place while it is in no committed
checkpoint: it left its old tag through the delete protocol (manifest first) before it
came here.

This module and storage.py are the only ones that touch files; it deals only with the
memory tier, which is always a local folder.

Not for: what goes into a buffer (snapshot.py) or when a checkpoint is evicted
(persister.py).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from nebulaml.format.manifest import ItemEntry
from nebulaml.format.names import validate_name
from nebulaml.runtime.snapshot import Layout, fill
from nebulaml.storage.store import Store
from nebulaml.storage.streams import claim_unused, translate_errors

POOL_DIR = ".slots"
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


@dataclass(eq=False)
class MappedFile:
    """One item file mapped into this process: `tensor` (uint8) and `view` over its bytes."""

    fd: int
    size_bytes: int
    mm: mmap.mmap
    view: memoryview
    tensor: Any = field(repr=False)
    pinned: bool = False

    @classmethod
    def open(cls, fd: int, size_bytes: int) -> MappedFile:
        import torch

        mm = mmap.mmap(fd, size_bytes, flags=_MAP_FLAGS)
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

    def close(self) -> None:
        if self.pinned:
            from nebulaml.runtime.snapshot import unpin

            unpin(self.tensor)
            self.pinned = False
        self.tensor = None
        self.view.release()
        with contextlib.suppress(BufferError):
            self.mm.close()  # a BufferError: a caller still holds a view; GC unmaps it
        with contextlib.suppress(OSError):
            os.close(self.fd)


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

    def __init__(self, store: Store, *, limit_bytes: int | None = None) -> None:
        root = store.local_path()
        if root is None:
            raise ValueError(f"{store.url}: the memory tier must be a local folder")
        self.store = store
        self.limit_bytes = limit_bytes
        self._pool = os.path.join(root, POOL_DIR)
        self._maps: dict[tuple[int, int], MappedFile] = {}
        # The training thread fills buffers while the persister thread recycles them.
        self._lock = threading.RLock()
        store.mapped = self.view_of  # the persister reads the files through our mappings

    # filling ---------------------------------------------------------------------------
    def open_item(self, tag: str, name: str, size_bytes: int) -> MappedFile:
        """The file of item `name` in `tag`, `size_bytes` long and mapped: a pool file of
        that name if there is one (its pages already touched), else a new file."""
        validate_name("item", name)
        dest = self.store.local_path(tag, name)
        assert dest is not None
        with self._lock, translate_errors(self.store.display(tag, name)):
            self._sweep()
            for candidate in self._free_files(name, size_bytes):
                try:
                    os.rename(candidate, dest)  # atomic: another rank may take it first
                    break
                except FileNotFoundError:
                    continue
            fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                return self._map(fd, size_bytes)
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
        if st.st_size > size_bytes:
            os.ftruncate(fd, size_bytes)
        elif st.st_size < size_bytes:
            # Allocated now, so that a full RAM disk is an ENOSPC here (StorageFullError),
            # not a SIGBUS when the copy touches a page that has no room.
            os.posix_fallocate(fd, 0, size_bytes)
        mapped = MappedFile.open(fd, size_bytes)
        self._maps[key] = mapped
        return mapped

    def view_of(self, st_dev: int, st_ino: int, size_bytes: int) -> memoryview | None:
        """A read-only view of this pool's mapping of the file (st_dev, st_ino) when it has
        one of `size_bytes`, else None. Its pages are mapped already: reading them faults
        nothing in. The caller releases it; until then the memory stays mapped, even if the
        pool drops the file meanwhile (`MappedFile.close` leaves a mapping with views to
        the garbage collector)."""
        with self._lock:
            mapped = self._maps.get((st_dev, st_ino))
            if mapped is None or mapped.size_bytes != size_bytes or mapped.tensor is None:
                return None
            return mapped.view.toreadonly()

    def _free_files(self, name: str, size_bytes: int) -> list[str]:
        """Pool files for `name`, the one of the right size first."""
        try:
            entries = list(os.scandir(self._pool))
        except FileNotFoundError:
            return []
        mine = [e for e in entries if e.name.rsplit(".", 1)[0] == name and e.is_file()]
        mine.sort(key=lambda e: e.stat().st_size != size_bytes)
        return [e.path for e in mine]

    # recycling -------------------------------------------------------------------------
    def recycle(self, tag: str, name: str) -> bool:
        """Move the file of item `name` out of `tag` into the pool (True), or delete it when
        the pool already has one for that name or is over its limit (False). Call only once
        the tag's manifest is gone."""
        validate_name("item", name)
        path = self.store.local_path(tag, name)
        assert path is not None
        with self._lock:
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
                os.close(fd)

    def _room_for(self, name: str, size_bytes: int) -> bool:
        try:
            entries = [e for e in os.scandir(self._pool) if e.is_file()]
        except FileNotFoundError:
            entries = []
        if any(e.name.rsplit(".", 1)[0] == name for e in entries):
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
        """Size of the pool file `open_item(tag, name, size_bytes)` would take (0: none)."""
        for path in self._free_files(name, size_bytes):
            with contextlib.suppress(FileNotFoundError):
                return os.lstat(path).st_size
        return 0

    def trim(self, keep_name: str | None = None) -> int:
        """Delete the free files (but those of item `keep_name`); returns the bytes freed."""
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
        with self._lock, contextlib.suppress(FileNotFoundError):
            st = os.lstat(path)
            os.unlink(path)
            # Our mapping would keep the pages alive after the name is gone.
            self._drop((st.st_dev, st.st_ino))

    # mappings --------------------------------------------------------------------------
    def _sweep(self) -> None:
        """Forget mappings of files deleted meanwhile (by eviction, prune, recovery)."""
        with self._lock:
            for key in [k for k, m in list(self._maps.items()) if m.unlinked()]:
                self._drop(key)

    def _drop(self, key: tuple[int, int]) -> None:
        with self._lock:
            mapped = self._maps.pop(key, None)
        if mapped is not None:
            mapped.close()

    def close(self) -> None:
        """Unmap everything (the files stay)."""
        with self._lock:
            for key in list(self._maps):
                self._drop(key)


def write_snapshot(
    pool: SlotPool, tag: str, name: str, layout: Layout, *, rank: int, ready: Any = None
) -> ItemEntry:
    """Copy the item laid out by `layout` into its reused buffer in `tag`, hashing it on
    the way (snapshot.fill); the copy is done when this returns (the caller's tensors may
    change). Returns the item's manifest entry."""
    buffer = pool.open_item(tag, name, layout.size_bytes)
    if any(s.device.type == "cuda" for s in layout.storages):
        buffer.pin()  # once per buffer: it is reused from one checkpoint to the next
    digest = fill(buffer.tensor, buffer.view, layout, ready=ready)
    return ItemEntry.written(
        name,
        rank=rank,
        size_bytes=layout.size_bytes,
        checksum=digest,
        tensor_bytes=layout.tensor_bytes,
    )
