"""The persistent tier failing (issue #27): which failures may pass by themselves, the
backoff between tries, and the record of one outage.

A store that is down, a disk that is full, a network filesystem's I/O error: the
persister keeps what it could not persist in the memory tier and tries again, every
`RETRY_FIRST_S` doubling up to `RETRY_MAX_S`, until it lands. A failure no retry can fix
(a permission refused, a corrupt memory copy, a rank's part that never came) is said at
once instead.

    OutageWatch  one persister's record of it: the outage, when to try next, the tags
                 with a `failed` history row in it, those dropped never persisted (a
                 newer one superseded them); warned once when it starts, once at the
                 first drop, and once when it ends (with the count of drops)

May import: `nebulaml.errors`, `nebulaml.format` and `nebulaml.storage`. Not for: what the
persister queues and tries (persister.py).
"""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import dataclass, field

from nebulaml.errors import (
    CheckpointBusyError,
    CheckpointStateError,
    CommitConflictError,
    CorruptCheckpointError,
    ManifestError,
    NebulaError,
    PersistError,
    RankTimeoutError,
    StorageFullError,
    StoreTimeoutError,
    exception_chain,
)
from nebulaml.format.manifest import utc_now
from nebulaml.storage.retry import is_transient

log = logging.getLogger("nebulaml")

RETRY_FIRST_S = 0.5  # the first wait after a failed persist, doubling
RETRY_MAX_S = 30.0  # the longest wait between two tries


@dataclass(slots=True)
class Outage:
    """The persistent tier failing: since when (monotonic, and UTC for people), and the
    last failure."""

    started: float
    since_utc: str
    error: PersistError
    # No retry can fix the last failure: flush() raises it at once, and exit gives up.
    hopeless: bool = False


# What a store or a disk gets over by itself: a full disk freed or grown, an I/O error of a
# network filesystem, a store that does not answer (refused or reset, timeouts, 5xx).
_PASSING_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN,
     errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENETUNREACH}
)  # fmt: skip
# The checkpoint's own failures (`is_broken`): never retried. With a rank's part that
# never came, they are what no retry can fix (`may_pass`).
_BROKEN = (CheckpointStateError, CorruptCheckpointError, ManifestError, CommitConflictError)
_HOPELESS = (RankTimeoutError, *_BROKEN)


def may_pass(error: BaseException) -> bool:
    """Whether trying again later may succeed: what the persistent tier's failure is made
    of, down its chain of causes.

    Example:
        >>> from nebulaml.errors import CheckpointBusyError, StorageFullError
        >>> may_pass(StorageFullError("disk full")), may_pass(PermissionError(13, "denied"))
        (True, False)
        >>> may_pass(CheckpointBusyError("/ckpt", "global_step2", "pid 7 on node1"))
        True
    """
    for current in exception_chain(error):
        if isinstance(current, (StorageFullError, StoreTimeoutError, CheckpointBusyError)):
            # A full disk is freed or grown; a store that hangs answers again; another
            # live writer of the tag finishes (a rank of the job copying this rank's part
            # for it, a reader, an operator).
            return True
        if isinstance(current, _HOPELESS):
            return False
        if not isinstance(current, NebulaError):
            if isinstance(current, OSError) and current.errno in _PASSING_ERRNOS:
                return True
            if is_transient(current):
                return True
    return False


def is_broken(error: BaseException) -> bool:
    """Whether the failure is the checkpoint's own, not the store's (two ranks saved one
    item name, a corrupt memory copy): no retry can ever persist it as it is, so it is
    reported and dropped, as with `on_persist_error="raise"`.

    Example:
        >>> from nebulaml.errors import StorageFullError
        >>> is_broken(StorageFullError("disk full"))
        False
    """
    return any(isinstance(current, _BROKEN) for current in exception_chain(error))


def next_backoff(backoff_s: float) -> float:
    """The wait after the next failure, given this one's.

    Example:
        >>> next_backoff(RETRY_FIRST_S), next_backoff(RETRY_MAX_S)
        (1.0, 30.0)
    """
    return min(backoff_s * 2, RETRY_MAX_S)


