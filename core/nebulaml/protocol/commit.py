"""The commit protocol on one tier (docs/architecture.md): items, rank marker, manifest last.

    begin_tag         refuse a committed tag (unless overwriting), clear a dead writer's
                      leftovers, write this process's writer marker (markers.py), after
                      the tag's begun record in the index (commit_index.record_begun)
    claim_item        on a tier several ranks share: claim an item name for this rank, or
                      `ItemCollisionError` if another rank saves one of that name
    write_item        serialise one object into an item file, hashing on the way
    commit_rank       publish this rank's marker; the manifest once every writing rank's
                      is there (all ranks, or those the checkpoint names), of one generation
    await_commit      wait until those markers are there and the manifest published
    later_save        whether a part's generation is of a later save of the tag than
                      another's (a rank saved it again: the earlier save never commits)
    publish_manifest  the manifest from the writing ranks' markers (create-only), with
                      the commit sequence sequence.py reserves

A checkpoint's parts are written by every rank of the job, or by the ranks it names
(`ranks`: the markers and the manifest record them); each part carries the generation of
the job that wrote it (runtime/ranks.py), and parts of different generations are never
committed together: a rank's part saved before a restart never completes a checkpoint
with another's saved after it.

The same protocol with items copied from another tier is transfer.py; deleting is
delete.py.

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage`, catalog.py,
commit_index.py, delete.py, leases.py, markers.py and sequence.py. Not for: deciding when
to commit or persist (checkpoint.py and persister.py decide), reserving a commit's
sequence (sequence.py), copying (transfer.py) or deleting (delete.py).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from nebulaml.errors import (
    CheckpointBusyError,
    CheckpointExistsError,
    CommitConflictError,
    ItemCollisionError,
    ManifestError,
    NebulaError,
    PartSupersededError,
    RankGoneError,
    RankTimeoutError,
)
from nebulaml.format.checksum import HashingWriter
from nebulaml.format.manifest import (
    ItemEntry,
    Manifest,
    Producer,
    RankMarker,
    parse_marker,
    some_ranks,
    utc_now,
    writer_ranks,
)
from nebulaml.format.names import (
    MANIFEST_NAME,
    WRITER_PREFIX,
    marker_name,
    step_of,
    validate_name,
    writer_marker_name,
)
from nebulaml.format.serialization import write_item as serialise
from nebulaml.protocol.catalog import read_committed
from nebulaml.protocol.commit_index import record_begun, record_commit
from nebulaml.protocol.delete import delete_checkpoint, delete_part
from nebulaml.protocol.leases import live_leases
from nebulaml.protocol.markers import (
    claimed_items,
    describe_writer,
    read_writers,
    writer_alive,
    writer_record,
)
from nebulaml.protocol.sequence import SequenceReservation, reserve_sequence
from nebulaml.storage.store import MissingFileError, Store

log = logging.getLogger("nebulaml")

ANY_GENERATION: Any = object()  # read_markers: parts of any generation
GONE_POLL_S = 0.5  # await_commit: how often it asks whether a missing rank has ended
SLOW_RANKS_S = 5.0  # await_commit: when it says which ranks it waits for (`slow`)


def slow_after_s(timeout_s: float) -> float:
    """How long a wait for other ranks' parts goes before it is said: `SLOW_RANKS_S`, or
    half the timeout when that is shorter.

    Example:
        >>> slow_after_s(300.0), slow_after_s(2.0)
        (5.0, 1.0)
    """
    return min(SLOW_RANKS_S, timeout_s / 2)


def producer() -> Producer:
    """Who writes this process's manifests: nebula's and torch's versions, the host (read
    once per process: a manifest's producer is for people, never for logic)."""
    global _producer
    pid = os.getpid()
    if _producer is None or _producer[0] != pid:
        import torch

        from nebulaml._version import __version__

        made = Producer(nebula_version=__version__, torch_version=torch.__version__, host=_host())
        _producer = (pid, made)
    return _producer[1]


_producer: tuple[int, Producer] | None = None


def _host() -> str:
    return socket.gethostname()


