"""The fast snapshot: an item laid out once, then refilled by plain copies.

A snapshot is the only part of a checkpoint the training loop waits for, and writing it
with `torch.save` costs more in zip CRCs and first-touch page faults than in copying
(docs/benchmarks.md, "the fast path"). So an item is written as torch's zip in two parts:

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
pieces in turn: the caller and a long-lived helper (crew.py; no helper for less than
`_HELPED_PIECES` pieces' worth of bytes to copy, or parts spread thin over many pieces,
as a frozen base leaves). 1.5 GB on 2 cores:
0.12 s and 0.23 CPU-seconds, against 0.145 s when one worker hashed every piece in order
(plain xxh3) and 0.15-0.18 s for `copy_` and a hash after it. A lazy save fills with the
same two workers.

The file is byte for byte what `torch.load(path, weights_only=True)` reads. Objects the
layout cannot map exactly (anything but dicts, lists, tuples, plain values and dense
tensors) return None from `plan_layout`, and the caller writes them with `torch.save`.

This module holds the runtime half: `plan_layout` and the `LayoutCache` (a session's
state), the fill's threads, hashing and CUDA copies, and pinning. What the file looks like
(`Layout`, recording it under skip_data, the pickler's walk) is format/torchzip.py.

May import: `nebulaml.format` (torchzip, checksum, serialization's `to_saveable`),
runtime/crew.py and runtime/unchanged.py. Not
for: torch's zip layout (format/torchzip.py), where the buffers live or how they are
reused (slots.py), or the commit protocol (protocol/commit.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import random
import threading
from dataclasses import replace
from typing import Any

from nebulaml.format.checksum import (
    LEAF_BYTES,
    checksum_of,
    leaf_digest,
    leaf_hasher,
    tree_hexdigest,
)
from nebulaml.format.serialization import to_saveable
from nebulaml.format.torchzip import (
    Layout,
    record_layout,
    storages_and_signature,
    storages_in_pickle_order,
)
from nebulaml.runtime.crew import AUDIT_CREW, FILL_CREW, Job
from nebulaml.runtime.unchanged import (
    BufferMemory,
    FillRecord,
    PiecePlan,
    holds_layout_bytes,
    marks_of,
    reusable,
)

# A fill's unit of work is one checksum leaf: small enough that a piece just copied is
# still in the cache when it is hashed, large enough that the Python around each call
# costs nothing.
_PIECE_BYTES = LEAF_BYTES
FILL_WORKERS = 2  # threads per fill (a save waits for its copy; a lazy save's fence too)
# A fill copies alone unless it copies at least this many pieces' worth of bytes, in
# pieces at least half full on average: waking a helper, and the two threads taking turns
# at the GIL, cost more than they gain for less (a LoRA save's 15 pieces spread over a
# 188 MB frozen base: 2.5 ms alone, 3.0 ms with the helper, on 2 cores) or for parts
# spread thin (a 1 GB LoRA's 57 adapters of 0.3 MB: 2.8-3.2 ms alone, 3.2-4.1 helped;
# its 33 MB of Adam state in full pieces: 5.8-8.7 ms alone, 4.6-5.3 helped).
_HELPED_PIECES = 16
# The most hasher states a fill keeps for the next one (each ~0.6 kB: `_HostFill._hash`).
_PREFIX_STATES = 4096
# Where a fill samples the storages it may skip: its own generator, never the user's.
_SEEDS = random.Random()


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
    walked = _walked(obj)
    if walked is None:
        return None
    saveable, storages, _, versions = walked
    layout = record_layout(saveable, storages, align=_PIECE_BYTES)
    return None if layout is None else replace(layout, versions=versions)


def _walked(
    obj: Any,
) -> tuple[Any, list[Any], tuple[Any, ...] | None, tuple[tuple[int, ...], ...]] | None:
    """(what is written for `obj` (`to_saveable`), its storages, its signature, their
    version counters: torchzip.storages_and_signature), or None if the layout cannot map
    it. Plain data (dicts, lists, tuples, plain values and tensors: a state dict) is
    written as it is, and walked once: `to_saveable` would copy its containers, and
    changes only what the walk refuses (a module, an optimizer)."""
    versions: list[list[int]] = []
    walked = storages_and_signature(obj, versions)
    saveable = obj
    if walked is None:
        saveable = to_saveable(obj)
        if saveable is obj:
            return None
        versions = []
        walked = storages_and_signature(saveable, versions)
        if walked is None:
            return None
    return saveable, walked[0], walked[1], _frozen(versions)


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
        walked = _walked(obj)
        if walked is None:
            return None
        saveable, storages, signature, versions = walked
        with self._lock:
            last = self._last.get(name)
        if last is not None and signature is not None and last[0] == signature:
            with self._lock:
                self.hits += 1
            return replace(last[1], storages=tuple(storages), versions=versions)
        layout = record_layout(saveable, storages, align=_PIECE_BYTES)
        with self._lock:
            self.misses += 1
            if layout is None or signature is None:
                self._last.pop(name, None)
            else:
                self._last[name] = (signature, replace(layout, storages=()))
        return None if layout is None else replace(layout, versions=versions)


def _frozen(versions: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(map(tuple, versions))


def fill(
    buffer: Any,
    view: memoryview,
    layout: Layout,
    *,
    ready: Any = None,
    workers: int = FILL_WORKERS,
    memory: BufferMemory | None = None,
    label: str = "",
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

    With `memory` (the buffer's `BufferMemory`), the storages the buffer still holds from
    its last fill (unchanged.py: the evidence) are not copied, and the pieces made of
    them alone not hashed again; what was skipped is audited in the background, and a
    warning names `label` (the item and checkpoint) if it changed unseen.
    """
    if buffer.numel() != layout.size_bytes or len(view) != layout.size_bytes:
        raise ValueError(f"a buffer of {len(view)} bytes for an item of {layout.size_bytes}")
    base = buffer.data_ptr()
    # Each storage's address and size, read once: the evidence, the copies, the record's
    # marks and the piece plan's key take them from here.
    spans = tuple([(s.data_ptr(), s.nbytes()) for s in layout.storages])
    keep: set[int] = set()
    record = None
    if memory is not None:
        memory.settle()
        keep = reusable(memory, layout, base, _SEEDS.randrange(1 << 30), spans)
        record, memory.record = memory.record, None  # the buffer is being written
    # torch's own bytes, and zeros between: there already when the buffer's last fill was
    # of this very layout (the same evidence as a kept storage's), but at every
    # FULL_EVERY-th fill that relies on the buffer (unchanged.py), which writes them again.
    relies = holds_layout_bytes(record, layout)
    if not relies:
        for offset, data in layout.segments:
            view[offset : offset + len(data)] = data
        for offset, length in layout.gaps:
            view[offset : offset + length] = bytes(length)
    if not layout.on_host():
        _fill_devices(buffer, layout, ready)
        return checksum_of(view)
    old = record if record is not None and keep else None
    job = _HostFill(base, view, layout, keep, old, spans, record)
    job.run(max(1, workers))
    digest = job.checksum()
    if memory is not None:
        if record is None:
            # The buffer's next fill may skip storages and have them audited: the audit's
            # thread is started by this fill (a cold save), not by that one.
            with contextlib.suppress(RuntimeError):  # interpreter exit
                AUDIT_CREW.start()
        memory.record = FillRecord(
            layout.size_bytes,
            layout.regions,
            layout.segments,
            marks_of(layout, spans, keep, old.marks if old is not None else None),
            job.leaves,
            record.fills_since_full + 1 if record is not None and (keep or relies) else 0,
            job.prefixes,
            job.plan,
        )
        # What this fill did not write: the storages kept, and torch's own bytes and the
        # zeros when the buffer held them.
        memory.reused_bytes = sum(layout.regions[i][1] for i in keep) + (
            layout.size_bytes - layout.tensor_bytes if relies else 0
        )
        memory.audit_later(base, layout, sorted(keep), label)
    return digest


