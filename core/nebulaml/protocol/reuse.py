"""Persisting what changed: the bytes of an item that equal its previous version's on the
same tier are taken from that version's file, not sent again.

    ReuseBook   what this process last persisted of each item name on each tier (its
                tag, checksum, and the digests of its pieces and blocks), and the bytes
                each persisted tag wrote and reused
    plan_item   which ranges of a new version of an item equal the book's version, by
                digest, checked against the item's checksum first

A frozen base model, an embedding table or an EMA copy that did not change since the last
persist costs no write: on a local root its ranges are cloned from the last version's file
(`Store.write_ranges`: shared extents on XFS and btrfs, an in-kernel copy elsewhere), on
Azure Blob Storage they are staged server-side from the last version's blob (Put Block
From URL: storage/azure_ranges.py), on S3 copied server-side from the last version's
object (UploadPartCopy: storage/s3_parts.py), and the version is still a complete file that
`torch.load` reads; on a local root an item unchanged whole is a hard link to that version's
file (`LocalBackend.write_ranges`: no byte written, on ext4 either). Deleting the older
version never touches the newer one (a clone, a staged copy and a linked name are files
of their own, or the same file under a name of its own).

How "equal" is known, without reading the older version back: its digests are kept in
memory from when this process persisted it. A new version is hashed in 1 MiB pieces (the
item checksum's leaves: `tree_leaves`, whose combination is checked against the manifest
entry before anything is written, so a corrupt memory copy is refused as before); a piece
whose leaf equals the older version's at the same offset is reused whole. Inside a piece
that differs, 16 KiB blocks are compared by xxh3-128 (`block_digests`), so that a small
tensor that changed (a LoRA adapter among frozen weights) costs its blocks, not its
piece. A piece reused whole inherits the older version's block digests; the others are
hashed in blocks, the first version this process persists included (about 40 ms per
200 MB, once), so that the very next persist compares blocks.

The older version is used only while it is still committed on the tier with the checksum
the book recorded, is not the tag being written, and opens as a regular file (on Azure:
is still the blob this process committed, its ETag unchanged; on S3 the object, likewise);
else the item is written whole. The ETag is the one the write itself returned
(`ItemVersion.stamp`), never read back later: a version whose object may have been
rewritten since its digests were recorded is never copied from. A process that restarts
starts a new book: its first persist of each item writes it whole, unless the newest
checkpoint committed on a local root holds that item with the same checksum and its file
still hashes to it (read once): then the file is linked to it (`_equal_on_the_tier`), so
that a frozen item costs a restart a read, not a write.

On a local root a version is also its file's stamp (device, inode, size, modification
time: `Store.file_stamp`), and nothing is taken from a file written since
(`LocalBackend.write_ranges`): a tool that wrote into it in place gets the next version
written whole. A bad sector changes no stamp; `nebula verify` finds it.

May import: `nebulaml.errors`, `nebulaml.format` and `nebulaml.storage`, catalog.py,
commit_index.py. Not for: the copy itself (transfer.py `copy_item` calls `plan_item`), or
when to persist (runtime/persister.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from nebulaml.errors import CorruptCheckpointError, NebulaError
from nebulaml.format.checksum import (
    CHECKSUM_ALGO,
    Range,
    compare_pieces,
    tree_hexdigest,
    tree_leaves,
)
from nebulaml.format.manifest import ItemEntry
from nebulaml.protocol.catalog import read_committed
from nebulaml.protocol.commit_index import newest
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")


@dataclass
class ItemVersion:
    """One persisted version of an item file, as the book knows it."""

    tag: str
    file: str
    size_bytes: int
    checksum: str
    leaves: list[bytes]  # the checksum's leaf digest of each LEAF_BYTES piece
    blocks: list[bytes | None]  # each piece's block digests, where known
    # The store's name for the file as this process wrote it (an Azure blob's ETag): a
    # later version takes ranges from that file only while it is still the same. None on
    # a store without one (a local root).
    stamp: str | None = None


@dataclass(frozen=True)
class ItemPlan:
    """How to write one item: its ranges in file order, and the version to record."""

    ranges: tuple[Range, ...]
    base: ItemVersion | None
    version: ItemVersion

    @property
    def reused_bytes(self) -> int:
        return sum(length for _, length, reuse in self.ranges if reuse)


@dataclass
class ReuseBook:
    """What this process last persisted of each item name on each tier, and the bytes
    each tag's persist wrote and took from an older version (for its history row).

    Example:
        >>> book = ReuseBook()
        >>> book.count("global_step2", written=10, reused=90)
        >>> book.take_counts("global_step2"), book.take_counts("global_step2")
        ((10, 90), None)
    """

    pause: Callable[[], None] | None = None
    """Called between chunks of a persist's hash and of its writes to a local root (the
    persister's: wait while a save runs, so a persist does not take the save's CPU and
    memory bandwidth)."""
    _versions: dict[tuple[str, str], ItemVersion] = field(default_factory=dict)
    _counts: dict[str, list[int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def base_for(self, store: Store, tag: str, item: ItemEntry) -> ItemVersion | None:
        """The version of `item`'s file last persisted to `store` if a new version may
        take ranges from it: still committed there with the checksum recorded, of the
        same size, and not `tag` itself (a tag written again loses its old files first)."""
        with self._lock:
            base = self._versions.get((store.url, item.file))
        if base is None and store.capabilities.local_path:
            try:
                return _equal_on_the_tier(store, tag, item, self.pause)
            except NebulaError:  # a saving, never a cause of failure: written whole
                return None
        if base is None or base.tag == tag or base.size_bytes != item.size_bytes:
            return None
        info = read_committed(store, base.tag)
        if info is None:
            return None
        same = [i for i in info.manifest.items if i.file == base.file]
        if len(same) != 1 or same[0].checksum != base.checksum:
            return None
        return base

    def remember(self, store: Store, version: ItemVersion) -> None:
        """`version` is now the newest of its file on `store` (its persist wrote it)."""
        with self._lock:
            self._versions[(store.url, version.file)] = version

    def count(self, tag: str, *, written: int, reused: int) -> None:
        """Add one item's bytes to the persist of `tag`."""
        with self._lock:
            counts = self._counts.setdefault(tag, [0, 0])
            counts[0] += written
            counts[1] += reused

    def take_counts(self, tag: str) -> tuple[int, int] | None:
        """(bytes written, bytes reused) by the persists of `tag` since the last call;
        None when nothing was counted (a store that takes nothing from older versions)."""
        with self._lock:
            counts = self._counts.pop(tag, None)
        return None if counts is None else (counts[0], counts[1])


