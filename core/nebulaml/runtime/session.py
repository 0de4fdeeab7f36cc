"""Process-wide state: the session `init()` starts, with its tiers, budget and persister.

`init()` may be called on every rank and several times; the same configuration is a
no-op. After a crash, the next `init()` for the same root persists what the memory tier
still holds that is newer than the persistent tier, and removes what dead writers left
half-written in the memory tier, and this rank's parts that an earlier generation of the
job (before a restart) left uncommitted. Who this process is in the job (rank, world
size) and its generation are read again at the first save (`bind_ranks`,
`save_generation`): a program may set nebula up before torch.distributed; where they
cannot be told at `init()`, the recovery waits for that first save. `close()` persists
what is pending and releases the memory tier once everything in it is persisted.

**Peer replicas** (`peer_replicas=1`, #44). The session opens nebula's own gloo group
and this rank's place in the ring (peers.open_ring: collective, so every rank's `init()`
calls it at the same point, after torch.distributed's `init_process_group`; one node, or
no process group, gets one warning and nothing else), then runs the restart's recovery
from the partners' replicas (`_recover_from_peers`, the hook), then starts this rank's
replication (replication.py: a sender and receivers on threads of their own). Each commit
hands its tag to the sender after the persister (save.py: `replicate`, which returns at
once). `close()` ends replication first (bounded: `REPLICATION_CLOSE_S`, within the
close's deadline; the partner's ranks close at about the same time) and destroys the
group. The release at a clean exit keeps the replicas this node holds for other nodes
while a restart may still need them (protocol/replicas_held.py: the persistent tier holds
neither their checkpoint nor a later step); the rest of the tier goes as ever.

May import: every layer below runtime, `nebulaml.config`, and the runtime modules the
session owns (budget, fence, job, peers, persister, ranks, replication, slots, snapshot,
write_watch).
Not for: the configuration (config.py), the exit path (exit.py), saving and loading
(save.py, load.py), or the public functions (api.py, checkpoint.py).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from nebulaml.config import LAZY_AUTO, Config, elastic_generation
from nebulaml.errors import (
    NebulaError,
    NotInitializedError,
    RootInUseError,
    UnsupportedSchemaError,
)
from nebulaml.format.manifest import RankMarker
from nebulaml.format.names import order_key
from nebulaml.protocol.catalog import CheckpointInfo, list_committed, read_committed, tag_folders
from nebulaml.protocol.commit import read_markers
from nebulaml.protocol.commit_index import newest as newest_committed
from nebulaml.protocol.commit_index import pinned
from nebulaml.protocol.delete import delete_checkpoint
from nebulaml.protocol.markers import own_parts
from nebulaml.protocol.rank_presence import RankPresence
from nebulaml.protocol.recovery import discard_stale_parts, remove_dead_writers, suspects
from nebulaml.protocol.removals import read_removals
from nebulaml.protocol.replicas import Replica
from nebulaml.protocol.replicas_held import held_replicas, needed_replicas
from nebulaml.protocol.sequence import SequenceReservation
from nebulaml.protocol.tier_lifetime import TierHold, release_memory_tier
from nebulaml.protocol.tiers import TierSet, claim_tiers, tighten_root
from nebulaml.runtime.budget import MemoryBudget
from nebulaml.runtime.closing import releasable
from nebulaml.runtime.connect import CONNECT_WAIT_S, adopt_root, identify, reach
from nebulaml.runtime.fence import SnapshotWorker
from nebulaml.runtime.job import JobHold, claim_job
from nebulaml.runtime.outage import may_pass
from nebulaml.runtime.persister import Persister
from nebulaml.runtime.ranks import (
    RankInfo,
    detect_ranks,
    generation_agreeable,
    job_generation,
    memory_budget_bytes,
    ranks_settled,
)
from nebulaml.runtime.slots import SlotPool
from nebulaml.runtime.snapshot import LayoutCache
from nebulaml.runtime.write_watch import unavailable as write_watch_unavailable
from nebulaml.storage.deadline import within
from nebulaml.storage.store import Store

if TYPE_CHECKING:  # imported when replication starts: it imports torch
    from nebulaml.runtime.peers import Peers
    from nebulaml.runtime.replication import Replication, ReplicationStatus

log = logging.getLogger("nebulaml")

# What a close gives the release of its hold on the root (one or two requests) when the
# persist before it took all of its time.
CLOSE_GRACE_S = 2.0
# What a close gives replication to end politely (the part in flight, the partner's BYE)
# before it cuts the connections (replication.py's `close`), at most.
REPLICATION_CLOSE_S = 5.0


class Session:
    """The tiers and persister of this process, for one configuration."""

    def __init__(self, config: Config) -> None:
        self.config = config
        # Who this process is, as far as can be told now; read again at the first save
        # (bind_ranks), once torch.distributed is up.
        self._ranks: RankInfo = detect_ranks()
        self._bound = False
        self.presence: RankPresence | None = None  # this rank, to the node's other ranks
        self._bind_lock = threading.RLock()
        # Which run and restart of the job: torchrun's is known now, another is agreed at
        # the first save (save_generation). Every part this process writes carries it.
        self.generation: str | None = elastic_generation()
        self._generation_known = self.generation is not None
        self._saves_of: dict[str, int] = {}  # how often this process began a save of a tag
        self.streamed: set[str] = set()  # why saves went around the memory tier, said once
        # The persistent root with its identity; this root's memory tier, checked private,
        # held while this session lives, and released first if an earlier root left it.
        self.tiers: TierSet
        self.hold: TierHold
        # The persistent tier, if it answers within CONNECT_WAIT_S; else the job starts
        # with the memory tier alone and the persister connects later (connect.py).
        path = config.persistent_storage_path
        persistent = None
        if path is not None:
            persistent = Store(path, dict(config.storage_options), private=config.private)
            if persistent.private:
                tighten_root(persistent)
        reached, root_id, why = True, None, None
        if persistent is not None:
            reached, root_id, why = reach(persistent, CONNECT_WAIT_S)
        self.tiers, self.hold = claim_tiers(persistent, root_id)
        # One job writes a root at a time (job.py): another live job's root is refused
        # before anything in it is touched; the ranks of this job share it.
        try:
            self.job: JobHold
            self.job, reached = self._claim_job(reached)
        except BaseException:
            self.hold.abandon()  # a refused init leaves no memory-tier folder behind
            raise
        # Leftovers of this node's crashed saves and persists; other nodes' are theirs.
        remove_dead_writers(self.tiers.memory)
        if reached and self.tiers.persistent is not None:
            self._remove_dead_persists()
        if not reached:
            log.warning(
                "the persistent tier %s does not answer (%s): checkpoints go to the memory "
                "tier only until it does; nebula connects in the background and persists "
                "them then", self.tiers.display, why or f"no answer within {CONNECT_WAIT_S:.0f} s",
            )  # fmt: skip
        share = memory_budget_bytes(self._ranks)
        # The budget is per process, the memory tier shared by the node's processes.
        limit = None if share is None else share * self._ranks.local_world_size
        self.pool = SlotPool(
            self.tiers.memory,
            limit_bytes=limit,
            reuse_unchanged=config.reuse_unchanged,
            spares=config.spare_buffers,
        )
        self.layouts = LayoutCache()  # each item name's last layout (snapshot.py)
        # This process's next commit sequence on the memory tier, recorded between saves.
        self.sequences = SequenceReservation(self.tiers.memory)
        self.persister = Persister(
            self.tiers,
            interval_s=config.persistent_time_interval_s,
            retention=config.num_of_version_in_retention,
            ranks=self._ranks,
            rank_timeout_s=config.rank_timeout_s,
            pool=self.pool,
            on_error=config.on_persist_error,
            give_up_s=config.exit_timeout_s,
            connect=None if reached else self._connect_later,
        )
        self.budget = MemoryBudget(
            limit, pool=self.pool, persister=self.persister, wait_s=config.exit_timeout_s
        )
        # Peer replicas (the module's docstring): the ring, the restart's recovery from
        # the partners, replication; before this rank's own recovery below, which then
        # persists what the partners gave back like anything an earlier process left.
        self.peers: Peers | None = None
        self.replication: Replication | None = None
        self.peer_recovered: str | None = None  # what the recovery restored from a partner
        if config.peer_replicas:
            self._start_peers()
        # What an earlier process left: recovered now if this process knows who it is in
        # the job (and, with several ranks, its generation), else at the first save.
        self.recovered: str | None = None
        self._recovery_due = True
        if reached and ranks_settled() and (self._ranks.world_size == 1 or self._generation_known):
            self._recover_once()
        # Lazy saves (fence.py): every one with lazy_snapshot=True; by default ("auto")
        # where the kernel records the writes to what a save has not copied yet, in a job of
        # one process (a job of several agrees on each commit at save(): ranks.py).
        self.snapshots: SnapshotWorker | None = None
        self.lazy_auto = config.lazy_snapshot == LAZY_AUTO
        self.lazy_refused: str | None = None  # why "auto" copies at save() from now on
        if self.lazy_auto and (not_lazy := self._why_not_lazy()) is not None:
            log.debug("saves copy at save(): %s", not_lazy)
        elif config.lazy_snapshot:
            self.snapshots = SnapshotWorker()
            self.snapshots.install_fence()

    def _why_not_lazy(self) -> str | None:
        """Why the default ("auto") takes every copy at save() in this session, or None."""
        if self._ranks.world_size > 1:
            return f"a job of {self._ranks.world_size} processes"
        if self.config.peer_replicas:
            return "peer replicas are sent at each commit"
        why = write_watch_unavailable()
        return None if why is None else f"no write watch ({why})"

    def _known_ranks(self) -> RankInfo | None:
        """This process's place in the job, if it can be told for certain (bind_ranks)."""
        ranks = self.bind_ranks()
        return ranks if self._bound else None

    def _claim_job(self, reached: bool) -> tuple[JobHold, bool]:
        """Hold the root for this job (job.py), and whether the persistent tier was
        reached: one that stops answering now is held later, as one that did not answer."""
        try:
            job = claim_job(self.tiers, self._ranks, on_lost=self._hold_lost, reached=reached)
            return job, reached
        except RootInUseError:
            raise
        except NebulaError as exc:
            if not may_pass(exc):
                raise
        job = claim_job(self.tiers, self._ranks, on_lost=self._hold_lost, reached=False)
        return job, False

    def _connect_later(self) -> list[CheckpointInfo]:
        """What init could not do with the persistent tier, done once it answers (on the
        persister's thread, before its first persist): the root's identity, the job's
        hold, the dead writers' leftovers; what the root holds committed."""
        persistent = self.tiers.persistent
        assert persistent is not None
        adopt_root(self.tiers.memory, persistent, identify(persistent))
        self.job.take_lease(self.tiers, self._ranks)
        self._remove_dead_persists()
        return list_committed(persistent)

    def _remove_dead_persists(self) -> None:
        """Remove what this node's dead writers left on the persistent tier: looked for
        only where it can be (recovery.suspects: the tags at the top of the root, and
        those the memory tier holds), not in every folder of the root."""
        persistent = self.tiers.persistent
        assert persistent is not None
        named = tag_folders(self.tiers.memory) if self.tiers.memory_usable else []
        remove_dead_writers(persistent, suspects(persistent, named))

    def _hold_lost(self, why: str) -> None:
        """Another job took the root over (this one was judged gone): said by the next call."""
        persister = getattr(self, "persister", None)
        if persister is not None:
            persister.fail(RootInUseError(self.tiers.display, why))

    # peer replicas ---------------------------------------------------------------------
    def _start_peers(self) -> None:
        """Open nebula's group and this rank's ring (collective: every rank, here), run the
        restart's recovery from the partners, start replication. One node, or no process
        group: peers.open_ring's one warning, and nothing else."""
        from nebulaml.runtime.peers import open_ring

        peers = open_ring()
        if peers is None:
            return
        self.peers = peers
        try:
            self.peer_recovered = self._recover_from_peers(peers)
            from nebulaml.runtime.replication import Replication

            self.replication = Replication(
                peers, self.tiers.memory, leaves=self.pool.leaves_of
            ).start()
        except BaseException:
            self._close_peers(0.0)
            raise

    def _recover_from_peers(self, peers: Peers) -> str | None:
        """The restart's recovery from the partners' replicas (runtime/peer_recovery.py),
        on every rank, at this one point of `init`: after nebula's group is open (`peers`)
        and before replication's threads start (none is on the group yet, and none has
        touched the replicas this node keeps), and before this session's own recovery of
        what an earlier process left (`_recover_once`). The ranks agree on the newest
        checkpoint complete from their parts, their partners' replicas and the persistent
        tier; a lost node's parts come back from its partner, checked, and the checkpoint
        is made durable. Returns its tag when this rank's memory tier received a part of
        it (the session keeps it as `peer_recovered`), else None. Raises what
        torch.distributed raises when a rank is gone (`init` then raises, nebula's group
        destroyed: the job restarts again)."""
        from nebulaml.runtime.peer_recovery import recover_from_peers

        result = recover_from_peers(peers, self.tiers, self.bind_ranks(), persister=self.persister)
        return result.tag if result.received else None

    def replicate(self, tag: str) -> None:
        """Hand this rank's committed part of `tag` to the replication's sender (save.py,
        after the hand-over to the persister); returns at once: the training thread never
        waits on the partner. A no-op without replication."""
        replication = self.replication
        if replication is not None:
            replication.replicate(tag)

    def replication_status(self) -> ReplicationStatus | None:
        """Where this rank's replication stands; None when it is off (`peer_replicas=0`,
        one node, no process group, or closed)."""
        replication = self.replication
        return None if replication is None else replication.status()

    def _close_peers(self, grace_s: float) -> None:
        """End replication (within about `grace_s`, twice that at worst: replication.py's
        `close`) and destroy nebula's group. A program that destroyed every group first
        (`destroy_process_group()`) is fine: the connections are cut all the same."""
        replication, self.replication = self.replication, None
        peers, self.peers = self.peers, None
        if replication is not None:
            try:
                replication.close(grace_s)
            except Exception as exc:  # noqa: BLE001 - the close goes on: the persist matters more
                log.warning("replication did not close cleanly: %s", exc)
        if peers is not None:
            dist = sys.modules.get("torch.distributed")
            if dist is not None:
                with contextlib.suppress(Exception):  # destroyed with the program's already
                    dist.destroy_process_group(peers.group)

    def wait_for_snapshots(self) -> None:
        """The fence: every lazy save's snapshot and commit done; raises their failure."""
        if self.snapshots is not None:
            self.snapshots.wait()

    # who this process is in the job ------------------------------------------------------
    @property
    def ranks(self) -> RankInfo:
        """This process's place in the job (read at the first save: `bind_ranks`)."""
        return self.bind_ranks()

    @property
    def rank(self) -> int:
        return self.bind_ranks().rank

    @property
    def world_size(self) -> int:
        return self.bind_ranks().world_size

    def bind_ranks(self) -> RankInfo:
        """Read this process's rank and world size again, once they can be told for
        certain (ranks.ranks_settled: torch.distributed is up, or the launcher said), and
        keep them from then on; the persister follows. Before, the reading of `init()`."""
        if self._bound:
            return self._ranks
        with self._bind_lock:
            if not self._bound and ranks_settled():
                ranks = detect_ranks()
                if ranks != self._ranks:
                    log.info(
                        "this process is rank %d of %d (nebula was set up as rank %d of %d)",
                        ranks.rank,
                        ranks.world_size,
                        self._ranks.rank,
                        self._ranks.world_size,
                    )
                    self._ranks = ranks
                    self.persister.set_ranks(ranks)
                if ranks.world_size > 1 and self.tiers.memory_usable:
                    # The other ranks of this node tell this one gone once it ends.
                    self.presence = RankPresence.take(self.tiers.memory, ranks.rank)
                self._bound = True
        return self._ranks

    def save_generation(self) -> str | None:
        """The generation this process's parts carry (ranks.job_generation), agreed with
        the other ranks at the first save; then what an earlier process left is recovered,
        if `init()` could not yet."""
        ranks = self.bind_ranks()
        if not self._generation_known or self._recovery_due:
            with self._bind_lock:
                if not self._generation_known:
                    self.generation = job_generation(ranks)
                    self._generation_known = True
                if self._recovery_due and self.persister.connected:
                    self._recover_once()
        return self.generation

    def recover_if_due(self) -> None:
        """Run the recovery `init()` left for the first save (several ranks: it waits for
        their generation) now, if this process can tell who it is and agree on its
        generation: `flush_persistence()` then covers what an earlier process left. A
        job of several ranks that resumed from a crash and flushed before its first save
        was told its newest checkpoint was durable while it was in the memory tier alone."""
        if not self._recovery_due or not ranks_settled():
            return
        if generation_agreeable(self.bind_ranks()):
            self.save_generation()

    def part_generation(self, tag: str) -> str | None:
        """The generation of this process's part of a save of `tag` beginning now: the
        job's (`save_generation`), and from the second save of one tag by this process on
        (`overwrite=True`) that with "/<n>". Every rank of a job saves a tag as often as
        the others, so a part of the second save is never committed with a slower rank's
        part of the first (its marker, still there, carries the plain generation).

        Example:
            >>> import nebulaml as nm, tempfile
            >>> nm.init(tempfile.mkdtemp())
            >>> from nebulaml.runtime import session
            >>> live = session.current("example")
            >>> first, again = live.part_generation("t"), live.part_generation("t")
            >>> again == f"{first}/2"
            True
        """
        generation = self.save_generation()
        with self._bind_lock:
            n = self._saves_of[tag] = self._saves_of.get(tag, 0) + 1
        return generation if n == 1 else f"{generation or ''}/{n}"

    def _recover_once(self) -> None:
        """Discard this rank's parts of earlier generations, then queue what the memory
        tier holds that the persistent tier lacks (`_recover`)."""
        self._recovery_due = False
        ranks = self._ranks
        if ranks.world_size > 1 and self._generation_known and self.generation is not None:
            stale = discard_stale_parts(
                self.tiers.memory, ranks.rank, self.generation, keep=self._completes
            )
            if stale:
                log.info(
                    "discarded rank %d's uncommitted part(s) of %s: written before a restart "
                    "of the job, never committed with parts written after it",
                    ranks.rank,
                    ", ".join(stale),
                )
        self.recovered = self._recover()
        if self.tiers.persistent is not None and self.tiers.memory_usable:
            # What the framework removed and an earlier process of this rank had not yet
            # deleted from every tier (killed first): deleted now, on the thread.
            for tag in read_removals(self.tiers.memory, ranks.rank):
                log.info("deleting %r, which the framework removed before a restart", tag)
                self.persister.forget(tag)

    def _completes(self, tag: str, marker: RankMarker) -> bool:
        """Whether this rank's part `marker` of `tag`, of an earlier generation, is all the
        persistent tier lacks to commit that checkpoint (every other rank that writes it
        persisted its part, of that generation): it is kept and persisted, not discarded."""
        persistent = self.tiers.persistent
        if persistent is None:
            return False
        try:
            if read_committed(persistent, tag) is not None:
                return False
            others = [r for r in marker.writers if r != marker.rank]
            return read_markers(persistent, tag, others, marker.generation) is not None
        except NebulaError:
            return False

    def _recover(self) -> str | None:
        """Queue the memory tier's newest checkpoint (this rank's part of it) if the
        persistent tier lacks it."""
        if self.tiers.persistent is None:
            return None
        ranks = self._ranks
        if ranks.all_local:
            committed = list_committed(self.tiers.memory)
            if ranks.world_size > 1:  # this rank persists its own part: where it wrote one
                committed = [c for c in committed if ranks.rank in c.manifest.writers]
            in_memory = [(c.tag, c.sort_key) for c in committed]
            # A labelled checkpoint is always persisted (persister.py), even one a crash
            # left unpersisted behind a newer one; also a tag saved again whose new
            # version the persistent tier lacks (it holds the old one: Lightning's
            # `last`), on every rank that wrote a part of it.
            for c in committed[:-1]:
                if c.manifest.labels and self._durable_version(c.tag) != c.manifest.created_at:
                    log.info("persisting %r (labelled), left in the memory tier", c.tag)
                    self.persister.request(c.tag)
        else:  # the node holds only its ranks' parts, never a manifest of the whole
            parts = own_parts(self.tiers.memory, ranks.rank)
            in_memory = sorted((tag, order_key(tag, created)) for tag, created in parts)
            in_memory.sort(key=lambda pair: pair[1])
        if not in_memory:
            return None
        persisted = newest_committed(self.tiers.persistent, 1)
        newest, newest_key = in_memory[-1]
        if persisted and persisted[0].sort_key >= newest_key:
            return None
        log.info("persisting %r, left in the memory tier by an earlier process", newest)
        self.persister.request(newest)
        return newest

    def _durable_version(self, tag: str) -> str | None:
        """When the persistent tier's committed copy of `tag` was created; None without
        one (or one this version cannot read)."""
        assert self.tiers.persistent is not None
        try:
            info = read_committed(self.tiers.persistent, tag)
        except UnsupportedSchemaError:
            return None
        return None if info is None else info.manifest.created_at

    def close(self, timeout_s: float | None = None) -> str | None:
        """Persist what is pending and stop; returns a tag left unpersisted, if any.

        The whole close takes at most `timeout_s` (and `CLOSE_GRACE_S` more for the
        hold's release after a persist that took it all): what comes after the persist
        (the memory tier's release, the job's hold on the root) asks the stores under
        that deadline (storage/deadline.py), so a store that hangs never keeps a process
        from ending."""
        ends = None if timeout_s is None else time.monotonic() + timeout_s
        if self.snapshots is not None:
            self.snapshots.close()  # the lazy saves commit first, then are persisted
        if self.peers is not None:
            # Before the persist, whose length varies by rank: the partners reach their
            # close at about the same time, and end with BYEs, not cut connections.
            grace = (
                REPLICATION_CLOSE_S if timeout_s is None else min(REPLICATION_CLOSE_S, timeout_s)
            )
            self._close_peers(grace)
            timeout_s = None if ends is None else max(0.0, ends - time.monotonic())
        left = self.persister.close(timeout_s)
        rest = None if ends is None else max(CLOSE_GRACE_S, ends - time.monotonic())
        with within(rest):
            return self._release(left)

    def _release(self, left: str | None) -> str | None:
        """After the persist at close: the buffers, the memory tier (when everything in it
        is persisted), the hold on the root."""
        # The free buffers are a cache of this process's; left behind they would hold RAM
        # (/dev/shm) after the job. The checkpoints themselves stay.
        self.pool.trim()
        self.pool.close()
        try:
            if (
                left is None
                and not self.config.keep_memory_tier
                and releasable(
                    self.tiers,
                    self.persister,
                    self._known_ranks(),
                    rank_timeout_s=self.config.rank_timeout_s,
                )
            ):
                needed = self._replicas_needed()
                if needed:
                    # This node's own checkpoints go (each by the delete protocol: one
                    # being read stays); the folder stays, for the replicas.
                    memory = self.tiers.memory
                    for tag in tag_folders(memory):
                        delete_checkpoint(memory, tag, own_holds=False)
                    parts = ", ".join(f"rank {r.rank}'s part of {r.tag!r}" for r in needed)
                    log.info(
                        "kept the memory tier %s: it holds the replicas of %s, which the "
                        "persistent tier lacks and a restart of the job may need (this "
                        "node's own checkpoints are persisted; `nebula gc` releases it once "
                        "those are too)",
                        self.tiers.memory.url,
                        parts,
                    )
                    return left
                done = release_memory_tier(self.tiers.memory, self.hold)
                if done.tags or done.size:
                    log.info("released the memory tier %s (%s: %d bytes, all persisted)",
                             self.tiers.memory.url, ", ".join(done.tags) or "empty",
                             done.size)  # fmt: skip
                if done.kept:
                    log.info("kept %s in the memory tier %s: another process is reading it "
                             "(`nebula gc` releases it later)", ", ".join(done.kept),
                             self.tiers.memory.url)  # fmt: skip
        except (NebulaError, OSError) as exc:
            log.warning("could not release the memory tier %s: %s", self.tiers.memory.url, exc)
        finally:
            if self.presence is not None:
                self.presence.close()
            self.hold.close()
            self.job.close()
        return left

    def _replicas_needed(self) -> list[Replica]:
        """The replicas of other nodes' parts this memory tier holds that a restart may
        still need (protocol/replicas_held.py); all of them when that cannot be told."""
        held = held_replicas(self.tiers.memory)
        try:
            return needed_replicas(held, self.tiers.persistent)
        except NebulaError:
            return list(held)


