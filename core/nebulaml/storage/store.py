"""One storage abstraction for every tier: a root given as a path or an fsspec URL.

`Store` is the only place in nebula that touches files. It gives the commit protocol the
primitives it needs on any backend: durable writes (fsync on local disks), a create-only
publish of small files (a hard link on local disks, a conditional create on object
stores), appends that concurrent writers cannot lose, and listing.

It is also the storage boundary: backend exceptions are translated here, once, into
`StorageError` (with secrets redacted from every message), and on network stores each
operation is retried on transient errors (a timeout, a reset connection, a 5xx) under a
bounded `RetryPolicy` before the error reaches the caller.

Not for: knowing what a checkpoint is (catalog.py and commit.py build on these primitives),
or Azure's specifics (azure.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import ctypes.util
import errno
import functools
import mmap
import os
import stat
import sys
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, BinaryIO, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from nebulaml.errors import (
    CommitConflictError,
    InvalidArgumentError,
    NebulaError,
    StorageError,
)
from nebulaml.format.checksum import (
    CHECKSUM_ALGO,
    HASH_WORKERS,
    LEAF_BYTES,
    new_hasher,
    tree_hexdigest,
    tree_leaves,
)
from nebulaml.storage import azure_auth as azure
from nebulaml.storage import azure_blob
from nebulaml.storage.redaction import redact, secrets_in
from nebulaml.storage.retry import OPTION_NAMES as RETRY_OPTIONS
from nebulaml.storage.retry import RetryPolicy
from nebulaml.storage.retry import call as call_with_retries
from nebulaml.storage.streams import (
    PRIVATE_FILE_MODE,
    PUBLIC_FILE_MODE,
    DirectFile,
    LocalWriter,
    MissingFileError,
    RemoteReader,
    RemoteWriter,
    create_file,
    describe,
    fsync_dir,
    mark_in_use,
    translate_errors,
    write_view_chunks,
)

T = TypeVar("T")


def segments_folder(name: str) -> str:
    """Where appends to file `name` go on object stores: a hidden folder beside it, one
    object per append (hidden: never taken for a checkpoint tag).

    Example:
        >>> segments_folder("checkpointHistories.csv")
        '.checkpointHistories.csv.d'
    """
    return f".{name}.d"


_LOCAL_PROTOCOLS = (None, "file", "local")
# Stores without appends (memory:// is fsspec's in-process object store, used in tests).
_OBJECT_STORE_PROTOCOLS = frozenset({"az", "abfs", "abfss", "s3", "s3a", "gs", "gcs", "memory"})

_scoped_options: contextvars.ContextVar[tuple[tuple[str, Any], ...]] = contextvars.ContextVar(
    "nebula_storage_options", default=()
)


@contextlib.contextmanager
def using_storage_options(options: Mapping[str, Any]) -> Iterator[None]:
    """Give `options` to every root opened by URL inside the block (not to local paths).

    For the functions that take a root (`list_checkpoints`, `copy_checkpoint`,
    `get_latest_checkpoint`, ...) when its credentials are not in the environment; options
    passed explicitly (`init(storage_options=...)`) win over these. The `nebula` CLI's
    `--storage-option KEY=VALUE` uses it.

    Example:
        >>> import nebulaml as nm
        >>> with nm.using_storage_options({"account_name": "myaccount"}):
        ...     pass  # e.g. nm.list_checkpoints("az://container/run1")
    """
    if not isinstance(options, Mapping):
        raise InvalidArgumentError(f"storage options must be a mapping, not {type(options)}")
    token = _scoped_options.set(tuple({**dict(_scoped_options.get()), **options}.items()))
    try:
        yield
    finally:
        _scoped_options.reset(token)


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


def _open_regular(path: str, where: str) -> BinaryIO:
    """Open a local file for reading only if it is a regular file, not through a symlink:
    a FIFO would block the reader forever, and a link could read outside the root."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StorageError(
                f"{where}: is a symbolic link; nebula reads only its own files"
            ) from exc
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StorageError(f"{where}: not a regular file; nebula reads only its own files")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_whole(f: BinaryIO, size: int) -> tuple[mmap.mmap, int]:
    """The file's bytes in fresh anonymous memory, and how many were read."""
    # Faulted in by the kernel in one go: about twice as fast as page by page
    # (1.4 GB: 0.55 s against 1.0-1.2 s on 2 cores).
    buffer = mmap.mmap(-1, size, flags=_ANON_POPULATED)
    with memoryview(buffer) as view:
        done = 0
        while done < size:
            n = f.readinto(view[done : min(size, done + _READ_CHUNK_BYTES)])
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
    reader.start()
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


