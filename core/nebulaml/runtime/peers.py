"""The ring of a job's nodes that replicates each node's memory tier to the next one, and
nebula's own process group that carries it.

A node is torchrun's: `GROUP_RANK` (the agent's number), else `RANK // LOCAL_WORLD_SIZE`.
The nodes, in ascending order, form a ring: each node's parts go to the node after it
(its *partner*), the last node's to the first. Each rank sends its own parts to the rank
of the partner node with the same place among that node's ranks (the same local rank on
a job whose nodes run as many ranks each; with fewer ranks there, that place modulo their
number), and receives the parts of the ranks of the node before it that name it so.

    node_of     the node of a rank
    plan_ring   this rank's place in the ring, from every rank's (node, local rank): pure
    open_ring   nebula's gloo process group and this rank's `Ring` on it (collective)

**The process group.** `open_ring` creates a process group of every rank of the job with
`torch.distributed.new_group(backend="gloo")`: host memory over TCP, beside whatever the
program's default group is (NCCL for the GPUs, typically), so that replication never
queues behind, or shares a failure with, the program's own collectives. `new_group` is
collective: every rank of the default group must call it, and call it in the same order
relative to every other `new_group` of the program (torch pairs the calls by their
order). So every rank calls `open_ring` once, at the same point of the same program
(nebula's `init`, after `torch.distributed.init_process_group` and before the program's
own groups when the program sets nebula up first), or none does. Whether a rank calls it
depends only on what every rank sees alike (the process group is initialised, the world
size), never on a rank's own state. Then one all-gather on the new group tells each rank
every rank's (node, local rank), so that the ring is the same on every rank even where
nodes run different numbers of ranks.

Replication needs two nodes: a job on one node, or without an initialised process group,
gets one warning and no ring (None). No group is made where that is known without one (no
process group, one rank, `LOCAL_WORLD_SIZE` covering the world); one made for ranks whose
places then put them all on one node is destroyed again.

May import: `nebulaml.errors`, `nebulaml.config` and runtime/ranks.py. Not for: what
crosses the ring (replication.py), or where the replicas are kept (protocol/replicas.py).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from nebulaml.config import ENV_GROUP_RANK, env_count
from nebulaml.runtime.ranks import detect_ranks

log = logging.getLogger("nebulaml")

# How long one operation of nebula's group may wait for its peer before gloo closes the
# connection between them. An idle link is kept alive well within it (replication.py's
# keepalive); a peer that answers nothing for this long is taken for gone.
PEER_TIMEOUT = timedelta(minutes=10)

_warned: set[str] = set()


@dataclass(frozen=True, slots=True)
class Ring:
    """One rank's place in the replication ring.

    `nodes`: every node of the job, in ring order; `partner`: the node after this rank's,
    which keeps this node's replicas; `send_to`: the rank of the partner node this rank
    sends its parts to; `receive_from`: the ranks (of the node before this one) whose
    parts this rank keeps, usually one.

    Example:
        >>> ring = plan_ring([(0, 0), (0, 1), (1, 0), (1, 1)], rank=1)
        >>> ring.node, ring.partner, ring.send_to, ring.receive_from
        (0, 1, 3, (3,))
    """

    rank: int
    node: int
    nodes: tuple[int, ...]
    partner: int
    send_to: int
    receive_from: tuple[int, ...]

    @property
    def peers(self) -> tuple[int, ...]:
        """Every rank this rank exchanges messages with, each once."""
        return tuple(sorted({self.send_to, *self.receive_from}))


@dataclass(frozen=True, slots=True)
class Peers:
    """A rank's ring and nebula's process group that carries it (`open_ring`)."""

    ring: Ring
    group: Any  # torch.distributed.ProcessGroup: its ranks are the job's ranks


def node_of(rank: int, local_world_size: int, group_rank: int | None = None) -> int:
    """The node of `rank`: torchrun's `GROUP_RANK` when it is known, else the rank's place
    counted in nodes of `local_world_size` ranks.

    Example:
        >>> node_of(5, 4), node_of(5, 2), node_of(5, 4, group_rank=3), node_of(0, 0)
        (1, 2, 3, 0)
    """
    if group_rank is not None:
        return group_rank
    return rank // max(1, local_world_size)


def plan_ring(places: Sequence[tuple[int, int]], rank: int) -> Ring | None:
    """`rank`'s place in the ring of the job whose rank `r` runs on node `places[r][0]`
    as its local rank `places[r][1]`; None when every rank is on one node (nothing to
    replicate to).

    Example:
        >>> plan_ring([(0, 0), (0, 1)], rank=0) is None
        True
        >>> ring = plan_ring([(0, 0), (1, 0), (2, 0)], rank=0)
        >>> ring.partner, ring.send_to, ring.receive_from
        (1, 1, (2,))
    """
    nodes = tuple(sorted({node for node, _ in places}))
    if len(nodes) < 2:
        return None
    # Each node's ranks, by local rank (then rank): a rank's place among them is its seat.
    members: dict[int, list[int]] = {node: [] for node in nodes}
    for r in sorted(range(len(places)), key=lambda r: (places[r][1], r)):
        members[places[r][0]].append(r)
    seat = {r: i for node in nodes for i, r in enumerate(members[node])}

    def target(r: int) -> int:
        node = places[r][0]
        partner = nodes[(nodes.index(node) + 1) % len(nodes)]
        there = members[partner]
        return there[seat[r] % len(there)]

    node = places[rank][0]
    return Ring(
        rank=rank,
        node=node,
        nodes=nodes,
        partner=nodes[(nodes.index(node) + 1) % len(nodes)],
        send_to=target(rank),
        receive_from=tuple(r for r in range(len(places)) if target(r) == rank),
    )


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    log.warning("%s", message)


def open_ring(*, timeout: timedelta = PEER_TIMEOUT) -> Peers | None:
    """Nebula's gloo process group over every rank of the job, and this rank's ring on
    it; None, with one warning, where there is nothing to replicate to: no initialised
    torch.distributed process group, or every rank on one node.

    Collective where a group is made: every rank of the job calls it at the same point of
    its program (see the module's docstring), and `timeout` is the group's (`PEER_TIMEOUT`).
    """
    dist = sys.modules.get("torch.distributed")  # never import torch just to ask
    if dist is None or not dist.is_available() or not dist.is_initialized():
        _warn_once(
            "no group",
            "peer_replicas: torch.distributed is not initialised, so there is no node to "
            "replicate the memory tier to: replication is off",
        )
        return None
    ranks = detect_ranks()
    # Every rank on this node (LOCAL_WORLD_SIZE covers the world, as every rank of the
    # job sees alike): one node, told without a group.
    if ranks.world_size < 2 or ranks.all_local:
        _warn_once("one node", "peer_replicas: the job runs on one node: replication is off")
        return None
    group = dist.new_group(backend="gloo", timeout=timeout)
    mine = (
        node_of(ranks.rank, ranks.local_world_size, env_count(ENV_GROUP_RANK)),
        ranks.local_rank,
    )
    places: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(places, mine, group=group)
    ring = plan_ring([(int(node), int(local)) for node, local in places], ranks.rank)
    if ring is None:
        dist.destroy_process_group(group)
        _warn_once("one node", "peer_replicas: the job runs on one node: replication is off")
        return None
    log.info(
        "peer_replicas: node %d of %d replicates to node %d (rank %d -> rank %d)",
        ring.node, len(ring.nodes), ring.partner, ring.rank, ring.send_to,
    )  # fmt: skip
    return Peers(ring, group)
