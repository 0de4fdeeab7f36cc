"""Choosing from a root's listing what `nebula ls` and `nebula latest` show: sorted, kept
by the time they were committed and by their labels, cut to a number
(`select_checkpoints`); and the file of one checkpoint's item (`checkpoint_item_path`),
for `nebula latest --label best --item model`.

May import: every layer below ops (`errors`, `format`, `protocol`, `runtime`).
Not for: listing the tiers (api.py `list_checkpoints`, protocol/catalog.py) or drawing
the table (the CLI's `ls`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta, timezone
from typing import Any

from nebulaml.errors import CheckpointNotFoundError, InvalidArgumentError, ItemNotFoundError
from nebulaml.format.manifest import parse_utc
from nebulaml.format.names import validate_name
from nebulaml.protocol.catalog import read_committed
from nebulaml.protocol.leases import LISTINGS
from nebulaml.runtime.locate import tiers_for

PathLike = str | os.PathLike[str]
Listed = dict[str, Any]  # one checkpoint as `nm.list_checkpoints` gives it

# How `select_checkpoints` orders, by name: nebula's own order (the listing's: newest
# first, or its reverse), the commit time (latest first), the size (largest first), the tag.
SORTS: dict[str, Callable[[list[Listed]], list[Listed]]] = {
    "newest": lambda listed: listed,
    "oldest": lambda listed: listed[::-1],
    "committed": lambda listed: sorted(listed, key=lambda c: c["committed_at"], reverse=True),
    "size": lambda listed: sorted(listed, key=lambda c: c["size_bytes"], reverse=True),
    "tag": lambda listed: sorted(listed, key=lambda c: c["tag"]),
}


def select_checkpoints(
    checkpoints: Iterable[Listed],
    *,
    sort: str = "newest",
    since: datetime | timedelta | None = None,
    labels: Iterable[str] = (),
    limit: int | None = None,
) -> list[Listed]:
    """The checkpoints of a listing (`nm.list_checkpoints`, newest first) committed at or
    after `since` (a timezone-aware time, or a duration back from now) that carry every
    one of `labels`, ordered by `sort` (one of `SORTS`: newest, oldest, committed, size,
    tag), the first `limit` of them. Pure but for the clock a duration reads.

    Example:
        >>> listed = [{"tag": "global_step2", "committed_at": "2026-01-02T00:00:00Z",
        ...            "size_bytes": 10, "labels": ["best"]},
        ...           {"tag": "global_step1", "committed_at": "2026-01-01T00:00:00Z",
        ...            "size_bytes": 20, "labels": []}]
        >>> [c["tag"] for c in select_checkpoints(listed, sort="size")]
        ['global_step1', 'global_step2']
        >>> [c["tag"] for c in select_checkpoints(listed, labels=["best"])]
        ['global_step2']
    """
    if sort not in SORTS:
        raise InvalidArgumentError(f"sort must be one of {', '.join(SORTS)}, not {sort!r}")
    if limit is not None and (isinstance(limit, bool) or limit < 1):
        raise InvalidArgumentError(f"limit must be at least 1, not {limit!r}")
    wanted = set(labels)
    cutoff = _cutoff(since)
    kept = [
        c
        for c in checkpoints
        if wanted <= set(c["labels"])
        and (cutoff is None or _at_or_after(c["committed_at"], cutoff))
    ]
    return SORTS[sort](kept)[:limit]


def _at_or_after(committed_at: str, cutoff: datetime) -> bool:
    when = parse_utc(committed_at)
    return when is not None and when >= cutoff


def _cutoff(since: datetime | timedelta | None) -> datetime | None:
    if since is None:
        return None
    if isinstance(since, timedelta):
        return datetime.now(timezone.utc) - since
    if since.tzinfo is None or since.utcoffset() is None:
        raise InvalidArgumentError(f"since={since!r} has no time zone")
    return since


def checkpoint_item_path(root: PathLike, tag: str, item: str) -> str:
    """The file of item `item` of checkpoint `tag` at `root`, what plain
    `torch.load(path, weights_only=True)` reads: the persistent copy's (it outlives the
    node), else the memory tier's; a URL for a remote root. Held for 10 s against a
    retention or prune before the caller opens it, as `nm.get_latest_checkpoint_path`
    does for the newest. Raises `CheckpointNotFoundError` or `ItemNotFoundError`.

    Example:
        >>> import nebulaml as nm, tempfile
        >>> root = tempfile.mkdtemp()
        >>> nm.init(root); nm.Checkpoint("global_step1").save("model", {"w": 1})
        >>> nm.flush_persistence()
        True
        >>> path = nm.ops.checkpoint_item_path(root, "global_step1", "model")
        >>> path == f"{root}/global_step1/model"
        True
    """
    validate_name("tag", tag)
    validate_name("item", item)
    tiers = tiers_for(root, "checkpoint_item_path")
    for _tier, store in sorted(tiers.stores, key=lambda tier_store: tier_store[0] != "persistent"):
        info = read_committed(store, tag)
        if info is None:
            continue
        found = info.manifest.item(item)
        if found is None:
            raise ItemNotFoundError(tag, item, [each.name for each in info.manifest.items])
        LISTINGS.hold(tag, [store])
        return store.local_path(tag, found.file) or store.display(tag, found.file)
    raise CheckpointNotFoundError(tiers.display, tag)
