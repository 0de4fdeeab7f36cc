"""torch's zip format: what the file `torch.save` writes looks like, without its data.

An item file is a zip archive of stored (uncompressed) members: `<archive>/data.pkl`, the
pickle of the object, whose tensors name their storages by key, and one member
`<archive>/data/<key>` per storage holding its raw bytes. This module knows that layout:

- planning an item's file without copying a tensor byte (`record_layout`: `torch.save`
  under `torch.serialization.skip_data` into a recorder that keeps only what torch itself
  writes), giving a `Layout`: torch's own bytes and the place of every storage's bytes;
  on request with its records largest first, so that the small ones (a LoRA adapter)
  sit together after the large ones, from a block boundary (`largest_records_first`:
  members moved, zeros between them, the central directory's offsets rewritten);
- mirroring the pickler's walk (`storages_and_signature`), so that a layout can be reused
  for an object of the same structure, and refusing what it cannot mirror;
- finding the storages' records in an archive (`data_records`) and reading `data.pkl`
  alone (`read_pickle_member`);
- writing with torch's zip CRC off (`zip_crc_off`: nebula's own checksum covers the bytes).

No file is opened and no thread started here: the caller hands in bytes or a stream. torch
is imported inside the functions that need it, so importing this module does not.

May import: `nebulaml.errors` and names.py. Not for: copying storages into buffers,
hashing and CUDA (runtime/snapshot.py), unpickling an item (serialization.py,
item_metadata.py), or which object is written for which (`to_saveable`, serialization.py).
"""

from __future__ import annotations

import bisect
import contextlib
import io
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from nebulaml.errors import CorruptCheckpointError
from nebulaml.format.names import name_number

_PLAIN = (str, bytes, int, float, bool, complex, type(None))
#: The most bytes of `data.pkl` read; a state dict of a million tensors needs ~100 MB.
MAX_PICKLE_BYTES = 512 << 20
_ZIP_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")


@contextlib.contextmanager
def zip_crc_off() -> Iterator[None]:
    """Skip torch's zip CRC32 while nebula writes an item.

    The CRC costs about 4x the copy itself (0.5 GB into /dev/shm: 1.0-1.5 s with it,
    0.22 s without, on 2 cores), and nebula's own xxh3 checksum, computed on the same
    pass and checked before every load, already covers the bytes. torch.load reads
    such files as usual.
    """
    try:
        from torch.utils.serialization import config
    except ImportError:  # torch before 2.5 has no switch; its CRC stays on
        yield
        return
    previous = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = previous


@dataclass(frozen=True, slots=True)
class Layout:
    """Where every byte of one item's file goes.

    `segments` are the bytes torch wrote itself (offset, bytes); `regions[i]` is the
    (offset, size_bytes) of `storages[i]`; `gaps` are the ranges neither covers (zip
    padding), zeroed on every fill so that a reused buffer carries nothing over;
    `versions[i]` what PyTorch counted of in-place changes to `storages[i]`.
    """

    size_bytes: int
    segments: tuple[tuple[int, bytes], ...]
    regions: tuple[tuple[int, int], ...]
    gaps: tuple[tuple[int, int], ...]
    storages: tuple[Any, ...]  # torch.UntypedStorage, in torch's key order
    # For each storage, the version counters of the tensors that view it, when the
    # object was planned (`storages_and_signature`); () when not taken.
    versions: tuple[tuple[int, ...], ...] = ()
    # Every storage is in host memory (known when the layout was recorded; a layout reused
    # for an object of the same signature has the same devices). False: not known.
    host: bool = False

    @property
    def tensor_bytes(self) -> int:
        return sum(size for _, size in self.regions)

    def on_host(self) -> bool:
        """Whether every storage is in host memory (no CUDA copy to make)."""
        return self.host or all(s.device.type == "cpu" for s in self.storages)


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


def storages_in_pickle_order(obj: Any) -> list[Any] | None:
    """The distinct tensor storages of `obj` in the order torch's pickler meets them, or
    None if `obj` holds anything whose pickling order this walk cannot mirror."""
    walked = storages_and_signature(obj)
    return None if walked is None else walked[0]


