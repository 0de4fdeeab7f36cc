"""Which job writes a root: one at a time (issue #18). The ranks of one job share it.

A job (runtime/job.py says how the ranks of one launch are told apart from another
launch: an opaque id string here) holds a root in two places:

    NodeClaim  this node's memory tier of the root: `.nebula-job-<digest of the job>.lock`,
               share-locked (flock) by each live session of that job on the node; a lock
               nobody holds is a dead job's. Memory-only jobs have only this one.
    RootLease  the persistent root: `.nebula-job-<generation>.json`, created create-only,
               saying which job holds the root (job, host, pid, the process's start,
               started_at, renewed_at) and renewed by its creator every `RENEW_S`. The
               highest generation is the hold. It is a dead job's when its process is
               gone (this host: the pid, and its start time, so a reused pid does not
               count) or, on another host, when it has not been renewed for `HOLD_TTL_S`.
               A new job takes a dead one's over by creating the next generation,
               create-only: of two jobs taking over at once, one wins.

A session of a second job is refused (`RootInUseError`, naming the holder's host and pid)
while another job holds either. A process that a holder started (on this host) belongs to
the holder's job: a launcher's first process may call `init` before it knows it is rank 0
of several, and the ranks it starts then join its hold.

The file names are spelled in format/names.py.

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage` and leases.py. Not
for: how a job is identified (runtime/job.py), when the lease is renewed (runtime/job.py's
heartbeat), or who reads and deletes a tag (leases.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import socket
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone

from nebulaml.errors import CommitConflictError, NebulaError, RootInUseError, StorageError
from nebulaml.format.manifest import parse_utc, utc_now
from nebulaml.format.names import JOB_CLAIM_FILE, JOB_PREFIX, name_number
from nebulaml.protocol.leases import process_alive
from nebulaml.storage.store import MissingFileError, Store

log = logging.getLogger("nebulaml")

HOLD_TTL_S = 90.0  # another host's hold counts while renewed within this long
RENEW_S = 15.0  # how often the creator of a root's hold renews it
_MAX_BYTES = 64 << 10  # a hold is a few hundred bytes; more is not ours
_LEASE_SUFFIX = ".json"
_LOCK_SUFFIX = ".lock"
_TAKE_TRIES = 8


def _host() -> str:
    return socket.gethostname()


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a root: one job, through one of its processes."""

    job: str
    host: str
    pid: int
    pid_start: str | None = None  # the process's start (this host's /proc), against reuse
    started_at: str = ""
    renewed_at: str = ""

    def describe(self) -> str:
        """'job X (pid 12 on node1, since 2026-...)' for messages."""
        since = f", since {self.started_at}" if self.started_at else ""
        return f"job {self.job} (pid {self.pid} on {self.host}{since})"

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def parse(cls, data: bytes) -> Holder | None:
        if len(data) > _MAX_BYTES:
            return None
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            return None
        if not isinstance(doc, dict):
            return None
        job, host, pid = doc.get("job"), doc.get("host"), doc.get("pid")
        if not isinstance(job, str) or not isinstance(host, str):
            return None
        if not isinstance(pid, int) or isinstance(pid, bool):
            return None

        def text(key: str) -> str:
            value = doc.get(key)
            return value if isinstance(value, str) else ""

        return cls(job, host, pid, text("pid_start") or None, text("started_at"),
                   text("renewed_at"))  # fmt: skip


def me(job: str) -> Holder:
    """This process as the holder of a root for `job`."""
    now = utc_now()
    return Holder(job, _host(), os.getpid(), process_start(os.getpid()), now, now)


