"""What the persister does to its tiers, one action a class: each does its I/O outside the
persister's lock and records the outcome in the schedule (persist_schedule.py) under it.

    Retention   what the persistent tier holds: learnt from a listing, and retention
                applied after a persist or a streamed commit (retirement.retire)
    Persisting  one tag persisted (persist_step.py): the root reached first if the
                session could not, its history row, its outcome for the schedule
    Eviction    the memory copies the schedule no longer needs, deleted: after a persist,
                for the budget (budget.py), and the one a commit asks for (on the
                eviction thread, or at the next save: `if_due`); the tags of the
                replicas the node keeps (`.replicas/`) are the schedule's to weigh
                (evict_plan.py)
    Following   a follower rank looking for its leaders' markers and commits
    Removals    the checkpoints a framework removed (`Persister.forget`), deleted from
                every tier (removal_queue.py), and recorded in the memory tier

May import: every layer below runtime, and runtime.connect, evict_plan, history_queue,
outage, persist_schedule, persist_step, ranks, removal_queue, retirement, slots, steps.
Not for: deciding what to do, or when (persist_schedule.py), which memory copies may go
(evict_plan.py), the thread (persist_loop.py), or the training thread's calls
(persister.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from nebulaml.errors import NebulaError, PersistError
from nebulaml.format.manifest import utc_now
from nebulaml.format.names import MANIFEST_NAME, marker_name, step_of, writer_marker_name
from nebulaml.protocol.catalog import CheckpointInfo, list_committed
from nebulaml.protocol.delete import delete_checkpoint, delete_part
from nebulaml.protocol.history import make_row
from nebulaml.protocol.markers import own_parts
from nebulaml.protocol.rank_presence import rank_gone
from nebulaml.protocol.removals import write_removals
from nebulaml.protocol.replicas import replica_tags
from nebulaml.protocol.retention import Version
from nebulaml.protocol.reuse import ReuseBook
from nebulaml.protocol.tiers import TierSet
from nebulaml.runtime.connect import keep_root
from nebulaml.runtime.evict_plan import settled_parts
from nebulaml.runtime.history_queue import HistoryQueue
from nebulaml.runtime.persist_schedule import FOLLOW_POLL_S, Follow, Removal, Schedule, saved_again
from nebulaml.runtime.persist_step import discard_partial, leader_of, persist_part, persist_whole
from nebulaml.runtime.removal_queue import RemovalQueue
from nebulaml.runtime.retirement import retire
from nebulaml.runtime.slots import SlotPool
from nebulaml.runtime.steps import trace

log = logging.getLogger("nebulaml")

# What a session that has not reached its persistent tier yet gives the persister: run
# before the first persist, it reaches the root and lists what it holds committed.
Connect = Callable[[], Sequence[CheckpointInfo]]


class Retention:
    """What the persistent tier holds committed, with each one's order and labels, as read
    once (retirement.retire): retention reads only the manifests it has not read. The thread
    and a streamed commit apply it, one at a time."""

    def __init__(
        self, tiers: TierSet, schedule: Schedule, cond: threading.Condition, keep: int
    ) -> None:
        self.tiers, self.schedule, self.cond = tiers, schedule, cond
        self.keep = keep
        self._retained: dict[str, Version] = {}
        self._lock = threading.Lock()

    def learn(self, committed: Sequence[CheckpointInfo]) -> None:
        """What the persistent tier holds committed, as listed (at the start, or once it
        is reached)."""
        with self.cond:
            self.schedule.learn(
                (c.tag for c in committed), max((c.sequence for c in committed), default=0)
            )
        with self._lock:
            for c in committed:
                self._retained[c.tag] = Version.of(c.manifest)

    def apply(self, just_persisted: str) -> None:
        """Retention on the persistent tier, now that `just_persisted` is there."""
        persistent = self.tiers.persistent
        assert persistent is not None
        with self._lock:
            held, sequence = retire(persistent, self.keep, just_persisted, self._retained)
            with self.cond:
                self.schedule.learn((), sequence)
                self.schedule.durable_tags = held
                self.schedule.held_listed = True

    def after_stream(self, tag: str) -> None:
        """Retention after `tag` was committed straight to the persistent tier; a failure
        is raised by the next call into the library."""
        persistent = self.tiers.persistent
        assert persistent is not None
        try:
            self.apply(tag)
        except NebulaError as exc:
            error = PersistError(tag, persistent.url, exc)
            error.__cause__ = exc
            log.error("%s", error)
            with self.cond:
                self.schedule.error = error


class Persisting:
    """One persist of a tag, and its history row; the outcome is the caller's to record
    (`Schedule.persisted`)."""

    def __init__(
        self,
        tiers: TierSet,
        schedule: Schedule,
        cond: threading.Condition,
        *,
        retention: Retention,
        history: HistoryQueue,
        reuse: ReuseBook,
        on_error: str,
        rank_timeout_s: float,
        connect: Connect | None,
    ) -> None:
        self.tiers, self.schedule, self.cond = tiers, schedule, cond
        self.retention = retention
        self.history = history
        self.reuse = reuse
        self.on_error = on_error
        self.rank_timeout_s = rank_timeout_s
        self._connect = connect  # not reached yet (session.py): run first, as part of it

    def _leader_of(self, tag: str) -> int | None:
        """The leader of `tag`, from its commit or else from this rank's marker in the
        memory tier; None when this rank wrote no part of it."""
        with self.cond:
            leader = self.schedule.leaders.get(tag)
            rank = self.schedule.rank
        return leader if leader is not None else leader_of(self.tiers.memory, tag, rank)

    def persist(self, tag: str) -> PersistError | None:
        """Persist `tag` (this rank's part of it, with several), and apply retention when
        this rank leads it; its error, if it failed."""
        persistent = self.tiers.persistent
        assert persistent is not None
        started_at, t0 = utc_now(), time.perf_counter()
        size = 0
        error: PersistError | None = None
        leader: int | None = 0
        ranks = self.schedule.ranks
        try:
            connect = self._connect
            if connect is not None:  # the session has not reached the root yet
                self.retention.learn(connect())
                with self.cond:
                    self._connect = None
                    self.schedule.reached = True
                log.warning("reached the persistent tier %s: persisting", self.tiers.display)
            if self.tiers.memory_usable:
                keep_root(self.tiers.memory, persistent)
            if ranks.world_size > 1:
                leader = self._leader_of(tag)
                if leader is None:
                    log.debug(
                        "%r: rank %d wrote no part of it, nothing to persist", tag, ranks.rank
                    )
                    return None
                size = persist_part(
                    self.tiers,
                    tag,
                    ranks,
                    leader=leader,
                    rank_timeout_s=self.rank_timeout_s,
                    reuse=self.reuse,
                )
                if leader != ranks.rank:
                    with self.cond:  # durable once its leader commits the checkpoint
                        self.schedule.part_out(tag, time.monotonic())
            else:
                size, sequence = persist_whole(self.tiers, tag, self.reuse)
                with self.cond:
                    self.schedule.learn((), sequence)
            if leader == ranks.rank:
                trace("retain", tag)
                self.retention.apply(tag)
        except PersistError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - reported as the persist's error, not dropped
            error = PersistError(tag, persistent.url, exc)
            error.__cause__ = exc
        counts = self.reuse.take_counts(tag)
        if error is not None:
            superseded = saved_again(error)
            if self.on_error == "raise" and not superseded:
                log.error("%s", error)
            with self.cond:
                reached = self.schedule.reached
            if reached:
                discard_partial(persistent, tag, ranks)
            if superseded:
                # Not a failure: the tag's newer save is persisted instead (the schedule
                # gives this one up; its leader's `skipped` row says so).
                log.info("gave up persisting %r: %s", tag, error.__cause__ or error)
                return error
            with self.cond:
                repeated = self.schedule.repeated_failure(tag)
            if repeated:
                return error  # its `failed` row is written; the `ok` row comes when it lands
        self.history.add(
            make_row(
                tag=tag,
                step=step_of(tag),
                tier="persistent",
                rank=ranks.rank,
                started_at=started_at,
                duration_s=time.perf_counter() - t0,
                blocking_s=0.0,
                size_bytes=size,
                error=error,
                bytes_written=size if counts is None or error else counts[0],
                bytes_reused=0 if counts is None or error else counts[1],
            )
        )
        return error


class Eviction:
    """The memory copies no longer needed, deleted (evicted files go back to the slot pool
    for reuse). A commit's eviction of the copies it superseded is asked for (`ask`) and
    run once, by the eviction thread or by the next save (`if_due`)."""

    def __init__(
        self,
        tiers: TierSet,
        schedule: Schedule,
        cond: threading.Condition,
        *,
        retention: int,
        pool: SlotPool | None,
    ) -> None:
        self.tiers, self.schedule, self.cond = tiers, schedule, cond
        self.retention = retention  # the memory tier's, when it is the only tier
        self.pool = pool
        self._due = False  # under `cond`
        self._after: Callable[[], object] | None = None
        self._lock = threading.Lock()  # one eviction a commit asked for at a time

    def ask(self, after_eviction: Callable[[], object] | None) -> None:
        """Under the lock: a commit asks for its eviction; `after_eviction` runs after it."""
        self._due = True
        self._after = after_eviction

    def evict(self, *, superseded_newest: bool = False) -> None:
        """Drop the memory copies the schedule no longer needs (`Schedule.evictable`).
        With several ranks each rank removes only its own part (manifest first)."""
        memory = self.tiers.memory
        ranks = self.schedule.ranks
        if ranks.world_size > 1:
            versions = [Version(t, created, ()) for t, created in own_parts(memory, ranks.rank)]
            files = {v.tag: memory.list_files(v.tag) for v in versions}
            versions = settled_parts(versions, files, ranks.rank)
        else:
            versions = [Version.of(c.manifest) for c in list_committed(memory)]
        if not versions:
            return
        replicas = replica_tags(memory)  # this rank's own parts of them stay
        with self.cond:
            doomed = self.schedule.evictable(
                versions, self.retention, superseded_newest=superseded_newest, replicas=replicas
            )
        for tag in doomed:
            # Re-check under the lock: a flush may have asked for it meanwhile, or the
            # training thread begun saving it again (`release`), which waits for this
            # delete: deleting the old part under the new one took the new items (same
            # names) and the folder (Lightning's `last`, a CI run).
            with self.cond:
                if not self.schedule.may_evict(tag):
                    continue
                self.schedule.evicting.add(tag)
            try:
                recycle = self.pool.recycle if self.pool is not None else None
                if ranks.world_size > 1:
                    delete_part(memory, tag, ranks.rank, discard=recycle)
                else:
                    delete_checkpoint(memory, tag, discard=recycle)
            finally:
                with self.cond:
                    self.schedule.evicting.discard(tag)
                    self.cond.notify_all()

    def evict_or_warn(self) -> None:
        """`evict`, a failure warned about: the copy stays for the next eviction."""
        try:
            self.evict()
        except NebulaError as exc:
            log.warning("could not evict old memory-tier copies: %s", exc)

    def evict_now(self) -> None:
        """An eviction now, on this thread (a follower let candidates go: their buffers
        are the next save's spares), one at a time with the one a commit asks for."""
        with self._lock:
            self.evict_or_warn()

    def if_due(self) -> None:
        """The eviction a commit asked for, once: on the eviction thread
        (crew.EVICT_CREW), or on the training thread at its next save, whichever comes
        first; the other waits for it."""
        with self._lock:
            with self.cond:
                if not self._due:
                    return
                self._due = False
                after, self._after = self._after, None
            self.evict_or_warn()
            if after is not None:
                try:
                    after()
                except Exception as exc:  # noqa: BLE001 - spare buffers: never a save's failure
                    log.debug("after the eviction: %s", exc)


class Following:
    """A follower rank's looks at the persistent tier: its leaders' markers (what they
    persist, it persists), and their commits of its parts."""

    def __init__(
        self,
        tiers: TierSet,
        schedule: Schedule,
        cond: threading.Condition,
        *,
        eviction: Eviction,
    ) -> None:
        self.tiers, self.schedule, self.cond = tiers, schedule, cond
        self.eviction = eviction

    def follow(self, candidates: list[str]) -> None:
        """Look for the leaders' markers of `candidates` (and of each leader's newest),
        and do what the schedule decides of them (`Schedule.followed`): a skipped tag's
        history row is the leader's (it knows which commit superseded it); this rank
        writes none. Candidates the schedule lets go (`Schedule.expired`: older than the
        newest few, and their leader's writer has not begun them) may be evicted. Exiting,
        a follower waits for the leader's marker of the newest tag
        (every leader persists its newest at exit) before it takes the older ones for
        skipped: a leader slow to start must not find a part missing."""
        persistent = self.tiers.persistent
        assert persistent is not None
        with self.cond:
            leaders, probe = self.schedule.follow_probe(candidates)
            expired = self.schedule.expired(time.monotonic())
        try:
            led = [t for t in probe if persistent.exists(t, marker_name(probe[t]))]
            begun = [
                t
                for t in expired
                if t in led or persistent.exists(t, writer_marker_name(leaders.get(t, 0)))
            ]
        except NebulaError as exc:
            log.warning("could not look for the leaders' persisted checkpoints: %s", exc)
            led, begun = [], list(expired)
        with self.cond:
            move, dropped = self.schedule.followed(
                candidates, leaders, probe, led, time.monotonic(), lambda: self._gone(leaders)
            )
            let_go = self.schedule.let_go(expired, begun)
        if let_go:
            self.eviction.evict_now()  # their buffers: the next save's spares
        with self.cond:
            if move is Follow.PROGRESS:
                self.cond.notify_all()
            elif move is Follow.POLL:
                self.cond.wait(timeout=FOLLOW_POLL_S)
            elif move in (Follow.LEADERS_GONE, Follow.TIMED_OUT):
                log.warning(
                    "rank %d exits without persisting %s: rank %s %s",
                    self.schedule.rank,
                    ", ".join(repr(t) for t in dropped),
                    "/".join(str(r) for r in sorted(set(leaders.values()))),
                    "ended first"
                    if move is Follow.LEADERS_GONE
                    else f"persisted none of them within {self.schedule.rank_timeout_s:.0f} s",
                )

    def _gone(self, leaders: dict[str, int]) -> bool:
        """Whether every leader of `leaders` was a rank of this node whose process ended."""
        if not self.tiers.memory_usable:
            return False
        return all(rank_gone(self.tiers.memory, r) for r in set(leaders.values()))

    def see_commits(self) -> None:
        """Look for the commits of this rank's persisted parts (`Schedule.commits_seen`),
        then evict what the memory tier no longer needs."""
        persistent = self.tiers.persistent
        assert persistent is not None
        with self.cond:
            waiting = self.schedule.commits_waiting(time.monotonic())
        try:
            committed = {t for t in waiting if persistent.exists(t, MANIFEST_NAME)}
        except NebulaError as exc:
            log.debug("could not look for the leaders' commits: %s", exc)
            return
        with self.cond:
            if not self.schedule.commits_seen(waiting, committed):
                return
            self.cond.notify_all()
        self.eviction.evict_or_warn()


class Removals:
    """The checkpoints a framework removed (Lightning's ModelCheckpoint), deleted from
    every tier by the thread (`queue.run(remove)`), never by the training thread."""

    def __init__(
        self,
        tiers: TierSet,
        schedule: Schedule,
        cond: threading.Condition,
        *,
        pool: SlotPool | None,
    ) -> None:
        self.tiers, self.schedule, self.cond = tiers, schedule, cond
        self.pool = pool
        self.queue = RemovalQueue(journal=self._journal)

    def _journal(self, tags: list[str]) -> None:
        """Record what is left to remove in the memory tier (a small local file): a
        process killed before its thread ran a removal leaves it to the next session."""
        if not self.tiers.memory_usable or self.tiers.persistent is None:
            return
        try:
            write_removals(self.tiers.memory, self.schedule.rank, tags)
        except (NebulaError, OSError) as exc:
            log.warning("could not record the removal of %s: %s", ", ".join(tags), exc)

    def remove(self, tag: str) -> bool:
        """Delete `tag` from every tier: this rank's part of the memory tier, and the
        persistent tier's copy when this rank leads the tag. False while a reader holds
        it, or it is being saved again, or the persistent tier was not reached yet
        (tried again later)."""
        with self.cond:
            start = self.schedule.start_removal(tag, self.queue.pending())
            if start is not Removal.GO:
                return start is Removal.DONE
            leads = self.schedule.leads(tag)
        try:
            recycle = self.pool.recycle if self.pool is not None else None
            memory, persistent = self.tiers.memory, self.tiers.persistent
            ranks = self.schedule.ranks
            if ranks.world_size > 1:
                gone = delete_part(memory, tag, ranks.rank, discard=recycle)
            else:
                gone = delete_checkpoint(memory, tag, discard=recycle)
            with self.cond:
                reached = self.schedule.reached
            if persistent is not None and leads and reached:
                gone = delete_checkpoint(persistent, tag) and gone
                if gone:
                    with self.cond:
                        self.schedule.durable_tags.discard(tag)
            elif persistent is not None and leads:
                return False  # not reached yet: later
            return gone
        finally:
            with self.cond:
                self.schedule.removing = None
                self.cond.notify_all()