def _pieces(
    base: int, layout: Layout, keep: frozenset[int], spans: tuple[tuple[int, int], ...]
) -> list[list[tuple[int, int, int]] | None]:
    """For each `_PIECE_BYTES` piece of the file, in order, the (destination address,
    source address, bytes) of the storages' parts that fall in it (none where the piece
    holds only torch's own bytes), but those of storages in `keep` (already in the
    buffer); None for a piece whose every storage part is of a storage in `keep`, when
    there is one such part. `spans`: each storage's (address, size)."""
    pieces: list[list[tuple[int, int, int]] | None] = [
        [] for _ in range(-(-layout.size_bytes // _PIECE_BYTES))
    ]
    touched = [False] * len(pieces)  # a storage to copy falls in it
    kept = [False] * len(pieces)
    for index, ((offset, length), (ptr, nbytes)) in enumerate(
        zip(layout.regions, spans, strict=True)
    ):
        if nbytes != length:  # memmove checks nothing: neither may we skip it
            raise ValueError(f"a storage of {nbytes} bytes laid out as {length}")
        if not length:
            continue
        if index in keep:  # in the buffer already: hashed with its pieces, not copied
            for piece in range(offset // _PIECE_BYTES, (offset + length - 1) // _PIECE_BYTES + 1):
                kept[piece] = True
            continue
        src = ptr - offset  # the source address of file offset `at`: src + at
        at, end = offset, offset + length
        while at < end:
            piece = at // _PIECE_BYTES
            n = min(end, (piece + 1) * _PIECE_BYTES) - at
            touched[piece] = True
            parts = pieces[piece]
            assert parts is not None
            parts.append((base + at, src + at, n))
            at += n
    for i in range(len(pieces)):
        if kept[i] and not touched[i]:
            pieces[i] = None
    return pieces


class _HostFill:
    """One fill of host storages into the buffer at `base`, piece by piece: each piece's
    copies, then its hash (its leaf). The storages `keep` names are already there: not
    copied, and a piece made of them alone (and torch's own bytes, the same as before)
    keeps its leaf from `old`, the buffer's record of its last fill (of this layout). A
    piece whose first copy begins where it began at that fill hashes from there on, from
    the hasher's state the fill kept over the bytes before it (bytes no fill has written
    since: kept storages and torch's own): `prefixes`, for the next fill. The piece plan
    is `last`'s (the buffer's record of its last fill, of any layout) when it was made for
    the same storages, addresses and `keep`. `spans`: each storage's (address, size)."""

    def __init__(
        self,
        base: int,
        view: memoryview,
        layout: Layout,
        keep: set[int],
        old: FillRecord | None,
        spans: tuple[tuple[int, int], ...],
        last: FillRecord | None,
    ) -> None:
        key = (base, layout.regions, frozenset(keep), spans)
        if last is not None and last.plan is not None and last.plan.key == key:
            plan = last.plan  # never changed once made
        else:
            pieces = _pieces(base, layout, key[2], spans)
            todo = [i for i, parts in enumerate(pieces) if parts is not None]
            copying = sum(1 for parts in pieces if parts)
            copy_bytes = sum(n for parts in pieces if parts for _, _, n in parts)
            helped = copy_bytes >= max(_HELPED_PIECES, copying / 2) * _PIECE_BYTES
            plan = PiecePlan(key, pieces, todo, helped)
        self.base, self.view, self.plan, self.pieces = base, view, plan, plan.pieces
        self.old_prefixes: dict[int, dict[int, Any]] = {}
        self.todo = plan.todo
        if keep and old is not None and len(old.leaves) == len(self.pieces):
            # A piece of kept storages alone keeps its leaf; the others are made below.
            self.old_prefixes = old.prefixes
            self.leaves = old.leaves.copy()
            for i in plan.todo:
                self.leaves[i] = b""
        else:
            self.leaves = [b""] * len(self.pieces)
            if len(self.todo) < len(self.pieces):  # no leaf to keep: every piece hashed
                self.todo = list(range(len(self.pieces)))
        self.prefixes: dict[int, dict[int, Any]] = {}
        # Hasher states this fill may keep (a bound on memory, not on correctness: two
        # workers may each take the last ones).
        self.states_left = _PREFIX_STATES

    def run(self, workers: int) -> None:
        """Copy and hash every piece of the plan's `todo`: `workers` threads (this one
        included) take the next piece in turn, each hashed after its copies while it is
        in the cache."""
        todo, piece = self.todo, self._piece
        # The helpers are long-lived threads (crew.py): a helper that has not started
        # when this thread has taken every piece is taken back, not waited for.
        helpers: list[Job] = []
        lock = threading.Lock()
        taken = 0

        def work() -> None:
            nonlocal taken
            while True:
                with lock:
                    k = taken
                    taken += 1
                if k >= len(todo):
                    return
                piece(todo[k])

        if self.plan.helped:
            for _ in range(workers - 1):
                try:
                    helpers.append(FILL_CREW.submit(work))
                except RuntimeError:  # interpreter exit: this thread copies alone
                    break
        if not helpers:  # alone: no turns to take
            for i in todo:
                piece(i)
            return
        try:
            work()
        finally:
            for helper in helpers:
                if not helper.take_back():
                    helper.wait()  # never leave a copy running into a buffer the caller reuses

    def _piece(self, i: int) -> None:
        """Copy piece `i`'s parts, then hash it while it is in the cache."""
        for dst, src, n in self.pieces[i] or ():
            ctypes.memmove(dst, src, n)
        self._hash(i)

    def _hash(self, i: int) -> None:
        parts = self.pieces[i] or ()
        view, base = self.view, self.base
        start = i * _PIECE_BYTES
        end = min(start + _PIECE_BYTES, len(view))
        offsets = sorted({dst - base - start for dst, _, _ in parts})
        first = offsets[0] if offsets else 0
        cuts = offsets[1:]  # where later copies begin
        if first > 0:
            # Bytes this fill did not write begin the piece: their hash is kept for the
            # next fill, whose copies begin there too while the same storages change.
            kept = self.old_prefixes.get(i, {}).get(first)
            hasher = kept.copy() if kept is not None else leaf_hasher(view[start : start + first])
            states = {first: hasher.copy()}
        elif not cuts or self.states_left < len(cuts):
            self.leaves[i] = leaf_digest(view[start:end])
            return
        else:
            hasher, states = leaf_hasher(b""), {}
        # Where a later copy begins, the hasher's state is kept too: if only that storage
        # and those after it change by the next fill, its copies begin there (a
        # fine-tune's first save after a full one, or a bias kept before an adapter).
        pos = first
        if cuts and self.states_left >= len(cuts):
            self.states_left -= len(cuts)
            for at in cuts:
                hasher.update(view[start + pos : start + at])
                states[at] = hasher.copy()
                pos = at
        hasher.update(view[start + pos : end])
        self.prefixes[i] = states
        self.leaves[i] = hasher.digest()

    def checksum(self) -> str:
        """The item's checksum, every piece hashed."""
        if b"" in self.leaves:  # a helper failed (it cannot raise here)
            raise RuntimeError("a fill worker stopped before its pieces were copied")
        return tree_hexdigest(self.leaves)


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
    storages = storages_in_pickle_order(obj) or []
    if not any(s.device.type == "cuda" for s in storages):
        return None
    return torch.cuda.current_stream().record_event()  # pragma: no cover - GPU
