"""One storage abstraction for every tier: a root given as a path or an fsspec URL.

`Store` is the only place in nebula that touches files. It gives the commit protocol the
primitives it needs on any backend: durable writes (fsync on local disks), a create-only
publish of small files (a hard link on local disks, an exclusive create elsewhere), and
listing. Backend exceptions are translated here, once, into `StorageError`.

Not for: knowing what a checkpoint is (catalog.py and commit.py build on these primitives).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any, BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import CommitConflictError, NebulaError, StorageError, StorageFullError

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_WRITE_BUFFER_BYTES = 4 << 20


class MissingFileError(StorageError, FileNotFoundError):
    """A file or folder the caller asked for is not there."""


@contextlib.contextmanager
def translate_errors(what: str) -> Iterator[None]:
    """Map backend exceptions to `StorageError` (and subclasses) naming `what`."""
    try:
        yield
    except NebulaError:
        raise  # already ours (a commit conflict is a FileExistsError too)
    except FileNotFoundError as exc:
        raise MissingFileError(f"{what}: not found") from exc
    except OSError as exc:
        if exc.errno in _FULL_ERRNOS:
            raise StorageFullError(exc.errno, f"{what}: storage is full ({exc.strerror})") from exc
        raise StorageError(f"{what}: {exc}") from exc


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _LocalWriter(io.RawIOBase):
    """A buffered local file whose close() flushes and (when durable) fsyncs."""

    def __init__(self, path: str, durable: bool) -> None:
        super().__init__()
        self._path, self._durable = path, durable
        self._file = open(path, "wb", buffering=_WRITE_BUFFER_BYTES)  # noqa: SIM115

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


class Store:
    """A checkpoint root on one backend.

    Paths inside the root are given as parts (`"global_step5", "model"`), never as
    strings with separators, so no caller builds paths by hand.

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
        storage_options: dict[str, Any] | None = None,
        *,
        durable: bool = True,
    ) -> None:
        url = os.fspath(url)
        with translate_errors(url):
            try:
                fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
            except ValueError as exc:  # an unknown protocol
                raise StorageError(f"{url}: {exc}") from exc
            except ImportError as exc:  # a known protocol whose backend is not installed
                raise StorageError(f"{url}: {exc}") from exc
        self.fs: fsspec.AbstractFileSystem = fs
        self.is_local = isinstance(fs, LocalFileSystem)
        self.root: str = os.path.abspath(root) if self.is_local else root.rstrip("/")
        # A URL that parses back to the same root (for display and for namespacing).
        self.url: str = self.root if self.is_local else fs.unstrip_protocol(self.root)
        self.durable = durable

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

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

    # reading -----------------------------------------------------------------------
    def exists(self, *parts: str) -> bool:
        with translate_errors(self.display(*parts)):
            return bool(self.fs.exists(self.path(*parts)))

    def list_dirs(self) -> list[str]:
        """Names of the folders directly under the root (hidden ones excluded)."""
        return [name for name, kind in self._entries(()) if kind == "directory"]

    def list_files(self, *parts: str) -> dict[str, int]:
        """Files directly inside the folder `parts`, with their sizes in bytes."""
        out: dict[str, int] = {}
        if self.is_local:
            with translate_errors(self.display(*parts)):
                try:
                    with os.scandir(self.path(*parts)) as it:
                        for entry in it:
                            if entry.is_file(follow_symlinks=False):
                                out[entry.name] = entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    return {}
            return out
        with translate_errors(self.display(*parts)):
            try:
                entries = self.fs.ls(self.path(*parts), detail=True)
            except FileNotFoundError:
                return {}
        for entry in entries:
            if entry.get("type") == "file":
                out[entry["name"].rstrip("/").rsplit("/", 1)[-1]] = int(entry.get("size") or 0)
        return out

    def _entries(self, parts: tuple[str, ...]) -> list[tuple[str, str]]:
        if self.is_local:
            with translate_errors(self.display(*parts)):
                try:
                    with os.scandir(self.path(*parts)) as it:
                        return [
                            (e.name, "directory" if e.is_dir(follow_symlinks=False) else "file")
                            for e in it
                            if not e.name.startswith(".")
                        ]
                except FileNotFoundError:
                    return []
        with translate_errors(self.display(*parts)):
            try:
                entries = self.fs.ls(self.path(*parts), detail=True)
            except FileNotFoundError:
                return []
        out = []
        for entry in entries:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if name and not name.startswith("."):
                out.append((name, entry.get("type", "file")))
        return out

    def modified_at(self, *parts: str) -> datetime | None:
        """A file's modification time (UTC), or None if the backend cannot tell or the
        file is gone."""
        with translate_errors(self.display(*parts)):
            try:
                if self.is_local:
                    mtime = os.stat(self.path(*parts), follow_symlinks=False).st_mtime
                    return datetime.fromtimestamp(mtime, timezone.utc)
                modified = self.fs.modified(self.path(*parts))
            except (NotImplementedError, FileNotFoundError):
                return None
        if not isinstance(modified, datetime):
            return None
        return modified if modified.tzinfo is not None else modified.replace(tzinfo=timezone.utc)

    def read_bytes(self, *parts: str) -> bytes:
        with translate_errors(self.display(*parts)):
            if self.is_local:
                with open(self.path(*parts), "rb") as f:
                    return f.read()
            return bytes(self.fs.cat_file(self.path(*parts)))

    @contextlib.contextmanager
    def open_read(self, *parts: str) -> Iterator[BinaryIO]:
        """A binary stream of a file; backend errors while reading become StorageError."""
        where = self.display(*parts)
        with translate_errors(where):
            if self.is_local:
                f: BinaryIO = open(self.path(*parts), "rb")  # noqa: SIM115
            else:
                f = self.fs.open(self.path(*parts), "rb")
        try:
            with translate_errors(where):
                yield f
        finally:
            f.close()

    # writing -----------------------------------------------------------------------
    def make_dir(self, *parts: str) -> None:
        """Create the folder `parts` (and the root); on local disks make the entry durable."""
        where = self.display(*parts)
        with translate_errors(where):
            if self.is_local:
                path = self.path(*parts)
                existed = os.path.isdir(path)
                os.makedirs(path, exist_ok=True)
                if self.durable and not existed:
                    _fsync_dir(os.path.dirname(path))
            else:
                self.fs.makedirs(self.path(*parts), exist_ok=True)

    @contextlib.contextmanager
    def open_write(self, *parts: str) -> Iterator[BinaryIO]:
        """Write a file; it is durable when the block exits, and removed if it raises."""
        where = self.display(*parts)
        path = self.path(*parts)
        with translate_errors(where):
            if self.is_local:
                writer: Any = _LocalWriter(path, self.durable)
            else:
                writer = self.fs.open(path, "wb")
        try:
            with translate_errors(where):
                yield writer
        except BaseException:
            if self.is_local:
                writer.abort()
            else:
                with contextlib.suppress(Exception):
                    writer.close()
                with contextlib.suppress(Exception):
                    self.fs.rm_file(path)
            raise
        with translate_errors(where):
            writer.close()

    def write_bytes(self, parts: tuple[str, ...], data: bytes) -> None:
        """Write (or replace) a small file durably."""
        with self.open_write(*parts) as f:
            f.write(data)

    def publish(self, parts: tuple[str, ...], data: bytes, *, create_only: bool = True) -> None:
        """Make a small file appear whole, or not at all (the commit point of a tag).

        Local disks: write a temporary file, fsync, hard-link it into place (which fails
        if the name exists) or rename it over, then fsync the folder. Other stores: an
        exclusive create. Raises `CommitConflictError` if `create_only` and it exists.
        """
        where = self.display(*parts)
        path = self.path(*parts)
        if not self.is_local:
            with translate_errors(where):
                if not create_only:
                    with self.fs.open(path, "wb") as f:
                        f.write(data)
                    return
                try:
                    with self.fs.open(path, "xb") as f:
                        f.write(data)
                except FileExistsError as exc:
                    raise self._conflict(parts) from exc
            return
        folder = os.path.dirname(path)
        tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
        with translate_errors(where):
            try:
                with open(tmp, "wb") as f:
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
                    _fsync_dir(folder)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    def _conflict(self, parts: tuple[str, ...]) -> CommitConflictError:
        # parts is (tag, file): the conflict is about the tag, at the root.
        if len(parts) >= 2:
            return CommitConflictError(self.display(*parts[:-2]), parts[-2])
        return CommitConflictError(self.url, parts[-1])

    def append_text(self, parts: tuple[str, ...], text: str) -> None:
        """Append text to a file (created if missing); durable on local disks."""
        where = self.display(*parts)
        data = text.encode("utf-8")
        with translate_errors(where):
            if self.is_local:
                fd = os.open(self.path(*parts), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                try:
                    # One write per batch keeps concurrent appenders' lines whole.
                    os.write(fd, data)
                    if self.durable:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                return
            old = self.fs.cat_file(self.path(*parts)) if self.fs.exists(self.path(*parts)) else b""
            with self.fs.open(self.path(*parts), "wb") as f:
                f.write(bytes(old) + data)

    def remove(self, *parts: str) -> None:
        """Remove one file; a missing file is not an error."""
        with translate_errors(self.display(*parts)):
            try:
                if self.is_local:
                    os.unlink(self.path(*parts))
                else:
                    self.fs.rm_file(self.path(*parts))
            except FileNotFoundError:
                return
        if self.is_local and self.durable and parts[:-1]:
            with (
                translate_errors(self.display(*parts[:-1])),
                contextlib.suppress(FileNotFoundError),
            ):
                _fsync_dir(self.path(*parts[:-1]))

    def remove_dir(self, *parts: str) -> None:
        """Remove a folder that holds only files (a tag folder); missing is not an error."""
        for name in self.list_files(*parts):
            self.remove(*parts, name)
        with translate_errors(self.display(*parts)):
            try:
                if self.is_local:
                    os.rmdir(self.path(*parts))
                elif self.fs.exists(self.path(*parts)):
                    self.fs.rm(self.path(*parts), recursive=True)
            except FileNotFoundError:
                return
