"""One persist: a committed memory-tier checkpoint (or this rank's part of one) copied to
the persistent tier and committed there, and what a failed one leaves removed.

    leader_of        the lowest rank that writes a tag: the one that decides its persist
    persist_whole    a checkpoint one process wrote, copied and committed
    persist_part     this rank's part of a checkpoint several ranks write
    discard_partial  what a failed persist wrote, removed (a full disk needs the room)

May import: every layer below runtime, runtime.outage and runtime.ranks. Not for: when a
persist runs, or what follows a failed one (persister.py), retention and the history
(persist_actions.py, history_queue.py).
"""

from __future__ import annotations

import logging

from nebulaml.errors import NebulaError, PersistError
from nebulaml.format.manifest import parse_marker
from nebulaml.format.names import marker_name
from nebulaml.protocol.catalog import read_committed
from nebulaml.protocol.cowriters import copy_alongside
from nebulaml.protocol.delete import delete_checkpoint, delete_part
from nebulaml.protocol.rank_presence import rank_gone
from nebulaml.protocol.reuse import ReuseBook
from nebulaml.protocol.tiers import TierSet
from nebulaml.protocol.transfer import copy_part
from nebulaml.runtime.outage import may_pass
from nebulaml.runtime.ranks import RankInfo
from nebulaml.storage.store import MissingFileError, Store

log = logging.getLogger("nebulaml")


def leader_of(memory: Store, tag: str, rank: int) -> int | None:
    """The leader of `tag` (the lowest rank that writes it), from this rank's marker in the
    memory tier; None when this rank wrote no part of it (a checkpoint of other ranks:
    nothing of it is this rank's to persist)."""
    try:
        where = memory.display(tag, marker_name(rank))
        return min(parse_marker(memory.read_bytes(tag, marker_name(rank)), where).writers)
    except MissingFileError:
        # No part of this rank's here: a checkpoint other ranks write (committed on a
        # shared tier without this rank, or on their nodes).
        info = read_committed(memory, tag)
        if info is None or rank not in info.manifest.writers:
            return None
    except NebulaError:
        pass
    return 0  # copy_part reports what is wrong with this rank's part


def persist_whole(tiers: TierSet, tag: str, reuse: ReuseBook | None = None) -> tuple[int, int]:
    """Copy the committed memory-tier checkpoint `tag` to the persistent tier and commit
    it there; its size in bytes and its commit sequence there. `reuse`: what this
    process persisted before, whose unchanged bytes are not written again (reuse.py)."""
    persistent = tiers.persistent
    assert persistent is not None
    src = read_committed(tiers.memory, tag)
    if src is None:
        raise PersistError(
            tag, persistent.url, FileNotFoundError("no committed copy in the memory tier")
        )
    # An operator's copy or flush of the same tag waits for this, or this for it, and a
    # committed copy of the same items is this persist's.
    copied = copy_alongside(src, persistent, overwrite=True, same_root=True, reuse=reuse)
    return src.manifest.total_bytes, copied.manifest.sequence


def persist_part(
    tiers: TierSet,
    tag: str,
    ranks: RankInfo,
    *,
    leader: int,
    rank_timeout_s: float,
    reuse: ReuseBook | None = None,
) -> int:
    """Copy this rank's part of `tag` to the persistent tier; the leader also waits for
    the other ranks' parts and commits the whole. Its size in bytes.

    The part of a rank of this node whose process has ended (`rank_gone`) is copied from
    the shared memory tier too, and the checkpoint committed without waiting for it."""
    persistent = tiers.persistent
    assert persistent is not None
    memory = tiers.memory

    def gone(missing: list[int]) -> list[int]:
        return [r for r in missing if r != ranks.rank and rank_gone(memory, r)]

    return copy_part(
        tiers.memory,
        persistent,
        tag,
        rank=ranks.rank,
        world_size=ranks.world_size,
        timeout_s=rank_timeout_s,
        # The leader waits for the whole and reports a missing rank; the others must not
        # block (it may be waiting for one of their older parts).
        wait=leader == ranks.rank,
        gone=gone if tiers.memory_usable else None,
        reuse=reuse,
    )


def discard_partial(persistent: Store, tag: str, ranks: RankInfo) -> None:
    """Remove what a failed persist wrote: on a full disk its partial files would keep the
    next persist from fitting. A committed copy (another writer's) is left alone."""
    try:
        if read_committed(persistent, tag) is not None:
            return
        if ranks.world_size > 1:
            delete_part(persistent, tag, ranks.rank)
        else:
            delete_checkpoint(persistent, tag)
    except NebulaError as exc:
        # The store still down: the next try removes it (said once, by the outage).
        say = log.debug if may_pass(exc) else log.warning
        say("could not remove what the failed persist of %r left: %s", tag, exc)
