"""The commit protocol on one tier (DESIGN.md §4): items, rank marker, manifest last.

    begin_tag      refuse a committed tag (unless overwriting), clear a dead writer's leftovers
    write_item     serialise one object into an item file, hashing on the way
    commit_rank    publish this rank's marker; the manifest once every rank's marker is there
    copy_checkpoint  the same protocol with items copied (and verified) from another tier
    delete_checkpoint  manifest first, then the data

Not for: deciding when to commit or persist (checkpoint.py and persister.py decide).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from .catalog import CheckpointInfo, read_committed
from .checksum import HashingWriter, new_hasher
from .errors import (
    CheckpointExistsError,
    CommitConflictError,
    CorruptCheckpointError,
    NebulaError,
)
from .manifest import (
    CHECKSUM_ALGO,
    ItemEntry,
    Manifest,
    Producer,
    RankMarker,
    marker_name,
    parse_marker,
    utc_now,
)
from .names import MANIFEST_NAME, step_of, validate_name
from .serialization import write_item as serialise
from .storage import Store

WRITER_PREFIX = ".writer-"
_COPY_CHUNK_BYTES = 8 << 20


def _writer_name(rank: int) -> str:
    return f"{WRITER_PREFIX}{rank}.json"


def producer() -> Producer:
    import torch

    from ._version import __version__

    return Producer(nebula_version=__version__, torch_version=torch.__version__, host=_host())


def _host() -> str:
    return socket.gethostname()


def begin_tag(store: Store, tag: str, *, rank: int, overwrite: bool) -> None:
    """Prepare the folder of `tag` for this rank's items.

    A committed tag is refused (`CheckpointExistsError`) unless `overwrite`, in which case
    it is deleted first, manifest first. Leftovers of an uncommitted earlier attempt are
    removed. A writer marker records who is writing, so that recovery can tell a live
    writer from a dead one.
    """
    validate_name("tag", tag)
    if store.exists(tag, MANIFEST_NAME):
        if not overwrite:
            raise CheckpointExistsError(store.url, tag)
        delete_checkpoint(store, tag)
    elif store.exists(tag):
        for name in store.list_files(tag):
            store.remove(tag, name)
    store.make_dir(tag)
    doc = {"host": _host(), "pid": os.getpid(), "rank": rank, "started_at": utc_now()}
    store.write_bytes((tag, _writer_name(rank)), json.dumps(doc).encode())


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


def write_item(store: Store, tag: str, name: str, obj: Any, *, rank: int) -> ItemEntry:
    """Serialise `obj` as the item `name` of `tag`; durable when it returns."""
    validate_name("item", name)
    with store.open_write(tag, name) as raw:
        out = HashingWriter(raw)
        tensor_bytes = serialise(obj, out)  # type: ignore[arg-type]
    return ItemEntry(
        name=name,
        file=name,
        rank=rank,
        size_bytes=out.size_bytes,
        checksum_algo=CHECKSUM_ALGO,
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
    all_items = [item for m in markers for item in m.items]
    all_labels = tuple(sorted({label for m in markers for label in m.labels}))
    manifest = Manifest(
        tag=tag,
        step=step_of(tag),
        created_at=min(m.created_at for m in markers),
        committed_at=utc_now(),
        world_size=world_size,
        items=tuple(sorted(all_items, key=lambda i: (i.rank, i.name))),
        producer=producer(),
        labels=all_labels,
    )
    try:
        store.publish((tag, MANIFEST_NAME), manifest.to_bytes(), create_only=True)
    except CommitConflictError:
        # Two ranks saw every marker at once: the other one's manifest, if it is valid
        # and lists the same items, is the commit.
        info = read_committed(store, tag)
        if info is None or info.manifest.items != manifest.items:
            raise
        manifest = info.manifest
    store.remove(tag, _writer_name(rank))
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


def copy_checkpoint(src: CheckpointInfo, dst: Store, *, overwrite: bool = False) -> Manifest:
    """Copy a committed checkpoint to another root with the full commit protocol.

    Every byte is hashed on the way and compared with the source manifest; a mismatch
    raises `CorruptCheckpointError` and nothing is committed at the destination. A
    destination that already holds the identical checkpoint is left as it is.
    """
    tag = src.tag
    existing = read_committed(dst, tag)
    if existing is not None and existing.manifest.items == src.manifest.items:
        return existing.manifest
    begin_tag(dst, tag, rank=0, overwrite=overwrite or existing is not None)
    for item in src.manifest.items:
        _copy_item(src.store, dst, tag, item)
    ranks = sorted({item.rank for item in src.manifest.items}) or [0]
    for rank in ranks:
        marker = RankMarker(
            tag,
            rank,
            src.manifest.world_size,
            src.manifest.created_at,
            tuple(i for i in src.manifest.items if i.rank == rank),
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
        items=src.manifest.items,
        producer=src.manifest.producer,
        labels=src.manifest.labels,
    )
    dst.publish((tag, MANIFEST_NAME), manifest.to_bytes(), create_only=True)
    dst.remove(tag, _writer_name(0))
    return manifest


def _copy_item(src: Store, dst: Store, tag: str, item: ItemEntry) -> None:
    hasher = new_hasher()
    size = 0
    with src.open_read(tag, item.file) as fin, dst.open_write(tag, item.file) as fout:
        while chunk := fin.read(_COPY_CHUNK_BYTES):
            hasher.update(chunk)
            size += len(chunk)
            fout.write(chunk)
        if size != item.size_bytes or hasher.hexdigest() != item.checksum:
            raise CorruptCheckpointError(
                src.display(tag, item.file),
                f"{item.size_bytes} bytes with {item.checksum_algo} {item.checksum}",
                f"{size} bytes with {item.checksum_algo} {hasher.hexdigest()}",
            )


def delete_checkpoint(store: Store, tag: str) -> None:
    """Delete a tag: the manifest first (so it is invisible at once), then the data."""
    validate_name("tag", tag)
    store.remove(tag, MANIFEST_NAME)
    store.remove_dir(tag)
