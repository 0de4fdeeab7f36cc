"""Two writers of one tag at one destination, cooperating instead of failing (issue #18).

An operator's `nebula copy ROOT --latest persistent` or `nebula flush ROOT` may copy into
the persistent tier the very checkpoint the job's persister is copying there. Each finds
the other's writer marker (markers.py) and would refuse (`CheckpointBusyError`), or both
write and one loses the create-only manifest (`CommitConflictError`). Both copy the same
committed source, so neither needs to fail:

    copy_alongside  `transfer.copy_checkpoint`, but one writer at a time per destination
                    tag on this node (an flock, `writing`): the second waits (up to
                    `wait_s`), then takes the first one's committed copy, when it has the
                    same items, as done; a live writer elsewhere (its writer marker) is
                    waited for too; and a manifest published first by another writer with
                    the same items is the commit, not a conflict

Writer markers alone cannot keep two writers apart: each looks for the other's, then
writes its own, and two that look at once both go on (and clear each other's files). The
node's processes therefore take a lock first: a file of that destination and tag alone
in this user's memory-tier base folder (`.nebula-writing-<digest>.lock`, the digest of
the destination's location and the tag), so that writers of other roots or tags never
wait for each other (64 shared files did: an unrelated job's 1 KiB persist waited 5 s
for a 189 MB one, and would have failed past `BUSY_WAIT_S`); a lock dies with its
process, and its file goes when the writer is done (a waiter checks that the file it
locked is still the one at the path).

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage`, catalog.py,
markers.py, memory_tier.py and transfer.py. Not for: the copy itself (transfer.py) or when to copy
(persister.py, ops/copying.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from nebulaml.errors import CheckpointBusyError, CommitConflictError, NebulaError
from nebulaml.format.names import WRITING_PREFIX, writer_marker_name
from nebulaml.protocol.catalog import CheckpointInfo, read_committed
from nebulaml.protocol.markers import read_writers
from nebulaml.protocol.memory_tier import ensure_private_dir, memory_base
from nebulaml.protocol.transfer import CopyResult, copy_checkpoint
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")

BUSY_WAIT_S = 300.0  # how long a copy waits for another live writer of its tag
_LOCK_DIGEST_BYTES = 16  # of sha256(location, tag), in the lock file's name


def copy_alongside(
    src: CheckpointInfo, dst: Store, *, wait_s: float | None = None, **options: Any
) -> CopyResult:
    """`copy_checkpoint(src, dst, **options)`, cooperating with another live writer of the
    same tag at `dst` (see the module docstring). Raises `CheckpointBusyError` if the other
    writer is still at it after `wait_s` (default `BUSY_WAIT_S`); says once that it waits.

    Example:
        >>> import tempfile, nebulaml as nm
        >>> from nebulaml.protocol.catalog import read_committed
        >>> root = tempfile.mkdtemp()
        >>> nm.init(root, persistent_time_interval=0)
        >>> nm.Checkpoint("global_step1").save("model", {"w": 1})
        >>> nm.flush_persistence()
        True
        >>> src = read_committed(Store(root), "global_step1")
        >>> copy_alongside(src, Store(tempfile.mkdtemp())).copied_items
        ('model',)
    """
    wait_s = BUSY_WAIT_S if wait_s is None else wait_s
    deadline = time.monotonic() + wait_s
    said: list[str] = []
    with writing(dst, src.tag, deadline, said, wait_s):
        return _copy_waiting(src, dst, deadline, options, said, wait_s)


def _waiting(exc: CheckpointBusyError, said: list[str], wait_s: float) -> None:
    """Say once that the copy waits for the other writer."""
    if not said:
        said.append(exc.writer)
        log.warning("%s: checkpoint %r is in use by %s; waiting for it (up to %g s)",
                    exc.where, exc.tag, exc.writer, wait_s)  # fmt: skip


def _copy_waiting(
    src: CheckpointInfo,
    dst: Store,
    deadline: float,
    options: dict[str, Any],
    said: list[str],
    wait_s: float,
) -> CopyResult:
    delay_s = 0.02
    while True:
        try:
            return copy_checkpoint(src, dst, **options)
        except CheckpointBusyError as exc:
            # Nothing was written: another live process writes (or reads) the tag there.
            if time.monotonic() >= deadline:
                raise
            _waiting(exc, said, wait_s)
        except CommitConflictError:
            # Both wrote; the other published first. The same items: that is the commit.
            existing = read_committed(dst, src.tag)
            if existing is None or existing.manifest.items != src.manifest.items:
                raise
            _drop_own_marker(dst, src.tag)
            return CopyResult(existing.manifest, unchanged=True)
        time.sleep(delay_s)
        delay_s = min(0.5, delay_s * 2)


def _drop_own_marker(dst: Store, tag: str) -> None:
    """Remove the writer marker of the copy that lost the race, if it is still ours."""
    with contextlib.suppress(NebulaError):
        if any(w.get("pid") == os.getpid() for w in read_writers(dst, tag)):
            dst.remove(tag, writer_marker_name(0))


@contextlib.contextmanager
def writing(
    dst: Store, tag: str, deadline: float, said: list[str] | None = None, wait_s: float = 0.0
) -> Iterator[None]:
    """Be this node's only writer of `tag` at `dst` for the block: an exclusive flock on
    the lock file of that destination and tag, waited for until `deadline` (then
    `CheckpointBusyError`). Where the memory-tier base folder cannot be used, nothing is
    locked (the markers still are).

    The lock file is removed when the block ends (a job leaves none behind): a lock
    counts only while its file is still the one at the path, so a waiter that locked a
    removed file opens the path again."""
    try:
        folder = memory_base()
        ensure_private_dir(folder)
        key = hashlib.sha256(f"{dst.location}\0{tag}".encode()).hexdigest()
        path = os.path.join(folder, f"{WRITING_PREFIX}{key[: 2 * _LOCK_DIGEST_BYTES]}.lock")
        fd = _lock_file(path, dst, tag, deadline, said, wait_s)
    except CheckpointBusyError:
        raise  # the other writer is still at it
    except (OSError, NebulaError) as exc:
        log.debug("copying %s unlocked: %s", dst.display(tag), exc)
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # under the lock: a waiter finds it gone, and makes a new one
        os.close(fd)


def _lock_file(
    path: str, dst: Store, tag: str, deadline: float, said: list[str] | None, wait_s: float
) -> int:
    """An open descriptor of the lock file at `path`, exclusively locked, that is still
    the file at `path` (not one a finished writer removed meanwhile)."""
    delay_s = 0.01
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            busy = CheckpointBusyError(dst.url, tag, "another process of this node")
            if time.monotonic() >= deadline:
                raise busy from None
            _waiting(busy, said if said is not None else [], wait_s)
            time.sleep(delay_s)
            delay_s = min(0.2, delay_s * 2)
            continue
        except BaseException:
            os.close(fd)
            raise
        try:
            mine, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
            if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # removed or replaced by the writer before: lock the new one
