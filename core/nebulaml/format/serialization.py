"""Items as files that plain `torch.load(path, weights_only=True)` reads.

Writing: objects with a `state_dict()` (modules, optimizers, schedulers) are saved as
their state dict, so that every item stays loadable without executing code. Reading: the
bytes are verified before they are unpickled, and unpickling runs with weights_only=True
unless the caller explicitly trusts the file.

May import: `nebulaml.errors`, `nebulaml.format.allowlist` and `nebulaml.format.torchzip`
(torch's zip layout: writing with its CRC off, finding the storages' records). Not for:
the zip layout itself (torchzip.py), where the bytes go (storage/) or which tier they come
from (checkpoint.py).
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any, BinaryIO

from nebulaml.errors import InvalidArgumentError, UnsafeCheckpointError
from nebulaml.format.allowlist import active_classes, allowed
from nebulaml.format.torchzip import data_records, zip_crc_off

MapLocation = Any  # None | str | torch.device | dict | Callable, as torch.load takes


def to_saveable(obj: Any) -> Any:
    """What nebula writes for `obj`: modules, optimizers and other objects with a
    `state_dict()` become their state dict (also inside dicts, lists and tuples), so that
    the item loads with weights_only=True; everything else is written as it is. A
    container met twice becomes one container, met twice (as torch.save keeps it).

    Example:
        >>> import torch
        >>> sorted(to_saveable({"model": torch.nn.Linear(2, 2)})["model"])
        ['bias', 'weight']
    """
    import torch

    memo: dict[int, Any] = {}
    sharded = sharded_tensor_types()
    top = obj

    def convert(obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, type(None))):
            if sharded and isinstance(obj, sharded):
                raise _sharded_tensor_error(top, obj, sharded)
            return obj
        if id(obj) in memo:
            return memo[id(obj)]
        new: Any
        if type(obj) is dict:
            new = memo[id(obj)] = {}
            new.update((key, convert(value)) for key, value in obj.items())
        elif type(obj) is list:
            new = memo[id(obj)] = []
            new.extend(convert(value) for value in obj)
        elif type(obj) is tuple:
            new = memo[id(obj)] = tuple(convert(value) for value in obj)
        else:
            state_dict: Any = getattr(obj, "state_dict", None)
            is_stateful = callable(state_dict) and not isinstance(obj, (type, dict))
            new = memo[id(obj)] = state_dict() if is_stateful else obj
            if is_stateful and sharded:  # a state dict is written as it is: look inside
                found = _first_sharded(new, sharded)
                if found is not None:
                    raise _sharded_tensor_error(top, found, sharded)
        return new

    return convert(obj)


# Tensors sharded over ranks, by the module that defines each class. None exists unless its
# module is imported, so nothing is imported to look for them.
SHARDED_TENSOR_CLASSES = (
    ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed._shard.sharded_tensor.api", "ShardedTensorBase"),
)


def sharded_tensor_types() -> tuple[type, ...]:
    """The classes of tensors sharded over ranks (DTensor, ShardedTensor) that can exist
    in this process: those whose module is imported.

    Example:
        >>> import torch.distributed.tensor
        >>> [cls.__name__ for cls in sharded_tensor_types()][0]
        'DTensor'
    """
    found = []
    for module_name, class_name in SHARDED_TENSOR_CLASSES:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def _sharded_tensor_error(top: Any, tensor: Any, sharded: tuple[type, ...]) -> Exception:
    """Checkpoint.save met a sharded tensor: an item holds one rank's plain tensors, and
    torch.save of this rank's shard alone could never load on another number of ranks."""
    path = _sharded_path(top, sharded)
    return InvalidArgumentError(
        f"{path!r} is a {type(tensor).__name__}, a tensor sharded over ranks (FSDP2's "
        f"fully_shard, tensor parallelism), which Checkpoint.save does not write: each rank "
        f"holds only its shard. Save sharded state through nebula with PyTorch's "
        f"distributed checkpoint, which loads on any number of ranks: "
        f"dcp.save(state, storage_writer=nebulaml.dcp.Writer(tag)) on every rank, and "
        f"dcp.load(state, storage_reader=nebulaml.dcp.Reader(tag)); or save full tensors "
        f"(get_state_dict(..., options=StateDictOptions(full_state_dict=True)))"
    )


