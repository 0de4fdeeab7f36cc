"""The commit protocol on one tier (DESIGN.md §4): items, rank marker, manifest last.

    begin_tag      refuse a committed tag (unless overwriting), clear a dead writer's leftovers
    write_item     serialise one object into an item file, hashing on the way
    commit_rank    publish this rank's marker; the manifest once every rank's marker is there
    copy_checkpoint  the same protocol with items copied (and verified) from another tier;
                   optionally resuming an interrupted copy and re-reading what it wrote
    delete_checkpoint  manifest first, then the data; never a tag being read (leases.py)

Not for: deciding when to commit or persist (checkpoint.py and persister.py decide).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from nebulaml.errors import (
    CheckpointBusyError,
    CheckpointExistsError,
    CommitConflictError,
    CorruptCheckpointError,
    ManifestError,
    NebulaError,
    RankTimeoutError,
    StorageError,
)
from nebulaml.format.checksum import HashingWriter, hash_stream, new_hasher
from nebulaml.format.manifest import (
    ItemEntry,
    Manifest,
    Producer,
    RankMarker,
    marker_name,
    parse_marker,
    utc_now,
)
from nebulaml.format.names import MANIFEST_NAME, step_of, validate_name
from nebulaml.format.serialization import write_item as serialise
from nebulaml.protocol.catalog import CheckpointInfo, read_committed
from nebulaml.protocol.leases import delete_claim, is_lease_file, live_leases, process_alive
from nebulaml.storage.store import MissingFileError, Store

WRITER_PREFIX = ".writer-"
_COPY_CHUNK_BYTES = 8 << 20


def writer_marker_name(rank: int) -> str:
    """`.writer-<rank>.json`: who is writing a rank's part (host, pid), until it commits."""
    return f"{WRITER_PREFIX}{rank}.json"


def producer() -> Producer:
    import torch

    from nebulaml._version import __version__

    return Producer(nebula_version=__version__, torch_version=torch.__version__, host=_host())


def _host() -> str:
    return socket.gethostname()


def begin_tag(store: Store, tag: str, *, rank: int, overwrite: bool, world_size: int = 1) -> None:
    """Prepare the folder of `tag` for this rank's items.

    A committed tag is refused (`CheckpointExistsError`) unless `overwrite`, in which case
    its manifest goes first, then its data. Leftovers of an uncommitted earlier attempt are
    removed, unless another live process on this host is still writing them
    (`CheckpointBusyError`). With several ranks the folder is shared: a rank removes only
    its own files, never another rank's. A writer marker records who is writing, so that
    recovery can tell a live writer from a dead one.
    """
    validate_name("tag", tag)
    if store.exists(tag, MANIFEST_NAME):
        if not overwrite:
            raise CheckpointExistsError(store.url, tag)
        deleted = (
            delete_checkpoint(store, tag) if world_size == 1 else delete_part(store, tag, rank)
        )
        if not deleted:
            readers = ", ".join(lease.describe() for lease in live_leases(store, tag))
            raise CheckpointBusyError(store.url, tag, readers or "a reader", activity="read")
    elif store.exists(tag):
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
    doc = {"host": _host(), "pid": os.getpid(), "rank": rank, "started_at": utc_now()}
    # Whole or not at all: a deleter reading a half-written marker would take the tag for
    # a dead writer's leftover (the concurrency campaign caught a prune doing so).
    store.publish((tag, writer_marker_name(rank)), json.dumps(doc).encode(), create_only=False)


def delete_part(
    store: Store,
    tag: str,
    rank: int,
    *,
    keep_folder: bool = False,
    discard: Callable[[str, str], object] | None = None,
) -> bool:
    """Remove one rank's part of a shared tag folder: the manifest first (the tag is then
    invisible on this tier), then the items this rank's marker lists, then its markers,
    then the folder if no other rank's files remain. A writer marker naming this process
    is there from the start, so a delete cut short is a dead writer's leftover.

    Returns False, and changes nothing, while a live reader holds a lease on the
    committed tag (leases.py); True once the part is gone. `discard(tag, name)`, when
    given, disposes of each item file instead (the memory tier recycles them: slots.py).
    """
    files = store.list_files(tag)
    if not files:
        return True
    if MANIFEST_NAME not in files:
        # Uncommitted: nobody can be reading it (leases.py), and a full disk must not keep
        # a failed write's leftovers from going for want of room for a claim.
        _remove_part(store, tag, rank, files, keep_folder, discard)
        return True
    with delete_claim(store, tag) as readers:
        if readers:
            return False
        _remove_part(store, tag, rank, files, keep_folder, discard)
    return True


