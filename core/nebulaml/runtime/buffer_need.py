"""How many buffers of each item a job needs at once, which is how many the memory tier's
pool keeps (slots.py).

A save fills a buffer while the newest committed copy stays whole (it is never
overwritten in place), so every item needs two buffers; where the persist of the copy
before is still in flight at the next save, that copy is held too and the save needs a
third. A pool that kept only two made the third from fresh pages at each such save
(2-7x the save's steady time, issue #49) and deleted it again at the next eviction.
`Need` remembers, per item, how many buffers its last saves found in use.

Pure: no I/O. May import the standard library only. Not for: the pool's files
(slots.py), or whether a buffer fits the memory budget (budget.py).
"""

from __future__ import annotations

import collections

# How many of an item's last saves `Need` remembers.
NEED_SAVES = 8


class Need:
    """How many buffers of each item a job needed at once (its copies in checkpoints and
    the one being filled) over its last `NEED_SAVES` saves: the pool keeps that many.

    Example:
        >>> need = Need()
        >>> need.of("model")                     # the newest copy and the one being filled
        2
        >>> need.saw("model", 3); need.of("model")  # a persist held the one before
        3
    """

    def __init__(self) -> None:
        self._seen: dict[str, collections.deque[int]] = {}

    def saw(self, name: str, buffers: int) -> None:
        """A save of `name` found `buffers` of it in use, its own included."""
        self._seen.setdefault(name, collections.deque(maxlen=NEED_SAVES)).append(buffers)

    def of(self, name: str) -> int:
        """The most buffers of `name` in use at once lately (at least 2)."""
        return max([2, *self._seen.get(name, ())])