@dataclass(slots=True)
class OutageWatch:
    """One persister's record of its persistent tier (`where`) failing; used under the
    persister's lock.

    Example:
        >>> from nebulaml.errors import PersistError, StorageFullError
        >>> watch = OutageWatch("/mnt/ckpt")
        >>> full = PersistError("global_step2", "/mnt/ckpt", StorageFullError("disk full"))
        >>> watch.failed("global_step2", full)
        >>> watch.outage is not None and watch.waiting()
        True
        >>> watch.landed("global_step2")
        >>> watch.outage is None and not watch.waiting()
        True
    """

    where: str
    outage: Outage | None = None
    retry_at: float | None = None  # not before (monotonic)
    backoff_s: float = RETRY_FIRST_S
    failed_rows: set[str] = field(default_factory=set)  # tags with a `failed` row in it
    failures: int = 0  # failed persists so far: a flush waits for one of its own
    dropped: list[str] = field(default_factory=list)  # failed in it, then superseded

    def waiting(self, now: float | None = None) -> bool:
        """Whether the backoff after a failure is not over yet (at `now`, monotonic: the
        clock's, unless given)."""
        now = time.monotonic() if now is None else now
        return self.retry_at is not None and now < self.retry_at

    def try_now(self) -> None:
        """The next try goes at once (a flush asked)."""
        self.retry_at = None

    def first_row(self, tag: str) -> bool:
        """Whether `tag`'s failure is its first in this outage (it gets a `failed` row)."""
        first = tag not in self.failed_rows
        self.failed_rows.add(tag)
        return first

    def failed(self, tag: str, error: PersistError, now: float | None = None) -> None:
        """The persist of `tag` failed (at `now`, monotonic: the clock's, unless given):
        the outage starts (warned) or goes on, and the next try waits the backoff, which
        doubles."""
        now = time.monotonic() if now is None else now
        self.failures += 1
        hopeless = not may_pass(error)
        if self.outage is None:
            self.outage = Outage(started=now, since_utc=utc_now(), error=error, hopeless=hopeless)
            log.warning(
                "could not persist %r to %s: %s. The memory tier keeps it and nebula tries "
                "again (every %.0f s at most) until it is durable; training goes on",
                tag, self.where, error.__cause__ or error, RETRY_MAX_S,
            )  # fmt: skip
        else:
            self.outage.error, self.outage.hopeless = error, hopeless
            log.debug("persist of %r failed again: %s", tag, error)
        self.retry_at = now + self.backoff_s
        self.backoff_s = next_backoff(self.backoff_s)

    def superseded(self, tag: str, by: str) -> None:
        """`tag`, whose persist failed in this outage, is superseded by the newer `by` and
        dropped without ever being durable: warned at the first in an outage, counted
        after (the count is said when it ends).

        Example:
            >>> watch = OutageWatch("/mnt/ckpt")
            >>> watch.superseded("global_step2", "global_step3")
            >>> watch.superseded("global_step3", "global_step4")
            >>> watch.dropped
            ['global_step2', 'global_step3']
        """
        self.dropped.append(tag)
        if len(self.dropped) > 1:
            log.debug("%r was never persisted and the newer %r supersedes it", tag, by)
            return
        log.warning(
            "%r was never persisted (the persistent tier fails) and the newer %r "
            "supersedes it: dropped from the memory tier, which keeps %r until it is "
            "durable (others dropped so in this outage are counted, and said when it "
            "ends)", tag, by, by,
        )  # fmt: skip

    def landed(self, tag: str) -> None:
        """`tag` is durable: an outage, if any, is over (warned, with the checkpoints it
        dropped)."""
        outage, self.outage = self.outage, None
        dropped, self.dropped = self.dropped, []
        self.retry_at, self.backoff_s = None, RETRY_FIRST_S
        self.failed_rows.clear()
        if outage is not None:
            lost = ""
            if dropped:
                first, last = dropped[0], dropped[-1]
                span = repr(first) if first == last else f"{first!r} to {last!r}"
                count = len(dropped)
                lost = f"; {count} checkpoint(s) superseded during it were never persisted ({span})"
            log.warning(
                "the persistent tier %s works again after %.0f s: %r is durable%s",
                self.where, time.monotonic() - outage.started, tag, lost,
            )  # fmt: skip
