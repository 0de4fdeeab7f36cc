"""The storage boundary's plumbing: error translation and the file streams `Store` hands out.

`translate_errors` maps a backend's exceptions to `StorageError` (and subclasses), with
secrets redacted from the message and from the chained exceptions; the stream classes
wrap a local file or a network store's file so that what they raise is translated too.

Not for: the storage operations themselves (store.py and its backends) or retries
(retry.py). May import: `nebulaml.errors` and storage/'s redaction.py, retry.py.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from nebulaml._threads import start as start_thread
from nebulaml.errors import NebulaError, StorageError, StorageFullError
from nebulaml.storage.redaction import redact, scrub_exception
from nebulaml.storage.retry import is_transient

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_WRITE_BUFFER_BYTES = 4 << 20
DIRECT_ALIGN = 4096  # offsets and lengths of direct writes (a multiple of any block size)
VIEW_CHUNK_BYTES = 64 << 20


class MissingFileError(StorageError, FileNotFoundError):
    """A file or folder the caller asked for is not there."""


def describe(exc: BaseException) -> str:
    """One line about a backend error (an HTTP error's first line, status and code)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    status = getattr(exc, "status_code", None)
    code = getattr(exc, "error_code", None)
    extra = ", ".join(str(x) for x in (f"HTTP {status}" if status else None, code) if x)
    line = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return f"{line} ({extra})" if extra else line


@contextlib.contextmanager
def translate_errors(
    what: str, secrets: tuple[str, ...] = (), *, remote: bool = False, tries: int = 1
) -> Iterator[None]:
    """Map backend exceptions to `StorageError` (and subclasses) naming `what`.

    `remote`: every exception of the block is a storage library's (the block holds only
    backend calls), so anything not ours becomes a `StorageError`; `tries` is how many
    attempts were made, for the message of a transient error that outlived them.
    Messages are redacted, and so are the chained backend exceptions.
    """
    try:
        yield
    except NebulaError:
        raise  # already ours (a commit conflict is a FileExistsError too)
    except FileNotFoundError as exc:
        scrub_exception(exc, secrets)
        raise MissingFileError(redact(f"{what}: not found", secrets)) from exc
    except OSError as exc:
        scrub_exception(exc, secrets)
        if exc.errno in _FULL_ERRNOS:
            message = redact(f"{what}: storage is full ({exc.strerror})", secrets)
            raise StorageFullError(exc.errno, message) from exc
        failure = _failure(exc, remote, tries, what)
        raise StorageError(redact(f"{what}: {failure}", secrets)) from exc
    except Exception as exc:
        if not remote:
            raise
        scrub_exception(exc, secrets)
        raise StorageError(redact(f"{what}: {_failure(exc, remote, tries)}", secrets)) from exc


def _failure(exc: BaseException, remote: bool, tries: int, what: str = "") -> str:
    if not remote:
        return local_failure(exc, what) if isinstance(exc, OSError) else str(exc)
    text = describe(exc)
    if tries > 1 and is_transient(exc):
        text += (
            f"; gave up after {tries} tries (set storage option nebula_retries or "
            f"NEBULA_STORAGE_RETRIES for more)"
        )
    return text


def local_failure(exc: OSError, what: str = "") -> str:
    """What a local file operation's error says after the path it is about (`what`): the
    system's words without `[Errno N]` and without the path again (the file the system
    names is added when it is another); a permission refused says what to do.

    Example:
        >>> refused = PermissionError(13, "Permission denied", "/ckpt/run1")
        >>> local_failure(refused, "/ckpt/run1")  # doctest: +ELLIPSIS
        'permission denied to user ...; ask for access (ls -ld shows the owner and mode) or ...'
        >>> local_failure(NotADirectoryError(20, "Not a directory", "/ckpt/run1/x"), "/ckpt/run1")
        'Not a directory on /ckpt/run1/x'
    """
    text = exc.strerror or str(exc)
    named = os.fsdecode(exc.filename) if exc.filename is not None else ""
    where = f" on {named}" if named and named.rstrip("/") != what.rstrip("/") else ""
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (
            f"{text[:1].lower()}{text[1:]}{where} to user {_user()}; ask for access (ls -ld "
            "shows the owner and mode) or run as a user who has it"
        )
    return text + where


def _user() -> str:
    import pwd

    uid = os.geteuid()
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


PUBLIC_FILE_MODE = 0o666  # less the umask: a persistent root's files, as any program's
PRIVATE_FILE_MODE = 0o600  # the memory tier's files: this user's alone
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def new_file_mode(folder: str, private: bool) -> int:
    """The permission bits of a file this process writes in the local `folder` for
    someone else to use (an export): 0600 when `private`, else what the kernel gives
    any program's new file there (0666 less the umask, and less what a default ACL
    masks), learned by creating one (removed at once). For files that a library writes
    with modes of its own (safetensors: 0600), so that they can be set to this.

    Example:
        >>> import tempfile
        >>> oct(new_file_mode(tempfile.gettempdir(), private=True))
        '0o600'
    """
    if private:
        return PRIVATE_FILE_MODE
    probe = os.path.join(folder, f".nebula-mode-{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        fd = create_file(probe, PUBLIC_FILE_MODE, exclusive=True)
    except OSError as exc:  # the folder refused it: said of the folder
        raise OSError(exc.errno, exc.strerror, folder) from exc
    try:
        return os.fstat(fd).st_mode & 0o7777
    finally:
        os.close(fd)
        os.unlink(probe)


def make_folders(path: str, private: bool) -> None:
    """Create the local folder `path` and each missing folder above it: 0700 when
    `private` (whatever the umask), else as any program's (0777 less the umask).
    `os.makedirs` gives its mode to the last folder alone.

    Example:
        >>> import tempfile
        >>> base = tempfile.mkdtemp()
        >>> make_folders(f"{base}/a/b", private=True)
        >>> oct(os.stat(f"{base}/a").st_mode & 0o777), oct(os.stat(f"{base}/a/b").st_mode & 0o777)
        ('0o700', '0o700')
    """
    parent = os.path.dirname(path)
    if parent and parent != path and not os.path.isdir(parent):
        make_folders(parent, private)
    try:
        os.mkdir(path, 0o700 if private else 0o777)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
        return
    if private:
        os.chmod(path, 0o700, follow_symlinks=False)  # a umask that takes the owner's bits


def create_file(path: str, mode: int, *, exclusive: bool = False) -> int:
    """Open `path` for writing, created with `mode` (truncated if it exists), never
    through a symbolic link at `path` (ELOOP); returns the descriptor."""
    flags = _CREATE_FLAGS | (os.O_EXCL if exclusive else os.O_TRUNC)
    return os.open(path, flags, mode)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write every byte of `data` to `fd` (os.write may take fewer at once)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class LocalWriter(io.RawIOBase):
    """A buffered local file whose close() flushes and (when durable) fsyncs."""

    def __init__(self, path: str, durable: bool, mode: int = PUBLIC_FILE_MODE) -> None:
        super().__init__()
        self._path, self._durable = path, durable
        self._file = os.fdopen(create_file(path, mode), "wb", buffering=_WRITE_BUFFER_BYTES)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self._file.write(data)

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._file.flush()
            if self._durable:
                os.fsync(self._file.fileno())  # a failed fsync fails the checkpoint
        finally:
            self._file.close()
            super().close()

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
        super().close()
        with contextlib.suppress(OSError):
            os.unlink(self._path)


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


class DirectFile:
    """A new local file written at offsets with O_DIRECT where the filesystem allows it.

    Direct writes go from the caller's memory to the device: no copy into the page cache,
    no dirty pages for the kernel's writeback to flush while training runs, no cached
    pages pushing training's memory out. In a training loop on 2 cores, persisting 1.5 GB
    every 10 steps this way cost no measurable time against 7.5-10% through the page
    cache, at the same 2 GB/s (`python -m benchmarks.interference`).

    Falls back to buffered writes, silently, where O_DIRECT is refused (tmpfs) or for a
    piece that is not aligned (the tail of a file). Memory handed to `write_at` must be
    page-aligned at `DIRECT_ALIGN` offsets, as a mapped file's is.

    Example:
        >>> import mmap, os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "f")
        >>> f = DirectFile(path, durable=True)
        >>> m = mmap.mmap(-1, 5000); m[:] = b"x" * 5000
        >>> f.write_at(memoryview(m), 0); f.close(); os.path.getsize(path)
        5000
    """

    def __init__(self, path: str, *, durable: bool, mode: int = PUBLIC_FILE_MODE) -> None:
        self._path, self._durable = path, durable
        # A new file, never an old one truncated: a load may have the old one mapped
        # (mapped_reads._map_file), and a truncated mapping is a SIGBUS, not an error.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        flags = _CREATE_FLAGS | os.O_EXCL
        self.direct = durable and hasattr(os, "O_DIRECT")
        try:
            self._fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), mode)
        except OSError as exc:
            if not self.direct or exc.errno != errno.EINVAL:
                raise
            self.direct = False
            self._fd = os.open(path, flags, mode)

    def _buffered(self) -> None:
        if self.direct:
            fl = fcntl.fcntl(self._fd, fcntl.F_GETFL)
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fl & ~os.O_DIRECT)
            self.direct = False

    def write_at(self, data: memoryview, offset: int) -> None:
        """Write all of `data` at `offset`."""
        done = 0
        while done < len(data):
            rest = data[done:]
            if self.direct and (offset + done) % DIRECT_ALIGN == 0:
                rest = rest[: len(rest) - len(rest) % DIRECT_ALIGN]
                if not rest:
                    self._buffered()  # the unaligned tail
                    continue
            elif self.direct:
                self._buffered()  # a short write left an unaligned offset
            try:
                n = os.pwrite(self._fd, rest, offset + done)
            except OSError as exc:
                if not self.direct or exc.errno != errno.EINVAL:
                    raise
                self._buffered()  # alignment this filesystem refuses: write through the cache
                continue
            if n == 0:
                raise OSError(errno.EIO, "a write made no progress", self._path)
            done += n

    def clone_from(self, source_fd: int, offset: int, length: int) -> int:
        """Make bytes [offset, offset + length) of this file those of `source_fd` at the
        same offsets, inside the filesystem: shared extents where it can (XFS and btrfs
        with reflinks: `copy_file_range` clones), else a copy in the kernel, no byte
        through this process. Returns how many bytes from `offset` on it made so; the
        caller writes the rest itself (another filesystem, no `copy_file_range`, a source
        shorter than it should be). A clone and its source are independent files."""
        if not hasattr(os, "copy_file_range"):
            return 0
        done = 0
        while done < length:
            at = offset + done
            try:
                n = os.copy_file_range(source_fd, self._fd, length - done, at, at)
            except OSError as exc:
                if exc.errno == errno.EINVAL and self.direct:
                    self._buffered()  # O_DIRECT refuses an unaligned end: the page cache
                    continue
                if exc.errno in _NO_CLONE_ERRNOS:
                    return done
                raise
            if n == 0:
                return done
            done += n
        return done

    def close(self) -> None:
        """Flush to the device (when durable) and close; a failed fsync raises (and the
        file stays open for `abort`)."""
        if self._durable:
            os.fsync(self._fd)
        fd, self._fd = self._fd, -1
        os.close(fd)

    def abort(self) -> None:
        """Close and remove the partial file."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(OSError):
            os.unlink(self._path)


# copy_file_range's ways of saying "not here" (another filesystem, none at all, a file
# the kernel will not splice): the range is written instead.
_NO_CLONE_ERRNOS = frozenset(
    {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF, errno.ETXTBSY}
)


class _Write:
    """One `write_at(piece, offset)` in a thread of its own (or in this one where no thread
    may start: a persist at interpreter exit)."""

    def __init__(
        self, write_at: Callable[[memoryview, int], None], piece: memoryview, offset: int
    ) -> None:
        self._error: BaseException | None = None
        thread = threading.Thread(
            target=self._run,
            args=(write_at, piece, offset),
            name="nebula-write",
            daemon=True,
        )
        try:
            start_thread(thread)
        except RuntimeError:
            self._thread: threading.Thread | None = None
            self._run(write_at, piece, offset)
        else:
            self._thread = thread

    def _run(self, write_at: Callable[[memoryview, int], None], piece: memoryview, at: int) -> None:
        try:
            write_at(piece, at)
        except BaseException as exc:  # noqa: BLE001 (re-raised in the caller's thread by result())
            self._error = exc

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def result(self) -> None:
        self.join()
        if self._error is not None:
            raise self._error


def write_view_chunks(
    write_at: Callable[[memoryview, int], None],
    view: memoryview,
    each: Callable[[memoryview], None],
) -> None:
    """Write `view` in `VIEW_CHUNK_BYTES` pieces, in order, calling `each(piece)` (a hash
    update) before its write: another thread writes piece k while this one runs `each`
    on piece k+1, so a checksum adds no time to a write that is slower than the hash."""
    pieces: list[memoryview] = []  # released when written: the caller may unmap the view
    writing: _Write | None = None
    try:
        for start in range(0, len(view), VIEW_CHUNK_BYTES):
            pieces.append(view[start : start + VIEW_CHUNK_BYTES])
            each(pieces[-1])
            if writing is not None:
                writing.result()
                pieces.pop(0).release()
            writing = _Write(write_at, pieces[-1], start)
        if writing is not None:
            writing.result()
    finally:
        if writing is not None:
            writing.join()  # never leave a write running on memory the caller frees
        for piece in pieces:
            piece.release()


class RemoteReader(io.RawIOBase):
    """A network store's read stream: each read retried and translated by the store."""

    def __init__(self, raw: Any, call: Callable[[Callable[[], Any]], Any]) -> None:
        super().__init__()
        self._raw, self._call = raw, call

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        n = -1 if size is None else size
        return bytes(self._call(lambda: self._raw.read(n)))

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return int(self._call(lambda: self._raw.seek(offset, whence)))

    def tell(self) -> int:
        return int(self._raw.tell())

    def close(self) -> None:
        if not self.closed:
            with contextlib.suppress(Exception):  # a failed close of a reader loses nothing
                self._raw.close()
            super().close()


