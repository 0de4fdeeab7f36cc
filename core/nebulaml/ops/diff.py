"""Comparing two checkpoints of a root, tensor by tensor: `nebula diff`.

    diff_checkpoints  per item and per leaf: added, removed, shape or dtype changed,
                      identical or changed, with the largest absolute and the relative L2
                      difference of changed floating tensors

Items whose committed bytes are the same (size and checksum in both manifests) are
identical without being read. Others are loaded one item at a time with weights-only reads
(verified against their manifest first; a local file is mapped, not copied), and tensors
are compared in chunks, in float64, so memory grows with the item, never with the chunk
arithmetic.

May import: every layer below ops. Not for: checking bytes against a manifest
(verification.py) or what an item holds without loading it (inspection.py).
"""

from __future__ import annotations

import math
import os
from typing import Any

from nebulaml.errors import ItemNotFoundError
from nebulaml.format.names import validate_name
from nebulaml.runtime.load import load_item
from nebulaml.runtime.locate import check_root, find_copy, tiers_for

PathLike = str | os.PathLike[str]

# The statuses of an item or a leaf.
ADDED, REMOVED, IDENTICAL, CHANGED = "added", "removed", "identical", "changed"
SHAPE_CHANGED, DTYPE_CHANGED = "shape_changed", "dtype_changed"
_CHUNK_ELEMENTS = 1 << 22
_VALUE_CHARS = 60


def diff_checkpoints(
    root: PathLike, tag_a: str, tag_b: str, item: str | None = None
) -> dict[str, Any]:
    """What changed from checkpoint `tag_a` to `tag_b` of `root`, per item (or only
    `item`) and per leaf, as a JSON-serialisable dict.

    Keys: `root`, `tag_a`, `tag_b`, `items` and `summary` (how many leaves of each status,
    and how many items). Each item: `item`, `status` (`added`, `removed`, `identical`: the
    same committed bytes, not read; else `changed`) and `entries`, one per leaf (tensors by
    dotted path, as `flatten_tensors` names them, and other values): `path`, `kind`
    (`tensor` or `value`), `status` (`added`, `removed`, `shape_changed`,
    `dtype_changed`, `identical` or `changed`), `dtype_a`, `dtype_b`, `shape_a`,
    `shape_b`, `changed_elements`, `max_abs_diff` and `rel_l2_diff` (||b - a|| / ||a||,
    None when a is all zeros) for changed floating tensors (else None), and `value_a`,
    `value_b` for values: numbers, booleans, strings (their first 60 characters) and None
    as themselves, anything else (and NaN, infinities) as short text, its repr. NaN
    equals NaN here. Raises `RootNotFoundError`,
    `CheckpointNotFoundError`, `ItemNotFoundError` (`item` in neither) and
    `CorruptCheckpointError`.

    Example:
        >>> import nebulaml as nm, tempfile, torch
        >>> root = tempfile.mkdtemp()
        >>> nm.init(root, persistent_time_interval=0)
        >>> nm.Checkpoint("global_step1").save("model", {"w": torch.zeros(3), "b": torch.ones(1)})
        >>> nm.flush_persistence()  # on the root before step 2 supersedes it in RAM
        True
        >>> nm.Checkpoint("global_step2").save("model", {"w": torch.tensor([0., 0., 2.]),
        ...                                              "b": torch.ones(1)})
        >>> doc = nm.ops.diff_checkpoints(root, "global_step1", "global_step2")
        >>> [(e["path"], e["status"], e["max_abs_diff"]) for e in doc["items"][0]["entries"]]
        [('w', 'changed', 2.0), ('b', 'identical', None)]
    """
    validate_name("tag", tag_a)
    validate_name("tag", tag_b)
    if item is not None:
        validate_name("item", item)
    location = check_root(root)
    tiers = tiers_for(root, "diff_checkpoints")
    manifest_a = find_copy(tiers, tag_a, lambda copy: copy.manifest, root=location)
    manifest_b = find_copy(tiers, tag_b, lambda copy: copy.manifest, root=location)
    names_a = [entry.name for entry in manifest_a.items]
    names_b = [entry.name for entry in manifest_b.items]
    names = names_a + [name for name in names_b if name not in names_a]
    if item is not None:
        if item not in names:
            raise ItemNotFoundError(tag_a, item, names)  # in neither
        names = [item]
    items: list[dict[str, Any]] = []
    for name in names:
        a, b = manifest_a.item(name), manifest_b.item(name)
        if a is None or b is None:
            items.append({"item": name, "status": ADDED if a is None else REMOVED, "entries": []})
        elif (a.size_bytes, a.checksum_algo, a.checksum) == (b.size_bytes, b.checksum_algo,
                                                              b.checksum):  # fmt: skip
            items.append({"item": name, "status": IDENTICAL, "entries": []})
        else:
            obj_a = load_item(tiers, tag_a, name, map_location="cpu", weights_only=True)
            obj_b = load_item(tiers, tag_b, name, map_location="cpu", weights_only=True)
            entries = _diff_objects(obj_a, obj_b)
            del obj_a, obj_b
            same = all(e["status"] == IDENTICAL for e in entries)
            items.append({"item": name, "status": IDENTICAL if same else CHANGED,
                          "entries": entries})  # fmt: skip
    return {
        "root": location,
        "tag_a": tag_a,
        "tag_b": tag_b,
        "items": items,
        "summary": _summary(items),
    }


