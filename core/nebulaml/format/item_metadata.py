"""What an item file holds, as rows: its `data.pkl` described without running it or
reading tensor data.

`describe_pickle` takes the records of the inert unpickler (inert_unpickler.py: nothing
in the pickle is imported or called) and walks them depth first, in stored order, into
one row per leaf: a tensor's type, dtype, shape, element count, bytes and device; a
value's type and a short repr; an object nebula refused to load, by its name. The walk is
bounded (`MAX_ENTRIES`, `MAX_DEPTH`) and reports cycles instead of following them.

May import: `nebulaml.errors` and `nebulaml.format.inert_unpickler`. Not for: reading
`data.pkl` out of the zip (torchzip.py), the unpickler itself (inert_unpickler.py),
finding the item (ops/inspection.py) or loading it (serialization.py).
"""

from __future__ import annotations

from typing import Any

from nebulaml.errors import CorruptCheckpointError
from nebulaml.format.inert_unpickler import (
    DTYPE_ITEMSIZE,
    _Refused,
    _Storage,
    _StorageType,
    _Tensor,
    _TensorType,
    _Value,
    unpickle_inert,
)

#: The most entries one item is described with (a pickle can share a container so that
#: a naive walk of it would never end).
MAX_ENTRIES = 1_000_000
#: The deepest nesting walked (paths are spelled out in full, so depth costs its square).
MAX_DEPTH = 1000
_VALUE_REPR_CHARS = 80


def describe_pickle(data: bytes, where: str) -> list[dict[str, Any]]:
    """The leaves of a torch `data.pkl`, as `describe_item` reports them (`where` names
    the file in errors). Nothing in the pickle is imported or called.

    Example:
        >>> import pickle
        >>> [e["value"] for e in describe_pickle(pickle.dumps({"a": [1, "x"]}, 2), "f")]
        ['1', "'x'"]
    """
    return _flatten(unpickle_inert(data, where), where)


def _leaf(path: str, kind: str, type_name: str, value: str | None) -> dict[str, Any]:
    return {
        "path": path,
        "kind": kind,
        "type": type_name,
        "dtype": None,
        "shape": None,
        "numel": None,
        "size_bytes": None,
        "device": None,
        "value": value,
    }


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int past Python's digit limit; deep nesting
        return f"<{type(value).__name__} too large to show>"
    if len(text) > _VALUE_REPR_CHARS:
        text = text[: _VALUE_REPR_CHARS - 3] + "..."
    return text


def _describe_leaf(path: str, obj: Any) -> dict[str, Any]:
    if isinstance(obj, _Tensor):
        itemsize = DTYPE_ITEMSIZE.get(obj.dtype)
        out = _leaf(path, "tensor", obj.type, None)
        out.update(
            dtype=obj.dtype,
            shape=list(obj.shape),
            numel=obj.numel,
            size_bytes=None if itemsize is None else obj.numel * itemsize,
            device=obj.device,
        )
        return out
    if isinstance(obj, _Value):
        return _leaf(path, "value", obj.type, obj.text)
    if isinstance(obj, _Refused) or (isinstance(obj, type) and issubclass(obj, _Refused)):
        return _leaf(path, "object", obj._global, f"<object {obj._global} (not loaded)>")
    if isinstance(obj, (_Storage, _StorageType, _TensorType)) or callable(obj):
        name = getattr(obj, "name", None) or getattr(obj, "__name__", type(obj).__name__)
        return _leaf(path, "object", str(name), f"<object {name} (not loaded)>")
    return _leaf(path, "value", type(obj).__name__, _short(obj))


def _flatten(obj: Any, where: str) -> list[dict[str, Any]]:
    """Depth first, in stored order, with an explicit stack (deep nesting cannot overflow
    it); a container met again inside itself is reported as a cycle, not walked, and one
    nested deeper than `MAX_DEPTH` is reported, not walked."""
    out: list[dict[str, Any]] = []
    on_path: set[int] = set()
    stack: list[tuple[str, Any, int] | int] = [("", obj, 0)]  # an int: leave that container
    while stack:
        top = stack.pop()
        if isinstance(top, int):
            on_path.discard(top)
            continue
        path, cur, depth = top
        if len(out) >= MAX_ENTRIES:
            raise CorruptCheckpointError(
                where, f"at most {MAX_ENTRIES} entries", "more (a pickle that shares itself?)"
            )
        children: list[tuple[Any, Any]] | None = None
        if isinstance(cur, dict) and cur:
            children = list(cur.items())
        elif isinstance(cur, (list, tuple)) and cur:
            children = list(enumerate(cur))
        if children is None:
            out.append(_describe_leaf(path, cur))
            continue
        if id(cur) in on_path or depth >= MAX_DEPTH:
            why = "<cycle>" if id(cur) in on_path else f"<nested deeper than {MAX_DEPTH}>"
            out.append(_leaf(path, "value", type(cur).__name__, why))
            continue
        on_path.add(id(cur))
        stack.append(id(cur))
        for key, value in reversed(children):
            key_text = key if isinstance(key, str) else _short(key)
            stack.append((f"{path}.{key_text}" if path else key_text, value, depth + 1))
    return out
