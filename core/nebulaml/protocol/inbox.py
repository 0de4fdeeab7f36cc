"""What every inbox of files arriving from another node shares: the first problem kept
(nothing raises while the sender's stream goes on), and the file being written closed
whole, or removed when the inbox fails.

    FileInbox   the base of protocol/replica_inbox.py's `ReplicaInbox` and
                protocol/part_restore.py's `PartInbox`

May import: `nebulaml.errors` and `nebulaml.storage`. Not for: what the files are, how
they are checked, or when they are committed (the inboxes themselves).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, BinaryIO

from nebulaml.errors import NebulaError
from nebulaml.storage.store import Store


class _Refused(Exception):
    """Thrown into a file's writer to end it without the file (not an OSError: the store
    would translate one)."""


class FileInbox:
    """Files arriving in order, one written at a time: `_open_writer` starts one,
    `_close_current` ends it (`failed`: removed), `_fail` keeps the first problem and
    removes the file being written, `_guard` runs a step that may fail in the store.

    Example:
        >>> import tempfile
        >>> store = Store(tempfile.mkdtemp()); store.make_dir("global_step1")
        >>> inbox = FileInbox()
        >>> inbox._open_writer(store, "global_step1", "model")
        >>> inbox._fail("its bytes did not match")
        >>> inbox._error, inbox._out, store.list_files("global_step1")
        ('its bytes did not match', None, {})
    """

    def __init__(self) -> None:
        self._error: str | None = None  # the first problem
        self._opened: Any = None  # the current file's writer (the context manager)
        self._out: BinaryIO | None = None  # and what it gave

    def _guard(self, step: Callable[[], Any]) -> None:
        try:
            step()
        except NebulaError as exc:
            self._fail(f"it could not be written: {exc}")

    def _fail(self, reason: str) -> None:
        if self._error is None:
            self._error = reason
        self._close_current(failed=True)

    def _open_writer(self, store: Store, tag: str, name: str) -> None:
        opened = store.open_write(tag, name)
        self._out = opened.__enter__()
        self._opened = opened

    def _close_current(self, *, failed: bool = False) -> None:
        opened, self._opened, self._out = self._opened, None, None
        if opened is None:
            return
        if failed:
            with contextlib.suppress(_Refused, NebulaError):
                opened.__exit__(_Refused, _Refused(), None)  # the writer removes the file
        else:
            opened.__exit__(None, None, None)
