"""The checkpoints a framework removed (Lightning's ModelCheckpoint), on their way out of
every tier (`RemovalQueue`): while a tier fails, or a reader holds one, they wait and are
tried again.

May import: every layer below runtime, and runtime.retry_queue (the wait after a failed
try). Not for: the delete itself (protocol/delete.py, run by persist_actions.py's
`Removals`), or the record of what is left to remove (protocol/removals.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from nebulaml.errors import NebulaError
from nebulaml.runtime.retry_queue import RetryQueue

log = logging.getLogger("nebulaml")


class RemovalQueue(RetryQueue[str]):
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
        super().__init__()  # the tags, and the wait after a failed try
        # Told, under the lock, each time what is left to remove changes: the persister
        # records it in the memory tier, so that a process killed before its thread ran
        # a removal leaves it to the next session (session.py's recovery).
        self._journal = journal

    def add(self, tag: str) -> None:
        with self._lock:
            if tag not in self._items:
                self._items.append(tag)
                self._note(self._items)

    def discard(self, tag: str) -> None:
        """`tag` is saved again: it is no longer to be removed."""
        with self._lock:
            if tag in self._items:
                self._items.remove(tag)
                self._note(self._items)

    def _note(self, tags: list[str]) -> None:
        if self._journal is not None:
            self._journal(list(tags))

    def pending(self) -> list[str]:
        with self._lock:
            return list(self._items)

    def run(self, remove: Callable[[str], bool], *, last: bool = False) -> list[str]:
        """Call `remove(tag)` for each queued tag (True: gone from every tier); the tags
        removed. A tag it refuses, or fails on, stays for a later try; with `last` (the
        process exits) it is given up, and said."""
        with self._lock:
            tags = list(self._items)
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
            self._items = [t for t in self._items if t not in removed]
            if removed:
                # Given up at exit, a failed one stays recorded for the next session.
                self._note(self._items)
            if last:
                self._items = [t for t in self._items if t not in failed]
            self._tried(ok=not failed or last)
        for tag, why in failed.items():
            say = log.warning if last else log.debug
            say(
                "could not delete %r, which the framework removed%s: %s",
                tag, "" if last else " (tried again later)", why,
            )  # fmt: skip
        return removed
