"""The tiers of one job: a node-local memory tier and, optionally, a persistent tier.

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
  checkpoints persisted releases the tier (`release_memory_tier`).

Not for: moving checkpoints between tiers (persister.py), reading them (catalog.py), or
listing every tier of this user (memory_tiers.py).
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

from nebulaml.errors import (
    CommitConflictError,
    NebulaError,
    StorageError,
    StorageFullError,
    UnsafeMemoryTierError,
)
from nebulaml.format.manifest import utc_now
from nebulaml.storage.store import MissingFileError, Store

log = logging.getLogger("nebulaml")

MEMORY_TIER_ENV = "NEBULA_MEMORY_TIER_PATH"
ROOT_INFO_FILE = ".nebula-root.json"  # in a memory tier: which root it belongs to
ROOT_ID_FILE = ".nebula-root-id.json"  # in a persistent root: its identity
HOLD_FILE = ".nebula-hold"  # in a memory tier: share-locked by every live session
_RECORD_MAX_BYTES = 64 << 10  # a record is a few hundred bytes; more is not ours

# States of a memory tier (`TierSet.memory_state`, `nebula memory`).
OK, STALE, UNSAFE, ORPHANED = "ok", "stale", "unsafe", "orphaned"


def memory_base() -> str:
    """The folder that holds this user's memory tiers on this node.

    `NEBULA_MEMORY_TIER_PATH` overrides it (a local NVMe folder, a RAM disk elsewhere, or
    tests); it must be a folder of this user's that others cannot write.
    """
    override = os.environ.get(MEMORY_TIER_ENV)
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


@dataclass(frozen=True, slots=True, eq=False)
class TierSet:
    """The stores of one job, fastest first.

    `memory_state` is `OK`, or `STALE` / `UNSAFE` (`memory_note` says why): then the
    memory tier is left out of `stores`, so nothing is listed, loaded, flushed or copied
    from it.
    """

    memory: Store
    persistent: Store | None
    memory_state: str = OK
    memory_note: str | None = None

    @property
    def memory_usable(self) -> bool:
        return self.memory_state == OK

    @property
    def stores(self) -> list[tuple[str, Store]]:
        tiers = [("memory", self.memory)] if self.memory_usable else []
        if self.persistent is not None:
            tiers.append(("persistent", self.persistent))
        return tiers

    @property
    def history_store(self) -> Store:
        """Where checkpointHistories.csv goes: the persistent root if there is one."""
        return self.persistent if self.persistent is not None else self.memory

    @property
    def display(self) -> str:
        return self.persistent.url if self.persistent is not None else self.memory.url


def open_tiers(
    persistent_path: str | os.PathLike[str] | None,
    storage_options: dict[str, Any] | None = None,
) -> TierSet:
    """The tiers for a persistent root (None: the memory tier alone), to read: a memory
    tier that is stale or unsafe is left out (`TierSet.memory_state`), with a warning."""
    persistent = None if persistent_path is None else Store(persistent_path, storage_options)
    memory = Store(memory_root_for(persistent), durable=False, private=True)
    state, note = judge_memory_tier(memory, persistent)
    if state != OK:
        log.warning("ignoring the memory tier %s: %s", memory.url, note)
    return TierSet(memory=memory, persistent=persistent, memory_state=state, memory_note=note)


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
    if len(data) > _RECORD_MAX_BYTES:
        return None
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def root_identity(persistent: Store, *, create: bool = False) -> str | None:
    """The identity of a persistent root; None when it has none (and `create` is False).
    With `create`, a root without one gets one, create-only: of several ranks or jobs
    opening a new root at once, all end up with the same."""
    doc = _read_json(persistent, ROOT_ID_FILE)
    if doc is not None and isinstance(doc.get("id"), str):
        return str(doc["id"])
    if not create:
        return None
    new = {"id": uuid.uuid4().hex, "created_at": utc_now()}
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

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

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
                return cls(fd)
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


def release_memory_tier(memory: Store, hold: TierHold | None = None) -> tuple[list[str], int]:
    """Remove a memory tier folder and everything in it, unless a live session other than
    `hold`'s holds it; returns (tags, bytes) released, or ([], 0) if it was kept or
    absent. Symbolic links inside are removed as names, never followed."""
    folder = memory.root
    if not check_private_dir(folder):
        return [], 0
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
            return [], 0
        tags, size = tier_contents(memory)
        shutil.rmtree(folder, ignore_errors=True)  # rmtree never follows links (Linux)
        return tags, size
    finally:
        if hold is None:
            own.close()


def claim_tiers(
    persistent_path: str | os.PathLike[str] | None,
    storage_options: dict[str, Any] | None = None,
) -> tuple[TierSet, TierHold]:
    """The tiers of a session that writes: the persistent root created with its identity,
    the memory tier checked private (`UnsafeMemoryTierError` otherwise) and held
    (`TierHold`). A stale memory tier (an earlier root's at this location) is released
    first, with one warning naming the root, its tags and bytes; one that a live session
    of that earlier root still holds is refused."""
    persistent = None if persistent_path is None else Store(persistent_path, storage_options)
    root_id = None
    if persistent is not None:
        persistent.make_dir()
        try:
            root_id = root_identity(persistent, create=True)
        except StorageError as exc:
            # A root this job may not write (a read-only credential): its persists fail
            # and say so; without an identity its memory tier is never judged stale.
            log.warning("could not read or give %s an identity: %s", persistent.url, exc)
    memory = Store(memory_root_for(persistent), durable=False, private=True)
    ensure_private_dir(os.path.dirname(memory.root))
    ensure_private_dir(memory.root)
    hold = TierHold.take(memory)
    try:
        record = read_record(memory)
        known = record.root_id if record is not None else None
        if persistent is not None and root_id is not None and known not in (None, root_id):
            shown = record.persistent or persistent.url
            tags, size = release_memory_tier(memory, hold)
            if not tags and not size and check_private_dir(memory.root):
                raise NebulaError(
                    f"{memory.url}: the memory tier of an earlier root at {shown} (deleted "
                    f"or created again since) is still held by a live process; end it, "
                    f"or wait for it"
                )
            log.warning(
                "%s; its root was deleted or created again since, so they were not used",
                describe_release(shown, tags, size),
            )
            hold.close()
            ensure_private_dir(memory.root)
            hold = TierHold.take(memory)
        try:
            write_record(memory, persistent, root_id or known)
        except StorageFullError as exc:  # a full RAM disk: saves go around it (budget.py)
            log.warning("could not record the memory tier's root: %s", exc)
    except BaseException:
        hold.close()
        raise
    return TierSet(memory=memory, persistent=persistent), hold


def describe_release(root: str, tags: list[str], size: int) -> str:
    """One line about a released memory tier, for warnings and `nebula gc`."""
    what = ", ".join(tags) if tags else "no checkpoint"
    return f"{root}: released {what} ({size / 2**20:.1f} MiB) from the memory tier"
