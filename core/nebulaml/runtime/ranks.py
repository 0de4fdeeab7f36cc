"""Who this process is in a job: rank, world size, and the ranks on its node.

torch.distributed is asked first when it is initialised; else torchrun's environment
(`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, read by config.py); else a single
process. The session reads them again at the first save (a program may set nebula up
before torch.distributed). The generation of the job (which run, and which restart of it:
`job_generation`) and the memory budget of the seed (`NEBULA_MEMORY_BUFFER_SIZE`: half of
it for checkpoints, divided among the node's processes) are derived here too.

May import: `nebulaml.errors` and `nebulaml.config`. Not for: talking to other ranks (they
meet through rank markers in the tiers; the generation is agreed once, through the process
group's key-value store, without a collective), or reading the environment (config.py).
"""

from __future__ import annotations

import logging
import sys
import uuid
from dataclasses import dataclass

from nebulaml.config import (
    ENV_LOCAL_RANK,
    ENV_LOCAL_WORLD_SIZE,
    ENV_RANK,
    ENV_WORLD_SIZE,
    elastic_generation,
    env_count,
    memory_buffer_bytes,
    rank_env_set,
)
from nebulaml.errors import InvalidArgumentError

log = logging.getLogger("nebulaml")
GENERATION_KEY = "nebulaml/generation"  # in the process group's store: the agreed one


@dataclass(frozen=True, slots=True)
class RankInfo:
    """This process's place in the job.

    Example:
        >>> RankInfo(rank=3, world_size=8, local_rank=1, local_world_size=2).all_local
        False
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def all_local(self) -> bool:
        """Every rank of the job runs on this node (they share one memory tier)."""
        return self.local_world_size >= self.world_size

    @property
    def is_leader(self) -> bool:
        """Rank 0 decides which checkpoints are persisted; the other ranks follow it."""
        return self.rank == 0


def detect_ranks() -> RankInfo:
    """This process's rank, from torch.distributed when initialised, else the environment."""
    rank, world_size = env_count(ENV_RANK), env_count(ENV_WORLD_SIZE)
    if _dist_initialized():
        dist = sys.modules["torch.distributed"]
        rank, world_size = dist.get_rank(), dist.get_world_size()
    rank = rank or 0
    world_size = world_size or 1
    if rank >= world_size:
        raise InvalidArgumentError(f"rank {rank} is not below the world size {world_size}")
    local_world_size = env_count(ENV_LOCAL_WORLD_SIZE) or (world_size if world_size == 1 else None)
    local_rank = env_count(ENV_LOCAL_RANK)
    if local_world_size is None:
        # Without torchrun's variables, assume every rank is on this node (the common
        # single-node launch); a multi-node launcher sets LOCAL_WORLD_SIZE.
        local_world_size = world_size
    if local_rank is None:
        local_rank = rank % local_world_size
    return RankInfo(rank, world_size, local_rank, min(local_world_size, world_size))


def _dist_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")  # never import torch just to ask
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def ranks_settled() -> bool:
    """Whether `detect_ranks()` can tell for certain who this process is: torch.distributed
    is initialised, or the launcher set both `RANK` and `WORLD_SIZE` (torchrun), or neither
    (one process; or a launcher's first process before it starts the others, which is
    rank 0 either way). Lightning's launcher sets `WORLD_SIZE` alone in the processes it
    starts: their rank is known once torch.distributed is initialised."""
    if _dist_initialized():
        return True
    rank_set, world_set = rank_env_set()
    return rank_set == world_set


def generation_agreeable(ranks: RankInfo) -> bool:
    """Whether `job_generation(ranks)` can give a value every rank agrees on now (not None
    for a lack of torch.distributed): torchrun's, one process's own, or one agreed through
    the process group's store."""
    return elastic_generation() is not None or ranks.world_size == 1 or _dist_initialized()


def job_generation(ranks: RankInfo) -> str | None:
    """Which run of the job, and which restart of it, this process belongs to: a value
    every rank of the job agrees on, carried by each part of a checkpoint, so that a
    checkpoint is never committed from parts of two runs (one rank's part saved before a
    restart, another's after).

    torchrun's run id and restart count; else, with torch.distributed initialised, the
    first value any rank proposes through the process group's store (no collective: a
    rank that never saves takes no part); else for one process an id of its own; else None
    (ranks without torchrun or a process group cannot agree on one: no check).
    """
    elastic = elastic_generation()
    if elastic is not None:
        return elastic
    mine = uuid.uuid4().hex[:16]
    if ranks.world_size == 1:
        return mine
    if not _dist_initialized():
        return None
    try:
        from torch.distributed import distributed_c10d

        agreed = distributed_c10d._get_default_store().compare_set(GENERATION_KEY, "", mine)
    except Exception as exc:  # noqa: BLE001 - no store (another backend): no generation
        log.debug("no generation agreed through the process group's store: %s", exc)
        return None
    return agreed.decode() if isinstance(agreed, bytes) else str(agreed)


def memory_budget_bytes(ranks: RankInfo) -> int | None:
    """This process's share of `NEBULA_MEMORY_BUFFER_SIZE` (bytes per node): half of it for
    checkpoints, divided by the processes on the node; None when it is not set.

    Example:
        >>> import os
        >>> os.environ["NEBULA_MEMORY_BUFFER_SIZE"] = "200000000"
        >>> memory_budget_bytes(RankInfo(rank=0, world_size=4, local_world_size=4))
        25000000
        >>> del os.environ["NEBULA_MEMORY_BUFFER_SIZE"]
    """
    total = memory_buffer_bytes()
    if total is None:
        return None
    return total // 2 // max(1, ranks.local_world_size)
