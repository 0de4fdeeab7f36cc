"""Work queued for a store that may fail (`RetryQueue`): what waits, and when it is tried
again after a failed try (RETRY_MAX_S later). The history's rows (history_queue.py) and
the checkpoints a framework removed (removal_queue.py) wait so.

May import: runtime.outage (its backoff). Not for: what is queued or how it is done (the
queues themselves), or the persistent tier's outage (outage.py).
"""

from __future__ import annotations

import threading
import time
from typing import Generic, TypeVar

from nebulaml.runtime.outage import RETRY_MAX_S

T = TypeVar("T")


class RetryQueue(Generic[T]):
    """Items waiting for a store (`_items`, under `_lock`), and the wait after a failed
    try: the thread asks `due` before a turn and `retry_at` for how long it may sleep.

    Example:
        >>> queue: RetryQueue[str] = RetryQueue()
        >>> queue._items.append("row")
        >>> queue.due(), queue.retry_at()
        (True, None)
        >>> with queue._lock:
        ...     queue._tried(ok=False)
        True
        >>> queue.due(), queue.retry_at() is not None
        (False, True)
    """

    def __init__(self) -> None:
        self._items: list[T] = []
        self._lock = threading.Lock()
        self._retry_at: float | None = None  # the last try failed: not before

    def due(self) -> bool:
        """Items waiting, and not in the wait after a failed try."""
        with self._lock:
            retry = self._retry_at
            return bool(self._items) and (retry is None or time.monotonic() >= retry)

    def retry_at(self) -> float | None:
        """When items wait after a failed try: the time to try again (None: they do not)."""
        with self._lock:
            return self._retry_at if self._items else None

    def _tried(self, *, ok: bool) -> bool:
        """Under `_lock`: a try ended; one that failed (`ok` False) starts the wait, one
        that did not ends it. Whether it was the first failure since the last success."""
        first = self._retry_at is None
        self._retry_at = None if ok else time.monotonic() + RETRY_MAX_S
        return first and not ok
