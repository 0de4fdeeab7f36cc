"""This user's memory tiers on this node: what each holds (`nebula memory`), and releasing
the ones no job needs any more (`nebula gc`).

A memory tier is RAM (`/dev/shm`): a tier left behind holds memory until it is released,
and in a container /dev/shm counts against the memory limit. A session releases its own
tier when it ends with everything persisted (session.py); these functions find the rest:
stale tiers (their root is gone, or was created again), tiers of finished jobs whose
newest checkpoint is persisted, and - only when asked - unpersisted checkpoints of jobs
that are gone.

A tier may also hold replicas of other nodes' parts (`peer_replicas=1`: its
`.replicas/` folder, protocol/replicas.py): each tier's `replicas` (`ReplicaInfo`, the
newest whole one of each rank), and `list_replicas(root)` for one root's. A tier whose
replicas the root lacks (protocol/replicas_held.py: neither their checkpoint nor a later
step is persisted) is kept by `nebula gc` as an unpersisted checkpoint is: a restart of
their job may need them.

May import: protocol's tiers, memory_tier, tier_identity, tier_lifetime, catalog,
recovery, replicas and replicas_held; runtime.locate (a root's tiers); storage; errors. Not for: a
running job's own tier (session.py), or persisting what a crashed job left
(copying.persist_memory_tier).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from nebulaml.errors import NebulaError, UnsafeMemoryTierError, UnsupportedSchemaError
from nebulaml.format.names import order_key, step_of
from nebulaml.protocol.catalog import list_committed, read_committed
from nebulaml.protocol.memory_tier import check_private_dir, memory_base
from nebulaml.protocol.recovery import dead_leftovers
from nebulaml.protocol.replicas import Replica
from nebulaml.protocol.replicas_held import held_replicas, needed_replicas
from nebulaml.protocol.tier_identity import (
    OK,
    ORPHANED,
    STALE,
    UNSAFE,
    judge_memory_tier,
    read_record,
)
from nebulaml.protocol.tier_lifetime import in_use, release_memory_tier, tier_contents
from nebulaml.runtime.locate import tiers_for
from nebulaml.storage.store import Store

UNKNOWN = "unknown"  # its root cannot be reached from here (credentials, network)
REPLICA_TIER = "replica"  # what `nebula ls` calls a replica's tier


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """A replica this node's memory tier keeps of another node's part: rank `rank`'s part
    of `tag` (of step `step`, None for a tag without one), sent by node `node`,
    `size_bytes` in all, whole since `received_at` (UTC, ISO 8601); `created_at` is when
    the rank wrote the part. `persisted`: whether the
    root holds its checkpoint committed, or one of a later step (then the replica is no
    longer needed); None where that cannot be told (the root cannot be read)."""

    rank: int
    node: int
    tag: str
    step: int | None
    size_bytes: int
    created_at: str
    received_at: str
    persisted: bool | None

    def to_json(self) -> dict[str, Any]:
        return {
            "tag": self.tag,
            "step": self.step,
            "tier": REPLICA_TIER,
            "rank": self.rank,
            "node": self.node,
            "size_bytes": self.size_bytes,
            "created_at": self.created_at,
            "received_at": self.received_at,
            "persisted": self.persisted,
        }


def _replica_infos(memory: Store, persistent: Store | None) -> tuple[ReplicaInfo, ...]:
    """The replicas `memory` holds (the newest whole one of each rank), each with whether
    `persistent` (None: a memory-only job's tier) makes it needless."""
    held = held_replicas(memory)
    if not held:
        return ()
    needed: list[Replica] | None
    try:
        needed = needed_replicas(held, persistent)
    except NebulaError:
        needed = None  # the root cannot be read: cannot be told
    return tuple(
        ReplicaInfo(
            rank=r.rank,
            node=r.node,
            tag=r.tag,
            step=step_of(r.tag),
            size_bytes=r.size_bytes,
            created_at=r.created_at,
            received_at=r.received_at,
            persisted=None if needed is None else r not in needed,
        )
        for r in held
    )


def list_replicas(persist_path: str | os.PathLike[str] | None = None) -> list[ReplicaInfo]:
    """The replicas of other nodes' parts this node keeps in the memory tier of
    `persist_path` (default: the live session's root), by rank: the newest whole one of
    each (`peer_replicas=1` at `nm.init`). Reads; writes nothing.

    Example:
        >>> import nebulaml as nm, tempfile
        >>> nm.ops.list_replicas(tempfile.mkdtemp())
        []
    """
    tiers = tiers_for(persist_path, "list_replicas")
    return list(_replica_infos(tiers.memory, tiers.persistent))


@dataclass(frozen=True, slots=True)
class MemoryTierInfo:
    """One memory tier folder of this user on this node.

    `state`: "ok", "stale" (its root is gone or was created again), "orphaned" (no record
    of its root), "unsafe" (not this user's alone), or "unknown" (its root cannot be
    read from here); `note` says why. `persisted`: whether the newest checkpoint is
    committed on the root (None where that cannot be told; False for a memory-only job).
    `replicas`: the replicas it keeps of other nodes' parts (`ReplicaInfo`), counted in
    `size_bytes`. `leftovers`: tags of a job that ended that never committed and never
    will (every writer ran on this host and is gone: a rank's part whose other ranks never
    saved theirs, a killed save), not among `tags` (there is nothing in them to flush);
    gc releases them with the tier, and a restart's `nm.init` removes them.
    """

    path: str
    root: str | None
    state: str
    note: str | None
    tags: tuple[str, ...]
    newest: str | None
    persisted: bool | None
    size_bytes: int
    writer_alive: bool
    replicas: tuple[ReplicaInfo, ...] = ()
    leftovers: tuple[str, ...] = ()

    @property
    def unpersisted_replicas(self) -> tuple[ReplicaInfo, ...]:
        """The replicas a restart of their job may still need (or that cannot be told)."""
        return tuple(r for r in self.replicas if r.persisted is not True)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "root": self.root,
            "state": self.state,
            "note": self.note,
            "tags": list(self.tags),
            "newest": self.newest,
            "persisted": self.persisted,
            "size_bytes": self.size_bytes,
            "writer_alive": self.writer_alive,
            "replicas": [replica.to_json() for replica in self.replicas],
            "leftovers": list(self.leftovers),
        }


