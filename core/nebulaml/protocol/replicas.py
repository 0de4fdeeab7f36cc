"""A node's replicas of other nodes' checkpoint parts, kept in its memory tier: written as
their bytes arrive, each file checked against what its rank's marker records, and
committed only whole.

    <memory tier>/.replicas/
      rank-<r>/                one root per rank whose parts this node keeps (a tier's
                               layout: a folder per tag), written by one receiver only
        <tag>/
          .rank-<r>.json       the part's marker, as rank r wrote it: its items, their
                               sizes and checksums
          manifest.json        the checkpoint's manifest, when rank r's memory tier held
                               one (a node's memory tier holds the whole checkpoint only
                               when every rank that writes it is on that node)
          <item>...            the items the marker lists
          .replica.json        written last, create-only: every file above arrived whole
                               and matched; {schema_version, tag, rank, node, created_at,
                               received_at, files: [[name, size, algo, checksum], ...]}

A replica is *whole* when its `.replica.json` is there, valid, and every file it lists is
there with its size. How one is received, checked and committed: protocol/replica_inbox.py.

After each commit the rank's other replicas go (`keep_only`): the one just committed is
kept until a newer one is whole. Newer is the sender's order, not the tags': a rank sends
its parts in the order it committed them, and a job that resumed an older checkpoint
(after a lost node, or rolled back) saves tags older than the replica held of the run
before, which is of no use any more (kept as the newest, it would remove each new
replica as soon as it was answered). **One older replica stays** while the receiving
rank's own part of the tag just committed is not in its memory tier yet (`OwnParts`: the
partner is a step ahead, replication being asynchronous): the one received last of those
whose tag its own part is committed for, so that a loss of the partner still finds a
checkpoint complete on this node (the partner's part from the replica, this rank's own
from its memory tier; runtime/persist_schedule.py's eviction keeps that own part while
the replica stands). It goes at the next commit after this rank's own part of a newer
replica's tag is there. The same part announced again (same files, sizes,
checksums) keeps the replica held and drops the bytes; a tag saved again (other
checksums) replaces it. Folders 0700, files 0600, nothing through a symbolic link: the
memory tier's `Store` writes everything.

    part_files       a rank's part of a tag in its memory tier, as its sender announces it
    check_claims     whether the files announced can be a rank's part of a tag
    replica_root     the root of one rank's replicas in a memory tier
    read_replica     a whole replica, or None; `whole_replicas`: all, newest first
    keep_only        every replica of a rank but the one of a tag removed (and an older one
                     while the receiving rank's own part of that tag is not committed)
    OwnParts         the receiving rank's own committed parts, as `keep_only` asks
    replica_tags     the tags of the replicas a memory tier holds, whole or arriving
    replica_ranks    the ranks whose replicas a memory tier holds

May import: `nebulaml.errors`, `nebulaml.format` and `nebulaml.storage`. Not for: moving
the bytes between nodes (runtime/replication.py), which nodes replicate to which
(runtime/peers.py), or restoring a replica into a memory tier.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nebulaml.errors import InvalidArgumentError, NebulaError
from nebulaml.format.checksum import CHECKSUM_ALGO, KNOWN_CHECKSUM_ALGOS, checksum_of
from nebulaml.format.jsonbounds import MAX_MANIFEST_BYTES, JsonBoundsError, load_json
from nebulaml.format.manifest import parse_marker
from nebulaml.format.names import (
    MANIFEST_NAME,
    REPLICA_DONE,
    REPLICAS_DIR,
    OrderKey,
    marker_name,
    name_number,
    order_key,
    validate_name,
)
from nebulaml.storage.store import MissingFileError, Store

log = logging.getLogger("nebulaml")

DONE_SCHEMA_VERSION = 1
_RANK_DIR = "rank-"


@dataclass(frozen=True, slots=True)
class FileClaim:
    """One file of a replica as its sender announces it: its name in the tag folder,
    its size, and its checksum under `algo` (one of `KNOWN_CHECKSUM_ALGOS`)."""

    name: str
    size: int
    algo: str
    checksum: str

    def to_json(self) -> list[Any]:
        return [self.name, self.size, self.algo, self.checksum]


@dataclass(frozen=True, slots=True)
class Replica:
    """A whole replica of rank `rank`'s part of `tag`, kept for node `node`."""

    tag: str
    rank: int
    node: int
    created_at: str  # when the rank wrote its part (its marker's)
    received_at: str
    files: tuple[FileClaim, ...]

    @property
    def sort_key(self) -> OrderKey:
        return order_key(self.tag, self.created_at)

    @property
    def size_bytes(self) -> int:
        return sum(claim.size for claim in self.files)

    @property
    def sizes(self) -> dict[str, int]:
        return {claim.name: claim.size for claim in self.files}