def plan_item(
    view: memoryview,
    tag: str,
    item: ItemEntry,
    base: ItemVersion | None,
    where: str = "",
    pause: Callable[[], None] | None = None,
) -> ItemPlan:
    """Hash `view` (the new version of `item`, to be written into `tag`), check it against
    `item`'s checksum (`CorruptCheckpointError` naming `where`, the source, if it
    differs: nothing is written), and
    compare it with `base` (module docstring): the ranges to write and to take from `base`.
    `pause()` is called between chunks of the hash (`ReuseBook.pause`).

    Example:
        >>> from nebulaml.format.checksum import BLOCK_BYTES
        >>> old = bytes(3 << 20)
        >>> new = bytearray(old); new[(1 << 20) + 5] = 1          # one byte of piece 1
        >>> first = plan_item(memoryview(old), "s1", _entry(old), None)
        >>> first.reused_bytes, len(first.version.blocks)
        (0, 3)
        >>> second = plan_item(memoryview(new), "s2", _entry(bytes(new)), first.version)
        >>> second.reused_bytes == (3 << 20) - BLOCK_BYTES   # all but one block of piece 1
        True
        >>> third = plan_item(memoryview(new), "s3", _entry(bytes(new)), second.version)
        >>> third.reused_bytes == 3 << 20
        True
    """
    size = len(view)
    leaves = tree_leaves(view, pause=pause)
    if item.checksum_algo != CHECKSUM_ALGO or size != item.size_bytes:
        found = f"{size} bytes"
    elif tree_hexdigest(leaves) != item.checksum:
        found = f"{size} bytes with {CHECKSUM_ALGO} {tree_hexdigest(leaves)}"
    else:
        found = ""
    if found:
        raise CorruptCheckpointError(
            where or f"{tag}/{item.file}",
            f"{item.size_bytes} bytes with {item.checksum_algo} {item.checksum}",
            found,
        )
    if base is not None and (base.size_bytes != size or len(base.leaves) != len(leaves)):
        base = None
    older = None if base is None else (base.leaves, base.blocks)
    ranges, blocks = compare_pieces(view, leaves, older, pause=pause)
    version = ItemVersion(tag, item.file, size, item.checksum, leaves, blocks)
    return ItemPlan(tuple(ranges), base, version)


def _equal_on_the_tier(
    store: Store, tag: str, item: ItemEntry, pause: Callable[[], None] | None = None
) -> ItemVersion | None:
    """For an item the book knows nothing of (the first persist of a process: a restart):
    its version in the newest checkpoint committed on `store` (a local root) but `tag`,
    if that version's manifest entry has the checksum and size of `item` and its file
    still hashes to that checksum (read, not trusted: a file damaged since its commit is
    not taken, and the new version is written whole from memory). Returned with its
    leaves and its file's stamp, so that `write_ranges` links it unless it is written
    meanwhile. None where the item changed, or nothing is there (two manifests read at
    most, from the index)."""
    for info in newest(store, 2):
        if info.tag == tag:
            continue
        same = [i for i in info.manifest.items if i.file == item.file]
        if len(same) != 1:
            return None
        entry = same[0]
        if (entry.checksum_algo, entry.checksum, entry.size_bytes) != (
            item.checksum_algo,
            item.checksum,
            item.size_bytes,
        ):
            return None
        stamp = store.file_stamp(info.tag, entry.file)
        if stamp is None:
            return None
        with store.map_read(info.tag, entry.file) as view:
            if view is None or len(view) != entry.size_bytes:
                return None
            leaves = tree_leaves(view, pause=pause)
        if tree_hexdigest(leaves) != entry.checksum:
            log.warning(
                "%s does not match its manifest (damaged since its commit?): the next "
                "version is written whole; `nebula verify` checks the rest",
                store.display(info.tag, entry.file),
            )
            return None
        blocks: list[bytes | None] = [None] * len(leaves)
        return ItemVersion(info.tag, entry.file, entry.size_bytes, entry.checksum, leaves, blocks,
                           stamp)  # fmt: skip
    return None


def _entry(data: bytes) -> ItemEntry:
    """A manifest entry for `data` (the doctests')."""
    from nebulaml.format.checksum import checksum_of

    return ItemEntry.written(
        "model", rank=0, size_bytes=len(data), checksum=checksum_of(data), tensor_bytes=0
    )
