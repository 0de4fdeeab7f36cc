"""The streams a network store's files are read and written through.

`Store.open_read` and `Store.open_write` hand these out for fsspec and Azure roots: each
read or write goes through the store's `call` (retried and its errors translated:
retry.py, failures.py), and a writer may report what it sent (`sent(n)`) for progress.

May import: nothing of nebulaml. Not for: local files (local_files.py), retries
(retry.py) or translating errors (failures.py).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any


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