def memory_tiers_folder() -> str:
    """The folder that holds this user's memory tiers on this node: `/dev/shm/nebula-<user>`,
    or `NEBULA_MEMORY_TIER_PATH` when it is set (it need not exist yet).

    Example:
        >>> import os, nebulaml as nm
        >>> nm.ops.memory_tiers_folder() == os.path.abspath(os.environ["NEBULA_MEMORY_TIER_PATH"])
        True
    """
    return memory_base()


def list_memory_tiers() -> list[MemoryTierInfo]:
    """Every memory tier of this user on this node (under `memory_tiers_folder()`), by path.

    Example:
        >>> import nebulaml as nm
        >>> nm.ops.list_memory_tiers()
        []
    """
    base = memory_base()
    if not check_private_dir(base):
        return []
    out = []
    with os.scandir(base) as entries:
        # A symbolic link where a tier folder goes is listed too: as unsafe, never followed.
        folders = sorted(
            e.path for e in entries if e.is_dir(follow_symlinks=False) or e.is_symlink()
        )
    for path in folders:
        info = describe_memory_tier(path)
        if os.path.lexists(path):  # not released meanwhile (a job's clean exit, a gc)
            out.append(info)
    return out


def describe_memory_tier(path: str) -> MemoryTierInfo:
    """What the memory tier folder `path` holds, and whether its root still has it."""
    memory = Store(path, durable=False, private=True)
    try:
        check_private_dir(path)
    except UnsafeMemoryTierError as exc:
        return MemoryTierInfo(path, None, UNSAFE, str(exc), (), None, None, 0, False)
    alive = in_use(memory)
    tags, size = tier_contents(memory)
    leftovers = () if alive else tuple(dead_leftovers(memory))  # never to commit
    tags = [tag for tag in tags if tag not in leftovers]
    newer: list[UnsupportedSchemaError] = []
    try:
        committed = list_committed(memory, newer)
    except NebulaError:
        committed = []
    if newer:  # a newer nebula's checkpoint: judged by its tag alone, as one never read
        committed = []
    if committed:
        newest_info = committed[-1]
        newest: str | None = newest_info.tag
    else:
        newest_info = None
        newest = max(tags, key=lambda t: order_key(t, ""), default=None)
    record = read_record(memory)
    if record is None:
        note = "no record of its root (an older nebula's, or a job that died at its start)"
        replicas = tuple(replace(r, persisted=None) for r in _replica_infos(memory, None))
        return MemoryTierInfo(
            path, None, ORPHANED, note, tuple(tags), newest, None, size, alive, replicas,
            leftovers,
        )  # fmt: skip
    if record.persistent is None:  # a memory-only job: nothing was ever persisted
        return MemoryTierInfo(
            path, None, OK, "a job without a persistent root", tuple(tags), newest,
            False if tags else None, size, alive, _replica_infos(memory, None), leftovers,
        )  # fmt: skip
    state, why, persisted = _judge_root(memory, record.persistent, record.location, newest_info)
    if newest is not None and newest_info is None and state == OK:
        persisted = _part_persisted(record.persistent, str(newest))
    root = _root_store(record.persistent) if state == OK else None
    replicas = _replica_infos(memory, root)
    if root is None:  # the root cannot be asked (or is not this tier's any more)
        replicas = tuple(replace(r, persisted=None) for r in replicas)
    return MemoryTierInfo(
        path, record.persistent, state, why, tuple(tags), newest,
        persisted if tags else None, size, alive, replicas, leftovers,
    )  # fmt: skip


