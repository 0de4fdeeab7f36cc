"""The fast snapshot: an item laid out once, then refilled by plain copies.

A snapshot is the only part of a checkpoint the training loop waits for, and writing it
with `torch.save` costs more in zip CRCs and first-touch page faults than in copying
(DESIGN.md §8). So an item is written as torch's zip in two parts:

- the *layout*: `torch.save` under `torch.serialization.skip_data` into a recorder that
  keeps only the bytes torch writes (the pickle, the zip headers and directory, a few
  kilobytes) and where each tensor storage's bytes go;
- the *fill*: each storage copied, as bytes, to its place in a buffer reused from one save
  to the next (slots.py), then one xxh3 pass over the result.

The file is byte for byte what `torch.load(path, weights_only=True)` reads. Objects the
layout cannot map exactly (anything but dicts, lists, tuples, plain values and dense
tensors) return None from `plan_layout`, and the caller writes them with `torch.save`.

Not for: where the buffers live or how they are reused (slots.py), or the commit protocol
(commit.py).
"""

from __future__ import annotations

import bisect
import io
import zipfile
from dataclasses import dataclass
from typing import Any

from .checksum import new_hasher
from .serialization import _zip_crc_off, to_saveable

_PLAIN = (str, bytes, int, float, bool, complex, type(None))
_HASH_CHUNK_BYTES = 16 << 20


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
    import torch

    found: dict[int, Any] = {}

    def walk(value: Any) -> bool:
        if isinstance(value, _PLAIN):
            return True
        if type(value) in (torch.Tensor, torch.nn.Parameter):
            if value.layout != torch.strided or value.is_quantized or value.__dict__:
                return False
            if value.device.type not in ("cpu", "cuda"):
                return False
            storage = value.untyped_storage()
            found.setdefault(storage._cdata, storage)
            return True
        if isinstance(value, dict) and type(value).__module__ in ("builtins", "collections"):
            return all(walk(k) and walk(v) for k, v in value.items())
        if type(value) in (list, tuple):
            return all(walk(v) for v in value)
        return isinstance(value, (torch.dtype, torch.Size, torch.device))

    return list(found.values()) if walk(obj) else None


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
    import torch

    saveable = to_saveable(obj)
    storages = _storages_in_pickle_order(saveable)
    if storages is None:
        return None
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


def fill(buffer: Any, view: memoryview, layout: Layout, *, ready: Any = None) -> None:
    """Write the item into `buffer` (a uint8 tensor of exactly `layout.size_bytes` bytes)
    whose bytes `view` also exposes: torch's own bytes, zeros in the gaps, and a copy of
    every storage. Reads the storages once; the caller may mutate them when it returns.

    CUDA storages are copied on a side stream that first waits for `ready` (a CUDA event
    recorded when the save was asked for; else the device's current stream), straight
    from the tensors' own memory (nothing is allocated on the GPU) into `buffer`, which
    should be pinned (`pin`) for the copy to run at the link's speed.
    """
    import torch

    for offset, data in layout.segments:
        view[offset : offset + len(data)] = data
    for offset, length in layout.gaps:
        view[offset : offset + length] = bytes(length)
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


def checksum(view: memoryview) -> str:
    """xxh3 of the filled buffer, in chunks (xxhash releases the GIL on large inputs)."""
    hasher = new_hasher()
    for start in range(0, len(view), _HASH_CHUNK_BYTES):
        hasher.update(view[start : start + _HASH_CHUNK_BYTES])
    return hasher.hexdigest()
