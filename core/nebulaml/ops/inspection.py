"""Looking inside checkpoints without trusting them: manifests, and what an item holds.

`inspect_checkpoint` reads a tag's manifest on every tier and says which copies are
committed; `describe_item` lists the tensors and values of one item from its pickle's
metadata alone (item_metadata.py), so nothing in the checkpoint is executed and no tensor
data is read. Unlike catalog.py, a manifest that cannot be read is an error here, not
something to skip.

May import: every layer below ops. Not for: checking sizes and checksums
(verification.py) or loading items (runtime/load.py).
"""

from __future__ import annotations

import os
from typing import Any

from nebulaml.errors import CheckpointNotFoundError, ManifestError, NebulaError
from nebulaml.format.item_metadata import describe_pickle
from nebulaml.format.manifest import Manifest, parse_manifest, parse_marker
from nebulaml.format.names import MANIFEST_NAME, RANK_PREFIX, validate_name
from nebulaml.format.torchzip import read_pickle_member
from nebulaml.runtime.locate import Copy, check_root, find_copy, tiers_for
from nebulaml.storage.store import MissingFileError, Store

PathLike = str | os.PathLike[str]


# Reading manifests ------------------------------------------------------------------------
def read_manifest_strict(store: Store, tag: str) -> Manifest | None:
    """The manifest of `tag` on `store`, or None if it has none; unlike
    `catalog.read_manifest`, an unreadable or invalid one raises `ManifestError`."""
    validate_name("tag", tag)
    where = store.display(tag, MANIFEST_NAME)
    try:
        data = store.read_bytes(tag, MANIFEST_NAME)
    except MissingFileError:
        return None
    manifest = parse_manifest(data, where)
    if manifest.tag != tag:
        raise ManifestError(where, f"the manifest names tag {manifest.tag!r}, not {tag!r}")
    return manifest


def list_tag_again(store: Store, tag: str) -> dict[str, int]:
    """The files of `tag` listed again, with its manifest when it is a regular file on a
    local root (its size from lstat), though the listing missed it."""
    files = store.list_files(tag)
    identity = store.file_identity(tag, MANIFEST_NAME)
    if identity is not None:
        files.setdefault(MANIFEST_NAME, identity[1])
    return files


def inspect_checkpoint(root: PathLike, tag: str) -> dict[str, Any]:
    """The manifest of checkpoint `tag` at `root` (and its memory tier on this node), with
    the copies that hold it, as a JSON-serialisable dict.

    Keys: `root`, `tag`, `tiers` (those holding a committed copy), `copies` (per tier:
    `tier`, `location`, `committed`, `problem`), `manifest` (manifest.json as written:
    items with `size_bytes` and `checksum`) and `reused`: by item name, what the persist
    of that item took from its previous version on the persistent tier instead of writing
    it (`bytes_reused`, and `from_tag`, None when it took nothing), for the items whose
    persist recorded it (in the rank markers there). Item bytes are not read
    (`verify_checkpoints` checks them). Raises `RootNotFoundError`,
    `CheckpointNotFoundError`, and `ManifestError` when no copy has a valid manifest.

    Example:
        >>> import nebulaml as nm, tempfile
        >>> nm.ops.inspect_checkpoint(tempfile.mkdtemp(), "global_step5")
        Traceback (most recent call last):
        ...
        nebulaml.errors.CheckpointNotFoundError: ...: no checkpoint 'global_step5' found
    """
    validate_name("tag", tag)
    location = check_root(root)
    copies: list[dict[str, Any]] = []
    reused: dict[str, dict[str, Any]] = {}
    chosen: Manifest | None = None
    committed_manifest: Manifest | None = None
    first_error: ManifestError | None = None
    for tier, store in tiers_for(root, "inspect_checkpoint").stores:
        files = store.list_files(tag)
        if MANIFEST_NAME not in files and store.exists(tag, MANIFEST_NAME):
            files = list_tag_again(store, tag)  # committed just now, or a scan missed it
        if MANIFEST_NAME not in files:
            continue
        copy: dict[str, Any] = {"tier": tier, "location": store.display(tag)}
        try:
            manifest = read_manifest_strict(store, tag)
        except ManifestError as exc:
            first_error = first_error or exc
            copies.append({**copy, "committed": False, "problem": str(exc)})
            continue
        if manifest is None:
            continue  # deleted while we looked
        bad = [item.file for item in manifest.items if files.get(item.file) != item.size_bytes]
        problem = None
        if bad:
            problem = "item file(s) missing or of the wrong size: " + ", ".join(bad)
        copies.append({**copy, "committed": not bad, "problem": problem})
        if not bad and not reused:
            reused = _reuse_of(store, tag, manifest, files)
        chosen = chosen or manifest
        if not bad and committed_manifest is None:
            committed_manifest = manifest
    manifest = committed_manifest or chosen
    if manifest is None:
        if first_error is not None:
            raise first_error
        raise CheckpointNotFoundError(location, tag)
    return {
        "root": location,
        "tag": tag,
        "tiers": [c["tier"] for c in copies if c["committed"]],
        "copies": copies,
        "manifest": manifest.to_json(),
        "reused": reused,
    }