# processes ---------------------------------------------------------------------------------
def process_start(pid: int) -> str | None:
    """When process `pid` of this host started (clock ticks since boot, with the boot's
    id), or None where /proc cannot tell: a pid reused by another process has another."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip().decode()
    except OSError:
        return None
    fields = stat_line.rpartition(b")")[2].split()
    return f"{boot}:{fields[19].decode()}" if len(fields) > 19 else None


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return int(fields[1]) if len(fields) > 1 else None


def started_by(holder: Holder) -> bool:
    """Whether this process was started (directly or not) by the holder's process: it is
    then one of the holder's job (a launcher's first rank and the ranks it starts)."""
    if holder.host != _host() or not holder_alive_here(holder):
        return False
    pid: int | None = os.getppid()
    for _ in range(64):
        if pid is None or pid <= 1:
            return False
        if pid == holder.pid:
            return True
        pid = _parent_of(pid)
    return False


def holder_alive_here(holder: Holder) -> bool:
    """Whether the holder's process (of this host) is alive: its pid exists, and started
    when the holder says (where both are known)."""
    if not process_alive(holder.pid):
        return False
    if holder.pid_start is None:
        return True
    now = process_start(holder.pid)
    return now is None or now == holder.pid_start


def lease_alive(
    holder: Holder | None,
    modified_at: datetime | None,
    *,
    now: datetime | None = None,
    ttl_s: float = HOLD_TTL_S,
) -> bool:
    """Whether a root's hold still counts: its process is alive (this host, with the
    process start time it recorded), or it was renewed within `ttl_s` (by its own clock
    or the store's, the later). A hold of this host without a process start time counts
    only while its pid is alive and it was renewed within `ttl_s` (pid 1 is always
    alive); a time in the future (forged, or a clock that ran ahead) counts as old as it
    is ahead. An unreadable hold counts while the store says it was written within
    `ttl_s`."""
    here = holder is not None and holder.host == _host()
    if here and holder is not None and (holder.pid_start or not process_alive(holder.pid)):
        return holder_alive_here(holder)
    times = [t for t in (modified_at, parse_utc(holder.renewed_at if holder else "")) if t]
    if not times:
        return False
    now = now or datetime.now(timezone.utc)
    age_s = min(abs((now - t).total_seconds()) for t in times)
    return age_s < ttl_s


# the persistent root -----------------------------------------------------------------------
def lease_name(generation: int) -> str:
    """The name of a root's hold of `generation`.

    Example:
        >>> lease_name(3)
        '.nebula-job-00000003.json'
    """
    return f"{JOB_PREFIX}{generation:08d}{_LEASE_SUFFIX}"


def _generation(name: str) -> int | None:
    if not (name.startswith(JOB_PREFIX) and name.endswith(_LEASE_SUFFIX)):
        return None
    digits = name[len(JOB_PREFIX) : -len(_LEASE_SUFFIX)]
    return name_number(digits)


@dataclass(frozen=True, slots=True)
class _Found:
    generation: int
    name: str
    holder: Holder | None
    modified_at: datetime | None


def _holds(store: Store) -> list[_Found]:
    """The holds at the root of `store`, lowest generation first: the root's files named
    `.nebula-job-*`, listed by that prefix (not the root's every tag folder: a restart's
    check costs the same at any number of checkpoints)."""
    found = []
    for name in store.list_prefixed(prefix=JOB_PREFIX):
        generation = _generation(name)
        if generation is None:
            continue
        try:
            holder = Holder.parse(store.read_bytes(name))
        except MissingFileError:
            continue  # released meanwhile
        except StorageError as exc:  # not a regular file (a FIFO, a folder): not a hold
            log.debug("ignoring %s: %s", store.display(name), exc)
            found.append(_Found(generation, name, None, None))
            continue
        # Another host's renewal time is by its clock, which may run ahead or behind
        # ours: the store's time of the write is asked too, and the later one counts
        # (`lease_alive`). A hold of this host is judged by its process.
        here = holder is not None and holder.host == _host()
        modified = None if here else store.modified_at(name)
        found.append(_Found(generation, name, holder, modified))
    return sorted(found, key=lambda f: f.generation)


def root_holder(store: Store) -> tuple[Holder | None, bool]:
    """(the holder of the root, whether its hold is live); (None, False) if none holds it."""
    holds = _holds(store)
    if not holds:
        return None, False
    top = holds[-1]
    return top.holder, lease_alive(top.holder, top.modified_at)


@dataclass(frozen=True, slots=True)
class HoldState:
    """The hold on a root as an operator sees it (`nebula unlock`, `nebula advise`): its
    file, its holder (None: unreadable), whether it counts (`lease_alive`), whether its
    process runs on this host, and its generation (each job that took the root over from
    a dead one made the next; a job that ends cleanly removes its hold, so the next one
    starts at 1 again)."""

    name: str
    holder: Holder | None
    live: bool
    running_here: bool
    generation: int = 1


def current_hold(store: Store) -> HoldState | None:
    """The hold on the root of `store` (the highest generation), or None."""
    holds = _holds(store)
    if not holds:
        return None
    top = holds[-1]
    holder = top.holder
    here = holder is not None and holder.host == _host() and holder_alive_here(holder)
    live = lease_alive(holder, top.modified_at)
    return HoldState(top.name, holder, live, here, top.generation)


def break_hold(store: Store, name: str) -> list[str]:
    """Remove the hold `name` (the one shown to the operator) and any older one; the
    names removed. A hold taken since (a higher generation) is not touched, and then
    nothing is: `NebulaError` says the root changed hands meanwhile."""
    holds = _holds(store)
    if not holds or holds[-1].name != name:
        raise NebulaError(
            f"{store.url}: its hold changed since it was shown ({name} is not the hold any "
            "more); nothing removed: look again"
        )
    removed = []
    for found in holds:
        with contextlib.suppress(MissingFileError):
            store.remove(found.name)
        removed.append(found.name)
    return removed


class RootLease:
    """A job's hold on a persistent root (see the module docstring). `owner`: this process
    created it, renews it and removes it at `release`; the job's other processes join it.

    Example:
        >>> import tempfile
        >>> store = Store(tempfile.mkdtemp())
        >>> lease = RootLease.take(store, "job-a")
        >>> RootLease.take(store, "job-a").owner      # another rank of job-a joins
        False
        >>> try:
        ...     RootLease.take(store, "job-b")
        ... except RootInUseError:
        ...     print("refused")
        refused
        >>> lease.release(); RootLease.take(store, "job-b").job
        'job-b'
    """

    def __init__(self, store: Store, name: str, holder: Holder, *, owner: bool) -> None:
        self.store = store
        self.name = name
        self.holder = holder
        self.owner = owner

    @property
    def job(self) -> str:
        return self.holder.job

    @classmethod
    def take(cls, store: Store, job: str, *, leader: bool = True) -> RootLease:
        """Hold `store` for `job`: join the job's live hold, take a free or dead job's
        over, or raise `RootInUseError` naming the live holder. The job's `leader` (rank 0)
        makes the hold its own (it renews it); a process the holder started joins it."""
        for _ in range(_TAKE_TRIES):
            holds = _holds(store)
            generation = 1
            if holds:
                top = holds[-1]
                holder = top.holder
                alive = lease_alive(holder, top.modified_at)
                started = holder is not None and started_by(holder)
                ours = holder is not None and (holder.job == job or started)
                if ours and alive:
                    assert holder is not None
                    if not leader or started or (holder.host, holder.pid) == (_host(), os.getpid()):
                        return cls(store, top.name, holder, owner=False)
                    # The job's leader renews its hold: the first of its ranks to start
                    # may have made it, or an earlier run of the job (torchrun's restart).
                    mine = replace(me(holder.job), started_at=holder.started_at or utc_now())
                    store.publish((top.name,), mine.to_bytes(), create_only=False)
                    return cls(store, top.name, mine, owner=True)
                if alive:
                    shown = holder.describe() if holder else f"an unreadable {top.name}"
                    raise RootInUseError(store.url, shown, hint=_hint(holder))
                generation = top.generation + 1
            mine = me(job)
            name = lease_name(generation)
            try:
                store.publish((name,), mine.to_bytes(), create_only=True)
            except CommitConflictError:
                continue  # another job (or a rank of ours) was quicker: look again
            for older in holds:
                with contextlib.suppress(StorageError):
                    store.remove(older.name)  # a dead job's: tidying only
            if holds and holds[-1].holder is not None:
                log.info("took over %s from %s, which is gone", store.url,
                         holds[-1].holder.describe())  # fmt: skip
            return cls(store, name, mine, owner=True)
        raise RootInUseError(store.url, "jobs contending for it", hint="; try again")

    def renew(self) -> Holder | None:
        """Renew the hold (the owner's, every `RENEW_S`); returns the job that holds the
        root instead of ours if it was taken over (ours was judged dead), else None."""
        if not self.owner:
            return None
        holds = _holds(self.store)
        # A hold planted above ours that does not count (dated years ahead, naming pid 1
        # without a start time, unreadable and old) is nobody's: it takes nothing over.
        # Nor does an unreadable one: another job's hold is always whole (written at once).
        while (
            holds
            and holds[-1].name != self.name
            and (
                holds[-1].holder is None or not lease_alive(holds[-1].holder, holds[-1].modified_at)
            )
        ):
            holds.pop()
        top = holds[-1] if holds else None
        other = top.holder if top is not None and top.name != self.name else None
        if other is not None and other.job != self.job:
            self.owner = False
            return other
        if top is None or top.name != self.name:
            # Our hold was removed (by hand?) and no other job's is there: put it back.
            with contextlib.suppress(CommitConflictError):
                self.store.publish((self.name,), self.holder.to_bytes(), create_only=True)
            return None
        if top.holder is not None and not self._is_me(top.holder):
            self.owner = False  # the job's leader renews it from now on
            return None
        self.holder = replace(self.holder, renewed_at=utc_now())
        self.store.publish((self.name,), self.holder.to_bytes(), create_only=False)
        return None

    def _is_me(self, holder: Holder) -> bool:
        return (holder.host, holder.pid) == (self.holder.host, self.holder.pid)

    def release(self) -> None:
        """Remove the hold (the owner's, at the end of its session): the root is free."""
        if not self.owner:
            return
        self.owner = False
        try:
            current = Holder.parse(self.store.read_bytes(self.name))
        except MissingFileError:
            return
        if current is not None and not self._is_me(current):
            return  # not ours any more
        self.store.remove(self.name)


def _hint(holder: Holder | None) -> str:
    if holder is None or holder.host == _host():
        return ""
    return (
        f" (a job on another host that is gone counts as holding the root until its hold "
        f"is {HOLD_TTL_S:g} s old)"
    )


# this node's memory tier -------------------------------------------------------------------
def _lock_name(job: str) -> str:
    return f"{JOB_PREFIX}{hashlib.sha256(job.encode()).hexdigest()[:16]}{_LOCK_SUFFIX}"


def _open_nofollow(path: str, flags: int) -> int:
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NebulaError(f"{path}: not a regular file")
    return fd


class NodeClaim:
    """A job's claim on this node's memory tier of a root: a shared flock on the job's lock
    file, held by each of its live sessions here (the module docstring).

    Example:
        >>> import tempfile
        >>> memory = Store(tempfile.mkdtemp(), durable=False, private=True)
        >>> claim = NodeClaim.take(memory, "job-a")
        >>> try:
        ...     NodeClaim.take(memory, "job-b")
        ... except RootInUseError:
        ...     print("refused")
        refused
        >>> claim.close(); NodeClaim.take(memory, "job-b").job
        'job-b'
    """

    def __init__(self, path: str, fd: int, job: str) -> None:
        self._path = path
        self._fd: int | None = fd
        self.job = job

    @classmethod
    def take(cls, memory: Store, job: str, *, where: str | None = None) -> NodeClaim:
        """Claim `memory` for `job`, or raise `RootInUseError` (naming `where`, default
        the memory tier) when another live job's sessions hold it."""
        folder = memory.root
        with _claim_lock(folder, create=True):
            for name in sorted(os.listdir(folder)):
                if not (name.startswith(JOB_PREFIX) and name.endswith(_LOCK_SUFFIX)):
                    continue
                if name == _lock_name(job):
                    continue
                holder = _live_lock(os.path.join(folder, name))
                if holder is None:
                    continue  # a dead job's: removed
                if holder.job != job and not started_by(holder):
                    raise RootInUseError(where or memory.url, holder.describe())
                job = holder.job  # a process the holder started: one of its job
            path = os.path.join(folder, _lock_name(job))
            fd = _open_nofollow(path, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                if os.fstat(fd).st_size == 0:
                    # Who holds it, for another job's refusal; a full RAM disk leaves it
                    # empty (the lock is the hold).
                    with contextlib.suppress(OSError):
                        os.write(fd, me(job).to_bytes())
            except BaseException:
                os.close(fd)
                raise
        return cls(path, fd, job)

    def close(self) -> None:
        """Let go; the last session of the job on this node removes its lock file."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with _claim_lock(os.path.dirname(self._path), create=False) as locked:
                if locked:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        pass  # another session of the job still holds it
                    else:
                        with contextlib.suppress(OSError):
                            if os.path.samestat(os.fstat(fd), os.lstat(self._path)):
                                os.unlink(self._path)
        finally:
            os.close(fd)


def _live_lock(path: str) -> Holder | None:
    """The holder of a job's lock file if a session holds it; else (a dead job's) None,
    and the file is removed. Called under the claim lock."""
    try:
        fd = _open_nofollow(path, os.O_RDONLY)
    except (FileNotFoundError, NebulaError):
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            data = os.read(fd, _MAX_BYTES + 1)
            holder = Holder.parse(data)
            return holder or Holder("(unknown)", _host(), 0)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None
    finally:
        os.close(fd)


@contextlib.contextmanager
def _claim_lock(folder: str, *, create: bool) -> Iterator[bool]:
    """Exclusive while a job claims this memory tier or lets it go (a few file operations).
    Without `create`, a folder already released yields False and locks nothing."""
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    try:
        fd = _open_nofollow(os.path.join(folder, JOB_CLAIM_FILE), flags)
    except FileNotFoundError:
        if create:
            raise
        yield False
        return
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageError(f"{folder}: {exc.strerror}") from exc
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)