def begin_tag(
    store: Store,
    tag: str,
    *,
    rank: int,
    overwrite: bool,
    world_size: int = 1,
    marker: tuple[str, ...] | None = None,
    announce: bool = True,
) -> bool:
    """Prepare the folder of `tag` for this rank's items.

    A committed tag is refused (`CheckpointExistsError`) unless `overwrite`, in which case
    its manifest goes first, then its data. Leftovers of an uncommitted earlier attempt are
    removed, unless another live process on this host is still writing them
    (`CheckpointBusyError`). With several ranks the folder is shared: a rank removes only
    its own files, never another rank's. A writer marker records who is writing, so that
    recovery can tell a live writer from a dead one.

    `marker`: a file on `store` that holds this process's writer marker for `rank`
    (`writer_record`), linked into a new folder instead of written there (a save's next
    tag: two system calls). Returns False if it was given and could not be linked (gone):
    the marker was written instead.

    `announce`: write the tag's begun record in `store`'s index, before the marker
    (commit_index.record_begun), so that a restart finds this folder among those at the
    top if this writer dies, without listing the root; False on a memory tier (whose
    leftovers a restart finds from its own listing of the few tags there).
    """
    validate_name("tag", tag)
    new = store.make_new_dir(tag)
    if announce:
        # Before the writer marker, a hint never trusted: a folder is a writer's leftover
        # only once it holds a marker. After the folder, so that a root this user may not
        # write says so of the tag's folder.
        record_begun(store, tag)
    if new:  # nothing in it to look for or clear
        name = writer_marker_name(rank)
        if marker is not None and store.link(marker, (tag, name)):
            return True
        store.publish((tag, name), writer_record(rank), create_only=False)
        return marker is None
    if store.exists(tag, MANIFEST_NAME) and not squatter_removed(store, tag):
        if not overwrite:
            raise CheckpointExistsError(store.url, tag)
        # A handle's hold does not keep a tag from its own writer (leases.py): a read does.
        # Of a shared folder, the part goes and the folder stays: the other ranks write
        # their new parts into it meanwhile, under the names of their old ones.
        deleted = (
            delete_checkpoint(store, tag, replacing=True)
            if world_size == 1
            else delete_part(store, tag, rank, replacing=True, keep_folder=True)
        )
        if not deleted:
            readers = ", ".join(lease.describe() for lease in live_leases(store, tag))
            raise CheckpointBusyError(store.url, tag, readers or "a reader", activity="read")
        if announce:
            record_begun(store, tag)  # the delete forgot the tag's record with its entries
    else:
        for writer in read_writers(store, tag):
            # Another live process on this host is writing this part (a copy, a second
            # job): clearing its files would corrupt that write.
            mine = world_size == 1 or writer.get("rank") == rank
            if mine and writer.get("pid") != os.getpid() and writer_alive(writer):
                raise CheckpointBusyError(store.url, tag, describe_writer(writer))
        if world_size == 1:
            for name in store.list_files(tag):
                store.remove(tag, name)
        else:
            delete_part(store, tag, rank, keep_folder=True)
    store.make_dir(tag)
    # Whole or not at all: a deleter reading a half-written marker would take the tag for
    # a dead writer's leftover (the concurrency campaign caught a prune doing so).
    store.publish((tag, writer_marker_name(rank)), writer_record(rank), create_only=False)
    return True


def claim_item(
    store: Store,
    tag: str,
    name: str,
    *,
    rank: int,
    claimed: list[str],
    started_at: str | None = None,
) -> None:
    """Claim the item `name` of `tag` for `rank` on a tier other ranks share, before it is
    written: `claimed` (this rank's names so far) and `name` go into its writer marker
    (`started_at`: when its save began), then the other live writers' markers are read.
    Raises `ItemCollisionError` (and withdraws the claim) when another rank claimed an
    item of that name.

    Each rank publishes its claim before it looks at the others', so of two ranks saving
    one name at once at least one sees the other's (both may, and both then fail): an
    item's file is never written by two ranks. A rank's writer marker stays until the tag
    is committed, so the items of a part waiting for the others stay claimed; those of a
    committed version (being replaced: `overwrite`) or of a dead process do not.
    """
    record = writer_record(rank, [*claimed, name], started_at)
    store.publish((tag, writer_marker_name(rank)), record, create_only=False)
    for other in _ranks_claiming(store, tag, name, rank):
        store.publish(
            (tag, writer_marker_name(rank)),
            writer_record(rank, list(claimed), started_at),
            create_only=False,
        )
        raise ItemCollisionError(store.display(tag), tag, name, other, rank)


