"""What follows a persist: retention on the persistent tier, and the checkpoint history.

    retire         apply retention after a persist: the tags left committed, and the
                   highest commit sequence seen
    HistoryQueue   the rows waiting to be appended to checkpointHistories.csv; while its
                   store fails they wait (at most HISTORY_KEPT) and are tried again
    RemovalQueue   the checkpoints a framework removed (Lightning's ModelCheckpoint), to
                   delete from every tier; while a tier fails (or a reader holds one)
                   they wait and are tried again

May import: every layer below runtime, and runtime.steps. Not for: when these run (persister.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from nebulaml.errors import NebulaError, UnsupportedSchemaError
from nebulaml.protocol.catalog import read_committed, tag_folders
from nebulaml.protocol.delete import delete_checkpoint
from nebulaml.protocol.history import HistoryRow, append_rows
from nebulaml.protocol.retention import Version, plan_retention
from nebulaml.runtime.outage import RETRY_MAX_S
from nebulaml.runtime.steps import trace
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")

HISTORY_KEPT = 10_000  # history rows kept while their store fails


def retire(
    persistent: Store,
    retention: int,
    just_persisted: str,
    known: dict[str, Version] | None = None,
) -> tuple[set[str], int]:
    """Delete what retention retires on `persistent` now that `just_persisted` is there;
    the tags left committed there, and the highest commit sequence it read (while
    nothing can go: `just_persisted`'s; the caller keeps the highest). A tag that cannot
    go now goes at the next persist's retention.

    `known`: what the caller knows is committed there (updated here), so that each
    persist reads only the manifests it has not read yet (`just_persisted`'s, and any
    new folder's), not every manifest of the root: one listing of the folders, and one
    manifest per new tag.

    Example:
        >>> import tempfile
        >>> from nebulaml.storage.store import Store
        >>> retire(Store(tempfile.mkdtemp()), 2, "global_step1")
        (set(), 0)
    """
    known = {} if known is None else known

    def read(tag: str) -> None:
        """Learn (or forget) `tag`'s version from its manifest; a newer nebula's schema is
        never this job's to retire."""
        try:
            info = read_committed(persistent, tag)
        except UnsupportedSchemaError:
            return
        if info is None:
            known.pop(tag, None)
        else:
            known[tag] = Version(tag, info.committed_at, info.manifest.labels, info.sequence)

    read_now: set[str] = set()
    if known:
        # What was just persisted is read (one manifest). While fewer checkpoints than
        # `retention` count, nothing can go: the root's folders need not be listed (one
        # job writes a root; what an operator copies in is read at the next listing).
        read(just_persisted)
        read_now.add(just_persisted)
        if just_persisted in known and (
            len(known) < retention or sum(1 for v in known.values() if not v.labels) < retention
        ):
            # The sequence of what was just persisted: the caller keeps the highest.
            return set(known), known[just_persisted].sequence
    folders = set(tag_folders(persistent))
    for tag in [t for t in known if t not in folders]:
        del known[tag]  # deleted meanwhile (a prune)
    for tag in folders - read_now:
        if tag not in known or tag == just_persisted:
            read(tag)
    for tag in plan_retention(list(known.values()), retention, {just_persisted}):
        try:
            delete_checkpoint(persistent, tag)
            del known[tag]
        except NebulaError as exc:
            # Tidying, after the persist: an older checkpoint that could not go now (a
            # prune deleting it too, say) goes at the next persist's retention.
            log.warning("retention could not delete %r yet: %s", tag, exc)
    return set(known), max((v.sequence for v in known.values()), default=0)


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


class RemovalQueue:
    """Checkpoints a framework removed, on their way out of every tier.

    The framework's decision is the retention (a Lightning ModelCheckpoint drops a
    checkpoint from its top k): the training thread only queues the tag, and the
    persister's thread deletes it (`run`), so that the training thread never waits on
    the persistent tier. A delete that fails (the store down) or is refused (a reader
    holds the checkpoint) is tried again later.

    Example:
        >>> queue = RemovalQueue()
        >>> queue.add("epoch=0-step=4")
        >>> queue.run(lambda tag: True), queue.due()
        (['epoch=0-step=4'], False)
    """

    def __init__(self, journal: Callable[[list[str]], None] | None = None) -> None:
        self._tags: list[str] = []
        self._lock = threading.Lock()
        self._retry_at: float | None = None
        # Told, under the lock, each time what is left to remove changes: the persister
        # records it in the memory tier, so that a process killed before its thread ran
        # a removal leaves it to the next session (session.py's recovery).
        self._journal = journal

    def add(self, tag: str) -> None:
        with self._lock:
            if tag not in self._tags:
                self._tags.append(tag)
                self._note(self._tags)

    def discard(self, tag: str) -> None:
        """`tag` is saved again: it is no longer to be removed."""
        with self._lock:
            if tag in self._tags:
                self._tags.remove(tag)
                self._note(self._tags)

    def _note(self, tags: list[str]) -> None:
        if self._journal is not None:
            self._journal(list(tags))

    def pending(self) -> list[str]:
        with self._lock:
            return list(self._tags)

    def due(self) -> bool:
        """Tags to remove, and not in the wait after a failed try."""
        with self._lock:
            retry = self._retry_at
            return bool(self._tags) and (retry is None or time.monotonic() >= retry)

    def retry_at(self) -> float | None:
        with self._lock:
            return self._retry_at if self._tags else None

    def run(self, remove: Callable[[str], bool], *, last: bool = False) -> list[str]:
        """Call `remove(tag)` for each queued tag (True: gone from every tier); the tags
        removed. A tag it refuses, or fails on, stays for a later try; with `last` (the
        process exits) it is given up, and said."""
        with self._lock:
            tags = list(self._tags)
        removed: list[str] = []
        failed: dict[str, str] = {}
        for tag in tags:
            try:
                if remove(tag):
                    removed.append(tag)
                else:
                    failed[tag] = "a reader holds it"
            except NebulaError as exc:
                failed[tag] = str(exc)
        with self._lock:
            self._tags = [t for t in self._tags if t not in removed]
            if removed:
                # Given up at exit, a failed one stays recorded for the next session.
                self._note(self._tags)
            if last:
                self._tags = [t for t in self._tags if t not in failed]
            self._retry_at = time.monotonic() + RETRY_MAX_S if failed and not last else None
        for tag, why in failed.items():
            say = log.warning if last else log.debug
            say(
                "could not delete %r, which the framework removed%s: %s",
                tag, "" if last else " (tried again later)", why,
            )  # fmt: skip
        return removed
