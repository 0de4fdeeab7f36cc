"""The tiers of one job: a node-local memory tier and, optionally, a persistent tier.

    open_tiers   the tiers of a root, to read: a stale or unsafe memory tier left out
    adopt_memory_tier  the memory tier of a root, to copy a checkpoint into outside a
                 session: private, with its root recorded
    claim_tiers  the tiers of a session that writes, for a root of a known identity: the
                 memory tier checked private and held, an earlier root's released first
    TierSet      the stores of one job, fastest first

What makes a memory tier private is memory_tier.py, its root's tier_identity.py, and
held tier_lifetime.py.

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage`, memory_tier.py,
tier_identity.py and tier_lifetime.py.
Not for: moving checkpoints between tiers (persister.py), reading them (catalog.py), or
listing every tier of this user (ops/memory_tiers.py).
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from typing import Any

from nebulaml.config import private_default
from nebulaml.errors import NebulaError, StorageFullError
from nebulaml.protocol.memory_tier import check_private_dir, ensure_private_dir, memory_root_for
from nebulaml.protocol.tier_identity import (
    OK,
    judge_memory_tier,
    read_record,
    root_identity,
    write_record,
)
from nebulaml.protocol.tier_lifetime import TierHold, describe_release, release_memory_tier
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")


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


def tighten_root(persistent: Store) -> None:
    """A private local root (`init(private=True)`, `NEBULA_PRIVATE=1`) is this user's
    alone: its folder, if it exists, is made 0700 (what nebula writes in it from now on
    is 0600 and 0700 already: storage/local.py). A root folder another user owns keeps
    its mode, with a warning. Files written before the root was made private keep theirs.
    """
    if not (persistent.private and persistent.is_local):
        return
    root = persistent.root
    try:
        st = os.lstat(root)
    except (FileNotFoundError, NotADirectoryError):
        return  # made 0700 when it is created
    if not stat.S_ISDIR(st.st_mode) or not stat.S_IMODE(st.st_mode) & 0o077:
        return
    if st.st_uid != os.geteuid():
        log.warning("private=True: %s is owned by uid %d, not by you: its mode (%04o) stays",
                    root, st.st_uid, stat.S_IMODE(st.st_mode))  # fmt: skip
        return
    os.chmod(root, 0o700, follow_symlinks=False)
    log.info("private=True: %s made 0700 (it was %04o)", root, stat.S_IMODE(st.st_mode))


def open_tiers(
    persistent_path: str | os.PathLike[str] | None,
    storage_options: dict[str, Any] | None = None,
) -> TierSet:
    """The tiers for a persistent root (None: the memory tier alone), to read: a memory
    tier that is stale or unsafe is left out (`TierSet.memory_state`), with a warning."""
    persistent = None
    if persistent_path is not None:
        persistent = Store(persistent_path, storage_options, private=private_default())
    memory = Store(memory_root_for(persistent), durable=False, private=True)
    state, note = judge_memory_tier(memory, persistent)
    if state != OK:
        log.warning("ignoring the memory tier %s: %s", memory.url, note)
    return TierSet(memory=memory, persistent=persistent, memory_state=state, memory_note=note)


def adopt_memory_tier(tiers: TierSet) -> None:
    """Make ready the memory tier of `tiers` for a checkpoint copied into it outside a
    session (`nebula copy ROOT TAG memory`): its folders private, and its root recorded
    (URL, location, identity) unless a session recorded it already, as `claim_tiers`
    does. Without the record `nebula memory` would call it orphaned ("no record of its
    root") and `nebula gc` could not tell that what it holds is on the root too."""
    memory, persistent = tiers.memory, tiers.persistent
    ensure_private_dir(os.path.dirname(memory.root))
    ensure_private_dir(memory.root)
    if persistent is None or read_record(memory) is not None:
        return
    write_record(memory, persistent, root_identity(persistent))


def claim_tiers(persistent: Store | None, root_id: str | None) -> tuple[TierSet, TierHold]:
    """The tiers of a session that writes, for the persistent root `persistent` (None: the
    memory tier alone) whose identity the caller learned (`root_id`: runtime/connect.py;
    None: not known, and the memory tier is not judged stale): the memory tier checked
    private (`UnsafeMemoryTierError` otherwise) and held (`TierHold`). A stale memory tier
    (an earlier root's at this location) is released first, with one warning naming the
    root, its tags and bytes; one that a live session of that earlier root still holds is
    refused. The persistent tier itself is not asked anything. A session refused after
    this (another job holds the root: job.py) gives the tier back with `hold.abandon()`,
    which removes the folder unless it holds a checkpoint or another session holds it."""
    memory = Store(memory_root_for(persistent), durable=False, private=True)
    ensure_private_dir(os.path.dirname(memory.root))
    ensure_private_dir(memory.root)
    hold = TierHold.take(memory)
    try:
        record = read_record(memory)
        known = record.root_id if record is not None else None
        if persistent is not None and root_id is not None and known not in (None, root_id):
            shown = (record.persistent if record else None) or persistent.url
            done = release_memory_tier(memory, hold, reads_only=True)
            if done.kept or (not done.tags and not done.size and check_private_dir(memory.root)):
                reading = f" reading {', '.join(done.kept)}" if done.kept else ""
                raise NebulaError(
                    f"{memory.url}: the memory tier of an earlier root at {shown} (deleted "
                    f"or created again since) is still held by a live process{reading}; end "
                    f"it, or wait for it"
                )
            log.warning(
                "%s; its root was deleted or created again since, so they were not used",
                describe_release(shown, done.tags, done.size),
            )
            hold.close()
            ensure_private_dir(memory.root)
            hold = TierHold.take(memory)
        try:
            write_record(memory, persistent, root_id or known)
        except StorageFullError as exc:  # a full RAM disk: saves go around it (budget.py)
            log.warning("could not record the memory tier's root: %s", exc)
    except BaseException:
        hold.abandon()  # the folder made here goes too, unless it holds what others need
        raise
    return TierSet(memory=memory, persistent=persistent), hold
