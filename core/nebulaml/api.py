"""The seed's module-level functions: init, list, latest, get, path, flush.

Each function that takes `persist_path` reads that root (and its memory tier on this node)
instead of the one given to `init()`, so a checkpoint can be found without initialising.
Finding the tiers, a tag or an item is runtime/locate.py's (`check_root` is re-exported
from there).

May import: every layer below the public API, and checkpoint.py. Not for: saving and
loading items (checkpoint.py), or operator commands (ops/).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from nebulaml.checkpoint import Checkpoint
from nebulaml.config import resolve_config
from nebulaml.errors import (
    CheckpointNotFoundError,
    ItemNotFoundError,
    ManifestError,
    NebulaError,
    PersistTimeoutError,
    StorageError,
)
from nebulaml.format.manifest import Manifest
from nebulaml.format.names import order_key, validate_name
from nebulaml.protocol.catalog import CheckpointInfo, read_committed
from nebulaml.protocol.leases import LISTINGS, HandleHolds, hold_tag
from nebulaml.protocol.markers import read_writers
from nebulaml.protocol.recovery import list_incomplete as catalog_list_incomplete
from nebulaml.protocol.tiers import TierSet
from nebulaml.runtime import exit as _exit
from nebulaml.runtime import session as _session
from nebulaml.runtime.locate import asking, find_copy, newest_first, out_of_reach, tiers_for
from nebulaml.runtime.locate import check_root as check_root  # public: nm.check_root
from nebulaml.storage.store import Store

PathLike = str | os.PathLike[str]

log = logging.getLogger("nebulaml")


def init(
    persistent_storage_path: PathLike | None = None,
    persistent_time_interval: float | None = None,
    num_of_version_in_retention: int | None = None,
    **kwargs: Any,
) -> None:
    """Start nebula for this process (idempotent; call it on every rank).

    `persistent_storage_path` is a path or fsspec URL (default:
    `NEBULA_PERSISTENT_STORAGE_PATH`; none at all means the memory tier alone).
    `persistent_time_interval` is the least number of seconds between two persists
    (default `NEBULA_PERSISTENT_TIME_INTERVAL`, else 100). `num_of_version_in_retention`
    is how many checkpoints the persistent tier keeps (default
    `NEBULA_NUM_OF_VERSION_IN_RETENTION`, else 2). Options: `storage_options` (a dict
    for fsspec), `exit_timeout_s` (how long exit waits for a pending persist,
    default `NEBULA_EXIT_TIMEOUT_S`, else 600), `lazy_snapshot` (default
    `NEBULA_LAZY_SNAPSHOT`, else "auto": below), `on_persist_error` (default
    `NEBULA_ON_PERSIST_ERROR`, else "retry") and `private` (default `NEBULA_PRIVATE`,
    else False: a local persistent root is then this user's alone, its folder made 0700
    and what nebula writes there 0600 and 0700; otherwise they follow the umask, as the
    memory tier never does) and `reuse_unchanged` (default `NEBULA_REUSE_UNCHANGED`, else
    True: a save does not copy again a tensor it knows unchanged since the buffer last
    received it, a frozen base model say; docs/architecture.md says how "unchanged" is
    known). Whatever it says, a persist to a local root writes only the bytes that
    differ from the item's previous version there, compared by digest.
    `spare_buffers` (default `NEBULA_SPARE_BUFFERS`, else True): the memory tier keeps
    the buffers the next save fills, made in the background (one beside the newest
    checkpoint, two while a persist of the one before is in flight); False keeps none
    between saves (less RAM, slower saves; the newest copy is never overwritten either way).

    `peer_replicas` (default `NEBULA_PEER_REPLICAS`, else 0): with 1, each node's committed
    memory-tier parts are replicated to the next node of the job (a ring of torchrun's
    nodes: `GROUP_RANK`, else `RANK // LOCAL_WORLD_SIZE`), so that a lost node's newest
    checkpoint is still on a live node. nebula opens its own gloo process group for it,
    beside the program's (NCCL's, say): call `init` on every rank, after
    `torch.distributed.init_process_group` and at the same point of the program (opening
    the group is collective). A job on one node, or without an initialised process group,
    gets one warning and runs without replicas. The parts are sent on background threads
    after each commit: no `save` or `commit` waits on the partner, and a partner that is
    slow or gone never stops training (`persistence_status()` says how replication
    stands). Memory: each node's memory tier also holds one replica of its partner
    node's newest part (two while a newer one arrives, until it is whole), counted in the
    node's memory budget (`NEBULA_MEMORY_BUFFER_SIZE`). The release of the memory tier at
    a clean exit keeps the replicas while the persistent tier lacks their checkpoint.
    Anything but 0 or 1 is refused (`InvalidArgumentError`).

    The persistent tier never stops training (`on_persist_error="retry"`, the default): a
    persist that fails (the store down, the disk full) leaves the checkpoint in the memory
    tier, and it is tried again until it is durable, with one warning per outage;
    `persistence_status()` and `flush_persistence()` tell what is durable, and exit says
    what is not. A store that does not answer at `init` is connected in the background
    (the job checkpoints to the memory tier only until then). With
    `on_persist_error="raise"` a failed persist is raised by the next call into nebula.

    A lazy save (`lazy_snapshot=True`: every save) returns at once, and the snapshot is
    copied in the background while the next forward and backward run; the next
    `optimizer.step()` (of any torch optimizer), `wait_for_snapshot()` and every other
    call into nebula wait for it first. Tensors whose storage is at most 64 KiB
    (BatchNorm's running statistics, step counters) are copied by `save` itself; a
    larger saved tensor changed in place before the copy (by anything but the
    optimizer's step, which waits) fails that checkpoint with `SnapshotChangedError`,
    raised by the next call into nebula. The checkpoint is committed once its copy is
    taken: a process killed before loses it (the one before stays the newest).

    The default, "auto", saves lazily where every write before the copy is seen: a job
    of one process without peer replicas, where the kernel records written pages (Linux
    6.7), after a torch optimizer step, for host tensors of this process (not pinned,
    shared or on a device), with room in the memory tier; any other save copies (and
    commits) before it returns, as `lazy_snapshot=False` does for every save. A write
    that a lazy save catches costs that checkpoint, is said in one warning (not raised),
    and the session's later saves copy before they return.

    Example:
        >>> import nebulaml as nm, tempfile
        >>> nm.init(tempfile.mkdtemp(), persistent_time_interval=2)
    """
    config = resolve_config(
        persistent_storage_path, persistent_time_interval, num_of_version_in_retention, kwargs
    )
    # A new session arms the exit path: SIGTERM becomes an exit that persists (exit.py).
    _session.start(config, on_start=_exit.install_sigterm_handler)


def wait_for_snapshot() -> None:
    """Wait until every lazy save's snapshot is taken and committed in the memory tier
    (the fence), then raise a background failure if there was one. A no-op without
    `lazy_snapshot`. `optimizer.step()` waits for the copies by itself.

    Example:
        >>> import nebulaml as nm, tempfile, torch
        >>> nm.init(tempfile.mkdtemp(), lazy_snapshot=True)
        >>> w = torch.zeros(3)
        >>> nm.Checkpoint("global_step1").save("model", {"w": w})
        >>> nm.wait_for_snapshot()
        >>> w.add_(1)   # safe now: the snapshot holds the zeros
        tensor([1., 1., 1.])
        >>> nm.get_latest_checkpoint().load("model")["w"]
        tensor([0., 0., 0.])
    """
    session = _session.current_or_none()
    if session is not None:
        session.wait_for_snapshots()


def list_checkpoints(
    persist_path: PathLike | None = None, *, hold: bool = False, limit: int | None = None
) -> list[dict[str, Any]]:
    """Committed checkpoints on every tier, newest first, as JSON-serialisable dicts;
    with `limit`, the `limit` newest only, found from each tier's commit index without
    reading every manifest (protocol/commit_index.py: `nebula ls --limit`).

    Each dict has `tag`, `step`, `tiers` (e.g. `["memory", "persistent"]`), `size_bytes`,
    `committed_at` (ISO-8601 UTC), `items` (names) and `labels`.

    A listing writes nothing, and reads one manifest per tag: retention and prune may
    delete a listed checkpoint before the caller opens it (`get_checkpoint` then returns
    None). What the caller opens is held: `get_checkpoint` and `get_latest_checkpoint`
    return a handle that keeps its checkpoint until released. `hold=True` also holds each
    checkpoint listed for 10 s (leases.py: one small file per tag, the first time this
    process lists it), against a retention or prune between the listing and the open.

    Example:
        >>> import nebulaml as nm, tempfile
        >>> nm.list_checkpoints(tempfile.mkdtemp())
        []
    """
    out = []
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    for copies in newest_first(tiers_for(persist_path, "list_checkpoints"), limit):
        manifest = copies[0][1].manifest
        if hold and not LISTINGS.hold(manifest.tag, _durable_copy(copies)):
            continue  # deleted since it was listed
        out.append(
            {
                "tag": manifest.tag,
                "step": manifest.step,
                "tiers": [tier for tier, _ in copies],
                "size_bytes": manifest.total_bytes,
                "committed_at": manifest.committed_at,
                "items": [item.name for item in manifest.items],
                "labels": list(manifest.labels),
            }
        )
    return out


def _durable_copy(copies: list[tuple[str, CheckpointInfo]]) -> list[Store]:
    """The store of the persistent copy, if there is one, else of every copy: a listing
    holds what a load could still fall back to, and leaves the memory tier's eviction
    free to reuse its buffers."""
    persistent = [info.store for tier, info in copies if tier == "persistent"]
    return persistent or [info.store for _tier, info in copies]


def list_incomplete(persist_path: PathLike | None = None) -> list[dict[str, Any]]:
    """Tags that were started but never committed (leftovers of crashed saves or persists,
    or saves in progress), on every tier, as JSON-serialisable dicts.

    Each dict has `tag`, `tier`, `files` (names), `size_bytes` and `writers`: who wrote
    the folder (`host`, `pid`, `rank`, `started_at`), as their markers say.

    Example:
        >>> import nebulaml as nm, tempfile
        >>> nm.list_incomplete(tempfile.mkdtemp())
        []
    """
    out = []
    for tier, store in tiers_for(persist_path, "list_incomplete").stores:
        for tag in catalog_list_incomplete(store):
            files = store.list_files(tag)
            out.append(
                {
                    "tag": tag,
                    "tier": tier,
                    "files": sorted(n for n in files if not n.startswith(".")),
                    "size_bytes": sum(files.values()),
                    "writers": read_writers(store, tag),
                }
            )
    return out


def get_latest_checkpoint(persist_path: PathLike | None = None) -> Checkpoint | None:
    """The newest committed checkpoint on any tier, or None.

    "Newest" is the one order of checkpoints everywhere (format/names.py `order_key`):
    the step the tag names (the number after `global_step`, or Lightning's `step=`; a tag
    without one is older than any with one), then the checkpoint's commit sequence on its
    root (clock-free: a clock stepped back or ahead reorders nothing), then its commit time
    (a tie-break only), then the tag; of a tag's copies, the fastest tier's decides.

    The handle holds the checkpoint (leases.py): retention, prune and eviction keep it
    until it is released (`Checkpoint.release()`, or `with` the handle) or its hold
    expires, 60 s after its last load.

    Example:
        >>> import nebulaml as nm, tempfile
        >>> nm.get_latest_checkpoint(tempfile.mkdtemp()) is None
        True
    """
    tiers = tiers_for(persist_path, "get_latest_checkpoint")
    tag = None
    deadline = time.monotonic() + _HOLD_WAIT_S
    while True:
        ordered = newest_first(tiers, limit=1)
        if not ordered:
            return None
        tag = ordered[0][0][1].tag
        holds = _hold(tiers, tag, [(tier, info.store) for tier, info in ordered[0]])
        if holds is not None:
            return Checkpoint._committed_handle(tag, tiers, holds)
        # Deleted between the listing and the hold (newer ones were committed): again,
        # for as long as a job saving faster than this listing lets us.
        if time.monotonic() >= deadline:
            log.warning("%s: the newest checkpoint changed faster than it could be held; "
                        "returning %r unheld", tiers.display, tag)  # fmt: skip
            return Checkpoint._committed_handle(tag, tiers)


_HOLD_WAIT_S = 30.0  # how long to keep listing while each newest found is deleted before held


def _hold(tiers: TierSet, tag: str, copies: list[tuple[str, Store]]) -> HandleHolds | None:
    """Hold `tag` on each of `copies` (tier, store) that still has it (leases.py); None if
    none does. A tier out of reach is passed over (locate.py): the others hold it."""
    holds = HandleHolds(tag)
    there = False
    for tier, store in copies:
        try:
            with asking(tiers, store):
                found, name = hold_tag(store, tag)
        except StorageError as exc:
            if not out_of_reach(tier, store, exc):
                raise
            continue
        there = there or found
        holds.add(store, name)
    if not there:
        holds.release()
        return None
    return holds


def get_checkpoint(tag: str, persist_path: PathLike | None = None) -> Checkpoint | None:
    """The committed checkpoint `tag` on any tier, or None. The handle holds it, as
    `get_latest_checkpoint`'s does.

    Example:
        >>> import nebulaml as nm, tempfile
        >>> nm.get_checkpoint("global_step5", tempfile.mkdtemp()) is None
        True
    """
    validate_name("tag", tag)
    tiers = tiers_for(persist_path, "get_checkpoint")
    try:
        # A tier's copy of a schema this version cannot read is raised only if no tier
        # has a readable copy.
        find_copy(tiers, tag, lambda _copy: None, manifest=_committed_manifest,
                  report=(ManifestError,))  # fmt: skip
    except CheckpointNotFoundError:
        return None
    # Held, as get_latest_checkpoint's handle is; gone meanwhile: there is none.
    holds = _hold(tiers, tag, tiers.stores)
    if holds is None:
        return None
    for _tier, store in tiers.stores:
        LISTINGS.release_tag(store, tag)  # opened: the handle holds it now
    return Checkpoint._committed_handle(tag, tiers, holds)


def _committed_manifest(store: Store, tag: str) -> Manifest | None:
    """The manifest of `tag` on `store` if the tag is committed there (every file listed
    is there with its size), else None."""
    info = read_committed(store, tag)
    return None if info is None else info.manifest


def get_latest_checkpoint_path(name: str, persist_path: PathLike | None = None) -> str | None:
    """The path of item `name` in the newest committed checkpoint, or None if there is none.

    The file is what plain `torch.load(path, weights_only=True)` reads. The persistent
    tier's copy is preferred (it outlives the node); else the memory tier's. The
    checkpoint is held for 10 s (leases.py), so that the file is there when the caller
    opens the path although retention or a prune ran between.

    Example:
        >>> import nebulaml as nm, tempfile
        >>> nm.get_latest_checkpoint_path("model", tempfile.mkdtemp()) is None
        True
    """
    validate_name("item", name)
    tiers = tiers_for(persist_path, "get_latest_checkpoint_path")
    ordered = newest_first(tiers, limit=1)
    if not ordered:
        return None
    copies = sorted(ordered[0], key=lambda copy: copy[0] != "persistent")
    info = copies[0][1]
    LISTINGS.hold(info.tag, [info.store])  # there when the caller opens the path
    entry = info.manifest.item(name)
    if entry is None:
        raise ItemNotFoundError(info.tag, name, [item.name for item in info.manifest.items])
    store = info.store
    return store.local_path(info.tag, entry.file) or store.display(info.tag, entry.file)


def memory_tier_path(persist_path: PathLike | None = None) -> str:
    """The folder of this node's memory tier for a persistent root (default: `init`'s).

    Checkpoints there are in RAM (`/dev/shm`) and survive a crash of the process, not of
    the node; `NEBULA_MEMORY_TIER_PATH` moves the base folder.

    Example:
        >>> import nebulaml as nm, tempfile
        >>> nm.memory_tier_path(tempfile.gettempdir() + "/run1").rsplit("/", 1)[-1][:5]
        'run1-'
    """
    return tiers_for(persist_path, "memory_tier_path").memory.display()


def flush_persistence(
    tag: str | None = None, timeout_s: float | None = None, *, raise_on_error: bool = True
) -> bool:
    """Persist `tag` (default: the newest unpersisted checkpoint) now, and wait.

    Returns True once it is committed on the persistent tier (or when there was nothing
    to persist): never while the newest acknowledged checkpoint is only in memory. While
    the persistent tier fails, the persist is tried again until `timeout_s` (default: the
    session's `exit_timeout_s` into the outage); then the last failure is raised, or False
    is returned with `raise_on_error=False`. Also raises `PersistTimeoutError` after
    `timeout_s`.

    Example:
        >>> import nebulaml as nm, tempfile
        >>> nm.init(tempfile.mkdtemp())
        >>> nm.flush_persistence()
        True
    """
    if tag is not None:
        validate_name("tag", tag)
    session = _session.current("flush_persistence")
    persistent = session.tiers.persistent
    try:
        session.recover_if_due()  # what an earlier process left is flushed too
        if tag is not None and persistent is not None:
            durable = read_committed(persistent, tag) if session.persister.holds(tag) else None
            in_memory = read_committed(session.tiers.memory, tag)
            # Already durable, unless the memory tier holds a different (re-saved) version.
            if durable and (
                in_memory is None or in_memory.manifest.items == durable.manifest.items
            ):
                session.persister.raise_pending_error()
                return True
        session.persister.flush(tag, timeout_s)
    except NebulaError as exc:
        if raise_on_error:
            raise
        log.warning("flush_persistence: %s", exc)
        return False
    return True


@dataclass(frozen=True, slots=True)
class PersistenceStatus:
    """What this process's checkpoints have reached (`persistence_status()`).

    `durable`: the newest checkpoint this process made durable (None: none yet);
    `pending`: acknowledged checkpoints not durable yet (newest last), in the memory tier;
    `last_error`: why the persistent tier fails, while it does (else None);
    `failing_since`: since when (UTC, ISO 8601), while it does.

    With `peer_replicas=1` (`nm.init`): `replicated`: the newest tag whose part of this
    rank the partner node holds, verified against its checksums and committed whole there
    (None until the partner has confirmed one, and always without replication);
    `replication`: None without replication (`peer_replicas=0`, a job on one node, no
    process group), "ok" while it works (before the first part is answered too), "failing"
    when the link to the partner is down (its process ended or stopped answering: nothing
    more is sent this run) or the partner refused the newest part it was sent (it stays
    "failing" until a newer part is replicated); `replication_error`: why, while failing.
    Replication failing stops nothing: saves and persists go on (`ok` is about the
    persistent tier alone).
    """

    durable: str | None
    pending: tuple[str, ...]
    last_error: str | None
    failing_since: str | None
    replicated: str | None = None
    replication: str | None = None
    replication_error: str | None = None

    @property
    def ok(self) -> bool:
        """Nothing waiting and nothing failing."""
        return not self.pending and self.last_error is None


def persistence_status() -> PersistenceStatus:
    """Where this process's checkpoints stand: the newest durable one, those waiting in
    the memory tier, and whether (and since when) the persistent tier fails; with
    `peer_replicas=1`, the newest replicated on the partner node and whether replication
    fails (`PersistenceStatus`). Asks no store: it reports what the background persister
    and replication know.

    Example:
        >>> import nebulaml as nm, tempfile, torch
        >>> nm.init(tempfile.mkdtemp(), persistent_time_interval=0)
        >>> nm.Checkpoint("global_step1").save("w", torch.ones(2))
        >>> nm.flush_persistence()
        True
        >>> status = nm.persistence_status()
        >>> status.durable, status.pending, status.ok
        ('global_step1', (), True)
    """
    session = _session.current("persistence_status", raise_pending=False)
    state = session.persister.status()
    replication = session.replication_status()
    failing, why = False, None
    if replication is not None:
        refused, replicated = replication.refused, replication.replicated
        failing = replication.link_down or (
            refused is not None
            and refused != replicated
            and (replicated is None or order_key(refused) > order_key(replicated))
        )
        why = replication.last_error if failing else None
    return PersistenceStatus(
        durable=state["durable"],  # type: ignore[arg-type]
        pending=tuple(state["pending"]),  # type: ignore[arg-type]
        last_error=state["last_error"],  # type: ignore[arg-type]
        failing_since=state["failing_since"],  # type: ignore[arg-type]
        replicated=None if replication is None else replication.replicated,
        replication=None if replication is None else ("failing" if failing else "ok"),
        replication_error=why,
    )


def shutdown(timeout_s: float | None = None) -> None:
    """Persist what is pending and stop nebula in this process (exit does this too).

    Raises `PersistTimeoutError` if a checkpoint could not be persisted within
    `timeout_s`, and the error of a failed persist.
    """
    left = _session.stop(timeout_s)
    if left is not None:
        raise PersistTimeoutError(
            f"checkpoint {left!r} was not persisted within {timeout_s} s; it is still in "
            f"the memory tier"
        )
