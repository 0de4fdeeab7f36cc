"""A torch `data.pkl` unpickled into inert records: nothing imported, nothing called.

An item's pickle names torch's rebuild functions, storage types and dtypes. The restricted
unpickler here resolves every global it meets to data or to a builder of this module that
only records metadata (`_Tensor`, `_Value`, `_Storage`...); any other global becomes an
inert placeholder (`_Refused`) that is reported, never called. Storages are described
from their persistent ids (dtype, element count), so no tensor byte is needed.
`unpickle_inert` is the entry point; item_metadata.py turns its result into rows.

The record types keep their private names: they show in messages ("a pickle may not
rebuild _Value") and in what `nebula inspect` prints for a bare storage.

May import: `nebulaml.errors`. Not for: finding `data.pkl` in the archive (torchzip.py),
the rows `describe_item` reports (item_metadata.py), or loading an item for real
(serialization.py).
"""

from __future__ import annotations

import _compat_pickle
import collections
import io
import pickle
from dataclasses import dataclass
from typing import Any

from nebulaml.errors import CorruptCheckpointError

# Bytes per element of every dtype torch names in a pickle (checked against torch by a test).
DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "qint8": 1,
    "quint8": 1,
    "qint32": 4,
    "quint4x2": 1,
    "quint2x4": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "bits8": 1,
    "bits16": 2,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
    **{f"uint{n}": 1 for n in range(1, 8)},
    **{f"int{n}": 1 for n in range(1, 8)},
}

# torch's legacy typed storage classes, as pickles name them, and their dtypes.
STORAGE_DTYPES: dict[str, str] = {
    "ByteStorage": "uint8",
    "CharStorage": "int8",
    "ShortStorage": "int16",
    "IntStorage": "int32",
    "LongStorage": "int64",
    "HalfStorage": "float16",
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
    "BoolStorage": "bool",
    "BFloat16Storage": "bfloat16",
    "QUInt8Storage": "quint8",
    "QInt8Storage": "qint8",
    "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
}

_TORCH_VALUES = {
    "per_tensor_affine": "qscheme",
    "per_tensor_symmetric": "qscheme",
    "per_channel_affine": "qscheme",
    "per_channel_symmetric": "qscheme",
    "per_channel_affine_float_qparams": "qscheme",
    "contiguous_format": "memory_format",
    "channels_last": "memory_format",
    "channels_last_3d": "memory_format",
    "preserve_format": "memory_format",
}


# The restricted unpickler -----------------------------------------------------------------
def _no_build(self: Any, state: Any) -> None:
    # BUILD on one of our records would rewrite it (slotted frozen dataclasses would
    # otherwise get dataclasses' own __setstate__): a pickle torch wrote never does that.
    raise pickle.UnpicklingError(f"a pickle may not rebuild {type(self).__name__}")


@dataclass(frozen=True, slots=True)
class _Value:
    """A torch value that is not a tensor (a dtype, device, layout...): its kind and text."""

    __setstate__ = _no_build

    type: str
    text: str

    def __call__(self, *args: Any) -> Any:
        raise pickle.UnpicklingError(f"{self.type} {self.text} is not callable")


@dataclass(frozen=True, slots=True)
class _StorageType:
    """A storage class named in a pickle (`torch.FloatStorage`): what dtype it holds."""

    __setstate__ = _no_build

    name: str
    dtype: str  # "uint8" for UntypedStorage, whose tensors name their own dtype

    def __call__(self, *args: Any) -> Any:
        raise pickle.UnpicklingError(f"storage type {self.name} is not callable")


@dataclass(frozen=True, slots=True)
class _Storage:
    """A storage, described by its persistent id; its bytes stay in the archive."""

    __setstate__ = _no_build

    key: str
    dtype: str
    numel: int
    location: str


@dataclass(frozen=True, slots=True)
class _TensorType:
    """`torch.Tensor` or `torch.nn.Parameter`, named as the type of a rebuilt tensor."""

    __setstate__ = _no_build

    name: str

    def __call__(self, *args: Any) -> Any:
        raise pickle.UnpicklingError(f"{self.name} cannot be built from a pickle here")


@dataclass(frozen=True, slots=True)
class _Tensor:
    """What a tensor in the pickle is, without its data."""

    __setstate__ = _no_build

    type: str
    dtype: str
    shape: tuple[int, ...]
    device: str
    storage_key: str | None

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n


class _Refused:
    """A global outside the allowlist: never imported, never called. Calling the class,
    or building it, only records that the pickle asked for it."""

    _global = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> _Refused:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def __repr__(self) -> str:
        return f"<object {self._global} (not loaded)>"


def _refused(name: str) -> type[_Refused]:
    return type("Refused", (_Refused,), {"_global": name, "__slots__": ()})


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value
    ):
        raise pickle.UnpicklingError(f"a tensor's {what} is not a tuple of sizes")
    return tuple(value)


def _tensor(storage: Any, size: Any, dtype: str | None = None) -> _Tensor:
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("a tensor without a storage")
    return _Tensor("Tensor", dtype or storage.dtype, _ints(size, "size"), storage.location,
                   storage.key)  # fmt: skip


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> _Tensor:
    return _tensor(storage, size)


def _rebuild_tensor_v3(
    storage: Any, offset: Any, size: Any, stride: Any, grad: Any, hooks: Any, dtype: Any, *rest: Any
) -> _Tensor:
    if not isinstance(dtype, _Value) or dtype.type != "dtype":
        raise pickle.UnpicklingError("a tensor without a dtype")
    return _tensor(storage, size, dtype.text.removeprefix("torch."))


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any) -> _Tensor:
    return _tensor(storage, size)


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    if isinstance(data, _Tensor):
        return _Tensor("Parameter", data.dtype, data.shape, data.device, data.storage_key)
    return data


