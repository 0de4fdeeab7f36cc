"""The fast snapshot: an item laid out once, then refilled by plain copies.

A snapshot is the only part of a checkpoint the training loop waits for, and writing it
with `torch.save` costs more in zip CRCs and first-touch page faults than in copying
(DESIGN.md §8). So an item is written as torch's zip in two parts:

- the *layout*: `torch.save` under `torch.serialization.skip_data` into a recorder that
  keeps only the bytes torch writes (the pickle, the zip headers and directory, a few
  kilobytes) and where each tensor storage's bytes go;
- the *fill*: each storage copied, as bytes, to its place in a buffer reused from one save
  to the next (slots.py), hashed (xxh3) on the way.

The layout of an item name is kept (`LayoutCache`) and used again while the object has the
same structure: the same containers, plain values, aliasing and tensor metadata; only the
tensors' bytes may differ. Laying out a GPT-2 optimizer state takes about 30 ms, as long
as copying 0.4 GB.

A fill copies with `memmove` (glibc's streaming stores use a third less CPU than torch's
`copy_`), one 1 MiB piece of the file at a time: the piece's parts of each storage, then
the piece's checksum leaf (checksum.py) while the piece is in the cache. Two workers take
pieces in turn. 1.5 GB on 2 cores: 0.12 s and 0.23 CPU-seconds, against 0.145 s when one
worker hashed every piece in order (plain xxh3) and 0.15-0.18 s for `copy_` and a hash
after it. A lazy save fills with the same two workers.

The file is byte for byte what `torch.load(path, weights_only=True)` reads. Objects the
layout cannot map exactly (anything but dicts, lists, tuples, plain values and dense
tensors) return None from `plan_layout`, and the caller writes them with `torch.save`.

Not for: where the buffers live or how they are reused (slots.py), or the commit protocol
(commit.py).
"""

from __future__ import annotations

import bisect
import ctypes
import io
import threading
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from nebulaml.format.checksum import LEAF_BYTES, checksum_of, leaf_digest, tree_hexdigest
from nebulaml.format.serialization import _zip_crc_off, to_saveable

_PLAIN = (str, bytes, int, float, bool, complex, type(None))
# A fill's unit of work is one checksum leaf: small enough that a piece just copied is
# still in the cache when it is hashed, large enough that the Python around each call
# costs nothing.
_PIECE_BYTES = LEAF_BYTES
FILL_WORKERS = 2  # threads per fill (a save waits for its copy; a lazy save's fence too)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where every byte of one item's file goes.

    `segments` are the bytes torch wrote itself (offset, bytes); `regions[i]` is the
    (offset, size_bytes) of `storages[i]`; `gaps` are the ranges neither covers (zip
    padding), zeroed on every fill so that a reused buffer carries nothing over.
    """

    size_bytes: int
    segments: tuple[tuple[int, bytes], ...]
    regions: tuple[tuple[int, int], ...]
    gaps: tuple[tuple[int, int], ...]
    storages: tuple[Any, ...]  # torch.UntypedStorage, in torch's key order

    @property
    def tensor_bytes(self) -> int:
        return sum(size for _, size in self.regions)


class _Recorder(io.RawIOBase):
    """A seekable sink that keeps what is written and where; skipped ranges cost nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.segments: list[tuple[int, bytes]] = []
        self.pos = 0
        self.end = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self.segments.append((self.pos, chunk))
        self.pos += len(chunk)
        self.end = max(self.end, self.pos)
        return len(chunk)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.end}[whence]
        self.pos = base + offset
        self.end = max(self.end, self.pos)
        return self.pos

    def tell(self) -> int:
        return self.pos


class _SparseReader(io.RawIOBase):
    """Reads the recorded segments back as one file, with zeros where nothing was written:
    enough for `zipfile` to read the archive's directory and local headers."""

    def __init__(self, segments: list[tuple[int, bytes]], size: int) -> None:
        super().__init__()
        self._segments = sorted(segments, key=lambda seg: seg[0])
        self._starts = [offset for offset, _ in self._segments]
        self._size, self._pos = size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        start = self._pos
        n = max(0, min(len(view), self._size - start))
        view[:n] = bytes(n)
        # Segments never overlap (torch writes forward only), so the one before `start`
        # and those after it up to the end of the read are all that can intersect.
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        while i < len(self._segments) and self._segments[i][0] < start + n:
            offset, data = self._segments[i]
            lo, hi = max(offset, start), min(offset + len(data), start + n)
            if lo < hi:
                view[lo - start : hi - start] = data[lo - offset : hi - offset]
            i += 1
        self._pos += n
        return n