class CountedWriter:
    """A writer that calls `sent(n)` after each write of `n` bytes returns.

    Example:
        >>> import io
        >>> counts = []
        >>> CountedWriter(io.BytesIO(), counts.append).write(b"abc"); counts
        3
        [3]
    """

    def __init__(self, raw: Any, sent: Callable[[int], None]) -> None:
        self._raw, self._sent = raw, sent

    def write(self, data: Any) -> int:
        n = int(self._raw.write(data))
        self._sent(n)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class RemoteWriter(io.RawIOBase):
    """A network store's write stream whose errors are translated by the store; `sent(n)`
    is called after each write returns (for writers that do not report their uploads)."""

    def __init__(
        self,
        raw: Any,
        call: Callable[[Callable[[], Any]], Any],
        sent: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__()
        self._raw, self._call, self._sent = raw, call, sent

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = int(self._call(lambda: self._raw.write(data)))
        if self._sent is not None:
            self._sent(n)
        return n

    def flush(self) -> None:
        """Writes are uploaded as blocks fill, and committed on close."""

    def finish(self) -> None:
        self._call(self._raw.close)
        super().close()

    def abort(self) -> None:
        abort = getattr(self._raw, "abort", None)
        with contextlib.suppress(Exception):  # the write already failed; keep that error
            if abort is not None:
                abort()
            else:
                self._raw.close()
        super().close()
