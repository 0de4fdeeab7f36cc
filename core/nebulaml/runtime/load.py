"""Loading one item of a committed checkpoint: `Checkpoint.load`'s pipeline.

The fastest tier that holds the item is read (locate.find_copy), under a read lease: no
prune, retention or eviction deletes the copy meanwhile. Its size and checksum are
verified before anything is unpickled; on a mismatch the next tier's copy is tried, else
`CorruptCheckpointError` is raised. A file the store can map is read in place
(`read_item_local`), without a copy of its bytes.

May import: every layer below runtime, and runtime.locate. Not for: finding the tiers or
the tag (locate.py), or what an item's pickle may hold (format/serialization.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nebulaml.errors import CorruptCheckpointError, UnsupportedSchemaError
from nebulaml.format.manifest import KNOWN_CHECKSUM_ALGOS, verify_bytes
from nebulaml.format.serialization import MapLocation, read_item, read_item_local
from nebulaml.protocol.tiers import TierSet
from nebulaml.runtime.locate import Copy, find_copy


def load_item(
    tiers: TierSet,
    tag: str,
    name: str,
    *,
    map_location: MapLocation = None,
    weights_only: bool | None = True,
) -> Any:
    """Item `name` of the committed checkpoint `tag`, from the fastest tier whose copy
    verifies (see `Checkpoint.load`).

    Raises, when no copy reads: `CorruptCheckpointError` (a copy did not verify), else
    `UnsupportedSchemaError` (a manifest of a schema this version cannot read), else
    `CheckpointNotFoundError` or `ItemNotFoundError`.
    """
    local_reads = weights_only in (True, None)

    def read(copy: Copy) -> Callable[[], Any]:
        store, entry = copy.store, copy.entry
        assert entry is not None
        where = store.display(tag, entry.file)
        known = entry.checksum_algo in KNOWN_CHECKSUM_ALGOS
        algo = entry.checksum_algo if local_reads and known else None
        with store.read_local(tag, entry.file, algo=algo) as local:
            if local is not None and local_reads:
                verify_bytes(where, entry, local.view, checksum=local.checksum)
                obj = read_item_local(
                    local.path, local.buffer, local.view, where, map_location=map_location
                )
                return lambda: obj
        data = store.read_bytes(tag, entry.file)
        verify_bytes(where, entry, data)
        # Unpickled once the copy is chosen: the bytes verified, a failure to unpickle
        # them is the item's, and no other tier's copy is tried for it.
        return lambda: read_item(data, where, map_location=map_location, weights_only=weights_only)

    unpickle = find_copy(
        tiers,
        tag,
        read,
        item=name,
        lease=True,
        report=(CorruptCheckpointError, UnsupportedSchemaError),
    )
    return unpickle()