def _first_sharded(obj: Any, sharded: tuple[type, ...]) -> Any:
    """A sharded tensor inside `obj` (through dicts, lists and tuples), or None."""
    stack = [obj]
    while stack:
        cur = stack.pop()
        if isinstance(cur, sharded):
            return cur
        if isinstance(cur, dict):
            stack.extend(cur.values())
        elif isinstance(cur, (list, tuple)):
            stack.extend(cur)
    return None


def _sharded_path(top: Any, sharded: tuple[type, ...]) -> str:
    """Where in `top` a sharded tensor is ("model.0.weight"); walked again as to_saveable
    walks it, only when it has met one."""
    stack: list[tuple[Any, str]] = [(top, "")]
    seen: set[int] = set()
    while stack:
        cur, path = stack.pop()
        if isinstance(cur, sharded):
            return path or "the object"
        if id(cur) in seen or isinstance(cur, (str, bytes)):
            continue
        seen.add(id(cur))
        children: Any = ()
        if isinstance(cur, dict):
            children = cur.items()
        elif isinstance(cur, (list, tuple)):
            children = enumerate(cur)
        elif callable(getattr(cur, "state_dict", None)) and not isinstance(cur, type):
            children = cur.state_dict().items()
        prefix = f"{path}." if path else ""
        stack.extend(reversed([(value, f"{prefix}{key}") for key, value in children]))
    return "the object"