def _root_store(url: str) -> Store | None:
    try:
        return Store(url)
    except NebulaError:
        return None


def _judge_root(
    memory: Store, url: str, location: str | None, newest: Any
) -> tuple[str, str | None, bool | None]:
    try:
        persistent = Store(url)
        if location is not None and persistent.location != location:
            return UNKNOWN, f"{url} is reached as another root with these credentials", None
        state, note = judge_memory_tier(memory, persistent)
        if state != OK or newest is None:
            return state, note, None
        durable = read_committed(persistent, newest.tag)
        persisted = durable is not None and durable.manifest.items == newest.manifest.items
        if not persisted:
            # An older copy in memory than the root's newest is persisted in effect.
            on_root = list_committed(persistent)
            persisted = bool(on_root) and on_root[-1].sort_key > newest.sort_key
        return OK, None, persisted
    except NebulaError as exc:
        return UNKNOWN, f"cannot read {url}: {exc}", None


def _part_persisted(url: str, tag: str) -> bool | None:
    """Whether the root holds `tag` committed (a node that holds only its ranks' parts)."""
    try:
        return read_committed(Store(url), tag) is not None
    except NebulaError:
        return None


@dataclass(frozen=True, slots=True)
class GcAction:
    """What `nebula gc` does with one memory tier: release it or keep it, and why."""

    tier: MemoryTierInfo
    release: bool
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {**self.tier.to_json(), "release": self.release, "reason": self.reason}


