"""The checkpoint history's rows on their way to checkpointHistories.csv (`HistoryQueue`):
while their store fails they wait (at most HISTORY_KEPT) and are tried again.

May import: every layer below runtime, runtime.retry_queue (the wait after a failure) and
runtime.steps (the trace of a persist's `history` step). Not for: the rows themselves or
the file's format (protocol/history.py), or when the queue is written (persist_loop.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from nebulaml.errors import NebulaError
from nebulaml.protocol.history import HistoryRow, append_rows
from nebulaml.runtime.retry_queue import RetryQueue
from nebulaml.runtime.steps import trace
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")

HISTORY_KEPT = 10_000  # history rows kept while their store fails


class HistoryQueue(RetryQueue[HistoryRow]):
    """History rows on their way to `store`'s checkpointHistories.csv.

    Example:
        >>> import tempfile
        >>> from nebulaml.storage.store import Store
        >>> queue = HistoryQueue(lambda: Store(tempfile.mkdtemp()))
        >>> queue.due(), queue.write()
        (False, 0)
    """

    def __init__(self, store: Callable[[], Store]) -> None:
        super().__init__()  # the rows, and the wait after the store failed
        self._store = store
        # Taking rows and writing them happen under one lock, so that a flush() returning
        # after the thread took rows finds them written.
        self._write_lock = threading.Lock()

    def add(self, row: HistoryRow) -> None:
        with self._lock:
            self._items.append(row)

    def write(self) -> int:
        """Append the queued rows; how many. The history is a report, not a checkpoint: a
        failure must not fail training. Its rows wait for the store, and it is said once."""
        with self._write_lock:
            with self._lock:
                rows, self._items = self._items, []
            if not rows:
                return 0
            try:
                append_rows(self._store(), rows)
            except NebulaError as exc:
                with self._lock:
                    self._items[:0] = rows
                    del self._items[:-HISTORY_KEPT]
                    first = self._tried(ok=False)
                if first:
                    log.warning(
                        "could not append %d row(s) to the checkpoint history (kept, and "
                        "tried again): %s", len(rows), exc,
                    )  # fmt: skip
                return 0
            with self._lock:
                self._tried(ok=True)
            for tag in dict.fromkeys(row.tag for row in rows if row.tier == "persistent"):
                trace("history", tag)  # the persist's row, the last step of a checkpoint
            return len(rows)