_lock = threading.RLock()
_session: Session | None = None


def start(config: Config, *, on_start: Callable[[], object] | None = None) -> Session:
    """Make `config` the process's configuration (a no-op if it already is); `on_start()`
    runs once a new session is made (`nm.init()` arms the exit path: exit.py)."""
    global _session
    with _lock:
        if _session is not None and _session.config == config:
            _session.persister.raise_pending_error()
            return _session
        if _session is not None:
            old, _session = _session, None
            left = old.close(config.exit_timeout_s)
            if left is not None:
                log.warning("re-init: checkpoint %r was not persisted before the switch", left)
            old.persister.raise_pending_error()
        # One listing of each tier's commit index answers the restart's questions (the
        # dead writers' recovery, what the root holds, the resume): commit_index.pinned.
        with pinned():
            _session = Session(config)
        if on_start is not None:
            on_start()
        return _session


def current(what: str, *, raise_pending: bool = True, fence: bool = True) -> Session:
    """The live session, after the lazy snapshots are done (unless `fence` is False: a
    save or commit queues behind them) and any pending background failure is raised
    (unless the caller raises it itself, later)."""
    session = _session
    if session is None:
        raise NotInitializedError(what)
    if fence:
        session.wait_for_snapshots()
    if raise_pending:
        session.persister.raise_pending_error()
    return session


def current_or_none() -> Session | None:
    """The live session (after the fence, any pending failure raised), or None."""
    session = _session
    if session is not None:
        session.wait_for_snapshots()
        session.persister.raise_pending_error()
    return session


def stop(timeout_s: float | None = None) -> str | None:
    """Close the session (persisting what is pending); returns a tag left unpersisted."""
    global _session
    with _lock:
        session, _session = _session, None
    if session is None:
        return None
    left = session.close(timeout_s if timeout_s is not None else session.config.exit_timeout_s)
    session.persister.raise_pending_error()
    return left


def live() -> Session | None:
    """The session as it is, or None: no fence waited for, no failure raised (exit.py)."""
    return _session


def detach() -> None:
    """Forget the session without closing it: the exit path closes it itself (exit.py)."""
    global _session
    _session = None
