"""The memory tier's budget: `NEBULA_MEMORY_BUFFER_SIZE`, enforced before each item is written.

The seed's rule: half of the node's `NEBULA_MEMORY_BUFFER_SIZE` holds checkpoints, shared
by the node's processes (`ranks.memory_budget_bytes`). Before an item goes into the memory
tier, `MemoryBudget.reserve` makes room for it, in this order: free pool files (slots.py),
evict old copies the persister no longer needs, wait for the pending persist and then evict
the newest copy too (it is durable by then, or superseded by a newer one committed on the
persistent tier). What still does not fit is refused (`False`): the caller streams the
checkpoint to the persistent tier instead. The newest committed copy is never overwritten
in place, and the memory tier never holds more than the budget because of nebula.

Not for: choosing which old copies are evictable (persister.py) or how the pool reuses
files (slots.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .persister import Persister
    from .slots import SlotPool

log = logging.getLogger("nebulaml")


class MemoryBudget:
    """Room-making for one memory tier under a byte limit (None: no limit).

    Example:
        >>> MemoryBudget(None, pool=None, persister=None).reserve("model", 10**12)
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

    def reserve(self, name: str, size_bytes: int) -> bool:
        """Make room for an item `name` of `size_bytes`; False if it cannot fit."""
        limit = self.limit_bytes
        if limit is None or self.pool is None or self.persister is None:
            return True
        if size_bytes > limit:
            return False
        pool, persister = self.pool, self.persister
        if self._fits(name, size_bytes):
            return True
        pool.trim(keep_name=name)
        if self._fits(name, size_bytes):
            return True
        persister.evict_memory(superseded_newest=True)
        if self._fits(name, size_bytes):
            return True
        # Older copies go once they are persisted: persist the pending one now, and wait.
        persister.flush(timeout_s=self.wait_s)
        persister.evict_memory(superseded_newest=True)
        pool.trim(keep_name=name)
        if self._fits(name, size_bytes):
            return True
        pool.trim()
        return self._fits(name, size_bytes, reuse=False)

    def _fits(self, name: str, size_bytes: int, *, reuse: bool = True) -> bool:
        assert self.pool is not None and self.limit_bytes is not None
        # A pool file of this item is overwritten in place, not added to.
        reused = self.pool.free_bytes(name, size_bytes) if reuse else 0
        used = self.pool.usage_bytes()
        return used - reused + size_bytes <= self.limit_bytes
