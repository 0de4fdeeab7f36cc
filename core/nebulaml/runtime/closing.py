"""Whether a closing session may release its memory tier (session.py's `close`).

    releasable  the memory tier may go: a persistent tier, nothing failed, not asked to
                be kept, and every checkpoint of this rank's in it persisted (or older
                than one that is); with several ranks this rank's parts go now, and the
                last rank out removes the folder

A rank that persisted its part of the newest checkpoint waits (at most LEADER_WAIT_S, or
the rank timeout, and not for a leader of this node whose process has ended) for its
leader to commit it on the persistent tier: a follower done before the leader's commit
kept its part, and nothing released it after the job.

May import: every layer below runtime, runtime.persist_step (a tag's leader), and
runtime.persister and ranks (their types). Not for: releasing itself
(protocol/tier_lifetime.py) or closing the session (session.py).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from nebulaml.errors import NebulaError, UnsupportedSchemaError
from nebulaml.format.manifest import ItemEntry
from nebulaml.format.names import marker_name, order_key
from nebulaml.protocol.catalog import list_committed, read_committed
from nebulaml.protocol.commit_index import newest as newest_committed
from nebulaml.protocol.delete import delete_part
from nebulaml.protocol.markers import own_parts
from nebulaml.protocol.rank_presence import rank_gone
from nebulaml.runtime.persist_step import leader_of

if TYPE_CHECKING:
    from nebulaml.protocol.tiers import TierSet
    from nebulaml.runtime.persister import Persister
    from nebulaml.runtime.ranks import RankInfo

log = logging.getLogger("nebulaml")

LEADER_WAIT_S = 30.0  # how long a closing rank waits for its leader's commit


def releasable(
    tiers: TierSet, persister: Persister, ranks: RankInfo | None, *, rank_timeout_s: float
) -> bool:
    """Whether the memory tier may go at close: there is a persistent tier, nothing
    failed, and every checkpoint of this rank's in the memory tier is persisted (or older
    than one that is). With several ranks on the node, this rank's parts go now, and the
    last rank out removes the folder. `ranks`: who this process is, None when it cannot
    be told (then no rank's parts are its to drop)."""
    persistent = tiers.persistent
    if persistent is None or persister.error or ranks is None:
        return False
    if not persister.connected:
        return False  # never reached: nothing in the memory tier is durable
    memory = tiers.memory
    if ranks.world_size > 1:
        _await_leaders(tiers, ranks.rank, own_parts(memory, ranks.rank), rank_timeout_s)
    # The newest on the root from its commit index, and the few tags the memory tier
    # holds, each looked up: not every manifest of the root (commit_index.py).
    top = newest_committed(persistent, 1)
    newest = top[0].sort_key if top else None

    def durable(tag: str) -> tuple[ItemEntry, ...] | None:
        try:
            info = read_committed(persistent, tag)
        except UnsupportedSchemaError:
            return None
        return None if info is None else info.manifest.items

    if ranks.world_size > 1:
        mine = own_parts(memory, ranks.rank)
        for tag, created in mine:
            if (newest is None or order_key(tag, created) >= newest) and durable(tag) is None:
                return False
        for tag, _created in mine:
            delete_part(memory, tag, ranks.rank, own_holds=False)  # as release_memory_tier
        return not any(True for _ in memory.list_dirs())
    for info in list_committed(memory):
        if (newest is None or info.sort_key >= newest) and durable(info.tag) != info.manifest.items:
            return False
    return True


def _await_leaders(
    tiers: TierSet, rank: int, mine: list[tuple[str, str]], rank_timeout_s: float
) -> None:
    """At close, the newest checkpoint this rank persisted its part of: wait (at most
    LEADER_WAIT_S, or the rank timeout) until its leader commits it on the persistent
    tier, so that this rank's memory copy goes too. A follower done with its part
    before the leader's commit kept it, and nothing released it after the job."""
    persistent = tiers.persistent
    if persistent is None or not mine:
        return
    tag = max(mine, key=lambda part: order_key(*part))[0]
    try:
        if not persistent.exists(tag, marker_name(rank)):
            return  # this rank's part is not there: nothing of it will be committed
        deadline = time.monotonic() + min(LEADER_WAIT_S, rank_timeout_s)
        # A leader of this node whose process has ended (a whole job stopped at once)
        # commits nothing more: no wait for it.
        leader = leader_of(tiers.memory, tag, rank)
        while read_committed(persistent, tag) is None and time.monotonic() < deadline:
            if leader is not None and leader != rank and rank_gone(tiers.memory, leader):
                return
            time.sleep(0.05)
    except NebulaError as exc:
        log.debug("could not wait for the commit of %r: %s", tag, exc)
