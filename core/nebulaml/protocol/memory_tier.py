"""One memory tier: where it lives, whose it is, and who holds it.

The memory tier lives in RAM (`/dev/shm`, or a temporary folder where there is none) under
this user's base folder, one folder per persistent root. It belongs to one root, one user
and one job's lifetime:

- **One root.** A folder is named after the root's *location* (`Store.location`: the real
  path of a local root, the account endpoint and path of a remote one), so a root reached
  through a symbolic link, or the same container on two accounts, is never mixed up. Every
  persistent root carries an identity (`ROOT_ID_FILE`, a random id made when nebula first
  opens it), and the memory tier records the identity it belongs to (`ROOT_INFO_FILE`). A
  memory tier whose root is gone, or was created again since, is *stale*: never listed,
  loaded, flushed or copied, and released by the next `init` of that root.
- **One user.** The base folder and every folder under it are 0700 and this user's (checked
  on every open: `check_private_dir`), files 0600; anything else is refused
  (`UnsafeMemoryTierError`) and never written or deleted through.
- **One job's lifetime.** Each live session holds a shared lock on the tier's `HOLD_FILE`
  (`TierHold`), so anyone can tell whether a writer is alive; a session that ends with its
  checkpoints persisted releases the tier (`release_memory_tier`), all but what another
  process is reading (a read lease or hold, leases.py), which `nebula gc` or the root's
  next `init` releases later. A session refused as it starts (`TierHold.abandon`) removes
  the folder it made, unless it holds a checkpoint or another session holds it.

The file names are spelled in format/names.py.

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage`, catalog.py and
delete.py. Not for: the tiers of a job together (tiers.py), moving checkpoints between
tiers (persister.py), reading them (catalog.py), or listing every tier of this user
(ops/memory_tiers.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import getpass
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

from nebulaml.config import memory_tier_base
from nebulaml.errors import (
    CommitConflictError,
    InvalidNameError,
    NebulaError,
    StorageFullError,
    UnsafeMemoryTierError,
)
from nebulaml.format.jsonbounds import JsonBoundsError, load_json
from nebulaml.format.manifest import utc_now
from nebulaml.format.names import (
    HOLD_FILE,
    RANK_LOCK_PREFIX,
    REMOVALS_PREFIX,
    ROOT_ID_FILE,
    ROOT_INFO_FILE,
    validate_name,
)
from nebulaml.protocol.catalog import tag_folders
from nebulaml.protocol.delete import delete_checkpoint
from nebulaml.storage.store import MissingFileError, Store

log = logging.getLogger("nebulaml")

_RECORD_MAX_BYTES = 64 << 10  # a record is a few hundred bytes; more is not ours

# States of a memory tier (`TierSet.memory_state`, `nebula memory`).
OK, STALE, UNSAFE, ORPHANED = "ok", "stale", "unsafe", "orphaned"


def memory_base() -> str:
    """The folder that holds this user's memory tiers on this node.

    `NEBULA_MEMORY_TIER_PATH` overrides it (a local NVMe folder, a RAM disk elsewhere, or
    tests); it must be a folder of this user's that others cannot write.
    """
    override = memory_tier_base()
    if override:
        return os.path.abspath(override)
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    shm = "/dev/shm"
    parent = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()
    return os.path.join(parent, f"nebula-{user}")


def check_private_dir(path: str) -> bool:
    """Whether the folder `path` exists (False if not); raises `UnsafeMemoryTierError`
    unless it is a real folder (not a symbolic link), owned by this user, that neither
    group nor others can write.

    Example:
        >>> import tempfile
        >>> check_private_dir(tempfile.mkdtemp()), check_private_dir("/no/such/folder")
        (True, False)
    """
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeMemoryTierError(path, "is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeMemoryTierError(path, "is not a folder")
    if st.st_uid != os.geteuid():
        raise UnsafeMemoryTierError(path, f"is owned by uid {st.st_uid}, not by you")
    if st.st_mode & 0o022:
        raise UnsafeMemoryTierError(
            path, f"can be written by other users (mode {stat.S_IMODE(st.st_mode):04o})"
        )
    return True


def ensure_private_dir(path: str) -> None:
    """Create the folder `path` 0700 if it is missing, then `check_private_dir` it."""
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    check_private_dir(path)


def memory_root_for(persistent: Store | None) -> str:
    """The memory-tier folder that belongs to a persistent root (or to a memory-only job,
    keyed by the working directory).

    Example:
        >>> import os, tempfile
        >>> os.path.basename(memory_root_for(Store(tempfile.gettempdir() + "/run1")))[:5]
        'run1-'
    """
    if persistent is None:
        key, slug = f"memory-only:{os.getcwd()}", "memory-only"
    else:
        key = persistent.location
        slug = re.sub(r"[^A-Za-z0-9_.-]", "_", persistent.url.rstrip("/").rsplit("/", 1)[-1])
        slug = slug.lstrip(".")[:40] or "root"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return os.path.join(memory_base(), f"{slug}-{digest}")


# identities -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TierRecord:
    """What a memory tier records of its root: its URL, location and identity."""

    persistent: str | None
    location: str | None
    root_id: str | None


def _read_json(store: Store, name: str) -> dict[str, Any] | None:
    """A small JSON object file of `store`'s root; None if missing or not such a file."""
    try:
        data = store.read_bytes(name)
    except MissingFileError:
        return None
    try:
        doc = load_json(data, max_bytes=_RECORD_MAX_BYTES)
    except JsonBoundsError:
        return None
    return doc if isinstance(doc, dict) else None


