"""Long-lived worker threads for the work a save hands off: no thread started per save.

Starting a thread costs the caller about a millisecond on an idle machine and several on
a busy one (`Thread.start` waits until the new thread runs), and a save of a frozen base
used to start three: a fill helper per item and an audit. A `Crew` keeps its threads
(started on first use, and again in a forked child) and runs the calls submitted to it in
order. A `Job` not started yet can be taken back (`Job.take_back`): a fill whose caller
finished every piece first does not wait for its helper to wake up.

    FILL_CREW     the fill's helper (snapshot.py), at the caller's priority
    AUDIT_CREW    the audits of what a fill did not copy (unchanged.py), at low priority
    EVICT_CREW    the memory-tier eviction a commit asks for (persister.notify_committed),
                  at low priority

The low-priority crews work *between* saves: `QUIET.saving()` is held around each call
of a synchronous save and commit, and while it is, those crews start no job and an audit
stops at its next chunk (`QUIET.pause_point`). Low priority alone did not keep them out
of the save: on 2 cores, an audit of the first item's frozen base ran beside the second
item's copy and the commit, and the frozen-base save took 2 ms more (a third of it). A
caller that needs a paused job's result (`QUIET.hurry()`: a fill waiting for the last
audit of its buffer) lets it run on. A persist pauses too, between its chunks
(`SaveYield`, bounded: a save may wait for the persist itself).

May import: runtime/pages.py (lower_priority). Not for: what the jobs do (snapshot.py,
unchanged.py, persist_actions.py).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from nebulaml._threads import start as start_thread
from nebulaml.runtime.pages import lower_priority

log = logging.getLogger("nebulaml")


class Job:
    """One call submitted to a `Crew`: waited for (`wait`), or taken back before it starts."""

    __slots__ = ("_done", "_fn", "_lock", "_state")

    def __init__(self, fn: Callable[[], object]) -> None:
        self._fn = fn
        self._state = "queued"  # queued -> running -> done, or queued -> taken back
        self._done = threading.Event()
        self._lock = threading.Lock()

    def _run(self) -> None:
        with self._lock:
            if self._state != "queued":
                return
            self._state = "running"
        try:
            self._fn()
        except BaseException:  # the submitter sees what its call left undone
            log.debug("a %s job failed", threading.current_thread().name, exc_info=True)
        finally:
            self._fn = _nothing  # drop what the call held (a buffer's view, its storages)
            self._state = "done"
            self._done.set()

    def take_back(self) -> bool:
        """True if the job had not started: it never will. False: it runs or ran
        (`wait` for it)."""
        with self._lock:
            if self._state != "queued":
                return False
            self._state = "taken back"
        self._fn = _nothing
        self._done.set()
        return True

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until the job has run, or was taken back (True), or `timeout_s` passed."""
        return self._done.wait(timeout_s)

    def done(self) -> bool:
        """Whether it ran, or was taken back."""
        return self._done.is_set()


def _nothing() -> None:
    return None


class Quiet:
    """Whether a save is running: background upkeep waits for it to end (module
    docstring).

    Example:
        >>> quiet = Quiet()
        >>> with quiet.saving():
        ...     quiet.busy()
        True
        >>> quiet.busy()
        False
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._saves = 0  # save calls running (several threads may save)
        self._hurry = 0  # callers waiting for a paused job's result
        self.generation = 0  # save calls begun so far

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Held around a save call: the low-priority crews wait until it returns."""
        with self._cond:
            self._saves += 1
            self.generation += 1
        try:
            yield
        finally:
            with self._cond:
                self._saves -= 1
                self._cond.notify_all()

    @contextmanager
    def hurry(self) -> Iterator[None]:
        """Held while waiting for a low-priority job: it runs on through saves."""
        with self._cond:
            self._hurry += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._hurry -= 1

    def busy(self) -> bool:
        """Whether a save runs (and nobody hurries the crews)."""
        with self._cond:
            return self._saves > 0 and not self._hurry

    def pause_point(self, timeout_s: float | None = None) -> bool:
        """Wait while a save runs, unless someone hurries (a low-priority job's loop
        calls this between its chunks); False if `timeout_s` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._saves > 0 and not self._hurry:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True


QUIET = Quiet()
# The longest a persist waits at one pause for a save to end (`SaveYield`).
YIELD_MAX_S = 1.0


class SaveYield:
    """A pause for a long job a save may itself wait for (a persist: the memory budget's
    flush, a tag saved again): called between the job's chunks, it waits while a save
    runs (`QUIET`), at most `max_s`; once a wait runs out, it does not pause again
    during that save, which may be waiting for this very job. A save that waits for one
    says so (`QUIET.hurry`), and then it does not pause at all.

    Example:
        >>> pause = SaveYield(max_s=0.01)
        >>> with QUIET.saving():
        ...     pause(); pause()   # the first waits 10 ms, the second not at all
        >>> pause()                # no save runs: no wait
    """

    def __init__(self, max_s: float = YIELD_MAX_S) -> None:
        self.max_s = max_s
        self._given_up = -1  # the save (QUIET.generation) not to wait for again

    def __call__(self) -> None:
        generation = QUIET.generation
        if generation != self._given_up and not QUIET.pause_point(self.max_s):
            self._given_up = generation


class Crew:
    """`size` daemon threads named `name` that run submitted calls in order; with `nice`,
    at low priority (pages.lower_priority) and between saves (`QUIET`). A call that
    raises is dropped (its submitter checks what it left undone).

    Example:
        >>> crew = Crew("doc-crew", 1)
        >>> out = []
        >>> job = crew.submit(lambda: out.append(1))
        >>> job.wait(5), out
        (True, [1])
    """

    def __init__(self, name: str, size: int, *, nice: bool = False) -> None:
        self.name = name
        self.size = size
        self.nice = nice  # low priority, and between saves (QUIET)
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[Job] = collections.deque()
        self._threads: list[threading.Thread] = []
        self._pid = os.getpid()

    def submit(self, fn: Callable[[], object]) -> Job:
        """Queue `fn`; raises RuntimeError when no thread can run it (the interpreter is
        exiting): the caller does the work itself."""
        job = Job(fn)
        with self._cond:
            self._staff()  # RuntimeError at interpreter exit: nothing was queued
            self._queue.append(job)
            self._cond.notify()
        return job

    def start(self) -> None:
        """Start the crew's threads now, before its first job: starting one costs the
        caller a millisecond or more, which a save that submits a job should not pay.
        Raises RuntimeError at interpreter exit."""
        with self._cond:
            self._staff()

    def _staff(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's threads are not here
            self._pid, self._threads, self._queue = os.getpid(), [], collections.deque()
        self._threads = [t for t in self._threads if t.is_alive()]
        while len(self._threads) < self.size:
            thread = threading.Thread(target=self._work, name=self.name, daemon=True)
            start_thread(thread)
            self._threads.append(thread)

    def _work(self) -> None:
        if self.nice:
            lower_priority()
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                job = self._queue.popleft()
            if self.nice:
                QUIET.pause_point()  # a save runs: after it
            job._run()


FILL_CREW = Crew("nebula-fill", 1)
AUDIT_CREW = Crew("nebula-audit", 1, nice=True)
EVICT_CREW = Crew("nebula-evict", 1, nice=True)