def plan_gc(
    tiers: Iterable[MemoryTierInfo], *, discard_unpersisted: bool = False
) -> list[GcAction]:
    """Decide, for each memory tier, whether `nebula gc` releases it.

    Released: stale tiers and empty ones, and tiers of finished jobs (no live writer)
    whose newest checkpoint is persisted. Never: a tier a live job holds, or one that is
    not this user's alone. An unpersisted checkpoint of a finished job (or one whose root
    cannot be read from here) only with `discard_unpersisted`; so too a replica of another
    node's part whose checkpoint the root lacks (`MemoryTierInfo.unpersisted_replicas`: a
    restart of its job may restore a lost node from it).

    Example:
        >>> plan_gc([])
        []
    """
    actions = []
    for tier in tiers:
        if tier.writer_alive:
            actions.append(GcAction(tier, False, "a live job holds it"))
        elif tier.state == UNSAFE:
            actions.append(GcAction(tier, False, f"not released: {tier.note}"))
        elif tier.state == STALE:
            actions.append(GcAction(tier, True, f"stale: {tier.note}"))
        elif not tier.tags and not tier.unpersisted_replicas:
            why = "holds no checkpoint"
            if tier.leftovers:
                why += f" ({', '.join(tier.leftovers)}: never committed, its writers gone)"
            actions.append(GcAction(tier, True, why))
        elif tier.persisted and tier.state == OK and not tier.unpersisted_replicas:
            actions.append(GcAction(tier, True, f"{tier.newest} is persisted; its job ended"))
        elif discard_unpersisted:
            why = _unpersisted(tier)
            actions.append(GcAction(tier, True, f"{why}; discarded (--discard-unpersisted)"))
        else:
            own = bool(tier.tags) and not (tier.persisted and tier.state == OK)
            if own and tier.root:
                how = f"run `nebula flush {tier.root}` first"
            elif own:  # nothing to flush to: the folder reads as a root of its own
                how = f"copy it first (`nebula copy {tier.path} {tier.newest} DEST`)"
            else:
                how = "keep it until the root holds their checkpoint"
            why = _unpersisted(tier)
            actions.append(GcAction(tier, False, f"{why}: {how}, or --discard-unpersisted"))
    return actions


def _unpersisted(tier: MemoryTierInfo) -> str:
    """What a tier holds that its root lacks: its newest checkpoint, replicas."""
    whys = []
    if tier.tags and not (tier.persisted and tier.state == OK):
        whys.append(tier.note or f"{tier.newest} is not persisted")
    if tier.unpersisted_replicas:
        parts = ", ".join(f"rank {r.rank}'s part of {r.tag}" for r in tier.unpersisted_replicas)
        whys.append(f"it holds the replica of {parts}, not persisted")
    return "; ".join(whys)


@dataclass(frozen=True, slots=True)
class GcResult:
    """One released (or, by then, kept) tier: its path, tags and bytes; `reason` says why
    a tier marked for release was kept."""

    path: str
    released: bool
    tags: tuple[str, ...]
    size_bytes: int
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "released": self.released,
            "tags": list(self.tags),
            "size_bytes": self.size_bytes,
            "reason": self.reason,
        }


def execute_gc(actions: Iterable[GcAction]) -> list[GcResult]:
    """Release the tiers `plan_gc` marked. A tier that changed since the plan (a job took
    hold of it, or wrote or removed checkpoints: the plan may be minutes old after a
    prompt) is kept, and so is one that cannot be released; `GcResult.reason` says why."""
    results = []
    for action in actions:
        if not action.release:
            continue
        path = action.tier.path
        if not os.path.lexists(path):
            results.append(GcResult(path, False, (), 0, "gone already"))
            continue
        why = _changed(action.tier, describe_memory_tier(path))
        if why is not None:
            results.append(GcResult(path, False, (), 0, f"{why} since the plan; not released"))
            continue
        memory = Store(path, durable=False, private=True)
        try:
            done = release_memory_tier(memory)
        except (NebulaError, OSError) as exc:
            results.append(GcResult(path, False, (), 0, f"cannot release it: {exc}"))
            continue
        gone = not os.path.lexists(path)
        reason = None
        if done.kept:
            reason = f"being read by another process: {', '.join(done.kept)} (the rest released)"
        elif not gone:
            reason = "a live job took hold of it; not released"
        results.append(GcResult(path, gone, tuple(done.tags), done.size, reason))
    return results


def _changed(planned: MemoryTierInfo, now: MemoryTierInfo) -> str | None:
    """How a tier changed between the plan and now, or None."""
    if now.writer_alive:
        return "a live job took hold of it"
    if (now.tags, now.newest) != (planned.tags, planned.newest):
        return "its checkpoints changed"
    if now.unpersisted_replicas != planned.unpersisted_replicas:
        return "its replicas changed"
    if (now.state, now.persisted) != (planned.state, planned.persisted):
        return f"its state changed ({now.state}, persisted: {now.persisted})"
    return None
