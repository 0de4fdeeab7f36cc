"""What a memory tier can give back at a restart, and a rank's part restored into it from
the replica another node kept of it: the protocol side of recovery from peer replicas
(runtime/peer_recovery.py agrees on a checkpoint and moves the bytes).

    HeldPart         one part a memory tier holds: a rank's own, or a replica of another
                     node's rank's part (protocol/replicas.py), with what its marker says
    own_parts_held   a rank's committed parts in its memory tier, each whole
    replicas_held    the whole replicas a memory tier keeps, each marker verified (one
                     that is not: `Damaged`)
    replica_files    the files of one replica to send back: its marker, then its items
    PartInbox        one part arriving: `feed` its bytes, `finish` (commit or refuse)

**A part restored** is what a save leaves (commit.py): the rank's items in the tag
folder, then its marker `.rank-<r>.json`, the part's commit point, published whole and
create-only, byte for byte the marker the rank wrote. While it is written a writer marker
names this process (commit.begin_tag, which also clears what the rank left there
uncommitted), so a restore cut short is a dead writer's leftover that the next session
clears. Every file is checked as its bytes arrive against its announced size and checksum
(an item's file is never closed, so never left, with bytes that do not match); the marker
must be the rank's part of that tag and record exactly the items announced, so every item
matches the checksums the rank's marker records. A part refused leaves nothing: the files
it wrote go (never a file another part wrote), and the folder when nothing is left in
it. The memory tier's `Store` writes everything (0600 files, 0700 folders, never
through a symbolic link).

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage`, catalog.py,
commit.py and replicas.py. Not for: moving the bytes or deciding which checkpoint to
restore (runtime/peer_recovery.py), or keeping replicas as they arrive (replica_inbox.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nebulaml.errors import ManifestError, NebulaError, StorageError
from nebulaml.format.checksum import new_hasher
from nebulaml.format.manifest import RankMarker, parse_marker
from nebulaml.format.names import MANIFEST_NAME, marker_name, writer_marker_name
from nebulaml.protocol.catalog import tag_folders
from nebulaml.protocol.commit import begin_tag
from nebulaml.protocol.inbox import FileInbox
from nebulaml.protocol.replicas import (
    FileClaim,
    Replica,
    check_claims,
    read_replica,
    replica_ranks,
    replica_root,
    whole_replicas,
)
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")


@dataclass(frozen=True, slots=True)
class HeldPart:
    """Rank `rank`'s part of `tag` as a memory tier holds it: the rank's own (`replica`
    False) or a whole replica of it, with its marker's generation, the ranks that write
    the checkpoint (`writers`) and when the part was written (`created_at`)."""

    tag: str
    rank: int
    generation: str | None
    writers: tuple[int, ...]
    created_at: str
    replica: bool = False


def _held(marker: RankMarker, *, replica: bool) -> HeldPart:
    return HeldPart(
        marker.tag, marker.rank, marker.generation, marker.writers, marker.created_at, replica
    )


def own_parts_held(memory: Store, rank: int) -> list[HeldPart]:
    """`rank`'s parts in the memory tier `memory` that are whole: its marker there, of that
    tag and rank, and every item it lists there with its size. A folder that cannot be
    read, or a marker that does not parse, is no part (said at debug).

    Example:
        >>> import tempfile
        >>> own_parts_held(Store(tempfile.mkdtemp()), 0)
        []
    """
    held = []
    name = marker_name(rank)
    for tag in tag_folders(memory):
        try:
            files = memory.list_files(tag)
            if name not in files:
                continue
            marker = parse_marker(memory.read_bytes(tag, name), memory.display(tag, name))
        except NebulaError as exc:
            log.debug("%s: no part of rank %d offered: %s", memory.display(tag), rank, exc)
            continue
        if marker.tag != tag or marker.rank != rank:
            continue
        if any(files.get(item.file) != item.size_bytes for item in marker.items):
            continue
        held.append(_held(marker, replica=False))
    return held


def _verified_marker(root: Store, replica: Replica) -> RankMarker | str:
    """The marker of `replica` in `root`, if its bytes are those its record claims and it
    is that rank's part of that tag; else why not."""
    name = marker_name(replica.rank)
    claim = next((c for c in replica.files if c.name == name), None)
    if claim is None:
        return f"its record lists no {name}"
    try:
        data = root.read_bytes(replica.tag, name)
        hasher = new_hasher(claim.algo)
        hasher.update(data)
        digest = hasher.hexdigest()
        if len(data) != claim.size or digest != claim.checksum:
            return (
                f"{name}: {len(data)} bytes with {claim.algo} {digest}, not {claim.size} "
                f"with {claim.checksum} as its record says"
            )
        marker = parse_marker(data, root.display(replica.tag, name))
    except (NebulaError, ValueError) as exc:
        return f"{name}: {exc}"
    if marker.tag != replica.tag or marker.rank != replica.rank:
        return f"{name} is rank {marker.rank}'s part of {marker.tag!r}"
    return marker


