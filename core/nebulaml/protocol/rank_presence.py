"""Which ranks of the job are alive on this node: each live process claims its rank.

A rank's claim is an exclusive flock on `RANK_LOCK_PREFIX<rank>.lock` in its node's
memory tier (`RankPresence`), released when the session closes or the process dies, so
the other ranks of the node tell a rank that is gone (`rank_gone`) from one that is slow:
a commit need not wait `rank_timeout_s` for a part that will never come.

May import: `nebulaml.format`, `nebulaml.storage` and memory_tier.py. Not for: ranks of
other nodes (never known to be gone), a job's ranks and generations (runtime/ranks.py) or
the session's hold on the tier (tier_lifetime.py).
"""

from __future__ import annotations

import fcntl
import logging
import os

from nebulaml.format.names import RANK_LOCK_PREFIX
from nebulaml.protocol.memory_tier import lock_held, open_private_file
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")


class RankPresence:
    """A live process's claim to be rank `rank` of the job on this node: an exclusive
    flock on `.nebula-rank-<rank>.lock` in the memory tier, released when the session
    closes or the process dies. The other ranks of the node so tell a rank that is gone
    (`rank_gone`) from one that is slow: a commit need not wait `rank_timeout_s` for a
    part that will never come.

    Example:
        >>> import tempfile
        >>> store = Store(tempfile.mkdtemp(), durable=False, private=True)
        >>> rank_gone(store, 1)  # never here: not known to be gone
        False
        >>> presence = RankPresence.take(store, 1)
        >>> rank_gone(store, 1)
        False
        >>> presence.close(); rank_gone(store, 1)
        True
    """

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    @classmethod
    def take(cls, memory: Store, rank: int) -> RankPresence:
        """Claim rank `rank` on this node; a claim another live process holds (an
        earlier process of the rank, still exiting) is left to it: never waited for."""
        path = os.path.join(memory.root, f"{RANK_LOCK_PREFIX}{rank}.lock")
        try:
            fd = open_private_file(path)
        except OSError as exc:
            log.debug("could not claim rank %d in %s: %s", rank, memory.url, exc)
            return cls(None)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return cls(None)
        return cls(fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def rank_gone(memory: Store, rank: int) -> bool:
    """Whether rank `rank` of the job was on this node and its process has ended (died,
    or closed its session): its claim (`RankPresence`) is there and nobody holds it.
    False when it is alive, or was never on this node (a rank of another node is never
    known to be gone)."""
    path = os.path.join(memory.root, f"{RANK_LOCK_PREFIX}{rank}.lock")
    try:
        return lock_held(path, fcntl.LOCK_SH) is False
    except OSError:
        return False