def _ranks_claiming(store: Store, tag: str, name: str, rank: int) -> list[int]:
    """The other ranks whose writer marker, of a live process, claims `name`."""
    found = []
    for file in sorted(store.list_files(tag)):
        if not file.startswith(WRITER_PREFIX) or file == writer_marker_name(rank):
            continue
        doc = claimed_items(store, tag, file) or {}
        other, names = doc.get("rank"), doc.get("items") or []
        if name not in names or not isinstance(other, int) or other == rank:
            continue
        if writer_alive({k: doc.get(k) for k in ("host", "pid")}):
            found.append(other)
    return found


def write_item(store: Store, tag: str, name: str, obj: Any, *, rank: int) -> ItemEntry:
    """Serialise `obj` as the item `name` of `tag`; durable when it returns."""
    validate_name("item", name)
    with store.open_write(tag, name) as raw:
        out = HashingWriter(raw)
        tensor_bytes = serialise(obj, out)  # type: ignore[arg-type]
    return ItemEntry.written(
        name,
        rank=rank,
        size_bytes=out.size_bytes,
        checksum=out.hexdigest(),
        tensor_bytes=tensor_bytes,
    )


def commit_rank(
    store: Store,
    tag: str,
    *,
    rank: int,
    world_size: int,
    items: list[ItemEntry],
    created_at: str,
    labels: tuple[str, ...] = (),
    ranks: Sequence[int] | None = None,
    generation: str | None = None,
    sequence_floor: int = 0,
    reserved: SequenceReservation | None = None,
) -> Manifest | None:
    """Publish this rank's marker, then the manifest if the marker of every rank that
    writes the tag (`ranks`; None: every rank of the job) is present, of `generation`.

    Returns the manifest if this call committed the tag, else None (other ranks pending).
    `sequence_floor` and `reserved`: see `publish_manifest`.
    """
    marker = RankMarker(
        tag,
        rank,
        world_size,
        created_at,
        tuple(items),
        labels,
        ranks=some_ranks(ranks, world_size),
        generation=generation,
    )
    store.publish((tag, marker_name(rank)), marker.to_bytes(), create_only=False)
    if marker.writers == (rank,):
        markers: list[RankMarker] | None = [marker]  # this rank writes it alone
    else:
        markers = read_markers(store, tag, marker.writers, generation)
    if markers is None:
        return None  # another rank's part is not written yet; the last rank commits
    manifest = publish_manifest(
        store, tag, world_size, markers, sequence_floor=sequence_floor, reserved=reserved
    )
    store.remove(tag, writer_marker_name(rank))
    return manifest


def await_commit(
    store: Store,
    tag: str,
    *,
    world_size: int,
    timeout_s: float,
    poll_s: float = 0.005,
    max_poll_s: float = 0.1,
    ranks: Sequence[int] | None = None,
    generation: Any = ANY_GENERATION,
    sequence_floor: int = 0,
    gone: Callable[[list[int]], list[int]] | None = None,
    slow: Callable[[list[int], float], None] | None = None,
) -> Manifest:
    """Wait until `tag` is committed on `store`: its manifest appears, or the marker of
    every rank that writes it (`ranks`; None: all `world_size`) is there, of `generation`,
    and this call publishes the manifest itself.

    Raises `RankTimeoutError` naming the ranks whose part is missing (or is of another
    generation) after `timeout_s`; `RankGoneError` as soon as `gone(missing)`, asked
    every `GONE_POLL_S`, names ranks among them whose process has ended;
    `slow(missing, waited_s)` is called once, `slow_after_s(timeout_s)` into the wait, with
    the ranks whose part is still missing (a save should say early why it blocks);
    `PartSupersededError` as soon as (looked at as often) a rank replaced its part there,
    during this wait, with one of a later save of the tag than `generation` (it saved the
    tag again: its part of this save is gone, and this one can never be committed). A
    part of a later save there from the start is waited out as before: it may be an
    earlier session's, which counted its saves of the tag on its own.
    """
    writers = writer_ranks(some_ranks(ranks, world_size), world_size)
    started = time.monotonic()
    deadline = started + timeout_s
    slow_at = None if slow is None else started + slow_after_s(timeout_s)
    next_gone = time.monotonic() + GONE_POLL_S
    next_look = time.monotonic()
    there_first: dict[int, str | None] | None = None  # later saves' parts at the start
    while True:
        info = read_committed(store, tag)
        if info is not None:
            return info.manifest
        markers = read_markers(store, tag, writers, generation)
        if markers is not None:
            manifest = publish_manifest(
                store, tag, world_size, markers, sequence_floor=sequence_floor
            )
            if manifest is not None:
                return manifest
        elif generation is not ANY_GENERATION and time.monotonic() >= next_look:
            next_look = time.monotonic() + GONE_POLL_S
            later = _later_parts(store, tag, writers, generation)
            if there_first is None:
                there_first = later
            again = [r for r, g in later.items() if r not in there_first or there_first[r] != g]
            if again:
                raise PartSupersededError(store.display(tag), again, tag=tag)
        if time.monotonic() >= deadline:
            files = store.list_files(tag)
            missing = [r for r in writers if marker_name(r) not in files]
            stale = [r for r in writers if r not in missing and _stale(store, tag, r, generation)]
            wrote = [r for r in writers if r not in missing and r not in stale]
            raise RankTimeoutError(
                store.display(tag), missing + stale, timeout_s, stale, wrote=wrote, tag=tag
            )
        if slow is not None and slow_at is not None and time.monotonic() >= slow_at:
            slow_at = None
            files = store.list_files(tag)
            slow([r for r in writers if marker_name(r) not in files], time.monotonic() - started)
        if gone is not None and time.monotonic() >= next_gone:
            next_gone = time.monotonic() + GONE_POLL_S
            files = store.list_files(tag)
            ended = gone([r for r in writers if marker_name(r) not in files])
            if ended:
                raise RankGoneError(store.display(tag), ended, tag=tag)
        time.sleep(poll_s)
        poll_s = min(max_poll_s, poll_s * 2)