@dataclass(frozen=True, slots=True)
class Damaged:
    """A whole replica of `rank`'s part of `tag` whose marker is not what its record
    says (`reason`): it is never offered."""

    tag: str
    rank: int
    reason: str


def replicas_held(memory: Store, damaged: list[Damaged] | None = None) -> list[HeldPart]:
    """The whole replicas the memory tier `memory` keeps of other nodes' parts (newest
    first for each rank), each with what its marker says; a replica whose marker does not
    match its record is none (appended to `damaged`, when given). Their items are checked
    when they are sent back.

    Example:
        >>> import tempfile
        >>> replicas_held(Store(tempfile.mkdtemp()))
        []
    """
    held = []
    for rank in replica_ranks(memory):
        try:
            root = replica_root(memory, rank)
            replicas = whole_replicas(root)
        except NebulaError as exc:
            log.debug("replicas of rank %d not offered: %s", rank, exc)
            continue
        for replica in replicas:
            if replica.rank != rank:
                continue
            marker = _verified_marker(root, replica)
            if isinstance(marker, str):
                if damaged is not None:
                    damaged.append(Damaged(replica.tag, rank, marker))
            else:
                held.append(_held(marker, replica=True))
    return held


def replica_files(memory: Store, tag: str, rank: int) -> tuple[Store, int, list[FileClaim]] | None:
    """The root of `rank`'s replicas in `memory`, the node whose part it is, and the files
    of its replica of `tag` to send back, as its record claims them (the marker first,
    then the items; a manifest it kept is left out: a node's memory tier holds parts);
    None when it holds no whole one."""
    try:
        root = replica_root(memory, rank)
        replica = read_replica(root, tag)
    except NebulaError as exc:
        log.debug("no replica of rank %d's part of %r: %s", rank, tag, exc)
        return None
    if replica is None or replica.rank != rank:
        return None
    name = marker_name(rank)
    files = [c for c in replica.files if c.name == name]
    files += [c for c in replica.files if c.name not in (name, MANIFEST_NAME)]
    return root, replica.node, files


@dataclass(frozen=True, slots=True)
class Restored:
    """What became of one part arriving: `committed` into the memory tier, or refused for
    `reason`; `size`: the bytes of its items."""

    tag: str
    rank: int
    committed: bool
    reason: str | None = None
    size: int = 0


