"""Pruning a root on request (`nebula prune`): list, plan, execute.

    list_prune_candidates  what is on the root: committed versions, and (on request) the
                           leftovers of crashed saves with how long they have been idle and
                           whether their writer is alive on this host
    plan_prune             a pure function from that listing to a `PrunePlan`, no I/O
    execute_prune          deletes what the plan says, manifest first, re-checking each
                           tag just before it goes; a tag being read is kept and reported

Never deleted: the newest committed checkpoint, a labelled one (unless the caller includes
labelled ones), a tag a live process on this host is writing, a checkpoint being read (a
live read lease, leases.py), a leftover that was written to within the grace period, and
anything without our markers (docs/architecture.md, "The commit protocol"). A tag folder
that cannot be read safely (a symbolic link put in its place) is never read through, and
one this user may not read (another user's, mode 000) is not listed: each is kept and
reported, and the rest is pruned.

Not for: the job's own retention while it trains (retention.py, applied by the persister).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from nebulaml.errors import (
    InvalidArgumentError,
    RootNotFoundError,
    StorageError,
    UnsupportedSchemaError,
)
from nebulaml.format.manifest import parse_utc
from nebulaml.format.names import MANIFEST_NAME, OrderKey, validate_name
from nebulaml.protocol.catalog import list_committed, read_committed
from nebulaml.protocol.delete import delete_checkpoint, delete_checkpoints
from nebulaml.protocol.leases import LISTINGS
from nebulaml.protocol.markers import describe_writer, is_marker, read_writers, writer_alive
from nebulaml.protocol.recovery import list_incomplete
from nebulaml.protocol.retention import Version
from nebulaml.runtime.locate import tiers_for
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")
PathLike = str | os.PathLike[str]
DEFAULT_GRACE_S = 3600.0
BEING_READ = "being read"  # why execute_prune kept a tag a reader holds a lease on
# Deletes a prune runs at once: each waits on its store (an fsync, a request) as much as it
# runs Python, so two per core, and at most 8.
PRUNE_WORKERS = max(2, min(8, 2 * (os.cpu_count() or 1)))
# Tags one delete takes at once on a local root (protocol/delete.py's delete_checkpoints):
# their manifests' removals share one journal commit. A batch's tags are claimed until its
# last is gone.
PRUNE_BATCH = 16


@dataclass(frozen=True, slots=True)
class Leftover:
    """An uncommitted tag folder with our markers, as seen when the root was listed.

    `idle_s` is the time since the last sign of activity (a writer marker's start or the
    newest file's modification time), None when neither is known; `live_writer` describes
    a writer that is alive on this host (e.g. "pid 12 on node1"), if any.
    """

    tag: str
    idle_s: float | None
    live_writer: str | None = None
    size_bytes: int = 0


@dataclass(frozen=True, slots=True)
class UnreadableTag:
    """A tag folder this user may not read (another user's, mode 000), or whose manifest
    is of a schema this nebula cannot read (a newer nebula's), as seen when the root was
    listed, and the error that says so: never deleted."""

    tag: str
    why: str


@dataclass(frozen=True, slots=True)
class PruneListing:
    """What `list_prune_candidates` found on one root."""

    root: str
    versions: tuple[Version, ...]
    leftovers: tuple[Leftover, ...] = ()
    unreadable: tuple[UnreadableTag, ...] = ()


@dataclass(frozen=True, slots=True)
class PruneDecision:
    """One tag and why the plan keeps or deletes it; `committed` is False for leftovers
    and for folders that could not be read."""

    tag: str
    reason: str
    committed: bool = True


@dataclass(frozen=True, slots=True)
class PrunePlan:
    """What `execute_prune` will delete and what it keeps, each with a reason.

    `delete`: committed tags to delete, oldest first. `incomplete`: leftovers to remove.
    `keep`: committed tags kept by the count. `protected`: tags that may not be deleted
    (the newest, labelled ones, leftovers being written or within the grace period,
    folders this user may not read).
    The options the plan was made with are kept so that the execution re-checks by them.
    """

    root: str
    keep_last: int
    include_labelled: bool
    grace_s: float
    newest: str | None
    keep: tuple[PruneDecision, ...]
    protected: tuple[PruneDecision, ...]
    delete: tuple[PruneDecision, ...]
    incomplete: tuple[PruneDecision, ...]

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON-serialisable data (kept = keep + protected)."""

        def rows(decisions: Sequence[PruneDecision]) -> list[dict[str, Any]]:
            return [{"tag": d.tag, "reason": d.reason, "committed": d.committed} for d in decisions]

        return {
            "root": self.root,
            "keep": self.keep_last,
            "include_labelled": self.include_labelled,
            "grace_s": self.grace_s,
            "delete": rows(self.delete),
            "incomplete": rows(self.incomplete),
            "kept": rows(self.keep + self.protected),
        }


@dataclass(frozen=True, slots=True)
class PruneResult:
    """What `execute_prune` deleted (in order) and what its last-moment checks spared."""

    deleted: tuple[str, ...]
    skipped: tuple[PruneDecision, ...]


def list_prune_candidates(root: PathLike, *, incomplete: bool = False) -> PruneListing:
    """List `root` itself (not its memory tier) for `plan_prune`.

    Committed checkpoints always; with `incomplete`, also the tag folders that carry our
    markers but no valid manifest. Folders without our markers are never listed; tag
    folders this user may not read are listed apart (`unreadable`), said once. Raises
    `RootNotFoundError` when `root` does not exist.

    Example:
        >>> import tempfile
        >>> list_prune_candidates(tempfile.mkdtemp()).versions
        ()
    """
    store = _store(root)
    refused: list[tuple[str, StorageError]] = []
    newer: list[UnsupportedSchemaError] = []  # a newer nebula's: protected, saying so
    versions = tuple(
        Version.of(info.manifest) for info in list_committed(store, newer, unreadable=refused)
    )
    unreadable = tuple(UnreadableTag(tag, str(exc)) for tag, exc in refused) + tuple(
        UnreadableTag(exc.tag or exc.where, str(exc)) for exc in newer
    )
    leftovers: tuple[Leftover, ...] = ()
    if incomplete:
        now = datetime.now(timezone.utc)
        found = (_inspect_leftover(store, tag, now) for tag in list_incomplete(store))
        leftovers = tuple(lo for lo in found if lo is not None)
    return PruneListing(store.url, versions, leftovers, unreadable)


def plan_prune(
    listing: PruneListing,
    keep: int,
    *,
    include_labelled: bool = False,
    grace_s: float = DEFAULT_GRACE_S,
) -> PrunePlan:
    """Decide what to delete so that the `keep` newest committed versions remain.

    The newest version is always kept and counts towards `keep`. Labelled versions are
    kept and do not count, unless `include_labelled`, which makes them ordinary versions.
    Leftovers in the listing are removed when no writer of theirs is alive on this host
    and they have been idle for at least `grace_s` seconds. Folders that could not be read
    are protected, saying why. Pure: no I/O, no clock.

    Example:
        >>> vs = tuple(Version(f"global_step{i}", "") for i in range(3))
        >>> [d.tag for d in plan_prune(PruneListing("/r", vs), keep=2).delete]
        ['global_step0']
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise InvalidArgumentError(f"keep must be an int of at least 1, not {keep!r}")
    if grace_s < 0:
        raise InvalidArgumentError(f"grace_s must be at least 0, not {grace_s!r}")
    ordered = sorted(listing.versions, key=lambda v: v.sort_key, reverse=True)
    newest = ordered[0].tag if ordered else None
    kept: list[PruneDecision] = []
    protected: list[PruneDecision] = []
    delete: list[PruneDecision] = []
    for version in ordered:
        if version.tag == newest:
            protected.append(PruneDecision(version.tag, "the newest committed checkpoint"))
        elif version.labels and not include_labelled:
            labels = ", ".join(version.labels)
            protected.append(PruneDecision(version.tag, f"labelled {labels}"))
        elif len(kept) + 1 < keep:  # + 1: the newest counts towards keep
            kept.append(PruneDecision(version.tag, f"one of the {keep} newest"))
        else:
            delete.append(PruneDecision(version.tag, f"older than the {keep} newest"))
    incomplete: list[PruneDecision] = []
    for leftover in sorted(listing.leftovers, key=lambda lo: lo.tag):
        spare = _spare_leftover(leftover, grace_s)
        if spare is None:
            idle = f"idle {leftover.idle_s:.0f} s" if leftover.idle_s is not None else ""
            reason = f"incomplete, no live writer, {idle}".rstrip(", ")
            incomplete.append(PruneDecision(leftover.tag, reason, committed=False))
        else:
            protected.append(PruneDecision(leftover.tag, spare, committed=False))
    for unreadable in sorted(listing.unreadable, key=lambda u: u.tag):
        reason = f"not deleted: it could not be read ({unreadable.why})"
        protected.append(PruneDecision(unreadable.tag, reason, committed=False))
    return PrunePlan(
        root=listing.root,
        keep_last=keep,
        include_labelled=include_labelled,
        grace_s=grace_s,
        newest=newest,
        keep=tuple(kept),
        protected=tuple(protected),
        delete=tuple(delete[::-1]),  # oldest first: an interrupted prune keeps the newer
        incomplete=tuple(incomplete),
    )


def execute_prune(root: PathLike, plan: PrunePlan) -> PruneResult:
    """Delete what `plan` says from `root`, each tag manifest first, then its data.

    Just before each deletion the tag is checked again, by the plan's own options: a
    committed tag must still be committed, unlabelled (unless the plan includes labelled
    ones) and not the newest; a leftover must still be uncommitted, carry our markers,
    have no live writer on this host and have been idle for the grace period. A tag that
    fails the check, or that a reader holds a lease on when its turn comes, is skipped and
    reported ("being read"), never deleted.
    """
    for decision in (*plan.delete, *plan.incomplete):
        validate_name("tag", decision.tag)
    store = _store(root)
    asker = threading.get_ident()
    witness = _witness(store, plan.newest)

    def why_kept(decision: PruneDecision) -> PruneDecision | None:
        """None when the committed tag may still go, as planned; else why it stays."""
        try:
            info = read_committed(store, decision.tag)
        except StorageError as exc:
            # One tag that cannot be read safely (a symbolic link put in its place since
            # the plan) is skipped and said; the others are still pruned.
            return PruneDecision(decision.tag, f"not deleted: {exc}")
        if info is None:
            return PruneDecision(decision.tag, "no longer committed")
        if info.manifest.labels and not plan.include_labelled:
            return PruneDecision(decision.tag, "labelled since the plan was made")
        if _newer_witness(store, witness, info.sort_key) is None:
            return PruneDecision(decision.tag, "it is now the newest committed")
        return None

    def batch(decisions: Sequence[PruneDecision]) -> list[PruneDecision | None]:
        """Delete a few committed tags of the plan: None for each deleted, else why not."""
        outcomes = [why_kept(decision) for decision in decisions]
        going = [d.tag for d, why in zip(decisions, outcomes, strict=True) if why is None]
        for tag in going:
            # The caller asked for the deletion: what its thread merely listed does not
            # hold the tag against it (a handle it took still does, and another thread's
            # listing).
            LISTINGS.release_tag(store, tag, thread=asker)
        done = delete_checkpoints(store, going)
        for i, decision in enumerate(decisions):
            if outcomes[i] is None:
                gone = done[decision.tag]
                if isinstance(gone, StorageError):
                    outcomes[i] = PruneDecision(decision.tag, f"not deleted: {gone}")
                elif not gone:
                    outcomes[i] = PruneDecision(decision.tag, BEING_READ)
        return outcomes

    # The deletes are independent: several batches at once (each waits on its store:
    # fsyncs on a disk, requests to an object store), reported in the plan's order.
    # An object store has no fsync to share: a tag a batch there, each on its own.
    size = PRUNE_BATCH if store.is_local else 1
    batches = [plan.delete[i : i + size] for i in range(0, len(plan.delete), size)]
    with ThreadPoolExecutor(max_workers=PRUNE_WORKERS, thread_name_prefix="nebula-prune") as pool:
        outcomes = [why for done in pool.map(batch, batches) for why in done]
    deleted = [d.tag for d, why in zip(plan.delete, outcomes, strict=True) if why is None]
    skipped = [why for why in outcomes if why is not None]
    now = datetime.now(timezone.utc)
    for decision in plan.incomplete:
        try:
            why = _remove_leftover(store, decision.tag, plan.grace_s, now)
        except StorageError as exc:
            # One leftover that cannot be read safely (a symbolic link put in its place)
            # is skipped and said; the others are still removed.
            why = f"not deleted: {exc}"
        if why is None:
            deleted.append(decision.tag)
        else:
            skipped.append(PruneDecision(decision.tag, why, False))
    return PruneResult(tuple(deleted), tuple(skipped))


def _remove_leftover(store: Store, tag: str, grace_s: float, now: datetime) -> str | None:
    """Delete the leftover `tag` if it still is one that may go: None once deleted, else
    why it stays."""
    leftover = _inspect_leftover(store, tag, now)
    if leftover is None:
        return "no longer an incomplete tag"
    spare = _spare_leftover(leftover, grace_s)
    if spare is not None:
        return spare
    if not delete_checkpoint(store, tag):
        return BEING_READ
    return None


# helpers -------------------------------------------------------------------------------------
def _store(root: PathLike) -> Store:
    store = tiers_for(root, "prune").persistent
    assert store is not None  # a root was given
    if not store.exists():
        raise RootNotFoundError(store.url)
    return store


def _spare_leftover(leftover: Leftover, grace_s: float) -> str | None:
    """Why a leftover must stay, or None when it may be removed (the one rule for both
    the plan and the last-moment check)."""
    if leftover.live_writer is not None:
        return f"being written by {leftover.live_writer}"
    if leftover.idle_s is None:
        return "incomplete; when it was last written is unknown"
    if leftover.idle_s < grace_s:
        return f"incomplete, written {leftover.idle_s:.0f} s ago (grace period {grace_s:g} s)"
    return None


def _witness(store: Store, newest: str | None) -> str | None:
    """The tag whose manifest proves that a newer checkpoint than each planned one stays:
    the plan's newest; where its folder cannot be read safely now (a symbolic link put in
    its place since the plan), it proves nothing and is never read through (said once),
    and the newest committed that can be read is the witness instead."""
    if newest is None:
        return None
    try:
        read_committed(store, newest)
    except StorageError as exc:
        log.warning("prune: the plan's newest checkpoint is not read, and kept: %s", exc)
        found = list_committed(store)
        return found[-1].tag if found else None
    return newest


def _newer_witness(store: Store, witness: str | None, key: OrderKey) -> str | None:
    """A tag committed on `store` that sorts after `key`, or None if there is none.

    The witness is checked first (one read); only if it has gone, or cannot be read
    safely any more (a symbolic link in its place), is the root listed.
    """
    if witness is not None:
        try:
            info = read_committed(store, witness)
        except StorageError:
            info = None  # swapped for a link since `_witness`: it proves nothing
        if info is not None and info.sort_key > key:
            return witness
    newest = list_committed(store)
    if newest and newest[-1].sort_key > key:
        return newest[-1].tag
    return None


def _inspect_leftover(store: Store, tag: str, now: datetime) -> Leftover | None:
    """The leftover `tag` as it is now, or None if it is not one (committed, gone, or
    without our markers)."""
    files = store.list_files(tag)
    if not any(is_marker(name) for name in files):
        return None
    if MANIFEST_NAME in files and read_committed(store, tag) is not None:
        return None
    host = socket.gethostname()
    writers = read_writers(store, tag)
    live = next((describe_writer(w) for w in writers if writer_alive(w, host)), None)
    times = [t for t in (parse_utc(w.get("started_at")) for w in writers) if t is not None]
    for name in files:
        modified = store.modified_at(tag, name)
        if modified is not None:
            times.append(modified)
    idle_s = max(0.0, (now - max(times)).total_seconds()) if times else None
    return Leftover(tag, idle_s, live, sum(files.values()))
