"""The commit protocol on one tier (DESIGN.md §4): items, rank marker, manifest last.

    begin_tag         refuse a committed tag (unless overwriting), clear a dead writer's
                      leftovers, write this process's writer marker (markers.py)
    write_item        serialise one object into an item file, hashing on the way
    commit_rank       publish this rank's marker; the manifest once every rank's is there
    await_commit      wait until every rank's marker is there and the manifest published
    publish_manifest  the manifest from every rank's marker (create-only)

The same protocol with items copied from another tier is transfer.py; deleting is
delete.py.

May import: `nebulaml.errors`, `nebulaml.format`, `nebulaml.storage`, catalog.py,
delete.py, leases.py and markers.py. Not for: deciding when to commit or persist
(checkpoint.py and persister.py decide), copying (transfer.py) or deleting (delete.py).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from nebulaml.errors import (
    CheckpointBusyError,
    CheckpointExistsError,
    CommitConflictError,
    ManifestError,
    RankTimeoutError,
)
from nebulaml.format.checksum import HashingWriter
from nebulaml.format.manifest import (
    ItemEntry,
    Manifest,
    Producer,
    RankMarker,
    parse_marker,
    utc_now,
)
from nebulaml.format.names import (
    MANIFEST_NAME,
    marker_name,
    step_of,
    validate_name,
    writer_marker_name,
)
from nebulaml.format.serialization import write_item as serialise
from nebulaml.protocol.catalog import read_committed
from nebulaml.protocol.delete import delete_checkpoint, delete_part
from nebulaml.protocol.leases import live_leases
from nebulaml.protocol.markers import describe_writer, read_writers, writer_alive, writer_record
from nebulaml.storage.store import Store


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
    # Whole or not at all: a deleter reading a half-written marker would take the tag for
    # a dead writer's leftover (the concurrency campaign caught a prune doing so).
    store.publish((tag, writer_marker_name(rank)), writer_record(rank), create_only=False)


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
    manifest = publish_manifest(store, tag, world_size, markers)
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
            manifest = publish_manifest(store, tag, world_size, markers)
            if manifest is not None:
                return manifest
        if time.monotonic() >= deadline:
            files = store.list_files(tag)
            missing = [r for r in range(world_size) if marker_name(r) not in files]
            raise RankTimeoutError(store.display(tag), missing, timeout_s)
        time.sleep(poll_s)
        poll_s = min(max_poll_s, poll_s * 2)


def publish_manifest(
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