def _storages_in_pickle_order(obj: Any) -> list[Any] | None:
    """The distinct tensor storages of `obj` in the order torch's pickler meets them, or
    None if `obj` holds anything whose pickling order this walk cannot mirror."""
    walked = _walk(obj)
    return None if walked is None else walked[0]


def _walk(obj: Any) -> tuple[list[Any], tuple[Any, ...] | None] | None:
    """(the distinct storages in pickling order, the signature of everything else that
    goes into the pickle), or None if the layout cannot map `obj`. The signature is None
    when `obj` holds something it cannot describe (the layout is then never reused).

    Two objects with equal signatures pickle to the same bytes, given the same storage
    sizes: the signature holds every container's type and length, every plain value
    (floats by their bits), every tensor's metadata, and which objects are the same
    object (the pickler writes a second meeting as a reference).
    """
    import torch

    found: dict[int, Any] = {}
    storage_index: dict[int, int] = {}
    seen: dict[int, int] = {}
    sig: list[Any] = []
    describable = True

    def walk(value: Any) -> bool:
        nonlocal describable
        if value is None or value is True or value is False:
            sig.append(value)
            return True
        first = seen.get(id(value))
        if first is not None:
            sig.append(("again", first))  # the same object as an earlier one
            return True
        seen[id(value)] = len(seen)
        kind = type(value)
        if isinstance(value, _PLAIN):
            sig.append((kind, value.hex() if kind is float else value))
            if kind not in _PLAIN:
                describable = False  # a subclass may pickle in its own way
            return True
        if kind in (torch.Tensor, torch.nn.Parameter):
            if value.layout != torch.strided or value.is_quantized or value.__dict__:
                return False
            if value.device.type not in ("cpu", "cuda"):
                return False
            storage = value.untyped_storage()
            key = storage_index.setdefault(storage._cdata, len(storage_index))
            found.setdefault(storage._cdata, storage)
            sig.append(
                (
                    kind,
                    key,
                    storage.nbytes(),
                    str(value.device),
                    value.dtype,
                    tuple(value.shape),
                    value.stride(),
                    value.storage_offset(),
                    value.requires_grad,
                    value.is_conj(),
                    value.is_neg(),
                )
            )
            if kind is torch.nn.Parameter or value._backward_hooks:
                describable = False
            return True
        if isinstance(value, dict) and kind.__module__ in ("builtins", "collections"):
            if kind not in (dict, OrderedDict):
                describable = False  # defaultdict's factory, a Counter's class, ...
            sig.append((kind, len(value)))
            return all(walk(k) and walk(v) for k, v in value.items())
        if kind in (list, tuple):
            sig.append((kind, len(value)))
            return all(walk(v) for v in value)
        if isinstance(value, (torch.dtype, torch.Size, torch.device)):
            sig.append((kind, value))
            return True
        return False

    if not walk(obj):
        return None
    return list(found.values()), (tuple(sig) if describable else None)


def plan_layout(obj: Any) -> Layout | None:
    """Lay out the item file for `obj`; None if it must be written with plain torch.save.

    Example:
        >>> import torch
        >>> layout = plan_layout({"w": torch.ones(4)})
        >>> layout.tensor_bytes, layout.size_bytes > 16
        (16, True)
        >>> plan_layout({"f": print}) is None   # not plain data: torch.save writes it
        True
    """
    saveable = to_saveable(obj)
    walked = _walk(saveable)
    return None if walked is None else _record_layout(saveable, walked[0])


def _record_layout(saveable: Any, storages: list[Any]) -> Layout | None:
    import torch

    recorder = _Recorder()
    with _zip_crc_off(), torch.serialization.skip_data():
        torch.save(saveable, recorder)
    size = recorder.end
    records = data_records(recorder.segments, size)
    if records is None or len(records) != len(storages):
        return None
    regions = tuple(records[i] for i in range(len(storages)))
    if any(n != s.nbytes() for (_, n), s in zip(regions, storages, strict=True)):
        return None
    return Layout(
        size_bytes=size,
        segments=tuple(recorder.segments),
        regions=regions,
        gaps=_gaps(recorder.segments, regions, size),
        storages=tuple(storages),
    )


