"""Whether an item fits the memory tier: its budget and its filesystem, checked before each
item is written.

The budget: half of the node's `NEBULA_MEMORY_BUFFER_SIZE` holds checkpoints (the seed's
rule), shared by the node's processes (`ranks.memory_budget_bytes`). The filesystem: the
free space of the memory tier's folder (`free_bytes`: `/dev/shm` is 64 MiB in a default
Docker container), counting that a pool file of the item is overwritten in place. Before
an item goes into the memory tier, `MemoryBudget.make_room` makes room for it, in this
order: free pool files (slots.py), evict old copies the persister no longer needs, wait
for the pending persist and then evict the newest copy too (it is durable by then, or
superseded by a newer one committed on the persistent tier). What still does not fit is
refused with a `Shortfall` saying why: the caller (checkpoint.py) streams the checkpoint
to the persistent tier instead. The newest committed copy is never overwritten in place,
and the memory tier never holds more than the budget because of nebula. A spare buffer
for the next save (slots.py) is made only where one more buffer fits (`spare_fits`), and
the bytes of one being allocated are not counted as free.

Replicas count: the memory tier's usage (slots.SlotPool.usage_bytes, every file under it)
includes the replicas it keeps of other nodes' parts (`peer_replicas=1`: `.replicas/`,
one replica of the partner's newest part, two while a newer one arrives until it is
whole, or while this rank's own part of the newer one's tag is not committed yet), and
so does the filesystem's free space. They take room from this node's own checkpoints,
and no eviction here frees them: the receiver replaces a replica only with a newer whole
one (runtime/replication.py), and the release at exit keeps those a restart may need
(session.py).

Not for: choosing which old copies are evictable (persister.py), how the pool reuses
files (slots.py), or streaming (checkpoint.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nebulaml.errors import PersistError

if TYPE_CHECKING:
    from nebulaml.runtime.persister import Persister
    from nebulaml.runtime.slots import SlotPool

log = logging.getLogger("nebulaml")

# Kept free on the memory tier's filesystem beyond the item: the checkpoint's small files
# (writer and rank markers, manifest, leases; a page each on tmpfs) must fit after it.
RECORDS_ROOM_BYTES = 64 << 10
_PAGE = 4096  # tmpfs allocates whole pages


def free_bytes(path: str) -> int | None:
    """Bytes a process may still write on the filesystem of `path` (of its nearest
    existing folder: the memory tier may not be made yet); None if it cannot be told.

    Example:
        >>> import tempfile
        >>> free_bytes(tempfile.gettempdir() + "/not/made/yet") > 0
        True
    """
    path = os.path.abspath(path)
    while True:
        try:
            st = os.statvfs(path)
        except FileNotFoundError:
            parent = os.path.dirname(path)
            if parent == path:
                return None
            path = parent
            continue
        except OSError:
            return None
        return st.f_bavail * st.f_frsize


@dataclass(frozen=True, slots=True)
class Shortfall:
    """Why an item of `size_bytes` does not fit the memory tier at `path`: over the budget
    (`limit_bytes` set, `NEBULA_MEMORY_BUFFER_SIZE`), or more than its filesystem has free
    (`free_bytes` set)."""

    size_bytes: int
    path: str
    limit_bytes: int | None = None
    free_bytes: int | None = None

    @property
    def over_budget(self) -> bool:
        return self.limit_bytes is not None


class MemoryBudget:
    """Room-making for one memory tier under a byte limit (None: no limit) and within the
    free space of its filesystem.

    Example:
        >>> MemoryBudget(None, pool=None, persister=None).make_room("model", 10**12) is None
        True
    """

    def __init__(
        self,
        limit_bytes: int | None,
        *,
        pool: SlotPool | None,
        persister: Persister | None,
        wait_s: float = 600.0,
    ) -> None:
        self.limit_bytes = limit_bytes
        self.pool = pool
        self.persister = persister
        self.wait_s = wait_s
        self.path: str | None = pool.store.local_path() if pool is not None else None

    def make_room(self, name: str, size_bytes: int) -> Shortfall | None:
        """Make room for an item `name` of `size_bytes` in the memory tier: None once it
        fits, else why it cannot (the caller writes it to the persistent tier instead)."""
        short = self._shortfall(name, size_bytes)
        pool, persister = self.pool, self.persister
        if short is None or pool is None or persister is None or self._out_of_reach(short):
            return short
        pool.trim(keep_name=name)
        if (short := self._shortfall(name, size_bytes)) is None:
            return None
        persister.evict_memory(superseded_newest=True)
        if (short := self._shortfall(name, size_bytes)) is None:
            return None
        # Older copies go once they are persisted: persist the pending one now, and wait;
        # never while the persistent tier fails (training does not wait on it: the item
        # goes around the memory tier, or its save says why it cannot).
        if not persister.failing():
            try:
                persister.flush(timeout_s=self.wait_s, wait_out=False)
            except PersistError:
                if persister.on_error == "raise":
                    raise
        persister.evict_memory(superseded_newest=True)
        pool.trim(keep_name=name)
        if (short := self._shortfall(name, size_bytes)) is None:
            return None
        pool.trim()
        return self._shortfall(name, size_bytes, reuse=False)

    def roomy(self, size_bytes: int) -> bool:
        """Whether an item of `size_bytes` surely fits the memory tier as it stands, by a
        look that takes no lock and makes no room: at most half the budget (the newest
        checkpoint and the one being saved side by side), and within what the tier's
        filesystem has free. A lazy save by default ("auto") leaves only such copies to
        the background; the others make their room at save().

        Example:
            >>> MemoryBudget(10, pool=None, persister=None).roomy(6)
            False
        """
        if self.limit_bytes is not None and 2 * size_bytes > self.limit_bytes:
            return False
        free = free_bytes(self.path) if self.path is not None else None
        return free is None or _pages(size_bytes) + RECORDS_ROOM_BYTES <= free

    def spare_fits(self, size_bytes: int) -> bool:
        """Whether one more buffer of `size_bytes` fits beside what the memory tier holds:
        within the budget, and within its filesystem's free space with the records' room
        left (a spare buffer for the next save, slots.SlotPool.prepare, is made only then)."""
        pool, limit, path = self.pool, self.limit_bytes, self.path
        if pool is None or path is None:
            return False
        if limit is not None and pool.usage_bytes() + size_bytes > limit:
            return False
        free = self._free(path)
        return free is None or _pages(size_bytes) + RECORDS_ROOM_BYTES <= free

    def filesystem_full(self, size_bytes: int) -> Shortfall:
        """The shortfall of an item whose write into the memory tier ran out of space
        after `make_room` found room (another process filled the filesystem meanwhile)."""
        path = self.path or ""
        return Shortfall(size_bytes, path, free_bytes=free_bytes(path) or 0)

    def _shortfall(self, name: str, size_bytes: int, *, reuse: bool = True) -> Shortfall | None:
        pool, limit, path = self.pool, self.limit_bytes, self.path
        if pool is None or path is None:
            return None
        # A pool file of this item is overwritten in place, not added to.
        reused = pool.free_bytes(name, size_bytes) if reuse else 0
        if limit is not None and pool.usage_bytes() - reused + size_bytes > limit:
            return Shortfall(size_bytes, path, limit_bytes=limit)
        free = self._free(path)
        if free is not None and _pages(size_bytes) - _pages(reused) + RECORDS_ROOM_BYTES > free:
            return Shortfall(size_bytes, path, free_bytes=free)
        return None

    def _free(self, path: str) -> int | None:
        """The filesystem's free bytes, less what spare buffers being made will take."""
        free = free_bytes(path)
        if free is None or self.pool is None:
            return free
        return max(0, free - self.pool.unallocated_bytes())

    def _out_of_reach(self, short: Shortfall) -> bool:
        """Whether no eviction can make room: the item is over the whole budget, or over
        what the filesystem would have free with this memory tier empty."""
        if short.limit_bytes is not None:
            return short.size_bytes > short.limit_bytes
        assert self.pool is not None and short.free_bytes is not None
        reachable = short.free_bytes + self.pool.usage_bytes()
        return _pages(short.size_bytes) + RECORDS_ROOM_BYTES > reachable


def _pages(size_bytes: int) -> int:
    return -(-size_bytes // _PAGE) * _PAGE
