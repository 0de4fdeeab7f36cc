"""Retention after a persist: what the persistent tier keeps once a checkpoint landed
there (`retire`), reading only the manifests it has not read before; its first listing
in a process also clears what dead writers of this node left below the root's top.

May import: every layer below runtime. Not for: when it runs (the persister's
persist_actions.py), or the plan itself (protocol/retention.py).
"""

from __future__ import annotations

import logging

from nebulaml.errors import NebulaError, UnsupportedSchemaError
from nebulaml.protocol.catalog import read_committed, tag_folders
from nebulaml.protocol.delete import delete_checkpoint
from nebulaml.protocol.recovery import remove_dead_writers
from nebulaml.protocol.retention import Version, plan_retention
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")


def retire(
    persistent: Store,
    retention: int,
    just_persisted: str,
    known: dict[str, Version] | None = None,
) -> tuple[set[str], int]:
    """Delete what retention retires on `persistent` now that `just_persisted` is there;
    the tags left committed there, and the highest commit sequence it read (while
    nothing can go: `just_persisted`'s; the caller keeps the highest). A tag that cannot
    go now goes at the next persist's retention.

    `known`: what the caller knows is committed there (updated here), so that each
    persist reads only the manifests it has not read yet (`just_persisted`'s, and any
    new folder's), not every manifest of the root: one listing of the folders, and one
    manifest per new tag.

    Example:
        >>> import tempfile
        >>> from nebulaml.storage.store import Store
        >>> retire(Store(tempfile.mkdtemp()), 2, "global_step1")
        (set(), 0)
    """
    known = {} if known is None else known

    def read(tag: str) -> None:
        """Learn (or forget) `tag`'s version from its manifest; a newer nebula's schema is
        never this job's to retire."""
        try:
            info = read_committed(persistent, tag)
        except UnsupportedSchemaError:
            return
        if info is None:
            known.pop(tag, None)
        else:
            known[tag] = Version.of(info.manifest)

    read_now: set[str] = set()
    if known:
        # What was just persisted is read (one manifest). While fewer checkpoints than
        # `retention` count, nothing can go: the root's folders need not be listed (one
        # job writes a root; what an operator copies in is read at the next listing).
        read(just_persisted)
        read_now.add(just_persisted)
        if just_persisted in known and (
            len(known) < retention or sum(1 for v in known.values() if not v.labels) < retention
        ):
            # The sequence of what was just persisted: the caller keeps the highest.
            return set(known), known[just_persisted].sequence
    folders = set(tag_folders(persistent))
    for tag in [t for t in known if t not in folders]:
        del known[tag]  # deleted meanwhile (a prune)
    uncommitted = []
    for tag in folders - read_now:
        if tag not in known or tag == just_persisted:
            read(tag)
            if tag not in known:
                uncommitted.append(tag)
    if uncommitted:
        # What this node's dead writers left below the top of the root (a delete cut
        # short): a restart looks only at the top (recovery.suspects); this listing,
        # once per process, sees every folder.
        try:
            remove_dead_writers(persistent, sorted(uncommitted))
        except NebulaError as exc:
            log.debug("leftovers of dead writers on %s: %s", persistent.url, exc)
    for tag in plan_retention(list(known.values()), retention, {just_persisted}):
        try:
            delete_checkpoint(persistent, tag)
            del known[tag]
        except NebulaError as exc:
            # Tidying, after the persist: an older checkpoint that could not go now (a
            # prune deleting it too, say) goes at the next persist's retention.
            log.warning("retention could not delete %r yet: %s", tag, exc)
    return set(known), max((v.sequence for v in known.values()), default=0)