class Store:
    """A checkpoint root on one backend.

    Paths inside the root are given as parts (`"global_step5", "model"`), never as
    strings with separators, so no caller builds paths by hand. `storage_options` go to
    the fsspec backend (for `az://` roots: adlfs, see azure.py), over any given by
    `using_storage_options`; `nebula_retries`, `nebula_retry_base_s` and
    `nebula_retry_max_s` set the retry policy of a network store.

    Example:
        >>> import tempfile
        >>> store = Store(tempfile.mkdtemp())
        >>> store.make_dir("t")
        >>> store.write_bytes(("t", "a"), b"hello")
        >>> store.read_bytes("t", "a")
        b'hello'
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None = None,
        *,
        durable: bool = True,
        private: bool = False,
    ) -> None:
        url = os.fspath(url)
        protocol = fsspec.core.split_protocol(url)[0]
        scoped = dict(_scoped_options.get()) if protocol not in _LOCAL_PROTOCOLS else {}
        options = {**scoped, **(storage_options or {})}
        self.is_azure = azure.is_azure_url(url)
        secret_sources = dict(options)
        if self.is_azure:  # what the Azure SDK may read from the environment is secret too
            for name, var in (
                ("account_key", azure.ENV_ACCOUNT_KEY),
                ("sas_token", azure.ENV_SAS_TOKEN),
                ("connection_string", azure.ENV_CONNECTION_STRING),
            ):
                secret_sources.setdefault(name, os.environ.get(var))
        self._secrets = secrets_in(secret_sources)
        where = redact(url, self._secrets)
        self.policy = RetryPolicy.from_options(options, os.environ)
        backend_options = {k: v for k, v in options.items() if k not in RETRY_OPTIONS}
        with translate_errors(where, self._secrets, remote=True):
            try:
                if self.is_azure:
                    fs, root = azure.open_filesystem(url, backend_options, os.environ)
                    self._block_bytes, self._concurrency = azure.upload_settings(options)
                else:
                    fs, root = fsspec.core.url_to_fs(url, **backend_options)
            except ImportError as exc:  # a known protocol whose backend is not installed
                raise StorageError(redact(f"{url}: {exc}", self._secrets)) from exc
            except ValueError as exc:  # an unknown protocol, or options the backend refuses
                raise StorageError(redact(f"{url}: {exc}", self._secrets)) from exc
        self.fs: fsspec.AbstractFileSystem = fs
        self.is_local = isinstance(fs, LocalFileSystem)
        self.root: str = os.path.abspath(root) if self.is_local else root.rstrip("/")
        # A URL that parses back to the same root (for display and for namespacing).
        if self.is_local:
            self.url: str = self.root
        elif self.is_azure:
            self.url = azure.canonical_url(url)
        else:
            self.url = fs.unstrip_protocol(self.root)
        self.durable = durable
        # A private store (the memory tier) is this user's alone: folders 0700, files 0600.
        self.private = private and self.is_local
        self._file_mode = PRIVATE_FILE_MODE if self.private else PUBLIC_FILE_MODE
        self.location = self._location(fs, options)
        self._container_ready = False
        # Mappings this process already holds, by (st_dev, st_ino, size): the slot pool's
        # of the memory tier's files (slots.SlotPool.view_of). None: map afresh.
        self.mapped: Callable[[int, int, int], memoryview | None] | None = None

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def _location(self, fs: Any, options: Mapping[str, Any]) -> str:
        """What this root is, whatever name reached it: the real path of a local root
        (symbolic links resolved); for a remote one its protocol, account endpoint and
        path. Two stores with one location are one root; two accounts with the same
        container and path are two."""
        if self.is_local:
            return os.path.realpath(self.root)
        if self.is_azure:
            return f"{azure.endpoint_of(fs)}|{self.url}"
        # Other fsspec stores: the options that name where the data is, never secrets.
        where = sorted(
            (k, str(v))
            for k, v in options.items()
            if k in ("endpoint_url", "host", "port", "project", "account_name", "bucket")
        )
        return f"{self.url}|{where}" if where else self.url

    # paths -------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """The backend path of `parts` under the root."""
        return "/".join([self.root, *parts]) if parts else self.root

    def display(self, *parts: str) -> str:
        """A human-readable location of `parts` (a path, or a URL for remote stores)."""
        return "/".join([self.url, *parts]) if parts else self.url

    def local_path(self, *parts: str) -> str | None:
        """The OS path of `parts` if this store is on a local filesystem, else None."""
        return self.path(*parts) if self.is_local else None

    def _local(self, parts: tuple[str, ...], *, leaf_may_link: bool = False) -> str:
        """The OS path of `parts`, after checking that no folder on the way under the root
        (nor `parts` itself, unless `leaf_may_link`: the caller opens it with O_NOFOLLOW
        or removes the name alone) is a symbolic link: nebula never reads, writes or
        deletes through one (`ln -s ~/project ROOT/global_step9` must not make a save
        delete the files of ~/project). Raises `StorageError` naming the link."""
        path = self.root
        last = len(parts) - (1 if leaf_may_link else 0)
        for i, part in enumerate(parts[:last]):
            path = f"{path}/{part}"
            try:
                mode = os.lstat(path).st_mode
            except (FileNotFoundError, NotADirectoryError):
                break  # nothing further down exists
            except OSError:
                break  # reported by the operation itself
            if stat.S_ISLNK(mode):
                raise StorageError(
                    redact(
                        f"{self.display(*parts[: i + 1])}: is a symbolic link; nebula never "
                        f"reads, writes or deletes through one (remove the link)",
                        self._secrets,
                    )
                )
        return self.path(*parts)

    # the boundary --------------------------------------------------------------------
    def _translated(self, what: str) -> contextlib.AbstractContextManager[None]:
        return translate_errors(what, self._secrets, remote=not self.is_local)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """`fn()`, a backend call: retried on transient errors (network stores), and
        translated to `StorageError` naming `what`."""
        if self.is_local:
            with self._translated(what):
                return fn()
        tries = 0

        def attempt() -> T:
            nonlocal tries
            tries += 1
            return fn()

        with translate_errors(what, self._secrets, remote=True, tries=self.policy.retries + 1):
            return call_with_retries(attempt, self.policy, redact(what, self._secrets),
                                     describe=self._describe_error)  # fmt: skip

    def _describe_error(self, exc: BaseException) -> str:
        return redact(describe(exc), self._secrets)

    # reading -----------------------------------------------------------------------
    def exists(self, *parts: str) -> bool:
        if self.is_local:  # the name itself, link or not; never through a linked folder
            with self._translated(self.display(*parts)):
                return os.path.lexists(self._local(parts, leaf_may_link=True))
        return self._call(self.display(*parts), lambda: bool(self.fs.exists(self.path(*parts))))

    def list_dirs(self) -> list[str]:
        """Names of the folders directly under the root (hidden ones excluded). On object
        stores a folder exists while it holds a file."""
        return [name for name, kind in self._entries(()) if kind == "directory"]

    def list_files(self, *parts: str) -> dict[str, int]:
        """Files directly inside the folder `parts`, with their sizes in bytes."""
        out: dict[str, int] = {}
        if self.is_local:
            with self._translated(self.display(*parts)):
                try:
                    with os.scandir(self._local(parts)) as it:
                        for entry in it:
                            if entry.is_file(follow_symlinks=False):
                                try:
                                    out[entry.name] = entry.stat(follow_symlinks=False).st_size
                                except FileNotFoundError:
                                    # Removed since the scan saw it (a reader's lease, say):
                                    # that file is gone, not the folder.
                                    continue
                except (FileNotFoundError, NotADirectoryError):
                    return {}  # no such folder (a file of that name is not a tag folder)
            return out
        for entry in self._ls(parts):
            if entry.get("type") == "file":
                out[entry["name"].rstrip("/").rsplit("/", 1)[-1]] = int(entry.get("size") or 0)
        return out

    def _ls(self, parts: tuple[str, ...]) -> list[dict[str, Any]]:
        path = self.path(*parts)
        if self.is_azure:  # one uncached request, no existence probes for an empty folder
            return list(
                self._call(self.display(*parts), lambda: azure_blob.list_folder(self.fs, path))
            )
        try:
            return list(self._call(self.display(*parts), lambda: self.fs.ls(path, detail=True)))
        except MissingFileError:
            return []

    def _entries(self, parts: tuple[str, ...]) -> list[tuple[str, str]]:
        if self.is_local:
            with self._translated(self.display(*parts)):
                try:
                    with os.scandir(self._local(parts)) as it:
                        return [
                            (e.name, "directory" if e.is_dir(follow_symlinks=False) else "file")
                            for e in it
                            if not e.name.startswith(".")
                        ]
                except FileNotFoundError:
                    return []
        out = []
        for entry in self._ls(parts):
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if name and not name.startswith("."):
                out.append((name, entry.get("type", "file")))
        return out

    def modified_at(self, *parts: str) -> datetime | None:
        """A file's modification time (UTC), or None if the backend cannot tell or the
        file is gone."""
        path = self.path(*parts)
        if self.is_local:
            with self._translated(self.display(*parts)):
                try:
                    path = self._local(parts, leaf_may_link=True)
                    mtime = os.stat(path, follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    return None
            return datetime.fromtimestamp(mtime, timezone.utc)

        def modified() -> Any:
            try:
                return self.fs.modified(path)
            except NotImplementedError:
                return None

        try:
            value = self._call(self.display(*parts), modified)
        except MissingFileError:
            return None
        if not isinstance(value, datetime):
            return None
        return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)

    def read_bytes(self, *parts: str) -> bytes:
        if self.is_local:
            where = self.display(*parts)
            with (
                self._translated(where),
                _open_regular(self._local(parts, leaf_may_link=True), where) as f,
            ):
                return f.read()
        return bytes(self._call(self.display(*parts), lambda: self.fs.cat_file(self.path(*parts))))

    @contextlib.contextmanager
    def open_read(self, *parts: str) -> Iterator[BinaryIO]:
        """A binary stream of a file; backend errors while reading become StorageError."""
        where = self.display(*parts)
        if self.is_local:
            with self._translated(where):
                f: Any = _open_regular(self._local(parts, leaf_may_link=True), where)
        else:
            raw = self._call(where, lambda: self.fs.open(self.path(*parts), "rb"))
            f = RemoteReader(raw, lambda fn: self._call(where, fn))
        try:
            # The block is the caller's code: only OS errors are the storage's here.
            with translate_errors(where, self._secrets):
                yield f
        finally:
            f.close()

    @contextlib.contextmanager
    def _open_local(self, *parts: str) -> Iterator[tuple[BinaryIO, os.stat_result] | None]:
        """A local regular file (see `_open_regular`) and its `fstat`, closed at the end;
        None for a remote store or an empty file (the callers then read bytes)."""
        if not self.is_local:
            yield None
            return
        where = self.display(*parts)
        with self._translated(where):
            f = _open_regular(self._local(parts, leaf_may_link=True), where)
        try:
            with self._translated(where):
                st = os.fstat(f.fileno())
            yield (f, st) if st.st_size else None
        finally:
            f.close()

    @contextlib.contextmanager
    def map_read(self, *parts: str) -> Iterator[memoryview | None]:
        """A local file's bytes, mapped read-only (no copy into this process); None for a
        remote store or an empty file.

        Where this process maps the file already (`mapped`: the slot pool, which filled
        it), that mapping is lent instead: a new one of 1.5 GB costs 0.15 s of page faults
        and 0.03 s to unmap, in the persister, beside training."""
        where = self.display(*parts)
        with self._open_local(*parts) as opened:
            if opened is None:
                yield None
                return
            f, st = opened
            size = st.st_size
            lent = None
            if self.mapped is not None:
                lent = self.mapped(st.st_dev, st.st_ino, size)
            if lent is not None:
                try:
                    with translate_errors(where, self._secrets):
                        yield lent
                finally:
                    lent.release()
                return
            with self._translated(where):
                mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
            view = memoryview(mm)
            try:
                with translate_errors(where, self._secrets):
                    yield view
            finally:
                view.release()
                with contextlib.suppress(BufferError):
                    mm.close()

    @contextlib.contextmanager
    def read_local(self, *parts: str, algo: str | None = None) -> Iterator[LocalRead | None]:
        """A local file's bytes in memory that loaded tensors may keep using (`buffer`),
        with `path`, a name of this very open file (not of whatever the name points to by
        the time it is reopened). None where that is not possible (a remote store, an
        empty file, no /proc): read bytes instead.

        On a local disk the file is mapped copy-on-write and read in at once (`_map_file`);
        on a network filesystem, read whole, in large reads, into fresh memory. In
        RAM (a store that is not `durable`: the memory tier) it is mapped copy-on-write
        instead, no copy at all (1.5 GB: 0.23 s against 0.85 s to copy and hash), and
        marked in use (`storage_io.mark_in_use`) for as long as the mapping lives, so the
        slot pool never recycles it under the loaded tensors. A file recycled before the
        mark raises `MissingFileError`, as if it were gone.

        With `algo` (a checksum algorithm), a file mapped from a local disk is hashed
        while it is read, and `checksum` is its checksum under `algo`; elsewhere (and
        without `algo`) `checksum` is None and the caller hashes `view`.
        """
        if not os.path.isdir("/proc/self/fd"):
            yield None
            return
        where = self.display(*parts)
        with self._open_local(*parts) as opened:
            if opened is None:
                yield None
                return
            f, st = opened
            size = st.st_size
            with self._translated(where):
                digest = None
                if self.durable:
                    mapped = _map_file(f, size, algo)
                    if mapped is not None:
                        (buffer, digest), done = mapped, size
                    else:
                        buffer, done = _read_whole(f, size)
                else:
                    buffer, done = _map_in_use(f, size, self.path(*parts), where), size
            view = memoryview(buffer)
            try:
                yield LocalRead(
                    buffer=buffer,
                    view=view[:done],
                    path=f"/proc/self/fd/{f.fileno()}",
                    checksum=digest,
                )
            finally:
                view.release()

    def read_appended(self, *parts: str) -> bytes | None:
        """Everything `append_text` appended to a file, in order (None if never written).

        On object stores the appends are separate objects under `.<file>.d/`, read in
        the order of their names (the time each was written); a file at the name itself
        (written whole, or by an older nebula) comes first.
        """
        try:
            head: bytes | None = self.read_bytes(*parts)
        except MissingFileError:
            head = None
        if not self._appends_as_objects:
            return head
        folder = (*parts[:-1], segments_folder(parts[-1]))
        names = sorted(self.list_files(*folder))
        if not names:
            return head
        paths = [self.path(*folder, name) for name in names]
        found = self._call(self.display(*folder), lambda: self.fs.cat(paths, on_error="raise"))
        if len(found) != len(paths):
            raise StorageError(f"{self.display(*folder)}: {len(paths)} appends listed, "
                               f"{len(found)} read")  # fmt: skip
        pieces = [head] if head else []
        pieces += [bytes(found[key]) for key in sorted(found)]  # one folder: by name
        return b"".join(p if p.endswith(b"\n") else p + b"\n" for p in pieces if p)

    # writing -----------------------------------------------------------------------
    def make_dir(self, *parts: str) -> None:
        """Create the folder `parts` (and the root); on local disks make the entry durable.
        Object stores have no empty folders: there a folder appears with its first file
        (the container of an `az://` root is created if it is missing)."""
        where = self.display(*parts)
        if self.is_local:
            with self._translated(where):
                self._make_local_dirs(parts)
        elif self.is_azure:
            if not self._container_ready:
                container = self.root.split("/", 1)[0]
                self._call(where, lambda: azure_blob.ensure_container(self.fs, container))
                self._container_ready = True
        else:
            self._call(where, lambda: self.fs.makedirs(self.path(*parts), exist_ok=True))

    def _make_local_dirs(self, parts: tuple[str, ...]) -> None:
        """Create the root and the folders `parts` under it, as real folders (0700 in a
        private store), each new entry made durable; never through a symbolic link."""
        path = self._local(parts)
        if os.path.isdir(path) and not os.path.islink(path):
            return
        mode = 0o700 if self.private else 0o777
        if not os.path.isdir(self.root):
            os.makedirs(os.path.dirname(self.root), exist_ok=True)
            try:
                os.mkdir(self.root, mode)
                if self.durable:
                    fsync_dir(os.path.dirname(self.root))
            except FileExistsError:
                if not os.path.isdir(self.root):
                    raise
        folder = self.root
        for part in parts:
            parent, folder = folder, f"{folder}/{part}"
            try:
                os.mkdir(folder, mode)
            except FileExistsError:
                self._local(parts)  # a link made meanwhile is refused, not followed
                if not os.path.isdir(folder):
                    raise
                continue
            if self.durable:
                fsync_dir(parent)

    @contextlib.contextmanager
    def open_write(self, *parts: str) -> Iterator[BinaryIO]:
        """Write a file; it is durable when the block exits, and removed if it raises.

        On Azure the file is uploaded in blocks, several in flight, while the block runs,
        and appears (whole) only when the block exits.
        """
        where = self.display(*parts)
        path = self.path(*parts)
        if self.is_local:
            with self._translated(where):
                path = self._local(parts, leaf_may_link=True)
                writer: Any = LocalWriter(path, self.durable, self._file_mode)
            try:
                with self._translated(where):
                    yield writer
            except BaseException:
                writer.abort()
                raise
            with self._translated(where):
                writer.close()
            return
        if self.is_azure:
            raw: Any = azure_blob.BlockWriter(
                self.fs,
                path,
                block_bytes=self._block_bytes,
                concurrency=self._concurrency,
                policy=self.policy,
                what=redact(where, self._secrets),
                describe=self._describe_error,
            )
        else:
            raw = self._call(where, lambda: self.fs.open(path, "wb"))

        # The block writer retried each block already: its error says how often.
        tries = self.policy.retries + 1 if self.is_azure else 1

        def translated(fn: Callable[[], Any]) -> Any:
            with translate_errors(where, self._secrets, remote=True, tries=tries):
                return fn()

        remote = RemoteWriter(raw, translated)
        try:
            with translate_errors(where, self._secrets):
                yield remote  # type: ignore[misc]
            remote.finish()
        except BaseException:
            remote.abort()
            if not self.is_azure:  # an fsspec writer may have left a partial file
                with contextlib.suppress(NebulaError):
                    self.remove(*parts)
            raise

    def write_view(
        self, parts: tuple[str, ...], view: memoryview, each: Callable[[memoryview], None]
    ) -> None:
        """Write `view` (page-aligned memory, such as `map_read`'s) as the file `parts`,
        durable on return and removed if this raises; `each(piece)` (a hash update) runs on
        every piece, in order, while the piece before it is written.

        On a local durable disk the pieces go with O_DIRECT (storage_io.DirectFile); other
        stores take them through `open_write`.
        """
        if not self.is_local:
            with self.open_write(*parts) as f:
                write_view_chunks(lambda piece, _offset: f.write(piece), view, each)
            return
        where = self.display(*parts)
        with self._translated(where):
            path = self._local(parts, leaf_may_link=True)
            out = DirectFile(path, durable=self.durable, mode=self._file_mode)
            try:
                write_view_chunks(out.write_at, view, each)
                out.close()
            except BaseException:
                out.abort()
                raise

    def write_bytes(self, parts: tuple[str, ...], data: bytes) -> None:
        """Write (or replace) a small file durably."""
        with self.open_write(*parts) as f:
            f.write(data)

    def publish(self, parts: tuple[str, ...], data: bytes, *, create_only: bool = True) -> None:
        """Make a small file appear whole, or not at all (the commit point of a tag).

        Local disks: write a temporary file, fsync, hard-link it into place (which fails
        if the name exists) or rename it over, then fsync the folder. Azure: one upload
        with `If-None-Match: *`, which the service refuses if the name exists. Other
        stores: an exclusive create. Raises `CommitConflictError` if `create_only` and it
        exists. On Azure, a create that finds exactly the bytes it was to write is a
        success, not a conflict: a retried upload whose first answer was lost finds its
        own bytes there (the manifest and history names make other writers' differ).
        """
        where = self.display(*parts)
        path = self.path(*parts)
        if self.is_azure:

            def upload() -> None:
                try:
                    azure_blob.create_blob(self.fs, path, data, overwrite=not create_only)
                except FileExistsError as exc:
                    # A retry (ours, or the HTTP client's own for a PUT on a dropped
                    # connection) may find what the first try wrote: the same bytes.
                    if bytes(self.fs.cat_file(path)) == data:
                        return
                    raise self._conflict(parts) from exc

            self._call(where, upload)
            return
        if not self.is_local:

            def create() -> None:
                try:
                    with self.fs.open(path, "xb" if create_only else "wb") as f:
                        f.write(data)
                except FileExistsError as exc:
                    raise self._conflict(parts) from exc

            self._call(where, create)
            return
        with self._translated(where):
            path = self._local(parts, leaf_may_link=True)
        folder = os.path.dirname(path)
        tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
        with self._translated(where):
            try:
                with os.fdopen(create_file(tmp, self._file_mode, exclusive=True), "wb") as f:
                    f.write(data)
                    f.flush()
                    if self.durable:
                        os.fsync(f.fileno())
                if create_only:
                    try:
                        os.link(tmp, path)
                    except FileExistsError as exc:
                        raise self._conflict(parts) from exc
                    except OSError as exc:
                        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                            raise
                        # A filesystem without hard links: check, then rename.
                        if os.path.exists(path):
                            raise self._conflict(parts) from exc
                        os.replace(tmp, path)
                else:
                    os.replace(tmp, path)
                if self.durable:
                    fsync_dir(folder)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    def _conflict(self, parts: tuple[str, ...]) -> CommitConflictError:
        # parts is (tag, file): the conflict is about the tag, at the root.
        if len(parts) >= 2:
            return CommitConflictError(self.display(*parts[:-2]), parts[-2])
        return CommitConflictError(self.url, parts[-1])

    @property
    def _appends_as_objects(self) -> bool:
        # Object stores cannot append to an object safely from several writers; every
        # append is an object of its own there. Local files take O_APPEND writes; other
        # fsspec stores rewrite the file (safe for one writer at a time only).
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        return self.is_azure or bool(_OBJECT_STORE_PROTOCOLS.intersection(protocols))

    def append_text(self, parts: tuple[str, ...], text: str) -> None:
        """Append text to a file (created if missing); read it back with `read_appended`.

        Local disks: one O_APPEND write (whole lines from concurrent writers stay whole),
        fsynced. Object stores (Azure, S3, GCS, memory://): a new object
        `.<file>.d/<UTC time>-<random>.part` created create-only, so concurrent writers
        never overwrite each other and a retried append is not written twice. Other
        stores: read, then rewrite the file.
        """
        where = self.display(*parts)
        data = text.encode("utf-8")
        if self.is_local:
            with self._translated(where):
                flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
                mode = self._file_mode if self.private else 0o644
                fd = os.open(self._local(parts, leaf_may_link=True), flags, mode)
                try:
                    # One write per batch keeps concurrent appenders' lines whole.
                    os.write(fd, data)
                    if self.durable:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            return
        if self._appends_as_objects:
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
            name = f"{stamp}-{uuid.uuid4().hex[:12]}.part"
            self.publish((*parts[:-1], segments_folder(parts[-1]), name), data)
            return
        path = self.path(*parts)

        def rewrite() -> None:
            old = self.fs.cat_file(path) if self.fs.exists(path) else b""
            with self.fs.open(path, "wb") as f:
                f.write(bytes(old) + data)

        self._call(where, rewrite)

    def remove(self, *parts: str) -> None:
        """Remove one file; a missing file is not an error."""
        where = self.display(*parts)
        if not self.is_local:
            with contextlib.suppress(MissingFileError):
                self._call(where, lambda: self.fs.rm_file(self.path(*parts)))
            return
        with self._translated(where):
            try:
                os.unlink(self._local(parts, leaf_may_link=True))  # a link: the name alone
            except FileNotFoundError:
                return
        if self.durable and parts[:-1]:
            with (
                self._translated(self.display(*parts[:-1])),
                contextlib.suppress(FileNotFoundError),
            ):
                fsync_dir(self.path(*parts[:-1]))

    def remove_dir(self, *parts: str) -> None:
        """Remove a folder that holds only files (a tag folder); missing is not an error."""
        for name in self.list_files(*parts):
            self.remove(*parts, name)
        where = self.display(*parts)
        path = self.path(*parts)
        if self.is_local:
            with self._translated(where), contextlib.suppress(FileNotFoundError):
                os.rmdir(self._local(parts))
            return

        def rm_folder() -> None:
            # A store with real folders (memory://, ADLS with a hierarchical namespace)
            # keeps the empty folder; a flat blob store has nothing left to remove.
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)

        with contextlib.suppress(MissingFileError):
            self._call(where, rm_folder)