def storages_and_signature(
    obj: Any, versions: list[list[int]] | None = None
) -> tuple[list[Any], tuple[Any, ...] | None] | None:
    """(the distinct storages in pickling order, the signature of everything else that
    goes into the pickle), or None if the layout cannot map `obj`. The signature is None
    when `obj` holds something it cannot describe (the layout is then never reused).

    Two objects with equal signatures pickle to the same bytes, given the same storage
    sizes: the signature holds every container's type and length, every plain value
    (floats by their bits), every tensor's metadata, and which objects are the same
    object (the pickler writes a second meeting as a reference).

    `versions`, when given, receives for each storage (in the same order) the version
    counters (`Tensor._version`) of the tensors of `obj` that view it: what PyTorch
    knows of in-place changes to them (runtime/snapshot.py's evidence).
    """
    import torch

    tensor_type, parameter_type, strided = torch.Tensor, torch.nn.Parameter, torch.strided
    found: list[Any] = []
    cpu = torch.device("cpu")
    storage_index: dict[int, int] = {}
    seen: dict[int, int] = {}
    sig: list[Any] = []
    append = sig.append
    describable = True
    # A save walks every state dict it writes, after a training step has taken the
    # caches: the common cases (str keys, plain tensors, dicts) are taken first, inline.

    def tensor(value: Any, kind: Any) -> bool:
        nonlocal describable
        if value.layout is not strided or value.is_quantized or value.__dict__:
            return False
        if value.is_cpu:
            device = cpu
        else:
            device = value.device  # a torch.device: compared and hashed as its string
            if device.type != "cuda":
                return False
        storage = value.untyped_storage()
        # PyTorch keeps one Python object per live storage: its id names it while `found`
        # holds it.
        sid = id(storage)
        key = storage_index.setdefault(sid, len(storage_index))
        if key == len(found):
            found.append(storage)
        if versions is not None:
            if key == len(versions):
                versions.append([])
            versions[key].append(value._version)
        append(
            (
                kind,
                key,
                storage.nbytes(),
                device,
                value.dtype,
                value.shape,  # a torch.Size: a tuple
                value.stride(),
                value.storage_offset(),
                value.requires_grad,
                value.is_conj(),
                value.is_neg(),
            )
        )
        if kind is parameter_type or value._backward_hooks:
            describable = False
        return True

    def walk(value: Any) -> bool:
        nonlocal describable
        if value is None or value is True or value is False:
            append(value)
            return True
        first = seen.get(id(value))
        if first is not None:
            append(("again", first))  # the same object as an earlier one
            return True
        seen[id(value)] = len(seen)
        kind = type(value)
        if kind is tensor_type or kind is parameter_type:
            return tensor(value, kind)
        if kind is dict or kind is OrderedDict:
            append((kind, len(value)))
            for k, v in value.items():
                if type(k) is str:  # a key met again is one the pickler memoised too
                    again = seen.get(id(k))
                    if again is None:
                        seen[id(k)] = len(seen)
                        append((str, k))
                    else:
                        append(("again", again))
                elif not walk(k):
                    return False
                if type(v) is tensor_type and id(v) not in seen:
                    seen[id(v)] = len(seen)
                    if not tensor(v, tensor_type):
                        return False
                elif not walk(v):
                    return False
            return True
        if isinstance(value, _PLAIN):
            append((kind, value.hex() if isinstance(value, float) else value))
            if kind not in _PLAIN:
                describable = False  # a subclass may pickle in its own way
            return True
        if kind is list or kind is tuple:
            append((kind, len(value)))
            for v in value:  # noqa: SIM110 - a loop: no generator per container
                if not walk(v):
                    return False
            return True
        if isinstance(value, dict) and kind.__module__ in ("builtins", "collections"):
            describable = False  # defaultdict's factory, a Counter's class, ...
            append((kind, len(value)))
            return all(walk(k) and walk(v) for k, v in value.items())
        if isinstance(value, (torch.dtype, torch.Size, torch.device)):
            append((kind, value))
            return True
        return False

    if not walk(obj):
        return None
    return found, (tuple(sig) if describable else None)