def root_identity(
    persistent: Store, *, create: bool = False, new_id: str | None = None
) -> str | None:
    """The identity of a persistent root; None when it has none (and `create` is False).
    With `create`, a root without one gets one (`new_id`, else a new random one),
    create-only: of several ranks or jobs opening a new root at once, all end up with the
    same."""
    doc = _read_json(persistent, ROOT_ID_FILE)
    if doc is not None and isinstance(doc.get("id"), str):
        return str(doc["id"])
    if not create:
        return None
    new = {"id": new_id or uuid.uuid4().hex, "created_at": utc_now()}
    try:
        persistent.publish((ROOT_ID_FILE,), json.dumps(new).encode(), create_only=True)
        return str(new["id"])
    except CommitConflictError:
        doc = _read_json(persistent, ROOT_ID_FILE)
        if doc is None or not isinstance(doc.get("id"), str):
            raise
        return str(doc["id"])


def read_record(memory: Store) -> TierRecord | None:
    """The memory tier's record of its root, or None (missing or unreadable)."""
    doc = _read_json(memory, ROOT_INFO_FILE)
    if doc is None:
        return None

    def text(key: str) -> str | None:
        value = doc.get(key)
        return value if isinstance(value, str) else None

    return TierRecord(text("persistent"), text("location"), text("root_id"))


def write_record(memory: Store, persistent: Store | None, root_id: str | None) -> None:
    """Record which root (URL, location, identity) a memory tier belongs to."""
    doc = {
        "persistent": persistent.url if persistent else None,
        "location": persistent.location if persistent else None,
        "root_id": root_id,
    }
    memory.publish((ROOT_INFO_FILE,), json.dumps(doc).encode(), create_only=False)


def read_removals(memory: Store, rank: int) -> list[str]:
    """The checkpoints a framework removed that rank `rank`'s session had not yet deleted
    from every tier when it ended (killed, or its store down): the next session of that
    rank deletes them. Names that are not tag names are ignored.

    Example:
        >>> import tempfile
        >>> memory = Store(tempfile.mkdtemp(), durable=False, private=True)
        >>> write_removals(memory, 0, ["epoch=0-step=4"])
        >>> read_removals(memory, 0), read_removals(memory, 1)
        (['epoch=0-step=4'], [])
    """
    doc = _read_json(memory, f"{REMOVALS_PREFIX}{rank}.json")
    tags = doc.get("tags") if doc is not None else None
    if not isinstance(tags, list):
        return []
    valid = []
    for tag in tags:
        with contextlib.suppress(InvalidNameError):
            valid.append(validate_name("tag", tag))
    return valid