def _summary(items: list[dict[str, Any]]) -> dict[str, int]:
    counts = {status: 0 for status in (ADDED, REMOVED, SHAPE_CHANGED, DTYPE_CHANGED,
                                       CHANGED, IDENTICAL)}  # fmt: skip
    for each in items:
        for entry in each["entries"]:
            counts[entry["status"]] += 1
    counts["items"] = len(items)
    counts["items_changed"] = sum(1 for each in items if each["status"] != IDENTICAL)
    return counts


def _leaves(obj: Any) -> dict[str, Any]:
    """Every leaf of an item by dotted path (as `flatten_tensors` names them), in order:
    its tensors and its other values."""
    import torch

    leaves: dict[str, Any] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor) or not isinstance(value, (dict, list, tuple)):
            leaves.setdefault(path or ("tensor" if isinstance(value, torch.Tensor) else "(item)"),
                              value)  # fmt: skip
        elif isinstance(value, dict):
            for key, inner in value.items():
                walk(inner, f"{path}.{key}" if path else str(key))
        else:
            for index, inner in enumerate(value):
                walk(inner, f"{path}.{index}" if path else str(index))

    walk(obj, "")
    return leaves


def _diff_objects(obj_a: Any, obj_b: Any) -> list[dict[str, Any]]:
    import torch

    leaves_a, leaves_b = _leaves(obj_a), _leaves(obj_b)
    paths = list(leaves_a) + [path for path in leaves_b if path not in leaves_a]
    out = []
    for path in paths:
        a, b = leaves_a.get(path, _MISSING), leaves_b.get(path, _MISSING)
        tensor_a, tensor_b = isinstance(a, torch.Tensor), isinstance(b, torch.Tensor)
        entry: dict[str, Any] = {
            "path": path,
            "kind": "tensor" if tensor_a or tensor_b else "value",
            "status": IDENTICAL,
            "dtype_a": _dtype(a) if tensor_a else None,
            "dtype_b": _dtype(b) if tensor_b else None,
            "shape_a": list(a.shape) if tensor_a else None,
            "shape_b": list(b.shape) if tensor_b else None,
            "changed_elements": None,
            "max_abs_diff": None,
            "rel_l2_diff": None,
            "value_a": None if tensor_a or a is _MISSING else _json_value(a),
            "value_b": None if tensor_b or b is _MISSING else _json_value(b),
        }
        if a is _MISSING or b is _MISSING:
            entry["status"] = ADDED if a is _MISSING else REMOVED
        elif tensor_a and tensor_b:
            entry.update(_compare_tensors(a, b))
        elif tensor_a != tensor_b:
            entry["status"] = DTYPE_CHANGED  # a tensor on one side, a value on the other
        elif not _same_value(a, b):
            entry["status"] = CHANGED
        out.append(entry)
    return out


class _Missing:
    pass


_MISSING = _Missing()


def _dtype(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _short(text: str) -> str:
    return text if len(text) <= _VALUE_CHARS else text[: _VALUE_CHARS - 3] + "..."


def _json_value(value: Any) -> Any:
    """A leaf value as JSON holds it: a number, a boolean, a string or None as itself
    (a long string shortened), anything else (and a float JSON has no number for) as the
    short text of its repr.

    Example:
        >>> [_json_value(v) for v in (0.05, 3, True, None, "adam", float("nan"), {1})]
        [0.05, 3, True, None, 'adam', 'nan', '{1}']
    """
    if value is None or type(value) in (bool, int):
        return value
    if type(value) is float:
        return value if math.isfinite(value) else repr(value)
    if type(value) is str:
        return _short(value)
    return _short(repr(value))


def _same_value(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value whose == does not answer: compare its text
        return repr(a) == repr(b)


def _compare_tensors(a: Any, b: Any) -> dict[str, Any]:
    """Status, changed elements and (floating) differences of two tensors, chunk by chunk."""
    import torch

    if a.dtype != b.dtype:
        return {"status": DTYPE_CHANGED}
    if a.shape != b.shape:
        return {"status": SHAPE_CHANGED}
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    floating = a.is_floating_point() or a.is_complex()
    wide = torch.complex128 if a.is_complex() else torch.float64
    changed = 0
    max_abs, diff_sq, ref_sq = 0.0, 0.0, 0.0
    for start in range(0, flat_a.numel(), _CHUNK_ELEMENTS):
        chunk_a = flat_a[start : start + _CHUNK_ELEMENTS]
        chunk_b = flat_b[start : start + _CHUNK_ELEMENTS]
        if not floating:
            changed += int((chunk_a != chunk_b).sum())
            continue
        wide_a, wide_b = chunk_a.to(wide), chunk_b.to(wide)
        same = (wide_a == wide_b) | (wide_a.isnan() & wide_b.isnan())
        changed += int((~same).sum())
        delta = torch.where(same, torch.zeros_like(wide_a), wide_a - wide_b).abs()
        delta = torch.nan_to_num(delta, nan=math.inf, posinf=math.inf)
        if delta.numel():
            max_abs = max(max_abs, float(delta.max()))
        diff_sq += float((delta.double() ** 2).sum())
        ref_sq += float((torch.nan_to_num(wide_a.abs(), nan=0.0).double() ** 2).sum())
    if changed == 0:
        return {"status": IDENTICAL, "changed_elements": 0}
    out: dict[str, Any] = {"status": CHANGED, "changed_elements": changed}
    if floating:
        out["max_abs_diff"] = max_abs if math.isfinite(max_abs) else None
        rel = math.sqrt(diff_sq) / math.sqrt(ref_sq) if ref_sq > 0 else None
        out["rel_l2_diff"] = rel if rel is not None and math.isfinite(rel) else None
    return out