def _reuse_of(
    store: Store, tag: str, manifest: Manifest, files: dict[str, int]
) -> dict[str, dict[str, Any]]:
    """What the persist of each item of `tag` on `store` took from earlier versions, by item
    name, from the rank markers there (a marker that does not read tells nothing)."""
    names = {item.file: item.name for item in manifest.items}
    out: dict[str, dict[str, Any]] = {}
    for name in sorted(files):
        if not name.startswith(RANK_PREFIX):
            continue
        try:
            marker = parse_marker(store.read_bytes(tag, name), store.display(tag, name))
        except NebulaError:
            continue
        for entry in marker.reused:
            if entry.file in names:
                out[names[entry.file]] = {"bytes_reused": entry.bytes_reused,
                                          "from_tag": entry.source}  # fmt: skip
    return out


def describe_item(root: PathLike, tag: str, name: str) -> list[dict[str, Any]]:
    """What item `name` of checkpoint `tag` holds, read from its `data.pkl` alone: no
    pickle is executed and no tensor data is read.

    One dict per leaf, in the order the item stores them: `path` (e.g.
    `"state.0.exp_avg"`), `kind` (`"tensor"`, `"value"`, or `"object"` for a global
    that is not loaded), `type`, and for tensors `dtype`, `shape`, `numel`, `size_bytes`
    (`numel` times the element size) and `device`, for other leaves a short `value`. The
    fastest tier whose copy can be read is used. Raises `CheckpointNotFoundError`,
    `ItemNotFoundError`, `ManifestError`, and `CorruptCheckpointError` for a file that is
    not a torch zip archive or whose pickle is truncated.

    Example:
        >>> import nebulaml as nm, tempfile, torch
        >>> root = tempfile.mkdtemp()
        >>> nm.init(root)
        >>> nm.Checkpoint("global_step1").save("model", {"w": torch.zeros(2, 3), "lr": 0.5})
        >>> [(e["path"], e["dtype"], e["shape"], e["value"])
        ...  for e in nm.ops.describe_item(root, "global_step1", "model")]
        [('w', 'float32', [2, 3], None), ('lr', None, None, '0.5')]
    """
    validate_name("tag", tag)
    validate_name("item", name)
    location = check_root(root)
    # A copy whose manifest does not read, or whose file is not a torch zip archive, is
    # passed over for the next tier's; the first such failure is raised if none reads.
    return find_copy(
        tiers_for(root, "describe_item"),
        tag,
        _describe_file,
        item=name,
        manifest=read_manifest_strict,
        root=location,
    )


def _describe_file(copy: Copy) -> list[dict[str, Any]]:
    store, tag, entry = copy.store, copy.manifest.tag, copy.entry
    assert entry is not None
    where = store.display(tag, entry.file)
    with store.open_read(tag, entry.file) as stream:
        data = read_pickle_member(stream, where)
    return describe_pickle(data, where)
