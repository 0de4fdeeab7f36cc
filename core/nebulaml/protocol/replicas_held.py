"""The replicas a memory tier holds of other nodes' parts, read without writing anything,
and which of them a restart of their job may still need.

    held_replicas    the newest whole replica of each rank's part in a memory tier
    needed_replicas  those whose checkpoint the persistent tier holds neither committed
                     nor superseded by a later step: a lost node's only copy

The rule a memory tier's release follows (runtime/session.py, `nebula gc`): the replicas
go with the tier only when none is needed; a tier that holds a needed one keeps its
`.replicas` folder (the node's own checkpoints, all persisted, go as ever) until the
persistent tier holds their checkpoints, or an operator discards them.

May import: `nebulaml.errors`, `nebulaml.format` and `nebulaml.storage`, and
protocol's replicas and catalog. Not for: receiving or committing a replica
(replicas.py), or restoring one (runtime).
"""

from __future__ import annotations

import os

from nebulaml.errors import NebulaError
from nebulaml.format.names import REPLICAS_DIR, step_of
from nebulaml.protocol.catalog import list_committed
from nebulaml.protocol.replicas import Replica, rank_folder, replica_ranks, whole_replicas
from nebulaml.storage.store import Store


def held_replicas(memory: Store) -> list[Replica]:
    """The newest whole replica of each rank's part that the memory tier `memory` keeps
    (`.replicas/rank-<r>/`), by rank; nothing is made or removed. A rank folder that is a
    symbolic link, or cannot be read, holds none.

    Example:
        >>> import tempfile
        >>> held_replicas(Store(tempfile.mkdtemp(), durable=False, private=True))
        []
    """
    held = []
    for rank in replica_ranks(memory):
        path = memory.local_path(REPLICAS_DIR, rank_folder(rank))
        if path is None or os.path.islink(path):
            continue
        try:
            whole = whole_replicas(Store(path, durable=False, private=True))
        except (NebulaError, OSError):
            continue
        if whole:
            held.append(whole[0])
    return held


def needed_replicas(replicas: list[Replica], persistent: Store | None) -> list[Replica]:
    """Those of `replicas` a restart may still need: the persistent tier (None: there is
    none) holds neither their tag committed nor a checkpoint of a later step. Raises the
    store's `NebulaError` when it cannot be read (the caller keeps them then).

    Example:
        >>> needed_replicas([], None)
        []
    """
    if not replicas or persistent is None:
        return list(replicas)
    durable = list_committed(persistent)
    tags = {info.tag for info in durable}
    steps = [step for info in durable if (step := step_of(info.tag)) is not None]
    newest_step = max(steps, default=None)

    def superseded(replica: Replica) -> bool:
        if replica.tag in tags:
            return True
        step = step_of(replica.tag)
        return newest_step is not None and (step is None or step < newest_step)

    return [replica for replica in replicas if not superseded(replica)]