@dataclass(frozen=True, slots=True)
class OwnParts:
    """The receiving rank `rank`'s own parts in its node's memory tier `memory`: a tag's is
    committed once the rank's marker is there (a save publishes it last)."""

    memory: Store
    rank: int

    def committed(self, tag: str) -> bool:
        try:
            return self.memory.exists(tag, marker_name(self.rank))
        except NebulaError:
            return False


def rank_folder(rank: int) -> str:
    """The folder of `rank`'s replicas under `.replicas/`.

    Example:
        >>> rank_folder(7), rank_of_folder("rank-7"), rank_of_folder("rank-x")
        ('rank-7', 7, None)
    """
    return f"{_RANK_DIR}{rank}"


def rank_of_folder(name: str) -> int | None:
    """The rank whose replicas the folder `name` holds (None: no such folder)."""
    if not name.startswith(_RANK_DIR):
        return None
    return name_number(name[len(_RANK_DIR) :])


def replica_root(memory: Store, rank: int) -> Store:
    """The root of `rank`'s replicas in the memory tier `memory` (a local, private store),
    made if missing; never reached through a symbolic link (`StorageError` naming it)."""
    memory.make_dir(REPLICAS_DIR, rank_folder(rank))  # refuses a link on the way
    path = memory.local_path(REPLICAS_DIR, rank_folder(rank))
    if path is None:
        raise InvalidArgumentError(f"replicas are kept in a local memory tier, not {memory.url}")
    return Store(path, durable=False, private=True)


def replica_ranks(memory: Store) -> list[int]:
    """The ranks whose replicas the memory tier `memory` holds folders of, ascending."""
    path = memory.local_path(REPLICAS_DIR)
    if path is None or not memory.exists(REPLICAS_DIR):
        return []
    folders = Store(path, durable=False, private=True).list_dirs()
    return sorted(r for r in map(rank_of_folder, folders) if r is not None)


def part_files(memory: Store, tag: str, rank: int) -> tuple[list[FileClaim], dict[str, bytes]]:
    """The files of `rank`'s part of `tag` in the memory tier `memory`, as a replica's
    sender announces them (its marker, the manifest when the tier holds one, then the
    items the marker lists, with the marker's sizes and checksums), and the bytes of the
    first two, read now. `MissingFileError` (a `NebulaError`) when the part has no marker
    there: not committed, or evicted."""
    name = marker_name(rank)
    small = {name: memory.read_bytes(tag, name)}
    marker = parse_marker(small[name], memory.display(tag, name))
    if MANIFEST_NAME in memory.list_files(tag):
        with contextlib.suppress(MissingFileError):
            small[MANIFEST_NAME] = memory.read_bytes(tag, MANIFEST_NAME)
    claims = [
        FileClaim(n, len(data), CHECKSUM_ALGO, checksum_of(data)) for n, data in small.items()
    ]
    claims += [FileClaim(i.file, i.size_bytes, i.checksum_algo, i.checksum) for i in marker.items]
    return claims, small


def check_claims(tag: str, rank: int, files: Sequence[FileClaim]) -> str | None:
    """Why a replica of `rank`'s part of `tag` announced as `files` cannot be one (None:
    it can): a name no tag folder holds, a file twice, no marker of `rank`, a size or
    checksum algorithm this nebula does not take.

    Example:
        >>> ok = FileClaim(".rank-0.json", 10, "xxh3_64_tree_1m", "00")
        >>> check_claims("global_step1", 0, [ok]) is None
        True
        >>> check_claims("global_step1", 1, [ok])
        'no marker of rank 1 (.rank-1.json) among the files'
    """
    try:
        validate_name("tag", tag)
    except ValueError as exc:
        return f"an unsafe tag: {exc}"
    names = [claim.name for claim in files]
    if len(set(names)) != len(names):
        return "a file announced twice"
    if marker_name(rank) not in names:
        return f"no marker of rank {rank} ({marker_name(rank)}) among the files"
    for claim in files:
        if claim.name not in (marker_name(rank), MANIFEST_NAME):
            try:
                validate_name("item", claim.name)
            except ValueError as exc:
                return f"an unsafe item name: {exc}"
        small = claim.name in (marker_name(rank), MANIFEST_NAME)
        if claim.size < 0 or (small and claim.size > MAX_MANIFEST_BYTES):
            return f"{claim.name}: an impossible size ({claim.size})"
        if claim.algo not in KNOWN_CHECKSUM_ALGOS:
            return f"{claim.name}: a checksum algorithm this nebula does not know ({claim.algo!r})"
    return None


