"""Read leases: a checkpoint being read is never deleted.

A reader publishes a small lease file in the tag folder before it reads and removes it
when done (`read_lease`). A deleter (prune, retention, memory-tier eviction, an overwrite)
publishes a delete claim there before it touches the manifest (`delete_claim`), and keeps
the tag if a live reader holds a lease. Each side publishes first and then looks for the
other, so of a reader and a deleter that overlap, at least one sees the other:

    reader                                      deleter
    r1 create .lease-read-...                   d1 create .lease-delete-...
    r2 list the folder: no manifest -> give up  d2 list the folder: a live read lease?
       a live delete claim -> wait until the       yes -> remove the claim, keep the tag
       claim goes (read) or the manifest goes      no  -> manifest first, then the data
       (give up); else read                     d3 the claim goes with the folder
    r3 remove the lease

If r2 ran before d1, then r1 < r2 < d1 < d2 and the deleter sees the lease; otherwise d1
came before r2 and the reader sees the claim. This needs a store whose listing shows
every completed create: local disks, Azure Blob Storage and memory:// do.

An uncommitted folder (no manifest when the deleter lists it) cannot be being read: a
reader there finds no manifest and leaves; `delete_claim` reports no readers for it.

A checkpoint handle (`nm.get_checkpoint`, `nm.get_latest_checkpoint`) holds its tag the
same way, with a hold lease (`hold_tag`, `HandleHolds`) published before the handle is
returned, so that the checkpoint the library just named is there when the caller loads
it: retention, prune and eviction keep a held tag (a tag replaced by its own writer, with
`overwrite=True`, is not kept for a hold: only for a read). A hold expires `HOLD_TTL_S`
after it was taken, even while its process lives; each load renews it, and
`Checkpoint.release()` ends it.

A replica's sender (runtime/replication.py) holds the part it sends the same way, for as
long as it reads it (renewed while the send goes on: `HandleHolds`), so that eviction
neither deletes it nor hands its buffers to a newer save mid-send; a node's memory tier in
a job over several nodes holds no manifest, so there the part's marker is what makes it
committed (`hold_tag(..., committed=marker_name(rank))`, honoured by
delete.py's `delete_part`). A tag saved again by its writer replaces it all the same.

A listing may hold too (`ListingHolds`, `.lease-list-...`): the path
`nm.get_latest_checkpoint_path()` names, and what `nm.list_checkpoints(hold=True)` names
(a listing holds nothing by default: it writes nothing), are held for `LIST_TTL_S`, so
that the one the caller then opens is there (opening it, `get_checkpoint`, ends the
listing's hold: the handle holds it then). A process holds a tag by
listing once only: a job that lists in its training loop would otherwise hold every
checkpoint for ever, and retention would never delete one. A prune by the thread that
listed ends its listing holds on what it deletes (it asked for that; a handle still
holds, and so does another thread's listing).

A lease's name says who holds it and since when, so deciding needs no file reads:
`.lease-<read|delete|hold|list>-<UTC time>-<pid>-<random>-<host>.json`. The lease of a process
that is gone (this host), one older than `LEASE_TTL_S` (another host, whose processes
cannot be checked from here), or a hold older than `HOLD_TTL_S` does not count, and
whoever lists it removes it.

May import: `nebulaml.errors`, `nebulaml.format` and `nebulaml.storage`. Not for: writers
(markers.py's writer markers say who is writing a tag) or deciding what to delete
(retention.py, ops/pruning.py).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone

from nebulaml.errors import StorageError
from nebulaml.format.names import LEASE_PREFIX, MANIFEST_NAME, name_number
from nebulaml.storage.store import MissingFileError, Store

log = logging.getLogger("nebulaml")

READ, DELETE, HOLD, LIST = "read", "delete", "hold", "list"
LEASE_TTL_S = 3600.0  # a lease of another host counts for this long
HOLD_TTL_S = 60.0  # a handle's hold counts for this long after it was taken (or renewed)
LIST_TTL_S = 10.0  # a listing's hold counts for this long
CLAIM_WAIT_S = 10.0  # how long a reader waits for a live deleter to decide
_STAMP = "%Y%m%dT%H%M%S%fZ"
_SUFFIX = ".json"


@dataclass(frozen=True, slots=True)
class Lease:
    """A read lease, a delete claim or a handle's hold found in a tag folder (`kind` is
    "read", "delete" or "hold")."""

    name: str
    kind: str
    host: str
    pid: int
    taken_at: datetime

    def describe(self) -> str:
        """'pid 123 on node1' for messages."""
        return f"pid {self.pid} on {self.host}"


def is_lease_file(name: str) -> bool:
    """Whether a file in a tag folder is a lease or a claim (not checkpoint data)."""
    return name.startswith(LEASE_PREFIX)


def parse_lease(name: str) -> Lease | None:
    """The lease a file name describes, or None if it is not one of ours.

    Example:
        >>> parse_lease(".lease-read-20250101T000000000000Z-42-ab12cd34-node-1.json").host
        'node-1'
    """
    if not (name.startswith(LEASE_PREFIX) and name.endswith(_SUFFIX)):
        return None
    fields = name[len(LEASE_PREFIX) : -len(_SUFFIX)].split("-", 4)
    if len(fields) != 5:
        return None
    kind, stamp, digits, _random, host = fields
    pid = name_number(digits)
    if kind not in (READ, DELETE, HOLD, LIST) or pid is None or not host:
        log.debug("ignoring %r: not a lease nebula writes", name)
        return None
    try:
        taken_at = datetime.strptime(stamp, _STAMP).replace(tzinfo=timezone.utc)
    except ValueError:
        return None
    return Lease(name, kind, host, pid, taken_at)


def lease_alive(lease: Lease, *, now: datetime | None = None, ttl_s: float = LEASE_TTL_S) -> bool:
    """Whether `lease` still counts: it is younger than `ttl_s` seconds and, on this host,
    its process is alive; a hold, besides, only for `HOLD_TTL_S` (a listing's for
    `LIST_TTL_S`). A lease names no process start time, so a live pid alone (pid 1, a
    reused one) never keeps it for ever; a time in the future (a forged name, a clock
    that ran ahead) counts as old as it is ahead.

    Example:
        >>> from datetime import datetime, timezone
        >>> forged = parse_lease(".lease-read-99991231T000000000000Z-1-ab12cd34-x.json")
        >>> lease_alive(forged)
        False
    """
    age_s = abs(((now or datetime.now(timezone.utc)) - lease.taken_at).total_seconds())
    if lease.kind == HOLD and age_s >= HOLD_TTL_S:
        return False
    if lease.kind == LIST and age_s >= LIST_TTL_S:
        return False
    if age_s >= ttl_s:
        return False
    return lease.host != _host() or process_alive(lease.pid)


def live_leases(store: Store, tag: str, *, ttl_s: float = LEASE_TTL_S) -> list[Lease]:
    """The live read leases and handles' holds in the folder of `tag`; stale ones are
    removed on the way.

    A deleter must publish its claim first (`delete_claim` does both in order); alone,
    this only describes who is reading.
    """
    return _live(store, tag, store.list_files(tag), (READ, HOLD, LIST), ttl_s)


@contextlib.contextmanager
def read_lease(store: Store, tag: str, *, wait_s: float = CLAIM_WAIT_S) -> Iterator[bool]:
    """Hold a read lease on `tag` for the block; yields whether it may be read.

    True: the manifest is there and no live deleter claims the tag; no delete protocol
    removes it until the block exits. False: the tag is gone or being deleted (a live
    deleter's claim that does not go within `wait_s` counts as deleting); read nothing.
    Costs a listing, one small create and one remove. On a store that refuses the
    create (read-only, or full) the tag is read without a lease, as it would be without
    this module: a full disk must not keep the last checkpoint from loading.

    Example:
        >>> import tempfile
        >>> with read_lease(Store(tempfile.mkdtemp()), "global_step1") as readable:
        ...     readable
        False
    """
    if not store.exists(tag, MANIFEST_NAME):
        yield False  # nothing to read: no lease needed
        return
    try:
        name = _publish(store, tag, READ)
    except StorageError as exc:
        log.debug("reading %s without a lease: %s", store.display(tag), exc)
        yield _await_no_claim(store, tag, wait_s)
        return
    if name is None:
        yield False
        return
    try:
        yield _await_no_claim(store, tag, wait_s)
    finally:
        store.remove(tag, name)


@contextlib.contextmanager
def delete_claim(
    store: Store,
    tag: str,
    *,
    ttl_s: float = LEASE_TTL_S,
    replacing: bool = False,
    own_holds: bool = True,
    committed: str = MANIFEST_NAME,
) -> Iterator[list[Lease]]:
    """Publish this thread's delete claim on `tag`, then yield the live read leases and
    holds (`replacing`: the read leases only; a tag written again by its own writer,
    `overwrite=True`, does not wait for handles). `own_holds=False`: this process's own
    holds (its handles', its listings') do not count, only its reads; a session that
    releases its memory tier at its end does so, as its handles read another tier then.
    `committed`: the file whose presence makes the folder one a reader may hold (the
    manifest; a rank's marker for a part on a tier that holds no manifest: `hold_tag`).

    Empty: no reader holds the tag, and none can start reading before the claim goes;
    remove the manifest first, then the data, inside the block. Not empty: leave the tag
    as it is. The claim is removed when the block exits (with the folder, if it went).
    """
    name = _publish(store, tag, DELETE)
    kinds = (READ,) if replacing else (READ, HOLD, LIST)
    try:
        files = store.list_files(tag)
        live = _live(store, tag, files, kinds, ttl_s) if committed in files else []
        if not own_holds:
            me = (_host(), os.getpid())
            live = [lease for lease in live if lease.kind == READ or (lease.host, lease.pid) != me]
        yield live
    finally:
        if name is not None:
            store.remove(tag, name, durable=False)


def hold_tag(
    store: Store,
    tag: str,
    *,
    wait_s: float = CLAIM_WAIT_S,
    kind: str = HOLD,
    committed: str = MANIFEST_NAME,
) -> tuple[bool, str | None]:
    """Publish a handle's hold (a listing's: `kind=LIST`) on the committed `tag` (see the
    module docstring).

    `committed`: the file that makes the folder committed, the manifest; a replica's
    sender (runtime/replication.py) holds one rank's part on a node's memory tier, which
    holds no manifest in a job over several nodes, by that rank's marker
    (`marker_name(rank)`: `delete_part` then honours the hold, as `delete_claim` with the
    same `committed` does).

    Returns (there, name): `there` is False when the tag is gone or being deleted (nothing
    is held then); `name` is the hold's file, None where the store refuses the create
    (read-only, or full: the tag is there, unheld, as it would be without this module).

    Example:
        >>> import tempfile
        >>> hold_tag(Store(tempfile.mkdtemp()), "global_step1")
        (False, None)
    """
    if not store.exists(tag, committed):
        return False, None
    try:
        name = _publish(store, tag, kind)
    except StorageError as exc:
        log.debug("not holding %s: %s", store.display(tag), exc)
        return _await_no_claim(store, tag, wait_s, committed), None
    if name is None:
        return False, None
    if _await_no_claim(store, tag, wait_s, committed):
        return True, name
    with contextlib.suppress(StorageError):
        store.remove(tag, name)
    return False, None


class HandleHolds:
    """The holds of one checkpoint handle on its tag, one per tier that holds it: renewed
    by `renew` (each load) once a quarter of `HOLD_TTL_S` old, ended by `release`.

    Example:
        >>> import tempfile
        >>> holds = HandleHolds("global_step1")
        >>> holds.add(Store(tempfile.mkdtemp()), None); holds.release(); holds.held
        0
    """

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self._lock = threading.Lock()
        self._held: list[tuple[Store, str]] = []
        self._taken = time.monotonic()

    @property
    def held(self) -> int:
        """How many tiers' copies this handle holds."""
        return len(self._held)

    def add(self, store: Store, name: str | None) -> None:
        """Keep the hold `name` (from `hold_tag`) on `store`'s copy."""
        if name is not None:
            with self._lock:
                self._held.append((store, name))

    def renew(self, *, force: bool = False) -> None:
        """Take each hold again (then drop the old one) once it is a quarter of
        `HOLD_TTL_S` old: a handle that is loaded keeps its checkpoint."""
        with self._lock:
            if not self._held or (not force and time.monotonic() - self._taken < HOLD_TTL_S / 4):
                return
            renewed: list[tuple[Store, str]] = []
            for store, old in self._held:
                try:
                    new = _publish(store, self.tag, HOLD)
                except StorageError as exc:
                    log.debug("could not renew the hold on %s: %s", store.display(self.tag), exc)
                    new = None
                if new is not None:
                    renewed.append((store, new))
                with contextlib.suppress(StorageError):
                    store.remove(self.tag, old)
            self._held, self._taken = renewed, time.monotonic()

    def release(self) -> None:
        """End every hold (idempotent; errors are left to the holds' expiry)."""
        with self._lock:
            held, self._held = self._held, []
        for store, name in held:
            with contextlib.suppress(StorageError):
                store.remove(self.tag, name)


class ListingHolds:
    """The holds this process's threads took on tags by listing them: each tag once per
    thread, for `LIST_TTL_S`; expired ones are removed at the next listing and at
    `release`. A thread's own prune ends its holds on what it deletes (`release_tag`);
    another thread's does not: it is another caller.

    Example:
        >>> import tempfile
        >>> listed = ListingHolds()
        >>> listed.hold("global_step1", [Store(tempfile.mkdtemp())])  # not there
        False
        >>> listed.release()
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (thread, store location, tag) -> (store, hold file, when taken)
        self._held: dict[tuple[int, str, str], tuple[Store, str, float]] = {}
        self._seen: set[tuple[int, str, str]] = set()

    def hold(self, tag: str, stores: list[Store]) -> bool:
        """Hold `tag` on each of `stores` not held by this thread's listings before;
        False when no store has it any more (it was deleted since it was listed)."""
        self._expire()
        there = False
        for store in stores:
            key = (threading.get_ident(), store.location, tag)
            with self._lock:
                if key in self._seen:
                    there = True  # held once already; a later listing does not renew it
                    continue
                self._seen.add(key)
            found, name = hold_tag(store, tag, kind=LIST)
            there = there or found
            if name is not None:
                with self._lock:
                    self._held[key] = (store, name, time.monotonic())
        return there

    def _expire(self) -> None:
        # The holds are in the order they were taken (a dict keeps insertion order): only
        # the expired ones at the front are looked at, not every hold at every call (a
        # listing of N tags calls this N times).
        now = time.monotonic()
        with self._lock:
            old = []
            for key, (_s, _n, taken) in self._held.items():
                if now - taken < LIST_TTL_S:
                    break
                old.append(key)
            gone = [(key[2], self._held.pop(key)) for key in old]
        for tag, (store, name, _t) in gone:
            with contextlib.suppress(StorageError):
                store.remove(tag, name)

    def release_tag(self, store: Store, tag: str, *, thread: int | None = None) -> None:
        """End this thread's (or `thread`'s) listing hold on `store`'s `tag`, if it took
        one."""
        who = threading.get_ident() if thread is None else thread
        with self._lock:
            held = self._held.pop((who, store.location, tag), None)
        if held is not None:
            with contextlib.suppress(StorageError):
                store.remove(tag, held[1])

    def release(self) -> None:
        """End every listing hold (idempotent; errors are left to the holds' expiry)."""
        with self._lock:
            held, self._held = self._held, {}
        for (_thread, _location, tag), (store, name, _t) in held.items():
            with contextlib.suppress(StorageError):
                store.remove(tag, name)


LISTINGS = ListingHolds()  # this process's holds on the tags it listed (api.py)
atexit.register(LISTINGS.release)


# helpers -------------------------------------------------------------------------------------
def _host() -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "unknown"


def process_alive(pid: int) -> bool:
    """Whether a process `pid` runs on this host (of any user). A zombie (dead, not yet
    reaped by its parent: torchrun reaps a killed rank only later) does not: it writes
    nothing any more, and its markers are a dead writer's.

    Example:
        >>> import os
        >>> process_alive(os.getpid()), process_alive(0)
        (True, False)
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists; it belongs to another user
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return True  # no /proc (not Linux), or gone just now: as os.kill said
    # "pid (comm) state ...": comm may hold spaces and parentheses; the state follows the last ")"
    state = stat_line[stat_line.rfind(b")") + 2 : stat_line.rfind(b")") + 3]
    return state not in (b"Z", b"X")


def _publish(store: Store, tag: str, kind: str) -> str | None:
    """Create this thread's lease file of `kind` in `tag`; None if the folder is gone."""
    now = datetime.now(timezone.utc)
    name = (
        f"{LEASE_PREFIX}{kind}-{now.strftime(_STAMP)}-{os.getpid()}-"
        f"{uuid.uuid4().hex[:8]}-{_host()}{_SUFFIX}"
    )
    doc = {"kind": kind, "host": socket.gethostname(), "pid": os.getpid(),
           "taken_at": now.isoformat().replace("+00:00", "Z")}  # fmt: skip
    try:
        # Not fsynced: a lease speaks to live processes, and a crash leaves none of them.
        store.write_bytes((tag, name), json.dumps(doc).encode(), durable=False)
    except MissingFileError:
        return None  # the folder was removed: nothing left to read or delete
    return name


def _live(
    store: Store, tag: str, files: Mapping[str, int], kinds: Collection[str], ttl_s: float
) -> list[Lease]:
    """The live leases of `kinds` among `files`; stale ones (of any kind) are removed."""
    now = datetime.now(timezone.utc)
    live = []
    for name in sorted(files):
        lease = parse_lease(name)
        if lease is None:
            continue
        if not lease_alive(lease, now=now, ttl_s=ttl_s):
            # Its holder is gone: it protects nothing. Removing it is only tidying (a
            # read-only store keeps it).
            with contextlib.suppress(StorageError):
                store.remove(tag, name)
        elif lease.kind in kinds:
            live.append(lease)
    return live


def delete_claims(store: Store, tag: str) -> list[Lease]:
    """The live delete claims on `tag` (whose delete a reader waits for), for messages."""
    return _live(store, tag, store.list_files(tag), (DELETE,), LEASE_TTL_S)


def _await_no_claim(store: Store, tag: str, wait_s: float, committed: str = MANIFEST_NAME) -> bool:
    """With our lease published: True once the manifest (`committed`) is there and no
    live deleter claims the tag; False once it is gone, or after `wait_s`."""
    deadline = time.monotonic() + wait_s
    delay_s = 0.002
    while True:
        files = store.list_files(tag)
        if committed not in files:
            return False
        if not _live(store, tag, files, (DELETE,), LEASE_TTL_S):
            return True
        # A deleter claimed the tag before it could see our lease: it either backs off
        # (its claim goes) or deletes (the manifest goes), within a few operations.
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay_s)
        delay_s = min(0.1, delay_s * 2)
