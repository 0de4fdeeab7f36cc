"""Reaching a session's persistent tier (issue #27): at init, for a bounded time; else
later, in the background, before the persister's first persist.

    CONNECT_WAIT_S  how long init waits for the persistent tier to answer
    identify        make the root and read (or give) its identity
    reach           `identify`, answered within a given time, without retries
    adopt_root      the memory tier's record of its root, once the root is reached late
    keep_root       before each persist: the root still carries the identity the memory
                    tier records (given back if it was deleted, adopted if it changed)

A store that does not answer at init (down, or hanging) does not keep the job from
checkpointing: the session starts with the memory tier only, says so once, and hands the
persister the rest of the connection (session.py), which it runs before its first
persist, with its retries and backoff (persister.py, outage.py).

May import: every layer below runtime, and runtime.outage. Not for: what the session does
once connected (session.py), or the retries (persister.py).
"""

from __future__ import annotations

import logging

from nebulaml.errors import NebulaError, StorageError
from nebulaml.protocol.tier_identity import read_record, root_identity, write_record
from nebulaml.runtime.outage import may_pass
from nebulaml.storage.deadline import within
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")

# A healthy store answers in well under a second (a first Azure request, with its
# credential, in one or two); one that is down refuses at once (init does not retry), and
# a hanging one may never answer: init goes on without it after this long.
CONNECT_WAIT_S = 3.0


def identify(persistent: Store) -> str | None:
    """Make the root, check that its store publishes create-only atomically (once per root
    and process: `Store.require_atomic_create`, an `InvalidArgumentError` if not), and read
    its identity, giving it one if it has none. A failure that may pass (the store down,
    the disk full) is raised; another (a read-only credential) is said once and the root
    goes without an identity (its persists then say why).

    Example:
        >>> import tempfile
        >>> len(identify(Store(tempfile.mkdtemp())))
        32
    """
    persistent.make_dir()
    try:
        persistent.require_atomic_create()  # its probe writes: a read-only root fails so
        return root_identity(persistent, create=True)
    except StorageError as exc:
        if may_pass(exc):
            raise
        log.warning("could not read or give %s an identity: %s", persistent.url, exc)
        return None


def reach(persistent: Store, wait_s: float) -> tuple[bool, str | None, BaseException | None]:
    """`identify(persistent)`, answered within `wait_s` seconds and without retries: a
    store that refuses the connection says enough at once, and one that hangs is waited
    for `wait_s` at most (storage/deadline.py). Returns whether it answered, the root's
    identity, and why not (a failure that may pass). A failure that cannot pass is
    raised, as `identify` would.

    Example:
        >>> import tempfile
        >>> reached, root_id, why = reach(Store(tempfile.mkdtemp()), 5)
        >>> reached, len(root_id), why
        (True, 32, None)
    """
    try:
        with within(wait_s, retry=False):
            return True, identify(persistent), None
    except NebulaError as exc:
        if may_pass(exc):
            return False, None, exc
        raise


def adopt_root(memory: Store, persistent: Store, root_id: str | None) -> None:
    """Record the identity of the root reached late in its memory tier. The memory tier
    now holds this job's checkpoints, whatever root it had recorded before: an earlier
    one's (the root deleted or created again meanwhile) is said, and this job's stay."""
    if root_id is None:
        return
    record = read_record(memory)
    known = record.root_id if record is not None else None
    if known == root_id:
        return
    if known is not None:
        log.warning(
            "the memory tier %s recorded another root at %s (deleted or created again "
            "since); this job's checkpoints in it are persisted to the root there now",
            memory.url, persistent.url,
        )  # fmt: skip
    write_record(memory, persistent, root_id)


def keep_root(memory: Store, persistent: Store) -> None:
    """Before each persist: the root carries the identity its memory tier records. One
    deleted while the job runs (an emulator reset, a container created again, an
    operator) is given back the same, so that the job's own memory copies are never
    judged another root's; one changed (the root created again by someone else) is
    adopted: this job's checkpoints are persisted to the root there now.

    Example:
        >>> import os, tempfile
        >>> root, memory = Store(tempfile.mkdtemp()), Store(tempfile.mkdtemp())
        >>> adopt_root(memory, root, identify(root))
        >>> before = root_identity(root)
        >>> os.remove(os.path.join(root.root, ".nebula-root-id.json"))
        >>> keep_root(memory, root)
        >>> root_identity(root) == before
        True
    """
    record = read_record(memory)
    known = record.root_id if record is not None else None
    current = root_identity(persistent)  # one small read per persist
    if current is None:
        persistent.make_dir()  # the root itself may have gone too (an emulator reset)
        current = root_identity(persistent, create=True, new_id=known)
    if current != known:
        adopt_root(memory, persistent, current)