def _parse_done(data: bytes, where: str) -> Replica | None:
    try:
        doc = load_json(data, max_bytes=MAX_MANIFEST_BYTES)
    except JsonBoundsError:
        return None
    if not isinstance(doc, dict) or doc.get("schema_version") != DONE_SCHEMA_VERSION:
        return None
    try:
        files = tuple(
            FileClaim(str(name), int(size), str(algo), str(checksum))
            for name, size, algo, checksum in doc["files"]
        )
        replica = Replica(
            tag=str(doc["tag"]),
            rank=int(doc["rank"]),
            node=int(doc["node"]),
            created_at=str(doc["created_at"]),
            received_at=str(doc["received_at"]),
            files=files,
        )
    except (KeyError, TypeError, ValueError):
        log.debug("%s is not a replica's record", where)
        return None
    if check_claims(replica.tag, replica.rank, files) is not None:
        return None
    return replica


def read_replica(root: Store, tag: str) -> Replica | None:
    """The whole replica of `tag` in `root` (`replica_root`), or None: no record, a record
    that is not valid or of another tag, or a file it lists missing or of another size."""
    try:
        replica = _parse_done(root.read_bytes(tag, REPLICA_DONE), root.display(tag, REPLICA_DONE))
    except MissingFileError:
        return None
    if replica is None or replica.tag != tag:
        return None
    files = root.list_files(tag)
    if any(files.get(claim.name) != claim.size for claim in replica.files):
        return None
    return replica


def whole_replicas(root: Store) -> list[Replica]:
    """The whole replicas in `root` (`replica_root`), newest first."""
    found = []
    for tag in root.list_dirs():
        try:
            validate_name("tag", tag)
        except ValueError:
            continue
        replica = read_replica(root, tag)
        if replica is not None:
            found.append(replica)
    return sorted(found, key=lambda r: r.sort_key, reverse=True)


def remove_replica(root: Store, tag: str) -> None:
    """Remove the replica of `tag` from `root`: its record first (it is no longer whole),
    then its files and folder. A folder that will not go (something in it that is no
    file) is left, and is no replica. A name that is no tag is never touched."""
    try:
        validate_name("tag", tag)
    except ValueError:
        return
    try:
        root.remove(tag, REPLICA_DONE, durable=False)
        root.remove_dir(tag)
    except NebulaError as exc:
        log.debug("replica folder %s left: %s", root.display(tag), exc)


def keep_only(root: Store, keep: str, *, own: OwnParts | None = None) -> list[str]:
    """Remove every replica in `root` but the one of `keep` (the one its receiver just
    committed, or kept: its sender's newest), with the folders left by a transfer cut
    short; the tags removed. Only `root`'s receiver calls it.

    With `own` (the receiving rank's own parts), while its own part of `keep` is not
    committed, the whole replica received last of those whose tag its own part is
    committed for stays too: the partner is ahead, and without it no checkpoint would be
    complete on this node (the module's docstring)."""
    others = [tag for tag in root.list_dirs() if tag != keep]
    spare: str | None = None
    if own is not None and others and not own.committed(keep):
        complete = [
            replica
            for tag in others
            if (replica := read_replica(root, tag)) is not None and own.committed(tag)
        ]
        if complete:
            spare = max(complete, key=lambda r: (r.received_at, r.sort_key)).tag
    removed = [tag for tag in others if tag != spare]
    for tag in removed:
        remove_replica(root, tag)
    return removed


def replica_tags(memory: Store) -> set[str]:
    """The tags of every replica the memory tier `memory` holds of other nodes' parts,
    whole or still arriving (a folder under `.replicas/rank-<r>/`); nothing is made or
    removed, and a folder that cannot be read holds none. Eviction keeps this node's own
    parts of them (runtime/persist_schedule.py).

    Example:
        >>> import tempfile
        >>> replica_tags(Store(tempfile.mkdtemp(), durable=False, private=True))
        set()
    """
    tags: set[str] = set()
    try:
        ranks = replica_ranks(memory)
    except (NebulaError, OSError):
        return tags
    for rank in ranks:
        path = memory.local_path(REPLICAS_DIR, rank_folder(rank))
        if path is None or os.path.islink(path):
            continue
        try:
            folders = Store(path, durable=False, private=True).list_dirs()
        except (NebulaError, OSError):
            continue
        for tag in folders:
            with contextlib.suppress(ValueError):
                validate_name("tag", tag)
                tags.add(tag)
    return tags
