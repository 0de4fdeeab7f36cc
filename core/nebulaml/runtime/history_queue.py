"""The checkpoint history's rows on their way to checkpointHistories.csv (`HistoryQueue`):
while their store fails they wait (at most HISTORY_KEPT) and are tried again.

May import: every layer below runtime, runtime.outage (its backoff) and runtime.steps
(the trace of a persist's `history` step). Not for: the rows themselves or the file's
format (protocol/history.py), or when the queue is written (persist_loop.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from nebulaml.errors import NebulaError
from nebulaml.protocol.history import HistoryRow, append_rows
from nebulaml.runtime.outage import RETRY_MAX_S
from nebulaml.runtime.steps import trace
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")

HISTORY_KEPT = 10_000  # history rows kept while their store fails


class HistoryQueue:
    """History rows on their way to `store`'s checkpointHistories.csv.

    Example:
        >>> import tempfile
        >>> from nebulaml.storage.store import Store
        >>> queue = HistoryQueue(lambda: Store(tempfile.mkdtemp()))
        >>> queue.due(), queue.write()
        (False, 0)
    """

    def __init__(self, store: Callable[[], Store]) -> None:
        self._store = store
        self._rows: list[HistoryRow] = []
        self._lock = threading.Lock()  # the rows and the retry time
        # Taking rows and writing them happen under one lock, so that a flush() returning
        # after the thread took rows finds them written.
        self._write_lock = threading.Lock()
        self._retry_at: float | None = None  # the store failed: not before

    def add(self, row: HistoryRow) -> None:
        with self._lock:
            self._rows.append(row)

    def due(self) -> bool:
        """Rows to append, and the store not in its backoff after a failure."""
        with self._lock:
            retry = self._retry_at
            return bool(self._rows) and (retry is None or time.monotonic() >= retry)

    def retry_at(self) -> float | None:
        """When rows wait for a failed store: the time to try again."""
        with self._lock:
            return self._retry_at if self._rows else None

    def write(self) -> int:
        """Append the queued rows; how many. The history is a report, not a checkpoint: a
        failure must not fail training. Its rows wait for the store, and it is said once."""
        with self._write_lock:
            with self._lock:
                rows, self._rows = self._rows, []
            if not rows:
                return 0
            try:
                append_rows(self._store(), rows)
            except NebulaError as exc:
                with self._lock:
                    first = self._retry_at is None
                    self._rows[:0] = rows
                    del self._rows[:-HISTORY_KEPT]
                    self._retry_at = time.monotonic() + RETRY_MAX_S
                if first:
                    log.warning(
                        "could not append %d row(s) to the checkpoint history (kept, and "
                        "tried again): %s", len(rows), exc,
                    )  # fmt: skip
                return 0
            with self._lock:
                self._retry_at = None
            for tag in dict.fromkeys(row.tag for row in rows if row.tier == "persistent"):
                trace("history", tag)  # the persist's row, the last step of a checkpoint
            return len(rows)