class PartInbox(FileInbox):
    """Rank `rank`'s part of `tag` arriving into the memory tier `memory` as the files
    `files` (the marker and the items, in the order their bytes follow): `feed` their
    bytes in pieces of any size, then `finish`. Nothing raises on the way: the first
    problem is kept, the bytes after it are taken and dropped (the sender's stream goes
    on), and `finish` refuses the part for it."""

    def __init__(
        self, memory: Store, *, tag: str, rank: int, files: Sequence[FileClaim], world_size: int
    ) -> None:
        super().__init__()
        self.memory, self.tag, self.rank = memory, tag, rank
        self.files = tuple(files)
        self.total = sum(max(0, claim.size) for claim in self.files)
        self.received = 0
        self._marker_name = marker_name(rank)
        self._error = check_claims(tag, rank, self.files)
        if self._error is None and any(c.name == MANIFEST_NAME for c in self.files):
            self._error = "a manifest announced with a rank's part"
        self._index = 0  # the file the next byte belongs to
        self._filled = 0  # its bytes taken so far
        self._hasher: Any = None
        self._marker = bytearray()
        self._written: list[str] = []  # item files this inbox wrote (removed if refused)
        self._begun = False
        if self._error is None:
            self._guard(lambda: self._begin(world_size))
        if self._error is None:
            self._advance()

    def _begin(self, world_size: int) -> None:
        # Clears what the rank left of the tag uncommitted, and names this process its
        # writer: a restore cut short is a dead writer's leftover.
        begin_tag(self.memory, self.tag, rank=self.rank, overwrite=False,
                  world_size=max(2, world_size), announce=False)  # fmt: skip
        self._begun = True

    def _start_current(self) -> None:
        claim = self.files[self._index]
        self._hasher = new_hasher(claim.algo)
        if claim.name == self._marker_name:
            return  # kept in memory: published last, as the part's commit
        # A file of that name is removed first, never written through: it may be a
        # leftover linked to another file.
        self.memory.remove(self.tag, claim.name, durable=False)
        self._open_writer(self.memory, self.tag, claim.name)
        self._written.append(claim.name)

    def _advance(self) -> None:
        """Check and close the current file once all its bytes are in, and every empty
        file after it; a file whose bytes do not match its claim is never closed whole."""
        while self._error is None and self._index < len(self.files):
            claim = self.files[self._index]
            if self._hasher is None:
                self._guard(self._start_current)
                if self._error is not None:
                    return
            if self._filled < claim.size:
                return
            digest = self._hasher.hexdigest()
            if digest != claim.checksum:
                self._fail(
                    f"{claim.name}: {claim.size} bytes with {claim.algo} {digest}, "
                    f"not {claim.checksum} as its rank recorded"
                )
                return
            self._guard(self._close_current)
            self._index, self._filled, self._hasher = self._index + 1, 0, None

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """The next bytes of the files, in order."""
        view = memoryview(data).cast("B")
        self.received += len(view)
        if self.received > self.total:
            self._fail(f"more bytes than the {self.total} announced")
        while view and self._error is None:
            claim = self.files[self._index]
            piece = view[: claim.size - self._filled]
            self._hasher.update(piece)
            if claim.name == self._marker_name:
                self._marker += piece
            elif self._out is not None:
                try:
                    self._out.write(piece)
                except (NebulaError, OSError) as exc:
                    self._fail(f"it could not be written: {exc}")
                    return
            self._filled += len(piece)
            view = view[len(piece) :]
            self._advance()

    def _check_marker(self) -> str | None:
        """Why the marker received does not vouch for the items received (None: it does)."""
        try:
            marker = parse_marker(
                bytes(self._marker), self.memory.display(self.tag, self._marker_name)
            )
        except ManifestError as exc:
            return str(exc)
        if marker.tag != self.tag or marker.rank != self.rank:
            return f"{self._marker_name} is rank {marker.rank}'s part of {marker.tag!r}"
        recorded = {(i.file, i.size_bytes, i.checksum_algo, i.checksum) for i in marker.items}
        announced = {
            (c.name, c.size, c.algo, c.checksum) for c in self.files if c.name != self._marker_name
        }
        if recorded != announced or len(marker.items) != len(self.files) - 1:
            return f"the items announced are not what its marker ({self._marker_name}) records"
        if any(item.rank != self.rank for item in marker.items):
            return f"{self._marker_name} lists another rank's item"
        return None

    def finish(self, sender_ok: bool = True) -> Restored:
        """Commit the part (its marker published, create-only) if every byte arrived and
        matched, else remove what was written of it. `sender_ok`: the sender read every
        file whole. Says nothing: the caller reports a refusal."""
        if self._error is None and self.received < self.total:
            self._fail(f"{self.received} of {self.total} bytes arrived")
        if self._error is None and not sender_ok:
            self._fail("its sender could not read it whole")
        if self._error is None:
            reason = self._check_marker()
            if reason is not None:
                self._fail(reason)
        if self._error is None:
            self._guard(self._commit)
        size = self.total - len(self._marker)
        if self._error is not None:
            self._remove()
            return Restored(self.tag, self.rank, committed=False, reason=self._error, size=size)
        return Restored(self.tag, self.rank, committed=True, size=size)

    def abandon(self) -> None:
        """The stream ended before the part did (its link failed): what was written goes."""
        self._fail("its transfer was cut short")
        self._remove()

    def _commit(self) -> None:
        self.memory.publish((self.tag, self._marker_name), bytes(self._marker), create_only=True)
        self.memory.remove(self.tag, writer_marker_name(self.rank))

    def _remove(self) -> None:
        """The files this inbox wrote, its writer marker, and the folder if it is empty."""
        if not self._begun:
            return
        try:
            for name in [*self._written, writer_marker_name(self.rank)]:
                self.memory.remove(self.tag, name, durable=False)
            if not self.memory.list_files(self.tag):
                self.memory.remove_dir(self.tag, files=[])
        except (NebulaError, StorageError) as exc:
            log.debug("what the refused part of %r left: %s", self.tag, exc)
