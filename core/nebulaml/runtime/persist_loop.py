"""The persister's thread: it waits until the schedule has something to do, asks it what
(persist_schedule.py's `Schedule.decide`), runs the action (persist_actions.py) and
records the outcome, turn after turn, until the schedule says it is finished.

A turn writes the history rows that wait (history_queue.py), runs the removals a
framework asked for when no persist is due, looks for a follower's leaders' markers or
commits, or persists one tag; after a persist that lands, the memory tier's copies the
schedule no longer needs are evicted. The thread runs at a lower CPU priority than
training.

May import: every layer below runtime, and runtime.persist_actions, persist_schedule, steps and
history_queue. Not for: deciding what to do, or when (persist_schedule.py), what an action does
(persist_actions.py), or the training thread's calls (persister.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from nebulaml._threads import start as start_thread
from nebulaml.format.manifest import utc_now
from nebulaml.format.names import step_of
from nebulaml.protocol.history import skipped_row
from nebulaml.runtime.history_queue import HistoryQueue
from nebulaml.runtime.persist_actions import Eviction, Following, Persisting, Removals
from nebulaml.runtime.persist_schedule import Schedule, Skip, Turn, Upkeep
from nebulaml.runtime.steps import trace

log = logging.getLogger("nebulaml")

PERSIST_NICE = 10


def record_skips(skips: list[Skip], schedule: Schedule, history: HistoryQueue) -> None:
    """What the schedule skipped: the leader's `skipped` history rows (the outage's record
    already counted one never durable)."""
    for skip in skips:
        if not skip.dropped:
            log.debug("%r superseded by %r before its persist: skipped", skip.tag, skip.by)
        if skip.row:
            history.add(
                skipped_row(
                    tag=skip.tag,
                    step=step_of(skip.tag),
                    rank=schedule.rank,
                    started_at=utc_now(),
                    superseded_by=skip.by,
                )
            )


class PersistLoop:
    """The thread that works one persister's schedule (its state under `cond`)."""

    def __init__(
        self,
        schedule: Schedule,
        cond: threading.Condition,
        *,
        history: HistoryQueue,
        persisting: Persisting,
        eviction: Eviction,
        following: Following,
        removals: Removals,
    ) -> None:
        self.schedule, self.cond = schedule, cond
        self.history = history
        self.persisting = persisting
        self.eviction = eviction
        self.following = following
        self.removals = removals
        self.thread = threading.Thread(target=self.run, name="nebula-persister", daemon=True)

    def start(self) -> None:
        start_thread(self.thread)

    def alive(self) -> bool:
        return self.thread.is_alive()

    def _upkeep(self) -> Upkeep:
        queue = self.removals.queue
        return Upkeep(
            history_due=self.history.due(),
            removals_due=queue.due(),
            removals_pending=bool(queue.pending()),
        )

    def _next_turn(self) -> Turn:
        """Under the lock: wait until the schedule has something for the thread to do."""
        while True:
            turn = self.schedule.decide(time.monotonic(), self._upkeep())
            if turn is not None:
                return turn
            retries = (self.history.retry_at(), self.removals.queue.retry_at())
            self.cond.wait(timeout=self.schedule.wait_s(time.monotonic(), retries))

    def run(self) -> None:
        _lower_priority()
        queue = self.removals.queue
        while True:
            with self.cond:
                turn = self._next_turn()
            self.history.write()
            if turn.remove:
                queue.run(self.removals.remove, last=self.schedule.stopping)
            if turn.finished:
                return
            if turn.see_commits:
                self.following.see_commits()
            if turn.probe:
                self.following.follow(list(turn.probe))
                continue
            if turn.persist is None:
                continue
            trace("persist", turn.persist)  # and, when this rank leads it, "retain"
            error = self.persisting.persist(turn.persist)
            with self.cond:
                skips = self.schedule.persisted(turn.persist, error, time.monotonic())
                record_skips(skips, self.schedule, self.history)
                self.cond.notify_all()
            if error is None:
                trace("evict", turn.persist)
                self.eviction.evict_or_warn()
            if queue.due():  # not only when idle: persists may follow one another
                queue.run(self.removals.remove, last=self.schedule.stopping)


def _lower_priority() -> None:
    """Run this (the persister's) thread at a lower CPU priority than training: on a
    machine with few cores a persist competes with the training step for them, and the
    step matters more than how soon the copy is durable. Linux sets it per thread."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PERSIST_NICE)
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed: keep going
        log.debug("could not lower the persister's priority: %s", exc)
