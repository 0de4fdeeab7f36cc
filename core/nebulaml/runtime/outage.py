"""The persistent tier failing (issue #27): which failures may pass by themselves, the
backoff between tries, and the record of one outage.

A store that is down, a disk that is full, a network filesystem's I/O error: the
persister keeps what it could not persist in the memory tier and tries again, every
`RETRY_FIRST_S` doubling up to `RETRY_MAX_S`, until it lands. A failure no retry can fix
(a permission refused, a corrupt memory copy, a rank's part that never came) is said at
once instead.

May import: `nebulaml.errors` and `nebulaml.storage`. Not for: what the persister does
about an outage (persister.py).
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from nebulaml.errors import (
    CheckpointStateError,
    CommitConflictError,
    CorruptCheckpointError,
    ManifestError,
    NebulaError,
    PersistError,
    RankTimeoutError,
    StorageFullError,
)
from nebulaml.storage.retry import is_transient

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
_HOPELESS = (
    RankTimeoutError, CheckpointStateError, CorruptCheckpointError, ManifestError,
    CommitConflictError,
)  # fmt: skip


def may_pass(error: BaseException) -> bool:
    """Whether trying again later may succeed: what the persistent tier's failure is made
    of, down its chain of causes.

    Example:
        >>> from nebulaml.errors import StorageFullError
        >>> may_pass(StorageFullError("disk full")), may_pass(PermissionError(13, "denied"))
        (True, False)
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, StorageFullError):
            return True
        if isinstance(current, _HOPELESS):
            return False
        if not isinstance(current, NebulaError):
            if isinstance(current, OSError) and current.errno in _PASSING_ERRNOS:
                return True
            if is_transient(current):
                return True
        current = current.__cause__ or current.__context__
    return False


_BROKEN = (CheckpointStateError, CorruptCheckpointError, ManifestError, CommitConflictError)


def is_broken(error: BaseException) -> bool:
    """Whether the failure is the checkpoint's own, not the store's (two ranks saved one
    item name, a corrupt memory copy): no retry can ever persist it as it is, so it is
    reported and dropped, as with `on_persist_error="raise"`.

    Example:
        >>> from nebulaml.errors import StorageFullError
        >>> is_broken(StorageFullError("disk full"))
        False
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, _BROKEN):
            return True
        current = current.__cause__ or current.__context__
    return False


def next_backoff(backoff_s: float) -> float:
    """The wait after the next failure, given this one's.

    Example:
        >>> next_backoff(RETRY_FIRST_S), next_backoff(RETRY_MAX_S)
        (1.0, 30.0)
    """
    return min(backoff_s * 2, RETRY_MAX_S)
