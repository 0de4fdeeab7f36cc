"""Writing a large view in pieces, each hashed while the piece before it is written.

`write_view_chunks` hands a view to any `write_at(piece, offset)` (a local file's, a
network store's) in `VIEW_CHUNK_BYTES` pieces, one write at a time in a thread of its own,
so that a checksum adds no time to a write slower than the hash.

May import: `nebulaml._threads`. Not for: the writes themselves (local_files.py, the
backends) or the checksum (format/checksum.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from nebulaml._threads import start as start_thread

VIEW_CHUNK_BYTES = 64 << 20


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