class LayoutCache:
    """The last layout of each item name, reused while the object keeps its structure.

    The cache holds no storage (a reused layout takes the object's current ones), so it
    keeps no tensor alive. `hits` and `misses` count the plans.

    Example:
        >>> import torch
        >>> cache = LayoutCache()
        >>> w = torch.zeros(4)
        >>> a = cache.plan("model", {"w": w, "step": 1})
        >>> w += 1                                   # new bytes, same structure
        >>> b = cache.plan("model", {"w": w, "step": 1})
        >>> c = cache.plan("model", {"w": w, "step": 2})   # a plain value changed
        >>> (cache.hits, cache.misses), b.segments == a.segments, c.segments == a.segments
        ((1, 2), True, False)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, tuple[tuple[Any, ...], Layout]] = {}
        self.hits = 0
        self.misses = 0

    def plan(self, name: str, obj: Any) -> Layout | None:
        """`plan_layout(obj)`, from the last layout of `name` when `obj` matches it."""
        saveable = to_saveable(obj)
        walked = _walk(saveable)
        if walked is None:
            return None
        storages, signature = walked
        with self._lock:
            last = self._last.get(name)
        if last is not None and signature is not None and last[0] == signature:
            with self._lock:
                self.hits += 1
            return replace(last[1], storages=tuple(storages))
        layout = _record_layout(saveable, storages)
        with self._lock:
            self.misses += 1
            if layout is None or signature is None:
                self._last.pop(name, None)
            else:
                self._last[name] = (signature, replace(layout, storages=()))
        return layout


def data_records(segments: list[tuple[int, Any]], size: int) -> dict[int, tuple[int, int]]:
    """{storage key: (offset, size)} of the `<archive>/data/<key>` records of the zip
    whose bytes are `segments` (offset, bytes), zeros elsewhere."""
    records: dict[int, tuple[int, int]] = {}
    reader = _SparseReader(segments, size)
    with zipfile.ZipFile(reader) as archive:
        for info in archive.infolist():
            parts = info.filename.split("/")
            if len(parts) != 3 or parts[1] != "data" or not parts[2].isdigit():
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                return {}
            reader.seek(info.header_offset)
            header = reader.read(30)
            name_len = int.from_bytes(header[26:28], "little")
            extra_len = int.from_bytes(header[28:30], "little")
            offset = info.header_offset + 30 + name_len + extra_len
            records[int(parts[2])] = (offset, info.file_size)
    return records


def _gaps(
    segments: list[tuple[int, bytes]], regions: tuple[tuple[int, int], ...], size: int
) -> tuple[tuple[int, int], ...]:
    covered = sorted([(o, len(d)) for o, d in segments] + list(regions))
    gaps: list[tuple[int, int]] = []
    pos = 0
    for offset, length in covered:
        if offset > pos:
            gaps.append((pos, offset - pos))
        pos = max(pos, offset + length)
    if pos < size:
        gaps.append((pos, size - pos))
    return tuple(gaps)


def fill(
    buffer: Any,
    view: memoryview,
    layout: Layout,
    *,
    ready: Any = None,
    workers: int = FILL_WORKERS,
) -> str:
    """Write the item into `buffer` (a uint8 tensor of exactly `layout.size_bytes` bytes)
    whose bytes `view` also exposes: torch's own bytes, zeros in the gaps, and a copy of
    every storage; returns the item's checksum (`CHECKSUM_ALGO`, checksum.py). Reads the
    storages once; the caller may mutate them when it returns.

    Host storages are copied by `workers` threads (this one included), each piece hashed
    as it is done (module docstring). CUDA storages are copied on a side stream that first
    waits for `ready` (a CUDA event recorded when the save was asked for; else the
    device's current stream), straight from the tensors' own memory (nothing is allocated
    on the GPU) into `buffer`, which should be pinned (`pin`) for the copy to run at the
    link's speed; the buffer is hashed after.
    """
    if buffer.numel() != layout.size_bytes or len(view) != layout.size_bytes:
        raise ValueError(f"a buffer of {len(view)} bytes for an item of {layout.size_bytes}")
    for offset, data in layout.segments:
        view[offset : offset + len(data)] = data
    for offset, length in layout.gaps:
        view[offset : offset + length] = bytes(length)
    if any(s.device.type != "cpu" for s in layout.storages):
        _fill_devices(buffer, layout, ready)
        return checksum_of(view)
    return _fill_host(buffer.data_ptr(), view, layout, max(1, workers))


def _pieces(base: int, layout: Layout) -> list[list[tuple[int, int, int]]]:
    """For each `_PIECE_BYTES` piece of the file, in order, the (destination address,
    source address, bytes) of the storages' parts that fall in it (none where the piece
    holds only torch's own bytes)."""
    pieces: list[list[tuple[int, int, int]]] = [
        [] for _ in range(-(-layout.size_bytes // _PIECE_BYTES))
    ]
    for (offset, length), storage in zip(layout.regions, layout.storages, strict=True):
        if storage.nbytes() != length:  # memmove checks nothing: neither may we skip it
            raise ValueError(f"a storage of {storage.nbytes()} bytes laid out as {length}")
        src = storage.data_ptr() - offset  # the source address of file offset `at`: src + at
        at, end = offset, offset + length
        while at < end:
            piece = at // _PIECE_BYTES
            n = min(end, (piece + 1) * _PIECE_BYTES) - at
            pieces[piece].append((base + at, src + at, n))
            at += n
    return pieces


def _fill_host(base: int, view: memoryview, layout: Layout, workers: int) -> str:
    """Copy host storages into the buffer at `base`, piece by piece, and hash each piece
    after its copies: `workers` threads (this one included) take the next piece in turn."""
    pieces = _pieces(base, layout)
    leaves = [b""] * len(pieces)
    lock = threading.Lock()
    taken = 0

    def work() -> None:
        nonlocal taken
        while True:
            with lock:
                i = taken
                taken += 1
            if i >= len(pieces):
                return
            for dst, src, n in pieces[i]:
                ctypes.memmove(dst, src, n)
            leaves[i] = leaf_digest(view[i * _PIECE_BYTES : (i + 1) * _PIECE_BYTES])

    helpers = [threading.Thread(target=work, daemon=True) for _ in range(workers - 1)]
    for helper in helpers:
        helper.start()
    try:
        work()
    finally:
        for helper in helpers:
            helper.join()  # never leave a copy running into a buffer the caller reuses
    if any(not leaf for leaf in leaves):  # a helper failed (it cannot raise here)
        raise RuntimeError("a fill worker stopped before its pieces were copied")
    return tree_hexdigest(leaves)


def _fill_devices(buffer: Any, layout: Layout, ready: Any) -> None:
    import torch

    streams: dict[Any, Any] = {}
    for (offset, length), storage in zip(layout.regions, layout.storages, strict=True):
        if length == 0:
            continue
        device = storage.device
        source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        if device.type != "cuda":
            buffer[offset : offset + length].copy_(source)
            continue
        stream = streams.get(device)
        if stream is None:
            stream = streams[device] = torch.cuda.Stream(device)
            if ready is not None and ready.device == device:  # pragma: no cover - GPU
                stream.wait_event(ready)
            else:
                stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            buffer[offset : offset + length].copy_(source, non_blocking=True)
    for stream in streams.values():
        stream.synchronize()


def pin(buffer: Any) -> bool:
    """Page-lock `buffer` (a host uint8 tensor over a mapped file) for CUDA copies; False
    where there is no CUDA. The mapping stays pinned until `unpin`."""
    import torch

    if not torch.cuda.is_available():
        return False
    result = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    return int(result) == 0


def unpin(buffer: Any) -> None:
    """Undo `pin`."""
    import torch

    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


def cuda_ready_event(obj: Any) -> Any:
    """A CUDA event recorded now on the current stream if `obj` holds CUDA tensors (a
    lazy snapshot copies them later, but as they are at this point of the stream)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    storages = _storages_in_pickle_order(obj) or []
    if not any(s.device.type == "cuda" for s in storages):
        return None
    return torch.cuda.current_stream().record_event()  # pragma: no cover - GPU