def later_save(theirs: str | None, ours: str | None) -> bool:
    """Whether a part of generation `theirs` is of a later save of its tag, in the same
    run and restart of the job, than a part of generation `ours`: the job's generation,
    then "/<n>" from a process's n-th save of one tag on (runtime/session.py's
    `part_generation`). A rank never saves a tag's earlier save again: once its part of
    a later one is there, its part of the earlier one will never come.

    Example:
        >>> later_save("ab12/2", "ab12"), later_save("ab12/3", "ab12/2")
        (True, True)
        >>> later_save("ab12", "ab12/2"), later_save("cd34/2", "ab12"), later_save("ab12", "ab12")
        (False, False, False)
    """

    def save_of(generation: str | None) -> tuple[str, int]:
        base, slash, n = (generation or "").rpartition("/")
        if slash and n.isdigit() and int(n) >= 2:
            return base, int(n)
        return generation or "", 1

    their_base, their_n = save_of(theirs)
    our_base, our_n = save_of(ours)
    return their_base == our_base and their_n > our_n


def _later_parts(
    store: Store, tag: str, writers: Sequence[int], generation: Any
) -> dict[int, str | None]:
    """The ranks of `writers` whose part of `tag` on `store` is of a later save of it than
    `generation` (`later_save`), with that part's generation."""
    files = store.list_files(tag)
    later: dict[int, str | None] = {}
    for rank in writers:
        if marker_name(rank) not in files:
            continue
        try:
            where = store.display(tag, marker_name(rank))
            marker = parse_marker(store.read_bytes(tag, marker_name(rank)), where)
        except NebulaError:
            continue  # being replaced, or unreadable: looked at again
        if later_save(marker.generation, generation):
            later[rank] = marker.generation
    return later


def _stale(store: Store, tag: str, rank: int, generation: Any) -> bool:
    """Whether rank `rank`'s marker of `tag` is of another generation than `generation`."""
    if generation is ANY_GENERATION:
        return False
    try:
        where = store.display(tag, marker_name(rank))
        marker = parse_marker(store.read_bytes(tag, marker_name(rank)), where)
    except NebulaError:
        return False
    return marker.generation != generation


