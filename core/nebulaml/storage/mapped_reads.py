"""Local files read into memory for a load: mapped copy-on-write, or read whole.

A load keeps using the bytes it read (tensors are built on them), so a file is read into
memory that outlives the read: from a local disk it is mapped copy-on-write and read in
at once, hashed while it is read (`_map_file`); from a network filesystem it is read
whole into fresh memory (`_read_whole`); from the memory tier it is mapped and marked in
use (`_map_in_use`, `mark_in_use`), so that the slot pool never recycles it under the
loaded tensors (`claim_unused` is the pool's side of that lock).
`map_view` lends a file's bytes read-only for a persist instead.

Every open goes through `open_regular`: never through a symbolic link, never a FIFO.

Not for: which file (local.py resolves paths and refuses linked folders) or errors as
callers see them (store.py). May import: `nebulaml.errors`, `nebulaml.format.checksum`
and failures.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import mmap
import os
import stat
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from nebulaml._threads import start as start_thread
from nebulaml.errors import StorageError
from nebulaml.format.checksum import (
    CHECKSUM_ALGO,
    HASH_WORKERS,
    LEAF_BYTES,
    new_hasher,
    tree_hexdigest,
    tree_leaves,
)
from nebulaml.storage.failures import MissingFileError

# Mappings this process already holds, by (st_dev, st_ino, size): see `Store.mapped`.
Lender = Callable[[int, int, int], memoryview | None]


@dataclass(frozen=True, slots=True)
class LocalRead:
    """A local file read whole: its bytes, and a path naming the open file."""

    buffer: mmap.mmap
    view: memoryview
    path: str
    checksum: str | None = None  # under the `algo` asked for, taken while reading; or None


_READ_CHUNK_BYTES = 64 << 20
_ANON_POPULATED = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
_MADV_POPULATE_READ = 22  # not in Python's mmap module before 3.13
# A mapped disk load reads this much per madvise call while it hashes what it has read.
_POPULATE_CHUNK_BYTES = 32 << 20
# Threads hashing what a mapped disk load has read. Reading waits on the disk, not the
# CPU; and in a VM that has handed freed memory back to its host, the first touch of
# each page just read can cost more than the read (1.5 GB: 1.2-2.4 s, then 0.06 s for the
# same bytes again).
_LOAD_HASH_WORKERS = HASH_WORKERS


def open_regular(path: str, where: str) -> BinaryIO:
    """Open a local file for reading only if it is a regular file, not through a symlink:
    a FIFO would block the reader forever, and a link could read outside the root."""
    fd = open_regular_fd(path, where)
    try:
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_regular_fd(
    path: str,
    where: str,
    *,
    flags: int = os.O_RDONLY,
    mode: int = 0o600,
    refusal: str = "nebula reads only its own files",
    link: str = "is a symbolic link",
) -> int:
    """`open_regular`'s descriptor, for a caller that reads with os.read; with `flags`
    (e.g. O_WRONLY | O_CREAT | O_APPEND) and `mode`, one that writes. Never through a
    symbolic link, never blocking on a FIFO planted at the name (a writer's open of one
    without a reader fails at once), never anything but a regular file: `StorageError`
    ending in `refusal` (after `link` for a symbolic link)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StorageError(f"{where}: {link}; {refusal}") from exc
        if exc.errno == errno.ENXIO:
            raise StorageError(f"{where}: not a regular file; {refusal}") from exc
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StorageError(f"{where}: not a regular file; {refusal}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_all(fd: int) -> bytes:
    """Every byte from `fd`'s position to its end."""
    chunks: list[bytes] = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _read_whole(f: BinaryIO, size: int) -> tuple[mmap.mmap, int]:
    """The file's bytes in fresh anonymous memory, and how many were read."""
    # Faulted in by the kernel in one go: about twice as fast as page by page
    # (1.4 GB: 0.55 s against 1.0-1.2 s on 2 cores).
    buffer = mmap.mmap(-1, size, flags=_ANON_POPULATED)
    with memoryview(buffer) as view:
        done = 0
        while done < size:
            n = f.readinto(view[done : min(size, done + _READ_CHUNK_BYTES)])  # type: ignore[attr-defined]
            if not n:
                break
            done += n
    return buffer, done


# statfs(2) f_type of the local filesystems a disk load maps its file from. Not network
# filesystems (NFS, SMB, FUSE mounts such as blobfuse, 9p): a page evicted under memory
# pressure is read again from the file, and if another host removed it meanwhile that
# read is a SIGBUS in the training process instead of an error at load time.
_MAPPABLE_FS = {
    0xEF53: "ext2/3/4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0xF2F52010: "f2fs",
    0x2FC12FC1: "zfs",
    0x01021994: "tmpfs",
}


def _fs_type(fd: int) -> int | None:
    """The statfs(2) f_type of the filesystem that holds `fd`; None where unknown."""
    libc = _libc()
    if libc is None:
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type is its first word
    if libc.fstatfs(fd, buf) != 0:
        return None
    return int.from_bytes(buf.raw[: ctypes.sizeof(ctypes.c_long)], sys.byteorder, signed=True)


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


def _map_file(
    f: BinaryIO, size: int, algo: str | None = None
) -> tuple[mmap.mmap, str | None] | None:
    """A local disk file's bytes mapped copy-on-write and read in: no copy out of the page
    cache and no fresh memory to zero (1.5 GB: 0.6 s, the disk's read speed, against
    1.0-1.5 s to read it whole). With `algo`, also the file's checksum under it, hashed
    while the rest is read (`_populate_hashing`), so that verifying costs no time of its
    own; else None. None where that is not safe or not possible (see `_MAPPABLE_FS`; a
    kernel before 5.14): read the file instead.

    nebula never writes a committed file in place (an overwrite removes the old files
    first; `DirectFile` makes a new file), so the mapped bytes are the ones verified."""
    if _fs_type(f.fileno()) not in _MAPPABLE_FS:
        return None
    mapped = mmap.mmap(
        f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
    )
    try:
        mapped.madvise(mmap.MADV_SEQUENTIAL)  # read ahead in large requests
        if algo is not None and _libc() is not None:
            digest: str | None = _populate_hashing(mapped, size, algo)
        else:
            mapped.madvise(_MADV_POPULATE_READ)  # a read error raises here, not later
            digest = None
        mapped.madvise(mmap.MADV_NORMAL)
    except OSError as exc:
        mapped.close()
        if exc.errno == errno.EINVAL:  # no MADV_POPULATE_READ: read it instead
            return None
        raise
    except BaseException:
        mapped.close()
        raise
    return mapped, digest


def _populate_hashing(mapped: mmap.mmap, size: int, algo: str) -> str:
    """Read `mapped` in (MADV_POPULATE_READ, `_POPULATE_CHUNK_BYTES` per call, in a helper
    thread: through ctypes, which lets go of the GIL) while this thread hashes what is
    already in; `algo`'s checksum of the whole. A read error raises `OSError` here."""
    libc = _libc()
    anchor = ctypes.c_char.from_buffer(mapped)  # the mapping's address (an export)
    base = ctypes.addressof(anchor)
    cond = threading.Condition()
    read_up_to = 0
    error: OSError | None = None
    stop = False

    def populate() -> None:
        nonlocal read_up_to, error
        for start in range(0, size, _POPULATE_CHUNK_BYTES):
            n = min(_POPULATE_CHUNK_BYTES, size - start)
            failed = stop or libc.madvise(
                ctypes.c_void_p(base + start), ctypes.c_size_t(n), _MADV_POPULATE_READ
            )
            with cond:
                if failed:
                    code = ctypes.get_errno()
                    error = OSError(code, os.strerror(code)) if not stop else None
                    cond.notify()
                    return
                read_up_to = start + n
                cond.notify()

    tree = algo == CHECKSUM_ALGO  # its pieces are hashed whole, by several threads
    leaves: list[bytes] = []
    hasher = None if tree else new_hasher(algo)  # an unknown algo raises here

    def hashable(upto: int) -> int:
        return upto if upto >= size or not tree else upto - upto % LEAF_BYTES

    reader = threading.Thread(target=populate, name="nebula-read", daemon=True)
    start_thread(reader)
    view = memoryview(mapped)
    try:
        hashed = 0
        while hashed < size:
            with cond:
                while hashable(read_up_to) <= hashed and error is None:
                    cond.wait()
                upto, failure = hashable(read_up_to), error
            if upto <= hashed:
                raise failure  # type: ignore[misc]
            if hasher is None:
                leaves += tree_leaves(view[hashed:upto], _LOAD_HASH_WORKERS)
            else:
                hasher.update(view[hashed:upto])
            hashed = upto
    finally:
        stop = True
        reader.join()
        view.release()
        del anchor
    return tree_hexdigest(leaves) if hasher is None else str(hasher.hexdigest())


def mark_in_use(fd: int) -> None:
    """Mark a memory-tier file as mapped by a load (a shared flock on `fd`, held while any
    duplicate of `fd` stays open, across processes, gone when the process dies).

    Loads from the memory tier map the item file copy-on-write instead of copying it; the
    slot pool must then not recycle that file for a later save, which would write new
    bytes under the loaded tensors. `claim_unused` is the pool's side of this.
    """
    fcntl.flock(fd, fcntl.LOCK_SH)


def claim_unused(fd: int) -> bool:
    """Lock a memory-tier file for recycling (an exclusive flock, without waiting): False
    if a load has it mapped (`mark_in_use`); the caller then removes it instead."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _map_in_use(f: BinaryIO, size: int, path: str, where: str) -> mmap.mmap:
    """The file mapped copy-on-write (writes to it stay in this process), marked in use
    until the mapping is garbage: see `Store.read_local`."""
    fd = os.dup(f.fileno())
    try:
        mark_in_use(fd)
        # Marked: no recycling from now on. Still the item, not a file recycled before?
        here, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
        if (here.st_dev, here.st_ino) != (there.st_dev, there.st_ino):
            raise MissingFileError(f"{where}: not found (recycled while it was opened)")
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(mapped, os.close, fd)  # the mark goes with the last loaded tensor
    with contextlib.suppress(OSError):  # page tables filled in one call (Linux 5.14+)
        mapped.madvise(_MADV_POPULATE_READ)
    return mapped


@contextlib.contextmanager
def map_view(f: BinaryIO, st: os.stat_result, lend: Lender | None) -> Iterator[memoryview]:
    """The bytes of the open file `f` (`st`: its fstat, not empty), read-only: the view
    that `lend` gives of a mapping this process holds already, else a new mapping (one of
    1.5 GB costs 0.15 s of page faults and 0.03 s to unmap, in the persister, beside
    training)."""
    lent = lend(st.st_dev, st.st_ino, st.st_size) if lend is not None else None
    if lent is not None:
        try:
            yield lent
        finally:
            lent.release()
        return
    mm = mmap.mmap(f.fileno(), st.st_size, prot=mmap.PROT_READ)
    view = memoryview(mm)
    try:
        yield view
    finally:
        view.release()
        with contextlib.suppress(BufferError):
            mm.close()


@contextlib.contextmanager
def read_in(
    f: BinaryIO, size: int, path: str, *, durable: bool, algo: str | None
) -> Iterator[LocalRead]:
    """The open file `f` (`size` bytes, not empty; `path`: its name) in memory that loaded
    tensors may keep.

    From a `durable` root (a disk) it is mapped copy-on-write and read in at once, hashed
    under `algo` while it is read (`_map_file`); on a network filesystem, read whole, in
    large reads, into fresh memory (`_read_whole`). In RAM (the memory tier, not
    `durable`) it is mapped copy-on-write instead, no copy at all (1.5 GB: 0.23 s against
    0.85 s to copy and hash), and marked in use (`mark_in_use`) for as long as the
    mapping lives, so the slot pool never recycles it under the loaded tensors
    (`_map_in_use`)."""
    digest = None
    if durable:
        mapped = _map_file(f, size, algo)
        if mapped is not None:
            (buffer, digest), done = mapped, size
        else:
            buffer, done = _read_whole(f, size)
    else:
        buffer, done = _map_in_use(f, size, path, path), size
    view = memoryview(buffer)
    try:
        yield LocalRead(
            buffer=buffer, view=view[:done], path=f"/proc/self/fd/{f.fileno()}", checksum=digest
        )
    finally:
        view.release()