def tensor_bytes_of(obj: Any) -> int:
    """Bytes of tensor storage reachable from `obj` through dicts, lists and tuples,
    each storage counted once."""
    import torch

    seen: set[tuple[str, int]] = set()
    total = 0
    stack = [obj]
    while stack:
        cur = stack.pop()
        if isinstance(cur, torch.Tensor) and cur.layout == torch.sparse_coo:
            stack.extend((cur._indices(), cur._values()))
        elif isinstance(cur, torch.Tensor) and cur.layout != torch.strided:
            total += cur.element_size() * cur.nelement()  # other layouts: about that
        elif isinstance(cur, torch.Tensor):
            storage = cur.untyped_storage()
            key = (str(storage.device), storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(cur, dict):
            stack.extend(cur.values())
        elif isinstance(cur, (list, tuple)):
            stack.extend(cur)
    return total


def estimate_bytes(obj: Any) -> int:
    """About what `write_item` writes for `obj`: its tensor bytes and a margin for the
    rest (the memory budget reserves this much before an object of no fixed layout)."""
    return tensor_bytes_of(to_saveable(obj)) + (1 << 20)


def write_item(obj: Any, out: BinaryIO) -> int:
    """Serialise `obj` into `out` in torch's zip format; returns its tensor bytes."""
    import torch

    saveable = to_saveable(obj)
    try:
        with zip_crc_off():
            torch.save(saveable, out)
    except RuntimeError as exc:
        # A failed write (a full disk) makes torch's zip writer raise its own RuntimeError
        # as it closes ("unexpected pos"): the write's OSError is what happened.
        if isinstance(exc.__context__, OSError):
            raise exc.__context__ from None
        raise
    return tensor_bytes_of(saveable)


def read_item(
    data: bytes | memoryview,
    where: str,
    *,
    map_location: MapLocation = None,
    weights_only: bool | None = True,
) -> Any:
    """Unpickle verified item bytes. Under weights_only=True a pickle that needs code
    execution raises `UnsafeCheckpointError`; nothing falls back silently.

    `weights_only=None` (what Lightning passes when its caller did not choose) means True:
    passed on as None, torch would let `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD` turn it off.
    While DeepSpeed's Nebula engine is loaded, DeepSpeed's few plain-data classes are
    allowed too (allowlist.py says which, and why that is still weights-only).
    """
    import torch

    if weights_only is None:
        weights_only = True
    if not isinstance(weights_only, bool):
        raise InvalidArgumentError(f"weights_only must be True or False, not {weights_only!r}")
    stream = io.BytesIO(data)
    try:
        if not weights_only:
            return torch.load(stream, map_location=map_location, weights_only=False)
        with allowed(active_classes()):
            return torch.load(stream, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if weights_only and "Weights only load failed" in str(exc):
            raise UnsafeCheckpointError(where, _unsafe_detail(str(exc))) from None
        raise


def read_item_local(
    path: str,
    buffer: Any,
    view: memoryview,
    where: str,
    *,
    map_location: MapLocation = None,
) -> Any:
    """Unpickle a verified item file, already in `buffer` (read whole, or mapped: see
    `Store.read_local`), with weights_only=True, without copying its tensor bytes again:
    `torch.load(mmap=True)` gives the structure (mapping the file, reading none of its
    data), and each storage is then rebound to its own slice of `buffer`, which the
    loaded tensors keep alive. Anything but plain containers of CPU tensors is unpickled
    from `view` the usual way.
    """
    import torch

    if map_location is None or str(map_location) == "cpu":
        try:
            with allowed(active_classes()):
                obj = torch.load(path, weights_only=True, mmap=True)
        except pickle.UnpicklingError as exc:
            if "Weights only load failed" in str(exc):
                raise UnsafeCheckpointError(where, _unsafe_detail(str(exc))) from None
            raise
        if _rebind_storages(obj, buffer, view):
            return obj
        del obj
    return read_item(view, where, map_location=map_location, weights_only=True)


def _rebind_storages(obj: Any, buffer: Any, view: memoryview) -> bool:
    """Point every tensor of `obj` (loaded with mmap=True from the file `view` holds) at
    the same bytes in `buffer`; False if `obj` holds objects whose tensors this walk
    cannot reach, or storages it cannot place."""
    import torch

    tensors: list[Any] = []
    stack = [obj]
    while stack:
        cur = stack.pop()
        if isinstance(cur, torch.Tensor):
            if cur.__dict__ or type(cur) not in (torch.Tensor, torch.nn.Parameter):
                return False
            if cur.layout != torch.strided or cur.device.type != "cpu":
                return False
            tensors.append(cur)
        elif isinstance(cur, dict):
            stack.extend(cur.values())
        elif type(cur) in (list, tuple):
            stack.extend(cur)
        elif not isinstance(
            cur, (str, bytes, int, float, complex, bool, type(None), torch.Size, torch.dtype)
        ):
            return False
    storages = {t.untyped_storage()._cdata: t.untyped_storage() for t in tensors}
    placed = [s for s in storages.values() if s.nbytes() > 0]
    if not placed:
        return True
    records = sorted(data_records([(0, view)], len(view)).values())
    if len(records) < len(placed):
        return False
    # The file is mapped whole: a storage's address is the mapping's base plus its
    # record's offset, so the lowest address belongs to the lowest record.
    base = min(s.data_ptr() for s in placed) - records[0][0]
    offsets = {offset for offset, _ in records}
    rebound: dict[int, Any] = {}
    for key, storage in storages.items():
        n, offset = storage.nbytes(), storage.data_ptr() - base
        if n == 0:
            continue
        if offset not in offsets or offset + n > len(view):
            return False
        rebound[key] = torch.frombuffer(
            buffer, dtype=torch.uint8, count=n, offset=offset
        ).untyped_storage()
    with torch.no_grad():
        for tensor in tensors:
            new = rebound.get(tensor.untyped_storage()._cdata)
            if new is not None:
                tensor.set_(new, tensor.storage_offset(), tensor.size(), tensor.stride())
    return True


def _unsafe_detail(message: str) -> str:
    # torch's message is long; keep the line that names the offending global.
    for line in message.splitlines():
        line = line.strip()
        if line.startswith(("WeightsUnpickler error:", "Unsupported global", "Unsupported")):
            return line[:300]
    return "its pickle references objects outside torch's weights-only allowlist"