def _remove_part(
    store: Store,
    tag: str,
    rank: int,
    files: dict[str, int],
    keep_folder: bool,
    discard: Callable[[str, str], object] | None = None,
) -> None:
    try:
        _claim(store, tag, rank)
    except MissingFileError:
        return  # the folder went meanwhile: another deleter was quicker
    store.remove(tag, MANIFEST_NAME)
    own: set[str] = set()
    if marker_name(rank) in files:
        try:
            marker = parse_marker(
                store.read_bytes(tag, marker_name(rank)), store.display(tag, marker_name(rank))
            )
            own = {item.file for item in marker.items}
        except (NebulaError, ValueError):
            own = set()
    for name in sorted(own & set(files)):
        if discard is not None:
            discard(tag, name)
        store.remove(tag, name)
    store.remove(tag, marker_name(rank))
    store.remove(tag, writer_marker_name(rank))
    # Leases (our claim among them) are no other rank's files.
    if not keep_folder and not [n for n in store.list_files(tag) if not is_lease_file(n)]:
        _remove_folder(store, tag, files)


def _claim(store: Store, tag: str, rank: int) -> None:
    """Write this process's writer marker into `tag` (before it changes what is there)."""
    doc = {"host": _host(), "pid": os.getpid(), "rank": rank, "started_at": utc_now()}
    # Written in place, not published: on a full disk a delete must still get its claim
    # in (a deleter's half-written claim only makes another deleter delete too).
    store.write_bytes((tag, writer_marker_name(rank)), json.dumps(doc).encode())


def read_writers(store: Store, tag: str) -> list[dict[str, Any]]:
    """The writer markers of an uncommitted tag: host, pid, rank, started_at (unreadable
    markers are skipped: they only describe, they decide nothing here)."""
    writers = []
    for name in sorted(store.list_files(tag)):
        if not name.startswith(WRITER_PREFIX):
            continue
        try:
            doc = json.loads(store.read_bytes(tag, name))
        except (NebulaError, ValueError):
            continue
        if isinstance(doc, dict):
            writers.append({k: doc.get(k) for k in ("host", "pid", "rank", "started_at")})
    return writers


def writer_alive(writer: dict[str, Any], host: str | None = None) -> bool:
    """Whether a writer marker (see `read_writers`) names a live process on this host.

    A writer on another host cannot be checked from here: it counts as not alive on this
    host, and callers decide what that means (recovery leaves it alone; prune waits for a
    grace period).
    """
    if writer.get("host") != (host or _host()):
        return False
    pid = writer.get("pid")
    return isinstance(pid, int) and not isinstance(pid, bool) and process_alive(pid)


