"""The persister's thread (persister.py holds its queue and what the training thread
calls): it takes the next tag due, reaches the persistent tier first if the session could
not (`connect`), runs one persist (persist_step.py), then retention and the history rows
(upkeep.py); after a failure it waits the backoff of its `OutageWatch` (outage.py) and
tries the newest again. A follower rank persists what its tag's leader persists. The
memory tier's eviction is here too: the thread runs it after each persist, and the
budget (budget.py) when it needs room.

`PersistThread` is the half of `Persister` that runs on the thread; the two share one
state under one lock (`_cond`), declared here.

May import: every layer below runtime, and runtime.connect, outage, persist_step, ranks,
slots, upkeep. Not for: the queue and the calls of the training thread (persister.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from nebulaml.errors import NebulaError, PersistError
from nebulaml.format.manifest import utc_now
from nebulaml.format.names import (
    MANIFEST_NAME,
    marker_name,
    order_key,
    step_of,
    writer_marker_name,
)
from nebulaml.protocol.catalog import CheckpointInfo, list_committed
from nebulaml.protocol.delete import delete_checkpoint, delete_part
from nebulaml.protocol.history import make_row
from nebulaml.protocol.markers import own_parts
from nebulaml.protocol.rank_presence import rank_gone
from nebulaml.protocol.retention import Version, plan_retention
from nebulaml.protocol.reuse import ReuseBook
from nebulaml.protocol.tiers import TierSet
from nebulaml.runtime.connect import keep_root
from nebulaml.runtime.outage import OutageWatch, is_broken
from nebulaml.runtime.persist_step import (
    discard_partial,
    leader_of,
    persist_part,
    persist_whole,
)
from nebulaml.runtime.ranks import RankInfo
from nebulaml.runtime.slots import SlotPool
from nebulaml.runtime.upkeep import HistoryQueue, RemovalQueue, retire

log = logging.getLogger("nebulaml")

FOLLOW_POLL_S = 0.2  # how often a follower looks for rank 0's persisted markers
# What a session that has not reached its persistent tier yet gives the persister: run
# before the first persist, it reaches the root and lists what it holds committed.
Connect = Callable[[], Sequence[CheckpointInfo]]


class PersistThread:
    """The thread's half of a `Persister` (its state is made by `Persister.__init__`)."""

    tiers: TierSet
    ranks: RankInfo
    rank: int
    on_error: str
    interval_s: float
    retention: int
    rank_timeout_s: float
    pool: SlotPool | None
    history: HistoryQueue
    reuse: ReuseBook
    removals: RemovalQueue
    _removing: str | None
    _saving: set[str]
    _evicting: set[str]
    _evict_due: bool
    _after_evict: Callable[[], object] | None
    _evict_lock: threading.Lock
    watch: OutageWatch
    _cond: threading.Condition
    _retention_lock: threading.Lock
    _retained: dict[str, Version]
    _pending: str | None
    _candidates: list[str]
    _leaders: dict[str, int]
    _newest_followed: dict[int, str]
    _follow_deadline: float | None
    _parts_out: set[str]
    _commits_due: float
    _forced: list[str]
    _inflight: str | None
    _inflight_forced: bool
    _last_start: float | None
    _done: dict[str, BaseException | None]
    _error: PersistError | None
    _gave_up: bool
    _stopping: bool
    _durable: str | None
    _sequence: int
    _durable_tags: set[str]
    _connect: Connect | None

    def _skip(self, old: str, by: str) -> None:  # persister.py
        raise NotImplementedError

    @property
    def connected(self) -> bool:
        """Whether the persistent tier was reached (always, without one)."""
        with self._cond:
            return self._connect is None

    def _learn(self, committed: Sequence[CheckpointInfo]) -> None:
        """What the persistent tier holds committed, as listed (at the start, or once it
        is reached)."""
        with self._cond:
            self._sequence = max([self._sequence, *(c.sequence for c in committed)])
            self._durable_tags |= {c.tag for c in committed}
        with self._retention_lock:
            for c in committed:
                self._retained[c.tag] = Version(
                    c.tag, c.committed_at, c.manifest.labels, c.sequence
                )

    def _note_sequence(self, sequence: int) -> None:
        with self._cond:
            self._sequence = max(self._sequence, sequence)

    def protected(self) -> set[str]:
        """Tags the memory tier must keep: pending, in flight, or queued (asked for, or
        labelled and not yet persisted)."""
        with self._cond:
            queued = (self._pending, self._inflight, *self._forced, *self._candidates)
            return {t for t in queued if t} | self._parts_out

    def evict_memory(self, *, superseded_newest: bool = False) -> None:
        """Drop memory copies that are no longer needed.

        With a persistent tier the memory tier keeps its newest checkpoint and those
        pending, queued (labelled ones until their persist) or in flight. Without one it
        is the only tier, and retention applies.
        With several ranks each rank removes only its own part (manifest first). With
        `superseded_newest` (the memory budget needs room) the newest goes too once the
        persistent tier holds it or a newer checkpoint.
        """
        memory = self.tiers.memory
        in_progress: set[str] = set()
        if self.ranks.world_size > 1:
            versions = [Version(t, created, ()) for t, created in own_parts(memory, self.rank)]
            # A part of a tag the other ranks have not committed yet (they are still saving
            # it, or died) is not "the newest": keeping it and evicting the committed one
            # before it lost a checkpoint both ranks had acknowledged (the elastic
            # campaign: rank 0 killed while rank 1's part of the next step waited for it).
            files = {v.tag: memory.list_files(v.tag) for v in versions}
            whole = {t for t, names in files.items() if MANIFEST_NAME in names}
            # Nor is a part still being written (its writer marker is there until the
            # commit): Lightning's `last`, saved again each epoch, was evicted between
            # its rank marker and its manifest, and the save failed (its folder gone).
            writing = {
                t
                for t, names in files.items()
                if t not in whole and writer_marker_name(self.rank) in names
            }
            versions = [v for v in versions if v.tag not in writing]
            if whole:
                newest_whole = max(
                    (v for v in versions if v.tag in whole), key=lambda v: v.sort_key
                )
                in_progress = {
                    v.tag
                    for v in versions
                    if v.tag not in whole and v.sort_key > newest_whole.sort_key
                }
                versions = [v for v in versions if v.tag not in in_progress]
        else:
            committed = list_committed(memory)
            versions = [
                Version(c.tag, c.committed_at, c.manifest.labels, c.sequence) for c in committed
            ]
        if not versions:
            return
        protected = self.protected()
        if self.tiers.persistent is None:
            doomed = plan_retention(versions, self.retention, protected)
        else:
            newest = max(versions, key=lambda v: v.sort_key).tag
            keep: str | None = newest
            if superseded_newest and self._superseded(newest):
                keep = None
            doomed = [v.tag for v in versions if v.tag != keep and v.tag not in protected]
        for tag in doomed:
            # Re-check under the lock: a flush may have asked for it meanwhile, or the
            # training thread begun saving it again (`release`), which waits for this
            # delete: deleting the old part under the new one took the new items (same
            # names) and the folder (Lightning's `last`, a CI run).
            with self._cond:
                if tag in self.protected() or tag in self._saving:
                    continue
                self._evicting.add(tag)
            try:
                recycle = self.pool.recycle if self.pool is not None else None
                if self.ranks.world_size > 1:
                    delete_part(memory, tag, self.rank, discard=recycle)
                else:
                    delete_checkpoint(memory, tag, discard=recycle)
            finally:
                with self._cond:
                    self._evicting.discard(tag)
                    self._cond.notify_all()

    def _evict_if_due(self) -> None:
        """The eviction a commit asked for (`Persister.notify_committed`), once: on the
        eviction thread (crew.EVICT_CREW), or on the training thread at its next save
        (`settle_eviction`), whichever comes first; the other waits for it."""
        with self._evict_lock:
            with self._cond:
                if not self._evict_due:
                    return
                self._evict_due = False
                then, self._after_evict = self._after_evict, None
            try:
                self.evict_memory()
            except NebulaError as exc:
                log.warning("could not evict old memory-tier copies: %s", exc)
            if then is not None:
                try:
                    then()
                except Exception as exc:  # noqa: BLE001 - spare buffers: never a save's failure
                    log.debug("after the eviction: %s", exc)

    def _superseded(self, tag: str) -> bool:
        """Whether the persistent tier holds `tag`, or a newer checkpoint, committed, as
        this job knows it (no request to the store: the training thread asks)."""
        with self._cond:
            if self.tiers.persistent is None:
                return False
            if tag in self._durable_tags:
                return True
            step = step_of(tag)
            steps = [step_of(t) for t in self._durable_tags]
        return step is not None and any(s is not None and s > step for s in steps)

    def _follows(self, tag: str) -> bool:
        """Under the lock: whether another rank, the tag's leader, decides its persist."""
        return (
            self.ranks.world_size > 1
            and self._leaders.get(tag, 0) != self.rank
            and self.tiers.persistent is not None
        )

    def _leader_of(self, tag: str) -> int | None:
        """The leader of `tag`, from its commit or else from this rank's marker in the
        memory tier; None when this rank wrote no part of it."""
        with self._cond:
            leader = self._leaders.get(tag)
        return leader if leader is not None else leader_of(self.tiers.memory, tag, self.rank)

    def _next_tag(self) -> str | None:
        """Under the lock: the tag to persist now, or None to keep waiting."""
        if self.watch.waiting():
            return None  # the persistent tier failed: not before the backoff is over
        self._inflight_forced = bool(self._forced)
        if self._forced:
            tag = self._forced.pop(0)
            if tag in self._candidates:
                self._candidates.remove(tag)
            return tag
        if self._pending is None or self._follows(self._pending):
            return None
        # During an outage the backoff paces the tries, not the interval.
        due = (
            self._last_start is None
            or self.watch.outage is not None
            or time.monotonic() - self._last_start >= self.interval_s
        )
        if due or self._stopping:
            tag, self._pending = self._pending, None
            return tag
        return None

    def _run(self) -> None:
        _lower_priority()
        while True:
            probe: list[str] = []
            with self._cond:
                while True:
                    tag = self._next_tag()
                    if tag is not None or self.history.due() or self._finished():
                        break
                    if self.removals.due() or (self._stopping and self.removals.pending()):
                        break
                    if self._candidates and self.tiers.persistent is not None:
                        probe = list(self._candidates)
                        break
                    if self._commits_to_see():
                        break
                    self._cond.wait(timeout=self._wait_s())
                if tag is not None:
                    self._inflight = tag
                    self._last_start = time.monotonic()
                wrote = self.history.due()
                see_commits = self._commits_to_see()
                finished = tag is None and not wrote and not probe and self._finished()
            self.history.write()
            if tag is None and self.removals.pending():
                self.removals.run(self._remove, last=self._stopping)
            if finished:
                return
            if see_commits:
                self._see_commits()
            if probe:
                self._follow_leader(probe)
                continue
            if tag is None:
                continue
            error = self._persist(tag)
            with self._cond:
                self._inflight = None
                if error is not None and self.on_error == "retry" and not is_broken(error):
                    self._retry_later(tag, error)
                else:
                    self._done[tag] = error
                    if tag != self._pending and tag not in self._forced + self._candidates:
                        self._leaders.pop(tag, None)
                    if error is not None:
                        self._error = error
                    else:
                        self._landed(tag)
                self._cond.notify_all()
            if error is None:
                try:
                    self.evict_memory()
                except NebulaError as exc:
                    log.warning("could not evict old memory-tier copies: %s", exc)
            if self.removals.due():  # not only when idle: persists may follow one another
                self.removals.run(self._remove, last=self._stopping)

    def _wait_s(self) -> float | None:
        """Under the lock: how long the thread may sleep before something is due (None:
        until notified)."""
        now = time.monotonic()
        due: list[float] = []
        if self._pending is not None and self._last_start is not None:
            due.append(self._last_start + self.interval_s)
        if self._parts_out:
            due.append(self._commits_due)
        if self.watch.retry_at is not None and (self._pending or self._forced):
            due.append(self.watch.retry_at)
        for retry in (self.history.retry_at(), self.removals.retry_at()):
            if retry is not None:
                due.append(retry)
        return max(0.0, min(due) - now) if due else None

    def _retry_later(self, tag: str, error: PersistError) -> None:
        """Under the lock: the persist of `tag` failed ("retry"): it stays queued where it
        was (a newer commit still supersedes an unlabelled one), and the thread tries again
        after a capped backoff. The first failure of an outage is warned about."""
        self.watch.failed(tag, error)
        if self._stopping:
            # Exiting: this was the last try. The memory tier keeps the checkpoint for the
            # next init on this node; the exit names it and the failure.
            self._error = error
            self._gave_up = True
        if self._inflight_forced:
            if tag not in self._forced:
                self._forced.insert(0, tag)
            return
        # An unlabelled one waits again, unless a newer commit came meanwhile (pending, or
        # taken by a flush): that one is persisted instead, this one skipped.
        key = order_key(tag, "")
        newer = [t for t in (self._pending, *self._forced) if t and order_key(t, "") > key]
        if not newer and self._pending is None:
            self._pending = tag
        elif newer:
            self._skip(tag, max(newer, key=lambda t: order_key(t, "")))

    def _landed(self, tag: str) -> None:
        """Under the lock: `tag` is durable; an outage, if any, is over."""
        self._durable_tags.add(tag)
        if self._durable is None or order_key(tag, "") >= order_key(self._durable, ""):
            self._durable = tag
        self.watch.landed(tag)

    def _follow_leader(self, candidates: list[str]) -> None:
        """Queue the candidates their leader has started to persist; drop older ones it
        skipped.

        A leader persists tags in order, one at a time, so once its marker of a tag is
        visible, the markers of every older tag it persisted are visible too. A skipped
        tag's history row is the leader's (it knows which commit superseded it); this rank
        writes none. Exiting, a follower waits for the leader's marker of the newest tag
        (every leader persists its newest at exit) before it takes the older ones for
        skipped: a leader slow to start must not find a part missing. It gives up after
        `rank_timeout_s` without the leader's progress (the leader died, or gave up).
        """
        persistent = self.tiers.persistent
        assert persistent is not None
        with self._cond:
            leaders = {t: self._leaders.get(t, 0) for t in candidates}
            # The newest tag of each leader (persisted by this rank at exit, no longer a
            # candidate): its marker tells that every older candidate was skipped.
            probe = {**leaders}
            for leader, latest in self._newest_followed.items():
                if leader in leaders.values():
                    probe.setdefault(latest, leader)
        try:
            led = [t for t in probe if persistent.exists(t, marker_name(probe[t]))]
        except NebulaError as exc:
            log.warning("could not look for the leaders' persisted checkpoints: %s", exc)
            led = []
        with self._cond:
            progress = False
            newest: dict[int, str] = {}  # each leader's newest persisted tag
            for t in sorted(led, key=lambda t: order_key(t, "")):
                newest[probe[t]] = t
            for tag in candidates:
                last = newest.get(leaders[tag])
                if tag in self._candidates and (
                    tag in led or (last is not None and order_key(tag, "") < order_key(last, ""))
                ):
                    progress = True
                    self._candidates.remove(tag)
                    if tag in led and tag not in self._forced:
                        self._forced.append(tag)
            if self._pending in led:
                self._pending = None
            if progress:
                self._follow_deadline = None
                self._cond.notify_all()
            elif not self._stopping:
                self._cond.wait(timeout=FOLLOW_POLL_S)
            elif self._follow_deadline is None and not self._leaders_gone(leaders):
                self._follow_deadline = time.monotonic() + self.rank_timeout_s
            elif self._follow_deadline is None or time.monotonic() >= self._follow_deadline:
                # Exiting, and the leaders are gone (their newest, persisted by this rank
                # at exit, took their parts along) or showed no progress for
                # rank_timeout_s: what they have not started by now, they will not.
                log.warning(
                    "rank %d exits without persisting %s: rank %s %s",
                    self.rank,
                    ", ".join(repr(t) for t in self._candidates),
                    "/".join(str(r) for r in sorted(set(leaders.values()))),
                    "ended first"
                    if self._follow_deadline is None
                    else f"persisted none of them within {self.rank_timeout_s:.0f} s",
                )
                self._candidates.clear()
            else:
                self._cond.wait(timeout=FOLLOW_POLL_S)

    def _commits_to_see(self) -> bool:
        """Under the lock: whether the thread should look for its leaders' commits now."""
        return bool(self._parts_out) and time.monotonic() >= self._commits_due

    def _see_commits(self) -> None:
        """Drop from `_parts_out` the tags now committed on the persistent tier, and those
        a newer committed checkpoint superseded (their leader's persist of them is over,
        committed or failed), then evict what the memory tier no longer needs."""
        persistent = self.tiers.persistent
        assert persistent is not None
        with self._cond:
            waiting = sorted(self._parts_out, key=lambda t: order_key(t, ""))
            self._commits_due = time.monotonic() + FOLLOW_POLL_S
        try:
            committed = {t for t in waiting if persistent.exists(t, MANIFEST_NAME)}
        except NebulaError as exc:
            log.debug("could not look for the leaders' commits: %s", exc)
            return
        with self._cond:
            newest = max(committed, key=lambda t: order_key(t, ""), default=None)
            over = {
                t
                for t in waiting
                if t in committed
                or (newest is not None and order_key(t, "") < order_key(newest, ""))
            }
            if not over:
                return
            self._parts_out -= over  # durable already as this rank knows it (`_landed`)
            self._cond.notify_all()
        try:
            self.evict_memory()
        except NebulaError as exc:
            log.warning("could not evict old memory-tier copies: %s", exc)

    def _leaders_gone(self, leaders: dict[str, int]) -> bool:
        """Whether every leader of `leaders` was a rank of this node whose process ended."""
        if not self.tiers.memory_usable:
            return False
        return all(rank_gone(self.tiers.memory, r) for r in set(leaders.values()))

    def _finished(self) -> bool:
        if self._stopping and self._gave_up:
            return True
        return (
            self._stopping
            and self._pending is None
            and not self._forced
            and not self._candidates
            and not self.removals.pending()
        )

    def _remove(self, tag: str) -> bool:
        """Delete `tag`, which the framework removed (`Persister.forget`), from every tier:
        this rank's part of the memory tier, and the persistent tier's copy when this rank
        leads the tag. False while a reader holds it (tried again later)."""
        with self._cond:
            # The thread runs this between persists: a protected tag was saved again
            # (`release` called the removal off; the new version is queued).
            if tag not in self.removals.pending() or tag in self.protected():
                return True
            if tag in self._saving:
                return False  # being saved again right now: looked at again later
            self._removing = tag
            leads = self._leaders.get(tag, 0) == self.rank
        try:
            recycle = self.pool.recycle if self.pool is not None else None
            memory, persistent = self.tiers.memory, self.tiers.persistent
            if self.ranks.world_size > 1:
                gone = delete_part(memory, tag, self.rank, discard=recycle)
            else:
                gone = delete_checkpoint(memory, tag, discard=recycle)
            if persistent is not None and leads and self.connected:
                gone = delete_checkpoint(persistent, tag) and gone
                if gone:
                    with self._cond:
                        self._durable_tags.discard(tag)
            elif persistent is not None and leads:
                return False  # not reached yet: later
            return gone
        finally:
            with self._cond:
                self._removing = None
                self._cond.notify_all()

    def _persist(self, tag: str) -> PersistError | None:
        persistent = self.tiers.persistent
        assert persistent is not None
        started_at, t0 = utc_now(), time.perf_counter()
        size = 0
        error: PersistError | None = None
        leader: int | None = 0
        try:
            connect = self._connect
            if connect is not None:  # the session has not reached the root yet
                self._learn(connect())
                with self._cond:
                    self._connect = None
                log.warning("reached the persistent tier %s: persisting", self.tiers.display)
            if self.tiers.memory_usable:
                keep_root(self.tiers.memory, persistent)
            if self.ranks.world_size > 1:
                leader = self._leader_of(tag)
                if leader is None:
                    log.debug("%r: rank %d wrote no part of it, nothing to persist", tag, self.rank)
                    return None
                size = persist_part(
                    self.tiers,
                    tag,
                    self.ranks,
                    leader=leader,
                    rank_timeout_s=self.rank_timeout_s,
                    reuse=self.reuse,
                )
                if leader != self.rank:
                    with self._cond:  # durable once its leader commits the checkpoint
                        self._parts_out.add(tag)
                        self._commits_due = time.monotonic()
            else:
                size, sequence = persist_whole(self.tiers, tag, self.reuse)
                self._note_sequence(sequence)
            if leader == self.rank:
                self._apply_retention(tag)
        except PersistError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - reported as the persist's error, not dropped
            error = PersistError(tag, persistent.url, exc)
            error.__cause__ = exc
        counts = self.reuse.take_counts(tag)
        if error is not None:
            if self.on_error == "raise":
                log.error("%s", error)
            if self.connected:
                discard_partial(persistent, tag, self.ranks)
            with self._cond:
                repeated = not self.watch.first_row(tag) and self.on_error == "retry"
            if repeated:
                return error  # its `failed` row is written; the `ok` row comes when it lands
        self.history.add(
            make_row(
                tag=tag,
                step=step_of(tag),
                tier="persistent",
                rank=self.rank,
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

    def _apply_retention(self, just_persisted: str) -> None:
        persistent = self.tiers.persistent
        assert persistent is not None
        with self._retention_lock:
            held, sequence = retire(persistent, self.retention, just_persisted, self._retained)
            self._note_sequence(sequence)
            with self._cond:
                self._durable_tags = held

    def _retire_after_stream(self, tag: str) -> None:
        persistent = self.tiers.persistent
        assert persistent is not None
        try:
            self._apply_retention(tag)
        except NebulaError as exc:
            error = PersistError(tag, persistent.url, exc)
            error.__cause__ = exc
            log.error("%s", error)
            with self._cond:
                self._error = error


PERSIST_NICE = 10


def _lower_priority() -> None:
    """Run this (the persister's) thread at a lower CPU priority than training: on a
    machine with few cores a persist competes with the training step for them, and the
    step matters more than how soon the copy is durable. Linux sets it per thread."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PERSIST_NICE)
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed: keep going
        log.debug("could not lower the persister's priority: %s", exc)
