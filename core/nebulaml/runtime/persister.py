"""The background persister: memory tier to persistent tier, one persist at a time.

After each commit in the memory tier the training thread calls `notify_committed`. A single
daemon thread copies the newest committed memory checkpoint to the persistent tier at
most once every `interval_s` seconds (a checkpoint superseded before its turn is skipped;
that is what the interval means, and its history row says `skipped`), commits it there,
applies retention on both tiers and appends the history rows. A labelled checkpoint is
never superseded: it is persisted as soon as the thread is free, without waiting for the
interval, and the memory tier keeps it until then.

A failed persist is tried again (`on_error="retry"`, the default): the memory tier keeps
the checkpoint, the thread waits a capped backoff (outage.py) and tries the newest again,
until it lands; warned once per outage and once when it ends. With `on_error="raise"` a
failure is kept and raised once, on the next call into the library
(`raise_pending_error`). Either way it is reported at exit; it is never swallowed.
A session that could not reach its persistent tier at init hands the persister a
`connect` to run before its first persist (session.py): until it succeeds, the job is an
outage like any other.

This module holds the queue (pending, forced, labelled, followers' candidates) and what
the training thread and the operators' calls do with it; persist_thread.py the thread that
works it (the two are one state machine under one lock). May import: every layer below
runtime, and runtime.crew, outage, persist_thread, ranks, slots, upkeep. Not for: the thread
(persist_thread.py), one persist's copy (persist_step.py), retention and the history
(upkeep.py), the commit protocol itself (commit.py) or process-wide state (session.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from nebulaml._threads import start as start_thread
from nebulaml.errors import NebulaError, PersistError, PersistTimeoutError, RankTimeoutError
from nebulaml.format.manifest import utc_now
from nebulaml.format.names import order_key, step_of
from nebulaml.protocol.catalog import highest_sequence, list_committed
from nebulaml.protocol.history import HistoryRow, skipped_row
from nebulaml.protocol.removals import write_removals
from nebulaml.protocol.retention import Version
from nebulaml.protocol.reuse import ReuseBook
from nebulaml.protocol.tiers import TierSet
from nebulaml.runtime.crew import EVICT_CREW
from nebulaml.runtime.outage import OutageWatch
from nebulaml.runtime.persist_thread import Connect, PersistThread
from nebulaml.runtime.ranks import RankInfo
from nebulaml.runtime.slots import SlotPool
from nebulaml.runtime.upkeep import HistoryQueue, RemovalQueue
from nebulaml.storage.deadline import within
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")


class Persister(PersistThread):
    """Owns the persist thread of one job's tiers.

    Example:
        >>> import tempfile
        >>> from nebulaml.protocol.tiers import open_tiers
        >>> p = Persister(open_tiers(tempfile.mkdtemp()), interval_s=0, retention=2)
        >>> p.close(timeout_s=5)
        >>> p.flush() is None   # nothing committed, nothing to wait for
        True
    """

    def __init__(
        self,
        tiers: TierSet,
        *,
        interval_s: float,
        retention: int,
        ranks: RankInfo | None = None,
        rank_timeout_s: float = 300.0,
        pool: SlotPool | None = None,
        on_error: str = "retry",
        give_up_s: float = 600.0,
        connect: Connect | None = None,
    ) -> None:
        self.tiers = tiers
        # "retry": a failed persist keeps its checkpoint queued (the memory tier keeps it)
        # and is tried again with a capped backoff until it is durable; "raise": it is
        # reported once, on the next call into the library, and dropped.
        self.on_error = on_error
        self.give_up_s = give_up_s  # how long flush() waits out an outage by default
        self.pool = pool  # evicted memory-tier files go back to it for reuse
        self.interval_s = interval_s
        self.retention = retention
        self.ranks = ranks or RankInfo()
        self.rank = self.ranks.rank
        self.rank_timeout_s = rank_timeout_s
        self._cond = threading.Condition()
        self._pending: str | None = None  # newest committed, not yet persisted
        # A follower persists exactly what the tag's leader persists: the tags it holds
        # and has not yet seen the leader's marker for, oldest first. The leader of a tag
        # is the lowest rank that writes it (rank 0, unless the checkpoint names ranks).
        self._candidates: list[str] = []
        self._leaders: dict[str, int] = {}
        self._newest_followed: dict[int, str] = {}  # each leader's newest commit
        self._follow_deadline: float | None = None  # exiting: when a follower gives up
        # A follower's parts persisted whose commit (by the leader) it has not yet seen:
        # kept in the memory tier until then, or the checkpoint was committed nowhere for
        # a moment (the memory copy lost this part; the persistent copy had no manifest).
        self._parts_out: set[str] = set()
        self._commits_due = 0.0  # when the thread looks for their commits next
        # Flush requests and labelled checkpoints: persisted in order, the interval
        # ignored, never superseded.
        self._forced: list[str] = []
        self._inflight: str | None = None
        self._last_start: float | None = None
        self._done: dict[str, BaseException | None] = {}
        self._error: PersistError | None = None
        # The persistent tier failing ("retry"): since when, the last error, when to try
        # again, and the next backoff. Warned once per outage, and once when it ends.
        self.watch = OutageWatch(tiers.display)
        self._gave_up = False  # exiting, and the last try failed: what is left stays
        self._inflight_forced = False
        self._durable: str | None = None  # the newest tag this process made durable
        self.history = HistoryQueue(lambda: self.tiers.history_store)
        # What this process persisted of each item, whose unchanged bytes the next
        # persist of the item takes from it instead of writing them (protocol/reuse.py).
        self.reuse = ReuseBook()
        # What a framework removed (Lightning's ModelCheckpoint): deleted on the thread.
        self.removals = RemovalQueue(journal=self._journal_removals)
        self._removing: str | None = None  # the tag the thread is deleting now
        # Tags the training thread is saving again (`release`, until `notify_committed`)
        # and those an eviction is deleting now: neither waits for nor deletes the other.
        self._saving: set[str] = set()
        self._evicting: set[str] = set()
        self._retention_lock = threading.Lock()  # the thread and a streamed commit apply it
        # A commit's eviction of the copies it superseded: asked for by `notify_committed`,
        # run by the eviction thread or by the next save (`settle_eviction`), once.
        self._evict_due = False
        self._after_evict: Callable[[], object] | None = None
        self._evict_lock = threading.Lock()
        # What the persistent tier holds committed, with each one's order and labels, as
        # read once (upkeep.retire): retention reads only the manifests it has not read.
        self._retained: dict[str, Version] = {}
        self._stopping = False
        # The highest commit sequence this job knows on its persistent tier (its start's,
        # then each persist's and retention's): a memory-tier commit takes a higher one,
        # so that "newest" is one order on both tiers (`sequence_floor`).
        self._sequence = 0
        # What the persistent tier holds, as this job knows it (its start's listing, then
        # each persist and retention): a save asks this, never the store (`holds`).
        self._durable_tags: set[str] = set()
        # Not reached yet (session.py): run before the first persist, as part of it.
        self._connect = connect
        self._unreached_since = utc_now()
        if connect is None and tiers.persistent is not None:
            self._learn(list_committed(tiers.persistent))
        self._thread = threading.Thread(target=self._run, name="nebula-persister", daemon=True)
        start_thread(self._thread)

    # called by the training thread --------------------------------------------------------
    def set_ranks(self, ranks: RankInfo) -> None:
        """This process's place in the job, read again at the first save (session.py)."""
        with self._cond:
            self.ranks = ranks
            self.rank = ranks.rank

    def notify_committed(
        self,
        tag: str,
        row: HistoryRow | None = None,
        *,
        labels: tuple[str, ...] = (),
        leader: int = 0,
        then: Callable[[], object] | None = None,
    ) -> None:
        """A tag was committed in the memory tier: it becomes the one to persist next,
        superseding the pending one. A labelled tag (`labels`) is queued instead: it is
        persisted without waiting for the interval and is never superseded. `leader`:
        the lowest rank that writes the tag, which decides whether it is persisted.
        `then` runs after the eviction of what the tag superseded, with it (the next
        save's spare buffers: slots.SlotPool.prepare)."""
        if row is not None:
            self.history.add(row)
        with self._cond:
            self._saving.discard(tag)
            if self.tiers.persistent is not None:
                self._done.pop(tag, None)
                self._leaders[tag] = leader
                if self._follows(tag):
                    # Its leader decides what is persisted and what skipped; this follows.
                    self._pending = tag
                    if tag not in self._candidates:
                        self._candidates.append(tag)
                    newest = self._newest_followed.get(leader)
                    if newest is None or order_key(tag, "") >= order_key(newest, ""):
                        self._newest_followed[leader] = tag
                else:
                    self._supersede_pending(tag)
                    if not labels:
                        self._pending = tag
                    elif tag not in self._forced:
                        self._forced.append(tag)
            # The copies this commit supersedes are evicted on the eviction thread, not
            # here: the save returns without waiting for their deletion (a persist in
            # flight does not hold it up either); the next save settles it first.
            self._evict_due = True
            self._after_evict = then
            self._cond.notify_all()
        try:
            EVICT_CREW.submit(self._evict_if_due)
        except RuntimeError:  # interpreter exit: no thread for it
            self._evict_if_due()

    def settle_eviction(self) -> None:
        """Run the eviction a commit asked for, if the thread has not yet (or wait while
        it runs it): a save calls this before it takes its buffers, so that it finds the
        memory tier, its budget and the slot pool as if the eviction had run at the
        commit. A failure is warned about; the copy stays for the next eviction."""
        self._evict_if_due()  # under the eviction's lock: one running is waited for

    def notify_streamed(self, tag: str, row: HistoryRow, *, leader: int = 0) -> None:
        """A tag too large for the memory budget was committed straight to the persistent
        tier: older pending copies are superseded, and retention runs on the thread."""
        self.history.add(row)
        with self._cond:
            self._saving.discard(tag)
            self._leaders[tag] = leader
            self._durable_tags.add(tag)
            # The streamed commit is the later one: it supersedes a pending tag of a step
            # no higher (a tag-only key orders by step; tags without one compare equal).
            if self._pending is not None and order_key(self._pending)[0] <= order_key(tag)[0]:
                self._supersede_pending(tag)
            self._cond.notify_all()
        if leader == self.rank:
            self._retire_after_stream(tag)

    def request(self, tag: str) -> None:
        """Persist `tag` (committed in the memory tier) as soon as possible."""
        with self._cond:
            if self.tiers.persistent is None:
                return
            if tag not in self._forced:
                self._forced.append(tag)
            self._done.pop(tag, None)
            self._cond.notify_all()

    def release(self, tag: str) -> None:
        """Stop persisting `tag` before it is written again (a save with overwrite=True):
        drop it from the queue, and wait while a persist of it is in flight, so that the
        copy never reads a tag being replaced. A removal of it (`forget`) is called off:
        the new version is not the one removed."""
        with self._cond:
            self._saving.add(tag)
            self._unqueue(tag)
            self.removals.discard(tag)
            while tag in (self._inflight, self._removing) or tag in self._evicting:
                self._cond.wait(timeout=1.0)
            self._done.pop(tag, None)

    def _journal_removals(self, tags: list[str]) -> None:
        """Record what is left to remove in the memory tier (a small local file): a
        process killed before its thread ran a removal leaves it to the next session."""
        if not self.tiers.memory_usable or self.tiers.persistent is None:
            return
        try:
            write_removals(self.tiers.memory, self.rank, tags)
        except (NebulaError, OSError) as exc:
            log.warning("could not record the removal of %s: %s", ", ".join(tags), exc)

    def forget(self, tag: str) -> None:
        """The framework that manages this job's checkpoints removed `tag` (Lightning's
        ModelCheckpoint dropped it from its top k): it is not persisted, and the thread
        deletes it from every tier, whatever its labels, newest or not. Never waits: a
        persist of it in flight finishes first, and a tier that fails is tried again."""
        with self._cond:
            self._unqueue(tag)
            self._done.pop(tag, None)
            self.removals.add(tag)
            self._cond.notify_all()

    def _unqueue(self, tag: str) -> None:
        """Under the lock: `tag` is no longer to be persisted."""
        if self._pending == tag:
            self._pending = None
        for queue in (self._forced, self._candidates):
            while tag in queue:
                queue.remove(tag)

    def fail(self, error: NebulaError) -> None:
        """A failure outside a persist (the root's hold lost): raised on the next call."""
        with self._cond:
            self._error = error  # type: ignore[assignment]

    def raise_pending_error(self) -> None:
        """Raise a background failure once; later calls go on until the next one."""
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def holds(self, tag: str) -> bool:
        """Whether the persistent tier holds `tag` committed, as this job knows it: no
        request to the store (a save asks this on the training thread)."""
        with self._cond:
            return tag in self._durable_tags

    def durable_tags(self) -> set[str]:
        """The tags the persistent tier holds committed, as this job knows it (`holds`)."""
        with self._cond:
            return set(self._durable_tags)

    def failing(self) -> bool:
        """Whether the persistent tier is failing now, or was never reached."""
        with self._cond:
            return self.watch.outage is not None or self._connect is not None

    def status(self) -> dict[str, object]:
        """What is durable and what is not (`nm.persistence_status()`)."""
        with self._cond:
            outage = self.watch.outage
            waiting = [t for t in (self._inflight, *self._forced, self._pending) if t]
            waiting += [t for t in self._candidates if t not in waiting]
            error, since = None, None
            if outage is not None:
                error, since = str(outage.error), outage.since_utc
            elif self._connect is not None:  # never reached: that is an outage too
                since = self._unreached_since
                error = f"{self.tiers.display} has not answered since the job started"
            return {
                "durable": self._durable,
                "pending": list(dict.fromkeys(waiting)),
                "last_error": error,
                "failing_since": since,
            }

    def flush(
        self, tag: str | None = None, timeout_s: float | None = None, *, wait_out: bool = True
    ) -> str | None:
        """Persist `tag` (default: the newest unpersisted one) now and wait for it.

        Returns the tag persisted, or None when there was nothing to persist. Raises the
        persist's `PersistError`, or `PersistTimeoutError` after `timeout_s`. While the
        persistent tier fails, the persist is tried again until it lands; the last failure
        is raised once `timeout_s` (None: `give_up_s` into the outage) has passed, or at
        once without `wait_out` (the memory budget's flush: training must not wait).
        """
        self.settle_eviction()  # the memory tier as of the last commit, when it returns
        self.raise_pending_error()
        with self._cond:
            if tag is None and self._pending is not None:
                tag = self._pending  # the newest: persisted now, the interval ignored
            if tag is None:
                # Nothing pending: wait for what is queued (persists are done in order, so
                # the last queued one finishes last), else for the one in flight.
                target = self._forced[-1] if self._forced else self._inflight
            else:
                target = tag
                if target != self._inflight:
                    if target == self._pending:
                        self._pending = None
                    if target not in self._forced:
                        self._forced.append(target)
                    self._done.pop(target, None)
            if target is not None and self.tiers.persistent is not None:
                # A flush is a request to try now: what was wrong may have been put right
                # (the link removed, the disk grown), so an earlier failure is not the answer.
                self.watch.try_now()
                tries = self.watch.failures
                self._cond.notify_all()
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
                while target not in self._done:
                    if not self._thread.is_alive():
                        raise PersistTimeoutError(f"the persister stopped before {target!r}")
                    outage = self.watch.outage
                    fresh = self.watch.failures > tries  # this flush's own try failed
                    if outage is not None and (
                        self._gave_up or (fresh and (outage.hopeless or not wait_out))
                    ):
                        raise outage.error  # no retry can fix it (or not waited out)
                    if deadline is None and outage is not None:
                        deadline = outage.started + self.give_up_s
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        if outage is not None:
                            raise outage.error  # still failing: not durable
                        raise PersistTimeoutError(
                            f"persisting {target!r} to {self.tiers.display} did not finish "
                            f"within {timeout_s} s"
                        )
                    self._cond.wait(timeout=min(left, 1.0) if left is not None else 1.0)
                result = self._done[target]
                if isinstance(result, PersistError) and result is self._error:
                    self._error = None  # reported here, not again on the next call
                if result is not None:
                    raise result
                self._await_commit(target)
            else:
                target = None
            self._await_removals(timeout_s)
        with within(timeout_s):  # the rows wait for the next try if the store hangs
            self.history.write()
        return target

    def _await_commit(self, tag: str) -> None:
        """Under the lock: a follower's part of `tag` is durable; wait (at most
        `rank_timeout_s`) until its leader commits the checkpoint, which is durable only
        then. Raises `PersistError` (its cause a `RankTimeoutError`) when it does not:
        the leader's persist failed (an item two ranks saved, say), or it died."""
        deadline = time.monotonic() + self.rank_timeout_s
        self._commits_due = 0.0  # look now
        self._cond.notify_all()
        while tag in self._parts_out and self._thread.is_alive():
            left = deadline - time.monotonic()
            if left <= 0:
                persistent = self.tiers.persistent
                assert persistent is not None
                leader = self._leaders.get(tag, 0)
                cause = RankTimeoutError(
                    persistent.display(tag), [leader], self.rank_timeout_s, tag=tag
                )
                raise PersistError(tag, self.tiers.display, cause) from cause
            self._cond.wait(timeout=min(left, 0.1))

    def _await_removals(self, timeout_s: float | None) -> None:
        """Under the lock: wait (within `timeout_s`) until the checkpoints the framework
        removed (`forget`) are deleted, or their delete failed and waits for a retry (a
        flush does not wait out an outage of removals: they are tidying)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._cond.notify_all()
        while self.removals.due() or self._removing is not None:
            if not self._thread.is_alive():
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            self._cond.wait(timeout=min(left, 0.1) if left is not None else 0.1)

    def sequence_floor(self, store: Store) -> int:
        """What a commit on `store`, one of this job's tiers, passes as its
        `sequence_floor` (protocol/commit.py): the highest commit sequence this job knows
        on its other tier. A memory-tier commit so comes after what the persistent tier
        holds; a commit streamed to the persistent tier after what the memory tier holds."""
        with self._cond:
            floor = self._sequence
        if store is not self.tiers.memory and self.tiers.memory_usable:
            floor = max(floor, highest_sequence(self.tiers.memory))
        return floor

    def close(self, timeout_s: float | None = None) -> str | None:
        """Persist what is pending, stop the thread, write the history.

        Returns the newest tag that could not be persisted within `timeout_s` (the one
        the memory tier keeps: an older one in flight is superseded by it), else None.
        """
        with self._cond:
            self._stopping = True
            if self._pending is not None:
                self._forced.append(self._pending)
                self._pending = None
            self._cond.notify_all()
        self._thread.join(timeout_s)
        self.settle_eviction()  # the last commit's, if its thread has not run it yet
        with self._cond:
            if self._thread.is_alive() or self._gave_up:
                left = [t for t in (self._inflight, *self._forced, self._pending) if t]
                return max(left, key=lambda t: order_key(t, "")) if left else None
        return None

    @property
    def gave_up(self) -> bool:
        """Whether the exit's last try of a persist failed (what is left stays in the
        memory tier), as opposed to a persist still running when the exit's time ran out."""
        with self._cond:
            return self._gave_up

    @property
    def error(self) -> PersistError | None:
        with self._cond:
            return self._error

    def _supersede_pending(self, by: str) -> None:
        """Under the lock: the newer commit `by` supersedes the pending tag, whose persist
        is skipped. Rank 0, which decides what is skipped (the other ranks follow it, see
        `_follow_leader`), appends the `skipped` history row."""
        old, self._pending = self._pending, None
        if old is None or old == by or old == self._inflight or old in self._forced:
            return  # nothing pending, or it is persisted anyway
        self._skip(old, by)

    def _skip(self, old: str, by: str) -> None:
        """Under the lock: `old`'s persist is skipped for the newer `by` (its memory copy
        goes at the next eviction). One that failed in this outage was acknowledged and
        is dropped without ever being durable: the outage's record says so (once, then
        the count when it ends)."""
        if old in self.watch.failed_rows:
            self.watch.superseded(old, by)  # warned once an outage, then counted
        else:
            log.debug("%r superseded by %r before its persist: skipped", old, by)
        if self._leaders.get(old, 0) == self.rank:
            row = skipped_row(
                tag=old, step=step_of(old), rank=self.rank, started_at=utc_now(), superseded_by=by
            )
            self.history.add(row)
