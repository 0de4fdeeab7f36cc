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

This module holds the queue (pending, forced, labelled, followers' candidates) and the
thread that works it, one state machine under one lock. May import: every layer below
runtime, and runtime.connect, outage, persist_step, ranks, slots, upkeep. Not for: one persist's
copy (persist_step.py), retention and the history (upkeep.py), the commit protocol itself
(commit.py) or process-wide state (session.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from nebulaml.errors import NebulaError, PersistError, PersistTimeoutError
from nebulaml.format.manifest import utc_now
from nebulaml.format.names import marker_name, order_key, step_of
from nebulaml.protocol.catalog import CheckpointInfo, highest_sequence, list_committed
from nebulaml.protocol.delete import delete_checkpoint, delete_part
from nebulaml.protocol.history import HistoryRow, make_row, skipped_row
from nebulaml.protocol.markers import own_parts
from nebulaml.protocol.retention import Version, plan_retention
from nebulaml.protocol.tiers import TierSet
from nebulaml.runtime.connect import keep_root
from nebulaml.runtime.outage import (
    RETRY_FIRST_S,
    RETRY_MAX_S,
    Outage,
    is_broken,
    may_pass,
    next_backoff,
)
from nebulaml.runtime.persist_step import (
    discard_partial,
    leader_of,
    persist_part,
    persist_whole,
)
from nebulaml.runtime.ranks import RankInfo
from nebulaml.runtime.slots import SlotPool
from nebulaml.runtime.upkeep import HistoryQueue, retire
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")

FOLLOW_POLL_S = 0.2  # how often a follower looks for rank 0's persisted markers
# What a session that has not reached its persistent tier yet gives the persister: run
# before the first persist, it reaches the root and lists what it holds committed.
Connect = Callable[[], Sequence[CheckpointInfo]]


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
        # Flush requests and labelled checkpoints: persisted in order, the interval
        # ignored, never superseded.
        self._forced: list[str] = []
        self._inflight: str | None = None
        self._last_start: float | None = None
        self._done: dict[str, BaseException | None] = {}
        self._error: PersistError | None = None
        # The persistent tier failing ("retry"): since when, the last error, when to try
        # again, and the next backoff. Warned once per outage, and once when it ends.
        self._outage: Outage | None = None
        self._retry_at: float | None = None
        self._backoff_s = RETRY_FIRST_S
        self._failed_once: set[str] = set()  # tags with a `failed` row in this outage
        self._failures = 0  # failed persists so far: a flush waits for one of its own
        self._gave_up = False  # exiting, and the last try failed: what is left stays
        self._inflight_forced = False
        self._durable: str | None = None  # the newest tag this process made durable
        self.history = HistoryQueue(lambda: self.tiers.history_store)
        self._retention_lock = threading.Lock()  # the thread and a streamed commit apply it
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
        self._thread.start()

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
    ) -> None:
        """A tag was committed in the memory tier: it becomes the one to persist next,
        superseding the pending one. A labelled tag (`labels`) is queued instead: it is
        persisted without waiting for the interval and is never superseded. `leader`:
        the lowest rank that writes the tag, which decides whether it is persisted."""
        if row is not None:
            self.history.add(row)
        with self._cond:
            if self.tiers.persistent is not None:
                self._done.pop(tag, None)
                self._leaders[tag] = leader
                if self._follows(tag):
                    # Its leader decides what is persisted and what skipped; this follows.
                    self._pending = tag
                    if tag not in self._candidates:
                        self._candidates.append(tag)
                else:
                    self._supersede_pending(tag)
                    if not labels:
                        self._pending = tag
                    elif tag not in self._forced:
                        self._forced.append(tag)
            self._cond.notify_all()
        self.evict_memory()

    def notify_streamed(self, tag: str, row: HistoryRow, *, leader: int = 0) -> None:
        """A tag too large for the memory budget was committed straight to the persistent
        tier: older pending copies are superseded, and retention runs on the thread."""
        self.history.add(row)
        with self._cond:
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
        copy never reads a tag being replaced."""
        with self._cond:
            if self._pending == tag:
                self._pending = None
            for queue in (self._forced, self._candidates):
                while tag in queue:
                    queue.remove(tag)
            while self._inflight == tag:
                self._cond.wait(timeout=1.0)
            self._done.pop(tag, None)

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

    @property
    def connected(self) -> bool:
        """Whether the persistent tier was reached (always, without one)."""
        with self._cond:
            return self._connect is None

    def failing(self) -> bool:
        """Whether the persistent tier is failing now, or was never reached."""
        with self._cond:
            return self._outage is not None or self._connect is not None

    def _learn(self, committed: Sequence[CheckpointInfo]) -> None:
        """What the persistent tier holds committed, as listed (at the start, or once it
        is reached)."""
        with self._cond:
            self._sequence = max([self._sequence, *(c.sequence for c in committed)])
            self._durable_tags |= {c.tag for c in committed}

    def status(self) -> dict[str, object]:
        """What is durable and what is not (`nm.persistence_status()`)."""
        with self._cond:
            outage = self._outage
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
                self._retry_at = None
                tries = self._failures
                self._cond.notify_all()
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
                while target not in self._done:
                    if not self._thread.is_alive():
                        raise PersistTimeoutError(f"the persister stopped before {target!r}")
                    outage = self._outage
                    fresh = self._failures > tries  # this flush's own try failed
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
            else:
                target = None
        self.history.write()
        return target

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

    def _note_sequence(self, sequence: int) -> None:
        with self._cond:
            self._sequence = max(self._sequence, sequence)

    def protected(self) -> set[str]:
        """Tags the memory tier must keep: pending, in flight, or queued (asked for, or
        labelled and not yet persisted)."""
        with self._cond:
            return {
                t for t in (self._pending, self._inflight, *self._forced, *self._candidates) if t
            }

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
        if self.ranks.world_size > 1:
            versions = [Version(t, created, ()) for t, created in own_parts(memory, self.rank)]
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
            # Re-check under the lock: a flush may have asked for it meanwhile.
            if tag in self.protected():
                continue
            recycle = self.pool.recycle if self.pool is not None else None
            if self.ranks.world_size > 1:
                delete_part(memory, tag, self.rank, discard=recycle)
            else:
                delete_checkpoint(memory, tag, discard=recycle)

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

    def close(self, timeout_s: float | None = None) -> str | None:
        """Persist what is pending, stop the thread, write the history.

        Returns the tag that could not be persisted within `timeout_s`, else None.
        """
        with self._cond:
            self._stopping = True
            if self._pending is not None:
                self._forced.append(self._pending)
                self._pending = None
            self._cond.notify_all()
        self._thread.join(timeout_s)
        with self._cond:
            if self._thread.is_alive() or self._gave_up:
                return self._inflight or (self._forced[0] if self._forced else self._pending)
        return None

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
        log.debug("%r superseded by %r before its persist: skipped", old, by)
        if self._leaders.get(old, 0) == self.rank:
            row = skipped_row(
                tag=old, step=step_of(old), rank=self.rank, started_at=utc_now(), superseded_by=by
            )
            self.history.add(row)

    # the thread ---------------------------------------------------------------------
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
        if self._retry_at is not None and time.monotonic() < self._retry_at:
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
            or self._outage is not None
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
                    if self._candidates and self.tiers.persistent is not None:
                        probe = list(self._candidates)
                        break
                    self._cond.wait(timeout=self._wait_s())
                if tag is not None:
                    self._inflight = tag
                    self._last_start = time.monotonic()
                wrote = self.history.due()
                finished = tag is None and not wrote and not probe and self._finished()
            self.history.write()
            if finished:
                return
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

    def _wait_s(self) -> float | None:
        """Under the lock: how long the thread may sleep before something is due (None:
        until notified)."""
        now = time.monotonic()
        due: list[float] = []
        if self._pending is not None and self._last_start is not None:
            due.append(self._last_start + self.interval_s)
        if self._retry_at is not None and (self._pending or self._forced):
            due.append(self._retry_at)
        history_retry = self.history.retry_at()
        if history_retry is not None:
            due.append(history_retry)
        return max(0.0, min(due) - now) if due else None

    def _retry_later(self, tag: str, error: PersistError) -> None:
        """Under the lock: the persist of `tag` failed ("retry"): it stays queued where it
        was (a newer commit still supersedes an unlabelled one), and the thread tries again
        after a capped backoff. The first failure of an outage is warned about."""
        now = time.monotonic()
        self._failures += 1
        hopeless = not may_pass(error)
        if self._outage is None:
            self._outage = Outage(started=now, since_utc=utc_now(), error=error)
            self._outage.hopeless = hopeless
            log.warning(
                "could not persist %r to %s: %s. The memory tier keeps it and nebula tries "
                "again (every %.0f s at most) until it is durable; training goes on",
                tag, self.tiers.display, error.__cause__ or error, RETRY_MAX_S,
            )  # fmt: skip
        else:
            self._outage.error, self._outage.hopeless = error, hopeless
            log.debug("persist of %r failed again: %s", tag, error)
        if self._stopping:
            # Exiting: this was the last try. The memory tier keeps the checkpoint for the
            # next init on this node; the exit names it and the failure.
            self._error = error
            self._gave_up = True
        self._retry_at = now + self._backoff_s
        self._backoff_s = next_backoff(self._backoff_s)
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

    def _landed(self, tag: str) -> None:
        """Under the lock: `tag` is durable; an outage, if any, is over."""
        self._durable_tags.add(tag)
        if self._durable is None or order_key(tag, "") >= order_key(self._durable, ""):
            self._durable = tag
        outage, self._outage = self._outage, None
        self._retry_at, self._backoff_s = None, RETRY_FIRST_S
        self._failed_once.clear()
        if outage is not None:
            log.warning(
                "the persistent tier %s works again after %.0f s: %r is durable",
                self.tiers.display, time.monotonic() - outage.started, tag,
            )  # fmt: skip

    def _follow_leader(self, candidates: list[str]) -> None:
        """Queue the candidates their leader has started to persist; drop older ones it
        skipped.

        A leader persists tags in order, one at a time, so once its marker of a tag is
        visible, the markers of every older tag it persisted are visible too. A skipped
        tag's history row is the leader's (it knows which commit superseded it); this rank
        writes none.
        """
        persistent = self.tiers.persistent
        assert persistent is not None
        with self._cond:
            leaders = {t: self._leaders.get(t, 0) for t in candidates}
        try:
            led = [t for t in candidates if persistent.exists(t, marker_name(leaders[t]))]
        except NebulaError as exc:
            log.warning("could not look for the leaders' persisted checkpoints: %s", exc)
            led = []
        with self._cond:
            if led:
                newest: dict[int, str] = {}  # each leader's newest persisted candidate
                for t in sorted(led, key=lambda t: order_key(t, "")):
                    newest[leaders[t]] = t
                for tag in candidates:
                    last = newest.get(leaders[tag])
                    if tag in self._candidates and (
                        tag in led
                        or (last is not None and order_key(tag, "") < order_key(last, ""))
                    ):
                        self._candidates.remove(tag)
                        if tag in led and tag not in self._forced:
                            self._forced.append(tag)
                if self._pending in led:
                    self._pending = None
                self._cond.notify_all()
            elif self._stopping:
                # Exiting: what the leaders have not started by now, they skipped.
                for tag in candidates:
                    if tag in self._candidates:
                        self._candidates.remove(tag)
            else:
                self._cond.wait(timeout=FOLLOW_POLL_S)

    def _finished(self) -> bool:
        if self._stopping and self._gave_up:
            return True
        return (
            self._stopping and self._pending is None and not self._forced and not self._candidates
        )

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
                    self.tiers, tag, self.ranks, leader=leader, rank_timeout_s=self.rank_timeout_s
                )
            else:
                size, sequence = persist_whole(self.tiers, tag)
                self._note_sequence(sequence)
            if leader == self.rank:
                self._apply_retention(tag)
        except PersistError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - reported as the persist's error, not dropped
            error = PersistError(tag, persistent.url, exc)
            error.__cause__ = exc
        if error is not None:
            if self.on_error == "raise":
                log.error("%s", error)
            if self.connected:
                discard_partial(persistent, tag, self.ranks)
            with self._cond:
                repeated = self.on_error == "retry" and tag in self._failed_once
                self._failed_once.add(tag)
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
            )
        )
        return error

    def _apply_retention(self, just_persisted: str) -> None:
        persistent = self.tiers.persistent
        assert persistent is not None
        with self._retention_lock:
            held, sequence = retire(persistent, self.retention, just_persisted)
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