def describe_writer(writer: dict[str, Any]) -> str:
    """'pid 123 on node1' for messages."""
    return f"pid {writer.get('pid')} on {writer.get('host')}"


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
) -> Manifest | None:
    """Publish this rank's marker, then the manifest if every rank's marker is present.

    Returns the manifest if this call committed the tag, else None (other ranks pending).
    """
    marker = RankMarker(tag, rank, world_size, created_at, tuple(items), labels)
    store.publish((tag, marker_name(rank)), marker.to_bytes(), create_only=False)
    markers = read_markers(store, tag, world_size)
    if markers is None:
        return None  # another rank's part is not written yet; the last rank commits
    manifest = _publish_manifest(store, tag, world_size, markers)
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
) -> Manifest:
    """Wait until `tag` is committed on `store`: its manifest appears, or every rank's
    marker is there and this call publishes the manifest itself.

    Raises `RankTimeoutError` naming the ranks whose part is missing after `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        info = read_committed(store, tag)
        if info is not None:
            return info.manifest
        markers = read_markers(store, tag, world_size)
        if markers is not None:
            manifest = _publish_manifest(store, tag, world_size, markers)
            if manifest is not None:
                return manifest
        if time.monotonic() >= deadline:
            files = store.list_files(tag)
            missing = [r for r in range(world_size) if marker_name(r) not in files]
            raise RankTimeoutError(store.display(tag), missing, timeout_s)
        time.sleep(poll_s)
        poll_s = min(max_poll_s, poll_s * 2)


def _publish_manifest(
    store: Store, tag: str, world_size: int, markers: list[RankMarker]
) -> Manifest | None:
    """Publish the manifest from every rank's marker (create-only); None if another
    writer's manifest, with other items, won."""
    if any(m.world_size != world_size or m.tag != tag for m in markers):
        raise ManifestError(store.display(tag), "rank markers disagree on the world size")
    all_items = [item for m in markers for item in m.items]
    manifest = Manifest(
        tag=tag,
        step=step_of(tag),
        created_at=min(m.created_at for m in markers),
        committed_at=utc_now(),
        world_size=world_size,
        items=tuple(sorted(all_items, key=lambda i: (i.rank, i.name))),
        producer=producer(),
        labels=tuple(sorted({label for m in markers for label in m.labels})),
    )
    try:
        store.publish((tag, MANIFEST_NAME), manifest.to_bytes(), create_only=True)
    except CommitConflictError:
        # Two ranks saw every marker at once: the other one's manifest, if it is valid
        # and lists the same items, is the commit.
        info = read_committed(store, tag)
        if info is None or info.manifest.items != manifest.items:
            raise
        return info.manifest
    return manifest


def read_markers(store: Store, tag: str, world_size: int) -> list[RankMarker] | None:
    """Every rank's marker of `tag`, or None while any is missing."""
    files = store.list_files(tag)
    if any(marker_name(r) not in files for r in range(world_size)):
        return None
    return [
        parse_marker(store.read_bytes(tag, marker_name(r)), store.display(tag, marker_name(r)))
        for r in range(world_size)
    ]


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
    is called as bytes are copied or found in place. The defaults are the persister's:
    the destination tag is rewritten whole and only the source bytes are hashed.
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
    copied: list[str] = []
    for item in items:
        if item.file in skipped:
            continue

        def advance(n: int, base: int = done) -> None:
            if progress is not None:
                progress(base + n, total)

        copy_item(src.store, dst, tag, item, advance)
        if verify:
            # Re-read from the destination rather than trusting the bytes we sent: this is
            # what a later reader gets, so it also catches a store that truncated or altered
            # the upload, or a writer that raced us. Hashing while writing cannot.
            _check_item(dst, tag, item)
        done += item.size_bytes
        copied.append(item.name)
    ranks = sorted({item.rank for item in items}) or [0]
    for rank in ranks:
        marker = RankMarker(
            tag,
            rank,
            src.manifest.world_size,
            src.manifest.created_at,
            tuple(i for i in items if i.rank == rank),
            src.manifest.labels,
        )
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
    )
    dst.publish((tag, MANIFEST_NAME), manifest.to_bytes(), create_only=True)
    dst.remove(tag, writer_marker_name(0))
    return CopyResult(
        manifest,
        copied_items=tuple(copied),
        skipped_items=tuple(i.name for i in items if i.file in skipped),
        copied_bytes=sum(i.size_bytes for i in items if i.file not in skipped),
        skipped_bytes=sum(skipped.values()),
    )


def _resume_tag(dst: Store, tag: str, items: tuple[ItemEntry, ...]) -> dict[str, int]:
    """Prepare an uncommitted destination folder for a resumed copy.

    Returns {file: size} of the item files already there and verified. Everything else in
    the folder (partial or mismatching items, stale markers) is removed, and our writer
    marker is written, as `begin_tag` does.
    """
    validate_name("tag", tag)
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
    dst.make_dir(tag)
    doc = {"host": _host(), "pid": me, "rank": 0, "started_at": utc_now()}
    dst.publish((tag, writer_marker_name(0)), json.dumps(doc).encode(), create_only=False)
    return kept


