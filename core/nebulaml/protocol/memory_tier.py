"""Where a memory tier lives, and that it is this user's alone.

The memory tier lives in RAM (`/dev/shm`, or a temporary folder where there is none) under
this user's base folder (`memory_base`), one folder per persistent root
(`memory_root_for`). It belongs to one root, one user and one job's lifetime:

- **One root.** A folder is named after the root's *location* (`Store.location`: the real
  path of a local root, the account endpoint and path of a remote one), so a root reached
  through a symbolic link, or the same container on two accounts, is never mixed up; the
  identity it records of its root is tier_identity.py's.
- **One user.** The base folder and every folder under it are 0700 and this user's (checked
  on every open: `check_private_dir`), files 0600 (`open_private_file` for the lock files);
  anything else is refused (`UnsafeMemoryTierError`) and never written or deleted through.
- **One job's lifetime.** Each live session holds the tier and the last one releases it
  (tier_lifetime.py); each live rank of the job claims its place on the node
  (rank_presence.py): flocks on lock files, whose holders `lock_held` asks about without
  waiting.

The file names are spelled in format/names.py.

May import: `nebulaml.errors`, `nebulaml.config`, `nebulaml.format` and
`nebulaml.storage`. Not for: whose root a tier is (tier_identity.py), who holds it and its
release (tier_lifetime.py), the tiers of a job together (tiers.py), moving checkpoints
between tiers (persister.py), reading them (catalog.py), or listing every tier of this user
(ops/memory_tiers.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import os
import re
import stat
import tempfile

from nebulaml.config import memory_tier_base
from nebulaml.errors import UnsafeMemoryTierError
from nebulaml.storage.store import Store


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


def open_private_file(path: str) -> int:
    """Open the memory tier's file `path` for reading and writing, created 0600 if it is
    missing, never through a symbolic link (a lock file: a hold, a rank's presence)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, 0o600)


def lock_held(path: str, mode: int = fcntl.LOCK_EX) -> bool | None:
    """Whether a live process holds a flock on the memory tier's lock file `path` that
    bars `mode` (`fcntl.LOCK_EX`: any lock; `LOCK_SH`: an exclusive one), asked without
    waiting and without keeping a lock; None when there is no file there, or it is not a
    regular file. Never through a symbolic link; any other failure is raised (`OSError`).

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "lock")
        >>> lock_held(path) is None
        True
        >>> fd = open_private_file(path); fcntl.flock(fd, fcntl.LOCK_SH)
        >>> lock_held(path), lock_held(path, fcntl.LOCK_SH)
        (True, False)
        >>> os.close(fd); lock_held(path)
        False
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