def record_layout(saveable: Any, storages: list[Any], *, align: int = 0) -> Layout | None:
    """Lay out the file `torch.save(saveable)` writes, copying no tensor byte: `storages`
    are `saveable`'s, as `storages_and_signature` found them. None if torch's records do
    not match them (the caller then writes with plain torch.save).

    With `align`, an item with a storage of at least `ALIGN_MIN_UNITS` x `align` bytes has
    its records laid out largest first, the smaller ones starting on a multiple of `align`
    (`largest_records_first`): a LoRA model's adapters sit together after every frozen
    weight, in pieces of their own.

    Example:
        >>> import torch
        >>> obj = {"w": torch.ones(4)}
        >>> storages, _ = storages_and_signature(obj)
        >>> layout = record_layout(obj, storages)
        >>> layout.regions[0][1], layout.tensor_bytes, layout.size_bytes > 16
        (16, 16, True)
    """
    import torch

    recorder = _Recorder()
    with zip_crc_off(), torch.serialization.skip_data():
        torch.save(saveable, recorder)  # type: ignore[arg-type]  # a file-like writer
    segments, size = recorder.segments, recorder.end
    if align:
        aligned = largest_records_first(segments, size, align)
        if aligned is not None:
            laid = _laid_out(aligned[0], aligned[1], storages)
            if laid is not None:
                return laid
    return _laid_out(segments, size, storages)


def _laid_out(segments: list[tuple[int, bytes]], size: int, storages: list[Any]) -> Layout | None:
    records = data_records(segments, size)
    if records is None or len(records) != len(storages):
        return None
    regions = tuple(records[i] for i in range(len(storages)))
    if any(n != s.nbytes() for (_, n), s in zip(regions, storages, strict=True)):
        return None
    return Layout(
        size_bytes=size,
        segments=tuple(segments),
        regions=regions,
        gaps=_gaps(segments, regions, size),
        storages=tuple(storages),
        host=all(s.device.type == "cpu" for s in storages),
    )


# A record is large when it is at least this many `align` units: an item with one has its
# records laid out largest first, the smaller ones from a multiple of `align` (the zeros
# before them are then under 1/ALIGN_MIN_UNITS of the item).
ALIGN_MIN_UNITS = 16
_CD_ENTRY, _EOCD64, _LOCATOR64, _EOCD = b"PK\x01\x02", b"PK\x06\x06", b"PK\x06\x07", b"PK\x05\x06"
_NO_OFFSET = 0xFFFFFFFF  # a 32-bit field that says "in the zip64 extra field"