def _matches(store: Store, tag: str, item: ItemEntry) -> bool:
    try:
        with store.open_read(tag, item.file) as f:
            size, digest = hash_stream(f, _COPY_CHUNK_BYTES, item.checksum_algo)
    except MissingFileError:
        return False
    return size == item.size_bytes and digest == item.checksum


def _check_item(store: Store, tag: str, item: ItemEntry) -> None:
    with store.open_read(tag, item.file) as f:
        size, digest = hash_stream(f, _COPY_CHUNK_BYTES, item.checksum_algo)
    if size != item.size_bytes or digest != item.checksum:
        raise CorruptCheckpointError(
            store.display(tag, item.file),
            f"{item.size_bytes} bytes with {item.checksum_algo} {item.checksum}",
            f"{size} bytes with {item.checksum_algo} {digest} after writing it",
        )


def copy_item(
    src: Store, dst: Store, tag: str, item: ItemEntry, advance: Callable[[int], None]
) -> None:
    """Copy one item file of `tag`, hashing on the way; a mismatch with `item` raises
    `CorruptCheckpointError`."""
    hasher = new_hasher(item.checksum_algo)
    size = 0

    def hashed(piece: memoryview) -> None:
        nonlocal size
        hasher.update(piece)
        size += len(piece)
        advance(size)

    def check() -> None:
        if size != item.size_bytes or hasher.hexdigest() != item.checksum:
            raise CorruptCheckpointError(
                src.display(tag, item.file),
                f"{item.size_bytes} bytes with {item.checksum_algo} {item.checksum}",
                f"{size} bytes with {item.checksum_algo} {hasher.hexdigest()}",
            )

    with src.map_read(tag, item.file) as mapped:
        if mapped is not None:
            # A local source is hashed and written from its pages, without a read() copy,
            # hashing one piece while the one before it is written (with O_DIRECT on a
            # local disk): the persister competes with training for the CPU.
            dst.write_view((tag, item.file), mapped, hashed)
            try:
                check()
            except CorruptCheckpointError:
                with contextlib.suppress(NebulaError):
                    dst.remove(tag, item.file)  # a bad copy is not left behind
                raise
            return
    with src.open_read(tag, item.file) as fin, dst.open_write(tag, item.file) as fout:
        while data := fin.read(_COPY_CHUNK_BYTES):
            hashed(memoryview(data))
            fout.write(data)
        check()


def copy_part(
    src: Store,
    dst: Store,
    tag: str,
    *,
    rank: int,
    world_size: int,
    timeout_s: float,
    wait: bool = True,
) -> int:
    """Copy one rank's part of `tag` (its marker and the items it lists) to another tier,
    verified; then, with `wait`, wait until every rank's part is there and the manifest is
    published (`RankTimeoutError` after `timeout_s`: the tag stays uncommitted on `dst`).

    Each rank persists its own part; whichever sees every marker first commits. Without
    `wait` this returns once the part is durable (followers must not block: the leader
    may be waiting for one of their older parts). Returns the bytes of this rank's items.
    """
    where = src.display(tag, marker_name(rank))
    marker = parse_marker(src.read_bytes(tag, marker_name(rank)), where)
    size = sum(item.size_bytes for item in marker.items)
    existing = read_committed(dst, tag)
    mine = set() if existing is None else {i for i in existing.manifest.items if i.rank == rank}
    if existing is not None and mine == set(marker.items):
        return size  # this part is already durable there
    begin_tag(dst, tag, rank=rank, overwrite=True, world_size=world_size)
    for item in marker.items:
        copy_item(src, dst, tag, item, lambda _n: None)
    dst.publish((tag, marker_name(rank)), marker.to_bytes(), create_only=False)
    # The writer's marker goes only once the tag is committed (or, without `wait`, once
    # this part is): with every part written but no manifest yet, a prune of leftovers
    # would otherwise take the tag for a dead job's and delete it under the commit.
    if wait:
        await_commit(
            dst, tag, world_size=world_size, timeout_s=timeout_s, poll_s=0.05, max_poll_s=0.5
        )
    else:
        markers = read_markers(dst, tag, world_size)
        if markers is not None and read_committed(dst, tag) is None:
            _publish_manifest(dst, tag, world_size, markers)
    dst.remove(tag, writer_marker_name(rank))
    return size


