"""The storage boundary's plumbing: error translation and the file streams `Store` hands out.

`translate_errors` maps a backend's exceptions to `StorageError` (and subclasses), with
secrets redacted from the message and from the chained exceptions; the stream classes
wrap a local file or a network store's file so that what they raise is translated too.

Not for: the storage operations themselves (storage.py) or retries (retry.py).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
from collections.abc import Callable, Iterator
from typing import Any

from .errors import NebulaError, StorageError, StorageFullError
from .redaction import redact, scrub_exception
from .retry import is_transient

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_WRITE_BUFFER_BYTES = 4 << 20


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
        raise StorageError(redact(f"{what}: {_failure(exc, remote, tries)}", secrets)) from exc
    except Exception as exc:
        if not remote:
            raise
        scrub_exception(exc, secrets)
        raise StorageError(redact(f"{what}: {_failure(exc, remote, tries)}", secrets)) from exc


def _failure(exc: BaseException, remote: bool, tries: int) -> str:
    if not remote:
        return str(exc)
    text = describe(exc)
    if tries > 1 and is_transient(exc):
        text += (
            f"; gave up after {tries} tries (set storage option nebula_retries or "
            f"NEBULA_STORAGE_RETRIES for more)"
        )
    return text


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalWriter(io.RawIOBase):
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


class RemoteWriter(io.RawIOBase):
    """A network store's write stream whose errors are translated by the store."""

    def __init__(self, raw: Any, call: Callable[[Callable[[], Any]], Any]) -> None:
        super().__init__()
        self._raw, self._call = raw, call

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return int(self._call(lambda: self._raw.write(data)))

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