def largest_records_first(
    segments: list[tuple[int, bytes]], size: int, align: int
) -> tuple[list[tuple[int, bytes]], int] | None:
    """The zip whose bytes are `segments` (offset, bytes; zeros elsewhere) with its
    storage records reordered, where one of them is at least ALIGN_MIN_UNITS x `align`
    bytes: the records largest first (records of one size in torch's order), the other
    members where they were (those ahead of the records ahead of them, the rest after),
    and zeros before the first record under ALIGN_MIN_UNITS x `align` bytes, so that its
    data starts at a multiple of `align`: (segments, size). None when nothing moves
    (no large record, or the records are in that order already), or the archive is not
    as torch writes it.

    What a fine-tune changes is, most often, the small tensors (a LoRA adapter is far
    smaller than the frozen weight it adapts; norms, biases, a new head): laid out largest
    first, they sit together at the end of the file, after the large frozen ones, and
    share no piece with them. A store that reuses unchanged ranges then writes one run
    (S3's parts are at least 5 MiB, so a changed tensor alone among frozen ones would cost
    5 MiB; the last part may be short), and a fill hashes them alone.

    Zip readers find members by the central directory, whose offsets are rewritten here;
    bytes between members belong to none (torch.load and zipfile read them past). Each
    member moves by a multiple of 64 bytes, so torch's 64-byte data alignment (mmap
    loads) stays; `align` is a multiple of 64.

    Example:
        >>> import torch
        >>> obj = {"b": torch.zeros(3), "w": torch.zeros(4 << 20), "a": torch.zeros(5)}
        >>> layout = record_layout(obj, storages_and_signature(obj)[0], align=1 << 20)
        >>> b, w, a = layout.regions   # w first; a (larger) then b, a on a piece
        >>> w[0] < a[0] < b[0], a[0] % (1 << 20), b[0] - (a[0] + a[1]) < 256
        (True, 0, True)
    """
    if align <= 0 or align % 64:
        return None
    reader = _SparseReader(segments, size)
    try:
        with zipfile.ZipFile(reader) as archive:
            infos = sorted(archive.infolist(), key=lambda i: i.header_offset)
            cd_start = archive.start_dir
        members = []  # (header offset, end, bytes of header, file size, a storage record)
        for k, info in enumerate(infos):
            end = infos[k + 1].header_offset if k + 1 < len(infos) else cd_start
            header = _data_offset(reader, info) - info.header_offset
            members.append((info.header_offset, end, header, info.file_size,
                            _storage_key(info) is not None))  # fmt: skip
    except (zipfile.BadZipFile, ValueError, OSError):
        return None
    large = ALIGN_MIN_UNITS * align
    records = [j for j, m in enumerate(members) if m[4]]
    if not records or not any(members[j][3] >= large for j in records):
        return None
    ordered = sorted(records, key=lambda j: -members[j][3])
    first = records[0]
    order = [j for j in range(first) if not members[j][4]] + ordered
    order += [j for j in range(first, len(members)) if not members[j][4]]
    small = next((j for j in ordered if members[j][3] < large), None)
    new_at: dict[int, int] = {}
    pos = members[0][0]
    for j in order:
        at, end, header, _, _ = members[j]
        if j == small:
            pos = -(-(pos + header) // align) * align - header
        else:
            pos += (at - pos) % 64
        new_at[j] = pos
        pos += end - at
    if all(new_at[j] == members[j][0] for j in order):
        return None
    shift = pos - cd_start
    starts = [m[0] for m in members]

    def moved(offset: int) -> int:
        j = bisect.bisect_right(starts, offset) - 1
        return new_at[j] + offset - starts[j] if j >= 0 else offset

    moved_segments: list[tuple[int, bytes]] = []
    tail = bytearray(size - cd_start)
    for offset, data in segments:
        end = offset + len(data)
        if offset >= cd_start:
            tail[offset - cd_start : end - cd_start] = data
            continue
        if end > cd_start or (data and moved(offset) + len(data) - 1 != moved(end - 1)):
            return None  # a write across a member's start: not as torch writes
        moved_segments.append((moved(offset), data))
    if not _moved_directory(tail, moved, shift):
        return None
    moved_segments.append((cd_start + shift, bytes(tail)))
    return sorted(moved_segments, key=lambda seg: seg[0]), size + shift


def _moved_directory(tail: bytearray, moved: Any, shift: int) -> bool:
    """Rewrite, in `tail` (the central directory and the end records), every member's
    header offset by `moved`, and the directory's own by `shift`; False when `tail` is
    not as torch writes it or an offset no longer fits its field."""
    p = 0
    while tail[p : p + 4] == _CD_ENTRY:
        if p + 46 > len(tail):
            return False
        usize, csize, offset = (
            int.from_bytes(tail[p + 24 : p + 28], "little"),
            int.from_bytes(tail[p + 20 : p + 24], "little"),
            int.from_bytes(tail[p + 42 : p + 46], "little"),
        )
        name_len, extra_len, comment_len = (
            int.from_bytes(tail[p + k : p + k + 2], "little") for k in (28, 30, 32)
        )
        if offset != _NO_OFFSET:
            new = moved(offset)
            if new >= _NO_OFFSET:
                return False
            tail[p + 42 : p + 46] = new.to_bytes(4, "little")
        else:  # in the zip64 extra field, after the sizes that are there too
            q, end = p + 46 + name_len, p + 46 + name_len + extra_len
            while q + 4 <= end and int.from_bytes(tail[q : q + 2], "little") != 1:
                q += 4 + int.from_bytes(tail[q + 2 : q + 4], "little")
            at = q + 4 + 8 * ((usize == _NO_OFFSET) + (csize == _NO_OFFSET))
            if q + 4 > end or at + 8 > end:
                return False
            new = moved(int.from_bytes(tail[at : at + 8], "little"))
            tail[at : at + 8] = new.to_bytes(8, "little")
        p += 46 + name_len + extra_len + comment_len
    zip64 = tail[p : p + 4] == _EOCD64
    if zip64:
        cd = int.from_bytes(tail[p + 48 : p + 56], "little")
        tail[p + 48 : p + 56] = (cd + shift).to_bytes(8, "little")
        p += 12 + int.from_bytes(tail[p + 4 : p + 12], "little")
        if tail[p : p + 4] != _LOCATOR64:
            return False
        where = int.from_bytes(tail[p + 8 : p + 16], "little")
        tail[p + 8 : p + 16] = (where + shift).to_bytes(8, "little")
        p += 20
    if tail[p : p + 4] != _EOCD or p + 22 > len(tail):
        return False
    cd = int.from_bytes(tail[p + 16 : p + 20], "little")
    if cd != _NO_OFFSET:
        if cd + shift >= _NO_OFFSET and not zip64:
            return False
        tail[p + 16 : p + 20] = min(cd + shift, _NO_OFFSET).to_bytes(4, "little")
    return True


def data_records(segments: list[tuple[int, Any]], size: int) -> dict[int, tuple[int, int]]:
    """{storage key: (offset, size)} of the `<archive>/data/<key>` records of the zip
    whose bytes are `segments` (offset, bytes), zeros elsewhere."""
    records: dict[int, tuple[int, int]] = {}
    reader = _SparseReader(segments, size)
    with zipfile.ZipFile(reader) as archive:
        for info in archive.infolist():
            key = _storage_key(info)
            if key is None:
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                return {}
            records[key] = (_data_offset(reader, info), info.file_size)
    return records


def _storage_key(info: zipfile.ZipInfo) -> int | None:
    """The storage key of a `<archive>/data/<key>` member, None for any other member."""
    parts = info.filename.split("/")
    return name_number(parts[2]) if len(parts) == 3 and parts[1] == "data" else None


def _data_offset(reader: _SparseReader, info: zipfile.ZipInfo) -> int:
    """Where member `info`'s bytes begin: after its local header, whose name and extra
    field lengths are its own (not the central directory's)."""
    reader.seek(info.header_offset)
    header = reader.read(30)
    name_len = int.from_bytes(header[26:28], "little")
    extra_len = int.from_bytes(header[28:30], "little")
    return info.header_offset + 30 + name_len + extra_len


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


def read_pickle_member(stream: BinaryIO, where: str) -> bytes:
    """The bytes of `data.pkl` in a torch zip archive, reading nothing else but the zip
    directory. Raises `CorruptCheckpointError` for anything that is not such an archive.

    The member is read by hand (local header, then its stored bytes) because nebula writes
    items with torch's zip CRC off, which `zipfile` would report as a bad CRC.
    """

    def corrupt(found: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(where, "a torch zip archive with a data.pkl", found)

    try:
        archive = zipfile.ZipFile(stream)
    except (zipfile.BadZipFile, EOFError, ValueError, struct.error, NotImplementedError) as exc:
        raise corrupt(f"no readable zip directory ({exc})") from None
    with archive:
        members = [
            info
            for info in archive.infolist()
            if info.filename.endswith("/data.pkl") and info.filename.count("/") == 1
        ]
        if len(members) != 1:
            raise corrupt(f"{len(members)} top-level data.pkl members")
        info = members[0]
        if info.compress_type != zipfile.ZIP_STORED:
            raise corrupt(f"data.pkl compressed with method {info.compress_type}")
        if info.file_size > MAX_PICKLE_BYTES:
            raise corrupt(f"a data.pkl of {info.file_size} bytes (over {MAX_PICKLE_BYTES})")
        if info.header_offset < 0:
            raise corrupt(f"data.pkl at offset {info.header_offset}")
        stream.seek(info.header_offset)
        header = stream.read(_ZIP_LOCAL_HEADER.size)
        if len(header) != _ZIP_LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
            raise corrupt("no local header for data.pkl")
        fields = _ZIP_LOCAL_HEADER.unpack(header)
        name_len, extra_len = fields[-2], fields[-1]
        stream.seek(info.header_offset + _ZIP_LOCAL_HEADER.size + name_len + extra_len)
        data = stream.read(info.file_size)
    if len(data) != info.file_size:
        raise corrupt(f"data.pkl cut short at {len(data)} of {info.file_size} bytes")
    return data
