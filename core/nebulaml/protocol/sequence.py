"""Commit sequences: reserving the number a manifest about to be published on a tier takes.

    reserve_sequence     1 + the highest reserved on the tier (or a floor), recorded first
    note_sequence        record a number a copy keeps (the tier's record never goes below)
    SequenceReservation  a writer's next commit sequence, recorded between its commits

A manifest's `sequence` is its place in "newest" order (names.order_key). Each tier
records the highest number reserved on it in `SEQUENCE_FILE`, written before the manifest
that takes the number: a commit that dies between the two leaves a gap, never a number
used twice by one writer. Reading what a tier holds (the file, or every manifest where it
is missing) is catalog.py's.

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage` and catalog.py. Not
for: publishing the manifest that takes the number (commit.py, transfer.py) or ordering
checkpoints by it (format/names.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import threading

from nebulaml.errors import StorageError
from nebulaml.format.names import SEQUENCE_FILE
from nebulaml.protocol.catalog import highest_sequence, read_sequence_file, scan_sequence
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")


def reserve_sequence(store: Store, floor: int = 0) -> int:
    """The commit sequence of a manifest about to be published on `store`: 1 + the
    highest reserved there (catalog.highest_sequence) or `floor`, whichever is higher,
    recorded in the tier's `SEQUENCE_FILE` before the manifest is published (a commit
    that dies between the two leaves a gap, never a number used twice by one writer).

    Two commits on one tier at the same instant may take the same number, as they could
    when the number came from reading every manifest; names.order_key then orders them
    by commit time and tag.

    Example:
        >>> import tempfile
        >>> store = Store(tempfile.mkdtemp())
        >>> reserve_sequence(store), reserve_sequence(store), reserve_sequence(store, 10)
        (1, 2, 11)
    """
    sequence = 1 + max(floor, highest_sequence(store))
    _record_sequence(store, sequence)
    return sequence


def note_sequence(store: Store, sequence: int) -> None:
    """Record that a manifest of `sequence` is about to be published on `store` (a copy
    keeps its source's number): the tier's `SEQUENCE_FILE` never goes below it."""
    recorded = read_sequence_file(store)
    if recorded is None:
        recorded = scan_sequence(store)  # once: the file is written below
    elif recorded >= sequence:
        return
    _record_sequence(store, max(recorded, sequence))


class SequenceReservation:
    """One writer's next commit sequence on `store`, recorded in `SEQUENCE_FILE` ahead of
    its commit, so that the commit itself neither reads nor writes that file.

    After a commit, `reserve_after(used)` records the next number (1 + the highest the
    file or `used` holds), off the training thread, and remembers the file's identity
    (inode, size, time: `Store.file_identity`). The next commit `take`s it if the file
    is still the one it wrote: any other writer's reservation replaces the file (a
    `publish` renames a new one into place), and then `take` reserves afresh, as
    `reserve_sequence` does. The file holds the number before a manifest takes it, as
    ever; a reservation no commit takes leaves a gap, as a commit that dies does.

    Example:
        >>> import tempfile
        >>> store = Store(tempfile.mkdtemp())
        >>> reservation = SequenceReservation(store)
        >>> first = reservation.take(0)        # nothing reserved yet: reserved now
        >>> reservation.reserve_after(first)   # the next one, between saves
        >>> first, reservation.take(0), reserve_sequence(store)
        (1, 2, 3)
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._next: tuple[int, tuple[int, int, int]] | None = None  # (sequence, identity)

    def take(self, floor: int = 0) -> int:
        """The sequence of a manifest about to be published on the store: the one
        reserved ahead when the file still holds it and it is above `floor`, else one
        reserved now (`reserve_sequence`)."""
        with self._lock:
            ahead, self._next = self._next, None
        if ahead is not None:
            sequence, identity = ahead
            if sequence > floor and self.store.file_identity(SEQUENCE_FILE) == identity:
                return sequence
        return reserve_sequence(self.store, floor)

    def reserve_after(self, used: int) -> None:
        """Record the sequence after `used` (or after the highest reserved, if higher)
        for this writer's next commit."""
        sequence = reserve_sequence(self.store, used)
        identity = self.store.file_identity(SEQUENCE_FILE)
        if identity is not None:  # an object store has none: its commits reserve
            with self._lock:
                self._next = (sequence, identity)


def _record_sequence(store: Store, sequence: int) -> None:
    """Write `SEQUENCE_FILE`. The file only saves reading every manifest: one that cannot
    be written (something else planted in its place, a folder, a FIFO) never fails the
    commit; it is removed if it can be, and a reader that finds no readable file scans."""
    doc = {"sequence": sequence}
    try:
        store.publish((SEQUENCE_FILE,), json.dumps(doc).encode(), create_only=False)
    except StorageError as exc:
        cause = exc.__cause__
        planted = isinstance(cause, OSError) and cause.errno in _NOT_A_FILE
        if not planted:
            raise  # a full disk, a store down: the commit fails as its manifest would
        log.warning("could not record the commit sequence in %s (reading every manifest "
                    "instead): %s", store.display(SEQUENCE_FILE), exc)  # fmt: skip
        with contextlib.suppress(StorageError):
            store.remove(SEQUENCE_FILE)  # a stale regular file must not be believed


# What keeps SEQUENCE_FILE from being replaced by a rename: something else in its place.
_NOT_A_FILE = frozenset({errno.EISDIR, errno.ENOTDIR, errno.ENOTEMPTY, errno.ELOOP,
                         errno.ENXIO})  # fmt: skip