def own_parts(store: Store, rank: int) -> list[tuple[str, str]]:
    """(tag, created_at) of every tag on `store` that holds this rank's marker."""
    out = []
    for tag in store.list_dirs():
        try:
            validate_name("tag", tag)
        except NebulaError:
            continue
        if marker_name(rank) not in store.list_files(tag):
            continue
        try:
            where = store.display(tag, marker_name(rank))
            marker = parse_marker(store.read_bytes(tag, marker_name(rank)), where)
        except (NebulaError, ValueError):
            continue  # removed meanwhile, or not readable: not a part to keep or evict
        out.append((tag, marker.created_at))
    return out


def delete_checkpoint(
    store: Store, tag: str, *, discard: Callable[[str, str], object] | None = None
) -> bool:
    """Delete a tag: the manifest first (so it is invisible at once), then the data.

    A checkpoint being read is never deleted: this publishes a delete claim, then looks
    for live read leases (leases.py); if there is one it returns False and the tag stays
    as it is (the caller reports it, or tries again later). Returns True once the tag is
    gone (also when there was nothing to delete).

    A writer marker naming this process goes in before the manifest goes out, so that a
    delete cut short (the process killed) leaves a leftover that recovery knows to be a
    dead writer's, not files nobody claims. `discard(tag, name)`, when given, disposes of
    each data file instead of removing it (the memory tier recycles them: slots.py).
    """
    validate_name("tag", tag)
    files = store.list_files(tag)
    if not files:
        _remove_folder(store, tag)  # an empty folder (a store with real folders)
        return True
    if MANIFEST_NAME not in files:
        # Uncommitted: nobody can be reading it (leases.py), and a full disk must not keep
        # a failed write's leftovers from going for want of room for a claim. But a live
        # writer may have started it since the caller judged it a leftover: its marker
        # would be overwritten by our claim, and its files deleted under it.
        if _live_writer(store, tag):
            return False
        try:
            _claim(store, tag, 0)
        except MissingFileError:
            return True  # another deleter was quicker
        _remove_checkpoint(store, tag, files, discard)
        return True
    with delete_claim(store, tag) as readers:
        if readers:
            return False
        try:
            _claim(store, tag, 0)  # before the manifest goes: no moment without a claim
        except MissingFileError:
            return True  # another deleter (prune, retention, eviction) was quicker
        _remove_checkpoint(store, tag, files, discard)
    return True


def _live_writer(store: Store, tag: str) -> bool:
    """Whether another live process on this host is writing `tag` (its writer marker)."""
    me = os.getpid()
    return any(w.get("pid") != me and writer_alive(w) for w in read_writers(store, tag))


def _remove_checkpoint(
    store: Store, tag: str, files: dict[str, int], discard: Callable[[str, str], object] | None
) -> None:
    store.remove(tag, MANIFEST_NAME)
    # Data first, our markers last: whatever a kill leaves behind still carries them.
    for name in files:
        if not name.startswith(".") and name != MANIFEST_NAME:
            if discard is not None:
                discard(tag, name)
            store.remove(tag, name)
    _remove_folder(store, tag, files)


def _remove_folder(store: Store, tag: str, known: Iterable[str] = (), tries: int = 8) -> None:
    """Remove the folder of a deleted tag with what is left in it (markers, leases).

    A reader may create its lease between the listing and the removal of the folder (it
    then finds no manifest and leaves), or another deleter its claim (it then finds the
    folder gone, or empties it too): the folder is not empty, so try again, a little later.
    Files that were not there when the delete listed the folder (`known`), other than
    leases and claims, are a new writer's (the tag saved again): the folder is theirs then.
    """
    delay_s = 0.001
    known = set(known) | {writer_marker_name(0)}
    for attempt in range(tries):
        present = store.list_files(tag)
        if any(name not in known and not is_lease_file(name) for name in present):
            return
        try:
            store.remove_dir(tag)
            return
        except StorageError:
            if attempt == tries - 1:
                raise
        time.sleep(delay_s)
        delay_s *= 2
