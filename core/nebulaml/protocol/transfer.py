"""Copying a committed checkpoint between tiers with the full commit protocol.

    copy_checkpoint  a whole tag, its items copied and verified, its manifest last;
                     optionally resuming an interrupted copy and re-reading what it wrote
    copy_part        one rank's part of a tag (the persister of each rank copies its own);
                     whichever rank sees every marker first publishes the manifest
    copy_item        one item file, hashed on the way and compared with its manifest entry

Every byte copied is hashed and checked against the source manifest: a mismatch raises
`CorruptCheckpointError` and nothing is committed at the destination.

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage`, catalog.py,
commit.py, commit_index.py, markers.py, reuse.py and sequence.py. Not for: when to copy
(persister.py, ops/copying.py) or what to delete after (retention.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from nebulaml.errors import (
    CheckpointBusyError,
    CheckpointExistsError,
    CorruptCheckpointError,
    ItemCollisionError,
    NebulaError,
    RankGoneError,
)
from nebulaml.format.checksum import CHECKSUM_ALGO, hash_stream, new_hasher
from nebulaml.format.manifest import ItemEntry, ItemReuse, Manifest, RankMarker, parse_marker
from nebulaml.format.names import (
    MANIFEST_NAME,
    RANK_PREFIX,
    WRITER_PREFIX,
    marker_name,
    validate_name,
    writer_marker_name,
)
from nebulaml.protocol.catalog import CheckpointInfo, highest_sequence, read_committed
from nebulaml.protocol.commit import (
    await_commit,
    begin_tag,
    publish_manifest,
    publish_new_manifest,
    read_markers,
)
from nebulaml.protocol.commit_index import record_begun
from nebulaml.protocol.markers import (
    claimed_items,
    describe_writer,
    read_writers,
    writer_alive,
    writer_record,
)
from nebulaml.protocol.reuse import ReuseBook, plan_item
from nebulaml.protocol.sequence import note_sequence
from nebulaml.storage.store import MissingFileError, Store

log = logging.getLogger("nebulaml")

_COPY_CHUNK_BYTES = 8 << 20

ProgressCallback = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class CopyResult:
    """What `copy_checkpoint` did: items copied, items found already there, byte counts."""

    manifest: Manifest
    copied_items: tuple[str, ...] = ()
    skipped_items: tuple[str, ...] = ()
    copied_bytes: int = 0
    skipped_bytes: int = 0
    unchanged: bool = False  # the destination already held this checkpoint, committed


def copy_checkpoint(
    src: CheckpointInfo,
    dst: Store,
    *,
    overwrite: bool = False,
    resume: bool = False,
    verify: bool = False,
    progress: ProgressCallback | None = None,
    same_root: bool = False,
    reuse: ReuseBook | None = None,
    verify_progress: ProgressCallback | None = None,
) -> CopyResult:
    """Copy a committed checkpoint to another root with the full commit protocol.

    Every byte is hashed on the way and compared with the source manifest; a mismatch
    raises `CorruptCheckpointError` and nothing is committed at the destination. A
    destination that already holds the identical checkpoint is left as it is; a different
    committed one is refused (`CheckpointExistsError`) unless `overwrite`.

    `verify` re-reads every item from the destination and checks its size and checksum
    before the manifest is published. `resume` keeps what an interrupted copy left: an
    uncommitted destination folder's item files of the right size whose checksum matches
    are not written again (counted in `skipped_bytes`); it refuses to touch a folder that
    a live process on this host is writing (`CheckpointBusyError`). `progress(done, total)`
    is called as bytes are copied or found in place, and `verify_progress(done, total)` as
    the copied items are read back from the destination (`verify`; an item is checked
    right after it is written, so the two alternate). The defaults are the persister's:
    the destination tag is rewritten whole and only the source bytes are hashed.

    The copy's commit `sequence` (its place in "newest" order): with `same_root` (the
    persister: another tier of the same root, one numbering) the source's, kept, so that
    an older checkpoint persisted after a newer one stays older; else (another root's
    checkpoint) 1 + the highest the destination holds, or the source's if higher: it
    comes after what the destination holds, as committed there last. `reuse`: the
    persister's book of what it persisted before (`copy_item`).
    """
    tag = src.tag
    items = src.manifest.items
    total = src.manifest.total_bytes
    existing = read_committed(dst, tag)
    if existing is not None and existing.manifest.items == items:
        if progress is not None:
            progress(total, total)
        return CopyResult(existing.manifest, unchanged=True)
    # A manifest that does not read as committed (an item missing, say) is not ours to
    # repair silently either: the caller asks for overwrite.
    has_manifest = existing is not None or dst.exists(tag, MANIFEST_NAME)
    if has_manifest and not overwrite:
        raise CheckpointExistsError(
            dst.url, tag, hint="copy with overwrite=True (nebula copy --overwrite) to replace it"
        )
    if resume and not has_manifest:
        skipped = _resume_tag(dst, tag, items)
    else:
        begin_tag(dst, tag, rank=0, overwrite=overwrite)
        skipped = {}
    done = sum(skipped.values())
    if progress is not None:
        progress(done, total)
    to_verify = sum(i.size_bytes for i in items if i.file not in skipped) if verify else 0
    verified = 0
    copied: list[str] = []
    notes: list[ItemReuse] = []
    for item in items:
        if item.file in skipped:
            continue

        def advance(n: int, base: int = done) -> None:
            if progress is not None:
                progress(base + n, total)

        note = copy_item(src.store, dst, tag, item, advance, reuse)
        if note is not None:
            notes.append(note)
        if verify:
            # Re-read from the destination rather than trusting the bytes we sent: this is
            # what a later reader gets, so it also catches a store that truncated or altered
            # the upload, or a writer that raced us. Hashing while writing cannot.
            _check_item(dst, tag, item, _reporter(verify_progress, verified, to_verify))
            verified += item.size_bytes
        done += item.size_bytes
        copied.append(item.name)
    ranks = sorted({item.rank for item in items}) or [src.manifest.writers[0]]
    for rank in ranks:
        marker = RankMarker(
            tag,
            rank,
            src.manifest.world_size,
            src.manifest.created_at,
            tuple(i for i in items if i.rank == rank),
            src.manifest.labels,
            ranks=src.manifest.ranks,
        )
        files = {i.file for i in marker.items}
        marker = dataclasses.replace(marker, reused=tuple(n for n in notes if n.file in files))
        dst.publish((tag, marker_name(rank)), marker.to_bytes(), create_only=False)
    manifest = Manifest(
        tag=tag,
        step=src.manifest.step,
        created_at=src.manifest.created_at,
        # The checkpoint's commit time, kept on every tier so that "newest" is one order.
        committed_at=src.manifest.committed_at,
        world_size=src.manifest.world_size,
        items=items,
        producer=src.manifest.producer,
        labels=src.manifest.labels,
        ranks=src.manifest.ranks,
        sequence=_sequence_at(src.manifest.sequence, dst, same_root),
    )
    note_sequence(dst, manifest.sequence)
    publish_new_manifest(dst, tag, manifest.to_bytes(), manifest.sequence)
    dst.remove(tag, writer_marker_name(0))
    return CopyResult(
        manifest,
        copied_items=tuple(copied),
        skipped_items=tuple(i.name for i in items if i.file in skipped),
        copied_bytes=sum(i.size_bytes for i in items if i.file not in skipped),
        skipped_bytes=sum(skipped.values()),
    )


def _sequence_at(sequence: int, dst: Store, same_root: bool) -> int:
    """The commit sequence of a copy of a checkpoint of `sequence` on `dst` (see
    `copy_checkpoint`); a schema 1 source (0) comes after what `dst` holds."""
    if same_root and sequence > 0:
        return sequence
    return max(sequence, 1 + highest_sequence(dst))


def _resume_tag(dst: Store, tag: str, items: tuple[ItemEntry, ...]) -> dict[str, int]:
    """Prepare an uncommitted destination folder for a resumed copy.

    Returns {file: size} of the item files already there and verified. Everything else in
    the folder (partial or mismatching items, stale markers) is removed, and our writer
    marker is written, as `begin_tag` does.
    """
    validate_name("tag", tag)
    dst.make_dir(tag)
    record_begun(dst, tag)  # after the folder, before the marker, as begin_tag
    me = os.getpid()
    for writer in read_writers(dst, tag):
        # An earlier, failed attempt of this very process is not a competitor.
        if writer.get("pid") != me and writer_alive(writer):
            raise CheckpointBusyError(dst.url, tag, describe_writer(writer))
    wanted = {item.file: item for item in items}
    kept: dict[str, int] = {}
    for name, size in dst.list_files(tag).items():
        item = wanted.get(name)
        if item is not None and size == item.size_bytes and _matches(dst, tag, item):
            kept[name] = size
        else:
            dst.remove(tag, name)
    dst.publish((tag, writer_marker_name(0)), writer_record(0), create_only=False)
    return kept


def _matches(store: Store, tag: str, item: ItemEntry) -> bool:
    try:
        with store.open_read(tag, item.file) as f:
            size, digest = hash_stream(f, _COPY_CHUNK_BYTES, item.checksum_algo)
    except MissingFileError:
        return False
    return size == item.size_bytes and digest == item.checksum


def _reporter(
    progress: ProgressCallback | None, base: int, total: int
) -> Callable[[int], None] | None:
    """`advance(n)` for `hash_stream`: reports `base` + the bytes read so far of `total`."""
    if progress is None:
        return None
    progress(base, total)
    read = base

    def advance(n: int) -> None:
        nonlocal read
        read += n
        progress(read, total)

    return advance


def _check_item(
    store: Store, tag: str, item: ItemEntry, advance: Callable[[int], None] | None = None
) -> None:
    with store.open_read(tag, item.file) as f:
        size, digest = hash_stream(f, _COPY_CHUNK_BYTES, item.checksum_algo, advance)
    if size != item.size_bytes or digest != item.checksum:
        raise CorruptCheckpointError(
            store.display(tag, item.file),
            f"{item.size_bytes} bytes with {item.checksum_algo} {item.checksum}",
            f"{size} bytes with {item.checksum_algo} {digest} after writing it",
        )


def copy_item(
    src: Store,
    dst: Store,
    tag: str,
    item: ItemEntry,
    advance: Callable[[int], None],
    reuse: ReuseBook | None = None,
) -> ItemReuse | None:
    """Copy one item file of `tag`, hashing on the way; a mismatch with `item` raises
    `CorruptCheckpointError`. `advance(n)` says `n` bytes of it have reached `dst` (on
    Azure: as uploads complete, from another thread).

    With `reuse` (the persister's book), a local source going to a store that `clones`
    (a local root, Azure) is hashed first and written range by range: what equals the
    version of the item the book last persisted to `dst` is taken from that version's file
    (reuse.py); the bytes written and reused are counted in the book, and returned as what
    the item took from which tag (None without a book)."""
    hasher = new_hasher(item.checksum_algo)
    size = 0
    sent_total = 0
    lock = threading.Lock()

    def hashed(piece: memoryview) -> None:
        nonlocal size
        hasher.update(piece)
        size += len(piece)

    def sent(n: int) -> None:
        nonlocal sent_total
        with lock:
            sent_total += n
            advance(sent_total)

    def check() -> None:
        if size != item.size_bytes or hasher.hexdigest() != item.checksum:
            raise CorruptCheckpointError(
                src.display(tag, item.file),
                f"{item.size_bytes} bytes with {item.checksum_algo} {item.checksum}",
                f"{size} bytes with {item.checksum_algo} {hasher.hexdigest()}",
            )

    with src.map_read(tag, item.file) as mapped:
        # An item of the older plain-xxh3 manifests (a copy of an old root) has no tree
        # of pieces to compare: it is copied whole.
        if (
            mapped is not None
            and reuse is not None
            and dst.clones
            and item.checksum_algo == CHECKSUM_ALGO
        ):
            base_version = reuse.base_for(dst, tag, item)
            where = src.display(tag, item.file)
            plan = plan_item(mapped, tag, item, base_version, where, pause=reuse.pause)
            base = None if plan.base is None else (plan.base.tag, plan.base.file)
            stamp = None if plan.base is None else plan.base.stamp
            pause = reuse.pause if dst.capabilities.local_path else None  # this thread's

            def sent_then_pause(n: int) -> None:
                sent(n)
                if pause is not None:
                    pause()

            done = dst.write_ranges(
                (tag, item.file), mapped, plan.ranges, base, sent_then_pause, base_stamp=stamp
            )
            plan.version.stamp = done.stamp
            reuse.remember(dst, plan.version)
            reuse.count(tag, written=done.written, reused=done.reused)
            source = plan.base.tag if plan.base is not None and done.reused else None
            return ItemReuse(item.file, done.reused, source)
        if mapped is not None:
            # A local source is hashed and written from its pages, without a read() copy,
            # hashing one piece while the one before it is written (with O_DIRECT on a
            # local disk): the persister competes with training for the CPU.
            dst.write_view((tag, item.file), mapped, hashed, sent)
            try:
                check()
            except CorruptCheckpointError:
                with contextlib.suppress(NebulaError):
                    dst.remove(tag, item.file)  # a bad copy is not left behind
                raise
        else:
            with (
                src.open_read(tag, item.file) as fin,
                dst.open_write(tag, item.file, sent=sent) as fout,
            ):
                while data := fin.read(_COPY_CHUNK_BYTES):
                    hashed(memoryview(data))
                    fout.write(data)
                check()
    if reuse is None:
        return None
    reuse.count(tag, written=item.size_bytes, reused=0)
    return ItemReuse(item.file, 0)


def copy_part(
    src: Store,
    dst: Store,
    tag: str,
    *,
    rank: int,
    world_size: int,
    timeout_s: float,
    wait: bool = True,
    gone: Callable[[list[int]], list[int]] | None = None,
    reuse: ReuseBook | None = None,
) -> int:
    """Copy one rank's part of `tag` (its marker and the items it lists) to another tier,
    verified; then, with `wait`, wait until the part of every rank that writes the tag is
    there and the manifest is published (`RankTimeoutError` after `timeout_s`: the tag
    stays uncommitted on `dst`).

    Each rank persists its own part; whichever sees every writer's marker first commits,
    from parts of the generation of this one only (the marker says which ranks write the
    tag and which generation wrote the part; `world_size` is the job's, for a marker
    that does not say). Without `wait` this returns once the part is durable (followers
    must not block: the leader may be waiting for one of their older parts). Returns the
    bytes of this rank's items. An item another rank's part of this generation already
    holds under the same name is refused (`ItemCollisionError`), not overwritten.

    `gone(ranks)` names the ranks among `ranks` whose process has ended (on this node:
    rank_presence.rank_gone). The part of such a rank that `src` holds, of this generation,
    is copied too (`adopt_parts`): the survivors of a node commit a checkpoint whose
    writer died after writing it to the memory tier, at once, instead of waiting
    `timeout_s` for a part that never comes. A gone rank without such a part raises
    `RankGoneError` (with `wait`) at once. `reuse`: as `copy_checkpoint`'s.
    """
    where = src.display(tag, marker_name(rank))
    marker = parse_marker(src.read_bytes(tag, marker_name(rank)), where)
    size = sum(item.size_bytes for item in marker.items)
    existing = read_committed(dst, tag)
    mine = set() if existing is None else {i for i in existing.manifest.items if i.rank == rank}
    if existing is not None and mine == set(marker.items):
        return size  # this part is already durable there
    jobs = max(marker.world_size, world_size, 2)  # several ranks: only this one's part goes
    begin_tag(dst, tag, rank=rank, overwrite=True, world_size=jobs)
    _refuse_collisions(dst, tag, marker)
    notes = [copy_item(src, dst, tag, item, lambda _n: None, reuse) for item in marker.items]
    marker = dataclasses.replace(marker, reused=tuple(n for n in notes if n is not None))
    dst.publish((tag, marker_name(rank)), marker.to_bytes(), create_only=False)
    # The writer's marker goes only once the tag is committed (or, without `wait`, once
    # this part is): with every part written but no manifest yet, a prune of leftovers
    # would otherwise take the tag for a dead job's and delete it under the commit.
    if wait:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await_commit(
                    dst,
                    tag,
                    world_size=marker.world_size,
                    ranks=marker.ranks,
                    generation=marker.generation,
                    timeout_s=max(0.0, deadline - time.monotonic()),
                    poll_s=0.05,
                    max_poll_s=0.5,
                    gone=gone,
                )
                break
            except RankGoneError as exc:
                if not adopt_parts(src, dst, tag, exc.missing, marker, world_size):
                    raise
    else:
        if gone is not None:
            files = dst.list_files(tag)
            missing = [r for r in marker.writers if marker_name(r) not in files]
            adopt_parts(src, dst, tag, gone(missing), marker, world_size)
        markers = read_markers(dst, tag, marker.writers, marker.generation)
        if markers is not None and read_committed(dst, tag) is None:
            publish_manifest(dst, tag, marker.world_size, markers)
    dst.remove(tag, writer_marker_name(rank))
    return size


def adopt_parts(
    src: Store, dst: Store, tag: str, ranks: list[int], mine: RankMarker, world_size: int
) -> bool:
    """Copy to `dst` the parts of `ranks` (whose processes have ended) that `src` holds,
    of the generation of `mine` (the copying rank's own part); False when one of them has
    no such part there (it never wrote it, or wrote it in another run)."""
    if not ranks:
        return False
    for rank in ranks:
        try:
            where = src.display(tag, marker_name(rank))
            theirs = parse_marker(src.read_bytes(tag, marker_name(rank)), where)
        except NebulaError:
            return False
        if theirs.generation != mine.generation:
            return False
    for rank in ranks:
        log.info("copying rank %d's part of %r too: its process has ended", rank, tag)
        copy_part(src, dst, tag, rank=rank, world_size=world_size, timeout_s=0, wait=False)
    return True


def _refuse_collisions(dst: Store, tag: str, marker: RankMarker) -> None:
    """Claim the item files of `marker`'s part of `tag` on `dst`, then `ItemCollisionError`
    (the claim withdrawn) if another rank of the generation of `marker` claims or holds
    one of them (ranks on different nodes meet only here).

    The claim goes into this rank's writer marker (with the generation: a writer on
    another node cannot be told alive from here) before the others are looked at, so of
    two ranks copying one name at once at least one sees the other's claim, and an item's
    file is never written by two ranks. A rank's writer marker stays until its rank
    marker is published, so a part is claimed from before its first byte is written.
    """
    mine = {item.file: item.name for item in marker.items}
    claim = (tag, writer_marker_name(marker.rank))
    record = writer_record(marker.rank, sorted(mine), generation=marker.generation)
    dst.publish(claim, record, create_only=False)
    for rank, names in _claims(dst, tag, marker):
        clash = sorted(names & set(mine))
        if clash:
            dst.publish(claim, writer_record(marker.rank, generation=marker.generation),
                        create_only=False)  # fmt: skip
            raise ItemCollisionError(dst.display(tag), tag, mine[clash[0]], rank, marker.rank)


def _claims(dst: Store, tag: str, marker: RankMarker) -> list[tuple[int, set[str]]]:
    """(rank, item files) of the other ranks' claims (writer markers) and parts (rank
    markers) of `tag` on `dst`, of the generation of `marker`. One listing; a marker is
    read only when the tag holds one of another rank."""
    found = []
    own = (marker_name(marker.rank), writer_marker_name(marker.rank))
    for name in sorted(dst.list_files(tag)):
        if name in own:
            continue
        if name.startswith(WRITER_PREFIX):
            doc = claimed_items(dst, tag, name) or {}
            rank, names = doc.get("rank"), doc.get("items")
            if doc.get("generation") != marker.generation or not isinstance(names, list):
                continue
            if isinstance(rank, int) and not isinstance(rank, bool):
                found.append((rank, {n for n in names if isinstance(n, str)}))
        elif name.startswith(RANK_PREFIX):
            try:
                theirs = parse_marker(dst.read_bytes(tag, name), dst.display(tag, name))
            except NebulaError:
                continue
            if theirs.generation == marker.generation:  # else an earlier run's: replaced
                found.append((theirs.rank, {item.file for item in theirs.items}))
    return found