def _rebuild_meta_tensor_no_storage(dtype: Any, size: Any, *rest: Any) -> _Tensor:
    if not isinstance(dtype, _Value) or dtype.type != "dtype":
        raise pickle.UnpicklingError("a meta tensor without a dtype")
    return _Tensor("Tensor", dtype.text.removeprefix("torch."), _ints(size, "size"), "meta", None)


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    # A tensor subclass, or a tensor with attributes. `func` came from find_class, so it is
    # one of this module's builders or an inert placeholder: calling it runs nothing foreign.
    if not isinstance(args, tuple):
        raise pickle.UnpicklingError("_rebuild_from_type_v2 without an argument tuple")
    result = func(*args)
    if isinstance(result, _Tensor):
        if isinstance(new_type, _TensorType):
            kind = new_type.name
        elif isinstance(new_type, type) and issubclass(new_type, _Refused):
            kind = new_type._global
        else:
            raise pickle.UnpicklingError("_rebuild_from_type_v2 with an unexpected type")
        if kind != "Tensor":
            return _Tensor(kind, result.dtype, result.shape, result.device, result.storage_key)
    return result


def _rebuild_qtensor(storage: Any, offset: Any, size: Any, *rest: Any) -> _Tensor:
    return _tensor(storage, size)  # the storage type names the quantized dtype


def _size(values: Any = ()) -> _Value:
    return _Value("Size", f"torch.Size({list(_ints(list(values), 'torch.Size'))})")


def _device(kind: Any, index: Any = None) -> _Value:
    text = str(kind) if index is None else f"{kind}:{index}"
    return _Value("device", text)


def _get_layout(name: Any) -> _Value:
    return _Value("layout", str(name))


def _encode(text: Any, encoding: Any = "utf-8") -> bytes:
    # How protocol-2 pickles store bytes: ("xy", "latin1"). No other codec is looked up.
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise pickle.UnpicklingError("_codecs.encode with an unexpected codec")
    return text.encode(encoding)


def _bytearray(value: Any = b"") -> bytearray:
    if not isinstance(value, (bytes, list)):  # bytearray(n) would allocate n bytes
        raise pickle.UnpicklingError("bytearray from an unexpected value")
    return bytearray(value)


_SAFE_GLOBALS: dict[str, Any] = {
    "collections.OrderedDict": collections.OrderedDict,
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "builtins.complex": complex,
    "builtins.bytearray": _bytearray,
    "_codecs.encode": _encode,
    "torch.Size": _size,
    "torch.device": _device,
    "torch.serialization._get_layout": _get_layout,
    "torch.Tensor": _TensorType("Tensor"),
    "torch.nn.parameter.Parameter": _TensorType("Parameter"),
    "torch._utils._rebuild_tensor": _rebuild_tensor,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
    "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
    "torch._utils._rebuild_meta_tensor_no_storage": _rebuild_meta_tensor_no_storage,
    "torch._utils._rebuild_qtensor": _rebuild_qtensor,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    "torch.storage.UntypedStorage": _StorageType("UntypedStorage", "uint8"),
    "torch.storage.TypedStorage": _StorageType("TypedStorage", "uint8"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds a picture of a pickle: every global resolves to data or a builder of this
    module, never to an imported object, and a storage to its description."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))

    def find_class(self, module: str, name: str) -> Any:
        # Python 2 names (torch's pickles are protocol 2: "__builtin__ set"), mapped by hand:
        # the mapping that pickle does itself lives in the find_class we replace.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        full = f"{module}.{name}"
        if full in _SAFE_GLOBALS:
            return _SAFE_GLOBALS[full]
        if module == "torch":
            if name in DTYPE_ITEMSIZE:
                return _Value("dtype", full)
            if name in STORAGE_DTYPES:
                return _StorageType(name, STORAGE_DTYPES[name])
            if name in _TORCH_VALUES:
                return _Value(_TORCH_VALUES[name], full)
        return _refused(full)

    def persistent_load(self, pid: Any) -> _Storage:
        # torch.save's persistent id: ("storage", storage type, key, location, numel).
        if (
            not isinstance(pid, tuple)
            or len(pid) != 5
            or pid[0] != "storage"
            or not isinstance(pid[1], _StorageType)
            or not isinstance(pid[4], int)
        ):
            raise pickle.UnpicklingError(f"unexpected persistent id {str(pid)[:80]}")
        return _Storage(key=str(pid[2]), dtype=pid[1].dtype, numel=pid[4], location=str(pid[3]))


def unpickle_inert(data: bytes, where: str) -> Any:
    """`data` (a torch `data.pkl`) as plain containers and this module's records; any
    pickle that does not fit raises `CorruptCheckpointError` naming `where`. Nothing in the
    pickle is imported or called.

    Example:
        >>> import pickle
        >>> unpickle_inert(pickle.dumps({"a": [1, "x"]}, 2), "f")
        {'a': [1, 'x']}
    """
    try:
        return _MetadataUnpickler(data).load()
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        AttributeError,
        OverflowError,
        RecursionError,
        MemoryError,
    ) as exc:
        raise CorruptCheckpointError(
            where, "a complete torch pickle", f"{type(exc).__name__}: {exc}"[:200]
        ) from None
