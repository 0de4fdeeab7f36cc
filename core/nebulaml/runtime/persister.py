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

`Persister` is the facade the rest of nebula calls: it holds the persister's state (a
`Schedule`, persist_schedule.py, which decides what is persisted, skipped, retried and
evicted, and when) under one lock, starts the thread that works it (persist_loop.py), and
hands the I/O to the actions (persist_actions.py). May import: every layer below runtime,
and runtime.crew, outage, persist_actions, persist_loop, persist_schedule, ranks, slots,
history_queue. Not for: the decisions themselves (persist_schedule.py; which memory
copies may go: evict_plan.py), the thread (persist_loop.py), the I/O of a persist, an
eviction, a follower or a removal (persist_actions.py), one persist's copy
(persist_step.py), retention after a persist (retirement.py), the history's queue
(history_queue.py), the commit protocol itself (commit.py) or process-wide state
(session.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from nebulaml.errors import NebulaError, PersistError, PersistTimeoutError, RankTimeoutError
from nebulaml.format.manifest import utc_now
from nebulaml.protocol.catalog import highest_sequence
from nebulaml.protocol.commit_index import indexed_tags
from nebulaml.protocol.history import HistoryRow
from nebulaml.protocol.reuse import ReuseBook
from nebulaml.protocol.tiers import TierSet
from nebulaml.runtime.crew import EVICT_CREW, QUIET, SaveYield
from nebulaml.runtime.history_queue import HistoryQueue
from nebulaml.runtime.outage import OutageWatch
from nebulaml.runtime.persist_actions import (
    Connect,
    Eviction,
    Following,
    Persisting,
    Removals,
    Retention,
)
from nebulaml.runtime.persist_loop import PersistLoop, record_skips
from nebulaml.runtime.persist_schedule import Schedule
from nebulaml.runtime.ranks import RankInfo
from nebulaml.runtime.slots import SlotPool
from nebulaml.storage.deadline import within
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")


class Persister:
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
        self.rank_timeout_s = rank_timeout_s
        self._cond = threading.Condition()  # guards the schedule
        # The persistent tier failing ("retry"): since when, the last error, when to try
        # again, and the next backoff. Warned once per outage, and once when it ends.
        self.watch = OutageWatch(tiers.display)
        self.schedule = Schedule(
            interval_s=interval_s,
            ranks=ranks or RankInfo(),
            persistent=tiers.persistent is not None,
            retries=on_error == "retry",
            rank_timeout_s=rank_timeout_s,
            watch=self.watch,
            reached=connect is None,
        )
        self.history = HistoryQueue(lambda: self.tiers.history_store)
        # What this process persisted of each item, whose unchanged bytes the next
        # persist of the item takes from it instead of writing them (protocol/reuse.py).
        # Its hash and local writes wait while a save runs (crew.SaveYield): a persist in
        # flight took a 0.3 GB save's memory bandwidth and CPU, and doubled its stall.
        self.reuse = ReuseBook(pause=SaveYield())
        self._unreached_since = utc_now()
        cond, schedule = self._cond, self.schedule
        self._retention = Retention(tiers, schedule, cond, retention)
        self._eviction = Eviction(tiers, schedule, cond, retention=retention, pool=pool)
        self._removals = Removals(tiers, schedule, cond, pool=pool)
        # What a framework removed (Lightning's ModelCheckpoint): deleted on the thread.
        self.removals = self._removals.queue
        self._persisting = Persisting(
            tiers,
            schedule,
            cond,
            retention=self._retention,
            history=self.history,
            reuse=self.reuse,
            on_error=on_error,
            rank_timeout_s=rank_timeout_s,
            connect=connect,
        )
        self._loop = PersistLoop(
            schedule,
            cond,
            history=self.history,
            persisting=self._persisting,
            eviction=self._eviction,
            following=Following(tiers, schedule, cond, eviction=self._eviction),
            removals=self._removals,
        )
        # What the root holds, from a walk of its whole commit index (no manifest):
        # learnt when first asked (`_learn_held`: a save's `holds`, a commit), not by init,
        # which reads only the top of the index (commit_index.py); the first retention
        # reads the manifests, on the persister's thread.
        self._held_unknown = connect is None and tiers.persistent is not None
        self._held_lock = threading.Lock()
        if connect is None and tiers.persistent is not None:
            with self._cond:
                self.schedule.learn((), highest_sequence(tiers.persistent))
        self._loop.start()

    @property
    def ranks(self) -> RankInfo:
        return self.schedule.ranks

    @property
    def rank(self) -> int:
        return self.schedule.rank

    # called by the training thread --------------------------------------------------------
    def set_ranks(self, ranks: RankInfo) -> None:
        """This process's place in the job, read again at the first save (session.py)."""
        with self._cond:
            self.schedule.ranks = ranks

    def notify_committed(
        self,
        tag: str,
        row: HistoryRow | None = None,
        *,
        labels: tuple[str, ...] = (),
        leader: int = 0,
        after_eviction: Callable[[], object] | None = None,
    ) -> None:
        """A tag was committed in the memory tier: it becomes the one to persist next,
        superseding the pending one. A labelled tag (`labels`) is queued instead: it is
        persisted without waiting for the interval and is never superseded. `leader`:
        the lowest rank that writes the tag, which decides whether it is persisted.
        `after_eviction` runs after the eviction of what the tag superseded, with it (the next
        save's spare buffers: slots.SlotPool.prepare)."""
        if row is not None:
            self.history.add(row)
        self._learn_held()  # before the eviction asks what the root holds
        with self._cond:
            skips = self.schedule.committed(tag, labels, leader, time.monotonic())
            record_skips(skips, self.schedule, self.history)
            # The copies this commit supersedes are evicted on the eviction thread, not
            # here: the save returns without waiting for their deletion (a persist in
            # flight does not hold it up either); the next save settles it first.
            self._eviction.ask(after_eviction)
            self._cond.notify_all()
        try:
            EVICT_CREW.submit(self._eviction.if_due)
        except RuntimeError:  # interpreter exit: no thread for it
            self._eviction.if_due()

    def settle_eviction(self) -> None:
        """Run the eviction a commit asked for, if the thread has not yet (or wait while
        it runs it): a save calls this before it takes its buffers, so that it finds the
        memory tier, its budget and the slot pool as if the eviction had run at the
        commit. A failure is warned about; the copy stays for the next eviction."""
        self._eviction.if_due()  # under the eviction's lock: one running is waited for

    def evict_memory(self, *, superseded_newest: bool = False) -> None:
        """Drop memory copies that are no longer needed.

        With a persistent tier the memory tier keeps its newest checkpoint and those
        pending, queued (labelled ones until their persist) or in flight. Without one it
        is the only tier, and retention applies.
        With several ranks each rank removes only its own part (manifest first). With
        `superseded_newest` (the memory budget needs room) the newest goes too once the
        persistent tier holds it or a newer checkpoint.
        """
        self._eviction.evict(superseded_newest=superseded_newest)

    def notify_streamed(self, tag: str, row: HistoryRow, *, leader: int = 0) -> None:
        """A tag too large for the memory budget was committed straight to the persistent
        tier: older pending copies are superseded, and retention runs on the thread."""
        self._learn_held()
        self.history.add(row)
        with self._cond:
            skips = self.schedule.streamed(tag, leader)
            record_skips(skips, self.schedule, self.history)
            self._cond.notify_all()
        if leader == self.rank:
            self._retention.after_stream(tag)

    def request(self, tag: str) -> None:
        """Persist `tag` (committed in the memory tier) as soon as possible."""
        with self._cond:
            self.schedule.request(tag)
            self._cond.notify_all()

    def release(self, tag: str) -> None:
        """Stop persisting `tag` before it is written again (a save with overwrite=True):
        drop it from the queue, and wait while a persist of it is in flight, so that the
        copy never reads a tag being replaced. A removal of it (`forget`) is called off:
        the new version is not the one removed."""
        with self._cond, QUIET.hurry():  # the persist in flight pauses for no save now
            self.schedule.saving.add(tag)
            self.schedule.unqueue(tag)
            self.removals.discard(tag)
            while self.schedule.busy(tag):
                self._cond.wait(timeout=1.0)
            self.schedule.done.pop(tag, None)

    def forget(self, tag: str) -> None:
        """The framework that manages this job's checkpoints removed `tag` (Lightning's
        ModelCheckpoint dropped it from its top k): it is not persisted, and the thread
        deletes it from every tier, whatever its labels, newest or not. Never waits: a
        persist of it in flight finishes first, and a tier that fails is tried again."""
        with self._cond:
            self.schedule.unqueue(tag)
            self.schedule.done.pop(tag, None)
            self.removals.add(tag)
            self._cond.notify_all()

    def fail(self, error: NebulaError) -> None:
        """A failure outside a persist (the root's hold lost): raised on the next call."""
        with self._cond:
            self.schedule.error = error

    def raise_pending_error(self) -> None:
        """Raise a background failure once; later calls go on until the next one."""
        with self._cond:
            error, self.schedule.error = self.schedule.error, None
        if error is not None:
            raise error

    # what this job knows -----------------------------------------------------------------
    @property
    def connected(self) -> bool:
        """Whether the persistent tier was reached (always, without one)."""
        with self._cond:
            return self.schedule.reached

    def holds(self, tag: str) -> bool:
        """Whether the persistent tier holds `tag` committed, as this job knows it: no
        request to the store (a save asks this on the training thread) but the first
        one's walk of the root's index (`_learn_held`)."""
        self._learn_held()
        with self._cond:
            return tag in self.schedule.durable_tags

    def durable_tags(self) -> set[str]:
        """The tags the persistent tier holds committed, as this job knows it (`holds`)."""
        self._learn_held()
        with self._cond:
            return set(self.schedule.durable_tags)

    def _learn_held(self) -> None:
        """Learn, once, what the root holds from its commit index (`indexed_tags`: a walk
        of every bucket), when first needed: a restart's init reads only the top of the
        index, and the first save or commit after it pays this walk (as init did before).
        A listing the first retention already replaced (`held_listed`: it read the
        manifests) is not added to; a store that fails it leaves what was known."""
        if not self._held_unknown:
            return
        with self._held_lock:
            if not self._held_unknown:
                return
            persistent = self.tiers.persistent
            assert persistent is not None
            try:
                tags = indexed_tags(persistent)
            except NebulaError as exc:
                log.debug("could not list the commit index of %s: %s", persistent.url, exc)
                tags = set()
            with self._cond:
                if not self.schedule.held_listed:
                    self.schedule.learn(tags, 0)
            self._held_unknown = False

    def protected(self) -> set[str]:
        """Tags the memory tier must keep: pending, in flight, or queued (asked for, or
        labelled and not yet persisted)."""
        with self._cond:
            return self.schedule.protected()

    def failing(self) -> bool:
        """Whether the persistent tier is failing now, or was never reached."""
        with self._cond:
            return self.schedule.failing()

    def status(self) -> dict[str, object]:
        """What is durable and what is not (`nm.persistence_status()`)."""
        with self._cond:
            outage = self.watch.outage
            error, since = None, None
            if outage is not None:
                error, since = str(outage.error), outage.since_utc
            elif not self.schedule.reached:  # never reached: that is an outage too
                since = self._unreached_since
                error = f"{self.tiers.display} has not answered since the job started"
            return {
                "durable": self.schedule.durable,
                "pending": self.schedule.waiting(),
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
        with QUIET.hurry():  # a save waiting here: the persist does not pause for it
            return self._flush(tag, timeout_s, wait_out=wait_out)

    def _flush(self, tag: str | None, timeout_s: float | None, *, wait_out: bool) -> str | None:
        self.settle_eviction()  # the memory tier as of the last commit, when it returns
        self.raise_pending_error()
        schedule = self.schedule
        with self._cond:
            target = schedule.flush_target(tag)
            if target is not None and self.tiers.persistent is not None:
                # A flush is a request to try now: what was wrong may have been put right
                # (the link removed, the disk grown), so an earlier failure is not the answer.
                self.watch.try_now()
                tries = self.watch.failures
                self._cond.notify_all()
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
                while target not in schedule.done:
                    if not self._loop.alive():
                        raise PersistTimeoutError(f"the persister stopped before {target!r}")
                    hopeless = schedule.flush_fails(tries, wait_out)
                    if hopeless is not None:
                        raise hopeless  # no retry can fix it (or not waited out)
                    outage = self.watch.outage
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
                result = schedule.done[target]
                if isinstance(result, PersistError) and result is schedule.error:
                    schedule.error = None  # reported here, not again on the next call
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
        self.schedule.commits_due = 0.0  # look now
        self._cond.notify_all()
        while tag in self.schedule.parts_out and self._loop.alive():
            left = deadline - time.monotonic()
            if left <= 0:
                persistent = self.tiers.persistent
                assert persistent is not None
                leader = self.schedule.leaders.get(tag, 0)
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
        while self.removals.due() or self.schedule.removing is not None:
            if not self._loop.alive():
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
            floor = self.schedule.sequence
        if store is not self.tiers.memory and self.tiers.memory_usable:
            floor = max(floor, highest_sequence(self.tiers.memory))
        return floor

    def close(self, timeout_s: float | None = None) -> str | None:
        """Persist what is pending, stop the thread, write the history.

        Returns the newest tag that could not be persisted within `timeout_s` (the one
        the memory tier keeps: an older one in flight is superseded by it), else None.
        """
        with self._cond:
            self.schedule.stop()
            self._cond.notify_all()
        self._loop.thread.join(timeout_s)
        self.settle_eviction()  # the last commit's, if its thread has not run it yet
        with self._cond:
            if self._loop.alive() or self.schedule.gave_up:
                return self.schedule.unpersisted()
        return None

    @property
    def gave_up(self) -> bool:
        """Whether the exit's last try of a persist failed (what is left stays in the
        memory tier), as opposed to a persist still running when the exit's time ran out."""
        with self._cond:
            return self.schedule.gave_up

    @property
    def error(self) -> NebulaError | None:
        with self._cond:
            return self.schedule.error