def publish_manifest(
    store: Store,
    tag: str,
    world_size: int,
    markers: list[RankMarker],
    *,
    sequence_floor: int = 0,
    reserved: SequenceReservation | None = None,
) -> Manifest | None:
    """Publish the manifest from the markers of the ranks that write `tag` (create-only);
    None if another writer's manifest, with other items, won.

    Raises `ManifestError` when the markers disagree on the job (its world size, the
    ranks that write, its generation), and `ItemCollisionError` when two ranks wrote an
    item of one name: such a checkpoint is never committed.

    The manifest's `sequence` (its place in "newest" order: names.order_key) is 1 + the
    highest on `store` or `sequence_floor`, whichever is higher: the caller's floor is the
    highest it knows on the root's other tiers (a memory tier's commit comes after what
    the persistent tier holds). `reserved`: this writer's `SequenceReservation` on
    `store`, whose number recorded ahead is taken when it still holds.
    """
    where = store.display(tag)
    if any(m.world_size != world_size or m.tag != tag for m in markers):
        raise ManifestError(where, "rank markers disagree on the world size")
    if len({m.ranks for m in markers}) > 1:
        raise ManifestError(where, "rank markers disagree on the ranks that write the checkpoint")
    if len({m.generation for m in markers}) > 1:
        raise ManifestError(where, "rank markers are of different runs or restarts of the job")
    all_items = [item for m in markers for item in m.items]
    by_name: dict[str, int] = {}
    by_file: dict[str, int] = {}
    for item in all_items:
        first = by_name.get(item.name, by_file.get(item.file))
        if first is not None:
            raise ItemCollisionError(where, tag, item.name, first, item.rank)
        by_name[item.name] = by_file[item.file] = item.rank
    manifest = Manifest(
        tag=tag,
        step=step_of(tag),
        created_at=min(m.created_at for m in markers),
        committed_at=utc_now(),
        world_size=world_size,
        items=tuple(sorted(all_items, key=lambda i: (i.rank, i.name))),
        producer=producer(),
        labels=tuple(sorted({label for m in markers for label in m.labels})),
        ranks=markers[0].ranks if markers else None,
        sequence=(
            reserve_sequence(store, sequence_floor)
            if reserved is None
            else reserved.take(sequence_floor)
        ),
    )
    try:
        publish_new_manifest(store, tag, manifest.to_bytes(), manifest.sequence)
    except CommitConflictError:
        # Two ranks saw every marker at once: the other one's manifest, if it is valid
        # and lists the same items, is the commit.
        info = read_committed(store, tag)
        if info is None or info.manifest.items != manifest.items:
            raise
        return info.manifest
    return manifest


def publish_new_manifest(store: Store, tag: str, data: bytes, sequence: int) -> None:
    """Publish `tag`'s manifest `data` of commit `sequence`, create-only:
    `CommitConflictError` if another writer's is there. Its entry in the tier's commit
    index goes first (commit_index.py: a manifest never lacks its entry). A name there
    that is no file at all (a FIFO, a symbolic link, an empty folder another hand put in
    a local root) is no commit: it is removed by name (never through the link), said in
    a warning, and the publish tried once more."""
    record_commit(store, tag, sequence)
    try:
        store.publish((tag, MANIFEST_NAME), data, create_only=True)
    except CommitConflictError:
        if not squatter_removed(store, tag):
            raise
        store.publish((tag, MANIFEST_NAME), data, create_only=True)


def squatter_removed(store: Store, tag: str) -> bool:
    """Whether something that is no file (a FIFO, a symbolic link, an empty folder) was
    at `tag`'s manifest name on a local root, and is removed now (by name, never through
    a link), said in a warning: another hand's, and no commit."""
    if not store.clear_squatter(tag, MANIFEST_NAME):
        return False
    log.warning(
        "%s was not a file (a FIFO, a link or a folder put there by another hand): "
        "removed, since nebula writes the checkpoint's manifest there",
        store.display(tag, MANIFEST_NAME),
    )
    return True


def read_markers(
    store: Store, tag: str, writers: int | Sequence[int], generation: Any = ANY_GENERATION
) -> list[RankMarker] | None:
    """The markers of `tag` of the ranks `writers` (an int: every rank of a job that
    size), or None while any is missing, or (given a `generation`) of another generation:
    a part saved before a restart is not part of a checkpoint saved after it."""
    ranks = range(writers) if isinstance(writers, int) else writers
    files = store.list_files(tag)
    if any(marker_name(r) not in files for r in ranks):
        return None
    try:
        markers = [
            parse_marker(store.read_bytes(tag, marker_name(r)), store.display(tag, marker_name(r)))
            for r in ranks
        ]
    except MissingFileError:
        return None  # a rank replacing its part (a save of the tag again) removed it meanwhile
    if generation is not ANY_GENERATION and any(m.generation != generation for m in markers):
        return None
    return markers