def write_removals(memory: Store, rank: int, tags: list[str]) -> None:
    """Record the removals rank `rank` has yet to finish (`read_removals`); none: the
    record goes."""
    name = f"{REMOVALS_PREFIX}{rank}.json"
    if tags:
        memory.publish((name,), json.dumps({"tags": tags}).encode(), create_only=False)
    else:
        memory.remove(name)


def judge_memory_tier(memory: Store, persistent: Store | None) -> tuple[str, str | None]:
    """(state, why): whether a memory tier may be read as its root's (see the module
    docstring). A folder that does not exist yet is `OK` (there is nothing in it)."""
    base, folder = os.path.dirname(memory.root), memory.root
    try:
        if not check_private_dir(base) or not check_private_dir(folder):
            return OK, None
    except UnsafeMemoryTierError as exc:
        return UNSAFE, str(exc)
    if persistent is None:
        return OK, None
    record = read_record(memory)
    if record is None or record.root_id is None:
        return OK, None  # an older nebula's, or a tier whose record did not fit
    try:
        current = root_identity(persistent)
    except NebulaError as exc:
        return STALE, f"cannot read the identity of {persistent.url} ({exc})"
    if current is None:
        return STALE, f"its root {persistent.url} is gone"
    if current != record.root_id:
        return STALE, f"its root {persistent.url} was deleted and created again since"
    return OK, None


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


# holds and release ------------------------------------------------------------------------
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
                fd = _open_hold(path)
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


def _open_hold(path: str) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, 0o600)


def in_use(memory: Store) -> bool:
    """Whether a live session (of any process on this node) holds this memory tier."""
    path = os.path.join(memory.root, HOLD_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


class RankPresence:
    """A live process's claim to be rank `rank` of the job on this node: an exclusive
    flock on `.nebula-rank-<rank>.lock` in the memory tier, released when the session
    closes or the process dies. The other ranks of the node so tell a rank that is gone
    (`rank_gone`) from one that is slow: a commit need not wait `rank_timeout_s` for a
    part that will never come.

    Example:
        >>> import tempfile
        >>> store = Store(tempfile.mkdtemp(), durable=False, private=True)
        >>> rank_gone(store, 1)  # never here: not known to be gone
        False
        >>> presence = RankPresence.take(store, 1)
        >>> rank_gone(store, 1)
        False
        >>> presence.close(); rank_gone(store, 1)
        True
    """

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    @classmethod
    def take(cls, memory: Store, rank: int) -> RankPresence:
        """Claim rank `rank` on this node; a claim another live process holds (an
        earlier process of the rank, still exiting) is left to it: never waited for."""
        path = os.path.join(memory.root, f"{RANK_LOCK_PREFIX}{rank}.lock")
        try:
            fd = _open_hold(path)
        except OSError as exc:
            log.debug("could not claim rank %d in %s: %s", rank, memory.url, exc)
            return cls(None)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return cls(None)
        return cls(fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def rank_gone(memory: Store, rank: int) -> bool:
    """Whether rank `rank` of the job was on this node and its process has ended (died,
    or closed its session): its claim (`RankPresence`) is there and nobody holds it.
    False when it is alive, or was never on this node (a rank of another node is never
    known to be gone)."""
    path = os.path.join(memory.root, f"{RANK_LOCK_PREFIX}{rank}.lock")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


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
            own = TierHold(_open_hold(os.path.join(folder, HOLD_FILE)))
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
