"""One memory tier's lifetime: held by every live session, released when none holds it.

Each live session holds a shared lock on the tier's `HOLD_FILE` (`TierHold`), so anyone
can tell whether a writer is alive (`in_use`); a session that ends with its checkpoints
persisted releases the tier (`release_memory_tier`, which takes the lock exclusively), all
but what another process is reading (a read lease or hold, leases.py), which `nebula gc`
or the root's next `init` releases later. A session refused as it starts
(`TierHold.abandon`) removes the folder it made, unless it holds a checkpoint or another
session holds it.

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage`, catalog.py,
delete.py and memory_tier.py. Not for: where a tier lives (memory_tier.py), whose root it
is (tier_identity.py), the ranks of a job on the node (rank_presence.py) or when a session
releases its tier (runtime/closing.py, runtime/session.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
from dataclasses import dataclass

from nebulaml.errors import NebulaError, StorageFullError
from nebulaml.format.names import HOLD_FILE
from nebulaml.protocol.catalog import tag_folders
from nebulaml.protocol.delete import delete_checkpoint
from nebulaml.protocol.memory_tier import check_private_dir, lock_held, open_private_file
from nebulaml.storage.store import Store


class TierHold:
    """A live session's hold on its memory tier: a shared flock on `HOLD_FILE`, released
    when the session closes or its process dies. `release_memory_tier` takes it
    exclusively, so a tier is never released under a live writer.

    Example:
        >>> import tempfile
        >>> store = Store(tempfile.mkdtemp(), durable=False, private=True)
        >>> hold = TierHold.take(store)
        >>> in_use(store)
        True
        >>> hold.close(); in_use(store)
        False
    """

    def __init__(self, fd: int, memory: Store | None = None) -> None:
        self._fd: int | None = fd
        self._memory = memory  # the tier held, when `take` took it

    @classmethod
    def take(cls, memory: Store) -> TierHold:
        path = os.path.join(memory.root, HOLD_FILE)
        for _ in range(100):
            try:
                fd = open_private_file(path)
            except FileNotFoundError:  # released meanwhile: the folder is made again
                memory.make_dir()
                continue
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a release holds it exclusively
            # A release may have removed the folder between the open and the lock.
            try:
                same = os.path.samestat(os.fstat(fd), os.lstat(path))
            except FileNotFoundError:
                same = False
            if same:
                return cls(fd, memory)
            os.close(fd)
            memory.make_dir()
        raise NebulaError(f"{memory.url}: could not hold the memory tier (released repeatedly)")

    def try_exclusive(self) -> bool:
        """Turn this hold exclusive if no other session holds the tier (no waiting)."""
        if self._fd is None:
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def abandon(self) -> None:
        """Close the hold of a session refused as it started (another job holds the root,
        say): the tier's folder goes too when it holds no checkpoint and no other session
        holds it, so that a refused `init` leaves nothing in the base folder. What a
        crashed job left there stays, for the next session to persist."""
        memory = self._memory
        try:
            if memory is not None and self.try_exclusive() and not tag_folders(memory):
                release_memory_tier(memory, self)
        finally:
            self.close()


def in_use(memory: Store) -> bool:
    """Whether a live session (of any process on this node) holds this memory tier."""
    return lock_held(os.path.join(memory.root, HOLD_FILE)) is True


@dataclass(frozen=True, slots=True)
class Released:
    """What `release_memory_tier` gave back: the tags and bytes removed, and the tags it
    kept because a reader held them (the folder stays with those, for `nebula gc` or the
    root's next `init`)."""

    tags: list[str]
    size: int
    kept: list[str]


def release_memory_tier(
    memory: Store, hold: TierHold | None = None, *, reads_only: bool = False
) -> Released:
    """Remove a memory tier folder and everything in it, unless a live session other than
    `hold`'s holds it (nothing is released then).

    A checkpoint being read is never deleted (leases.py): each tag goes through the
    delete protocol, and one that another process reads or holds (a handle, a listing)
    stays, and the folder with it. This process's own holds do not count: its session is
    ending, and its handles read the persistent copy. `reads_only`: only reads in progress
    count (the tier of a deleted root, which nobody lists or opens any more). Symbolic
    links inside are removed as names, never followed.
    """
    folder = memory.root
    if not check_private_dir(folder):
        return Released([], 0, [])
    own = hold
    if own is None:
        try:
            own = TierHold(open_private_file(os.path.join(folder, HOLD_FILE)))
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFullError(exc.errno, f"{folder}: {exc.strerror}") from exc
            raise
    try:
        if not own.try_exclusive():
            return Released([], 0, [])
        tags, size = tier_contents(memory)
        kept = [tag for tag in tag_folders(memory) if not _release_tag(memory, tag, reads_only)]
        if kept:
            _tags, left = tier_contents(memory)
            return Released([t for t in tags if t not in kept], size - left, kept)
        shutil.rmtree(folder, ignore_errors=True)  # rmtree never follows links (Linux)
        return Released(tags, size, [])
    finally:
        if hold is None:
            own.close()


def _release_tag(memory: Store, tag: str, reads_only: bool) -> bool:
    """Delete one tag of a tier being released; False if a reader keeps it. (Folders that
    are not tags are nobody's checkpoints: the folder's removal takes them.)"""
    try:
        return delete_checkpoint(memory, tag, replacing=reads_only, own_holds=False)
    except (NebulaError, OSError):
        return True  # not one of ours as it should be (a link, a file): removed as a name


def describe_release(root: str, tags: list[str], size: int) -> str:
    """One line about a released memory tier, for warnings and `nebula gc`."""
    what = ", ".join(tags) if tags else "no checkpoint"
    return f"{root}: released {what} ({size / 2**20:.1f} MiB) from the memory tier"


def tier_contents(memory: Store) -> tuple[list[str], int]:
    """(tag folders, bytes in all) of a memory tier folder, without following links."""
    tags, total = [], 0
    root = memory.root
    for folder, dirs, files in os.walk(root):
        if folder == root:
            tags = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return tags, total
