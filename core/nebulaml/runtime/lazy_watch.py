"""What a lazy save watches until its copy is taken: every write to its large storages.

A lazy `save()` (fence.py) copies its small storages at once and leaves the large ones to
the background, checking their version counters after the copy. Writes that bump no
version counter (through `.data`, a NumPy view, a pointer, a kernel of another library,
another thread's `.data`) would reach the snapshot unseen. Where the kernel can record
written pages (write_watch.py), a lazy save also:

- protects the whole pages of each large host storage (`LazyWatch.begin`, on the
  training thread: about 2 ms per 0.2 GB), and copies now the few bytes of each that lie
  in pages it shares with other memory (at most a page at each end);
- after the copy, lists the pages written since (`SaveWatch.check`): any write, by any
  thread, through anything, to a page not yet copied fails the save, as a changed
  version counter does; and compares the copied edge bytes with those taken at the save;
- lifts the protection (`SaveWatch.end`), so that the optimizer step after the fence
  takes no fault;
- once per storage, after its first copy, backs it with transparent huge pages where the
  system allows them (`collapse_new`, on the snapshot thread): each later protect then
  costs one page table entry per 2 MiB instead of 512 (1.4 GB: 7-11 ms instead of 30).
  A write is still marked by its small page.

Storages on a device, pinned or shared with other processes (written by DMA or by
another process: the kernel does not mark those writes here) keep the version counter
alone, as does everything where the kernel cannot watch (`write_watch.unavailable`).
The ranges stay registered for the session (registering splits the process's mappings;
unregistering 0.2 GB costs 4 ms, and holds the mappings' lock meanwhile).

May import: runtime/write_watch.py. Not for: what a save copies, or when (fence.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nebulaml.runtime.write_watch import (
    WriteWatch,
    collapse,
    inner_pages,
    unavailable,
    whole_pages,
)

log = logging.getLogger("nebulaml")

Range = tuple[int, int]


def _minus(ranges: list[Range], others: list[Range]) -> list[Range]:
    """The parts of `ranges` outside every range of `others`.

    Example:
        >>> _minus([(0, 10), (20, 30)], [(5, 25)])
        [(0, 5), (25, 30)]
    """
    out = []
    for start, end in ranges:
        pieces = [(start, end)]
        for lo, hi in others:
            pieces = [
                p for a, b in pieces for p in ((a, min(b, lo)), (max(a, hi), b)) if p[0] < p[1]
            ]
        out += pieces
    return out


@dataclass
class SaveWatch:
    """One lazy save's watch: its protected ranges, what each storage's pages are called,
    and the edge bytes it took at the save."""

    parent: LazyWatch
    ranges: list[Range]
    # (address, bytes, places) of each storage watched
    storages: list[tuple[int, int, list[Any]]]
    # address of a storage -> [(offset in it, the bytes there at the save)]
    edges: dict[int, list[tuple[int, bytes]]]
    spell: Callable[[Any], str] = str  # a place, as a message says it
    carried: list[Range] = field(default_factory=list)  # written before a later protect
    checked: bool = False  # against the buffer it was copied into
    ended: bool = False

    def check(self, view: memoryview | None = None, layout: Any = None) -> list[str]:
        """The places of the storages written since the save (any page of theirs marked,
        or, given the buffer's `view` and the item's `layout`, an edge byte copied that
        differs from the save's; without them, an edge byte of the storage itself), sorted."""
        written = self.carried + self.parent.written(self.ranges)
        changed = {
            place
            for address, size, places in self.storages
            if any(lo < address + size and hi > address for lo, hi in written)
            for place in places
        }
        if view is not None and layout is not None:
            self.checked = True
            for (offset, _length), storage in zip(layout.regions, layout.storages, strict=True):
                for at, data in self.edges.get(storage.data_ptr(), ()):
                    if view[offset + at : offset + at + len(data)] != data:
                        changed.update(self._places(storage.data_ptr()))
        else:  # written by torch.save: the storages' edges as they are now, a weaker test
            for address, taken in self.edges.items():
                if any(ctypes.string_at(address + at, len(data)) != data for at, data in taken):
                    changed.update(self._places(address))
        return sorted({self.spell(place) for place in changed})

    def _places(self, address: int) -> list[Any]:
        return next((p for a, _n, p in self.storages if a == address), [])

    def end(self) -> None:
        """Lift the protection of the pages no other pending save watches."""
        if not self.ended:
            self.ended = True
            self.parent.release(self)


class LazyWatch:
    """A session's watch over what its lazy saves have not copied yet.

    Example:
        >>> import torch
        >>> watch = LazyWatch()
        >>> w = torch.zeros(1 << 20)
        >>> saved = watch.begin([("['w']", w)])
        >>> w.data[500_000] = 1.0  # seen by no version counter
        >>> saved is None or saved.check() == ["['w']"]
        True
        >>> if saved is not None: saved.end()
        >>> watch.close()
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watch: WriteWatch | None = None
        self._broken = False
        self._pending: list[SaveWatch] = []
        # Storages (address, bytes) watched: those not yet in huge pages (`collapse_new`).
        self._seen: set[tuple[int, int]] = set()
        self._to_collapse: list[tuple[int, int]] = []

    def begin(
        self, tensors: list[tuple[Any, Any]], spell: Callable[[Any], str] = str
    ) -> SaveWatch | None:
        """Protect the whole pages of each (place, tensor)'s storage, host memory of this
        process only (`watchable`), and take the bytes at their edges; None where nothing
        can be watched (the version counters alone then tell). `spell(place)`: the place
        as `SaveWatch.check` names it."""
        spans: dict[int, tuple[int, list[Any]]] = {}
        for place, tensor in tensors:
            if not watchable(tensor):
                continue
            storage = tensor.untyped_storage()
            address, size = storage.data_ptr(), storage.nbytes()
            if size:
                spans.setdefault(address, (size, []))[1].append(place)
        if not spans:
            return None
        with self._lock:
            watch = self._watch_now()
            if watch is None:
                return None
            ranges, _outside = inner_pages((a, n) for a, (n, _p) in spans.items())
            edges = {}
            for address, (size, _places) in spans.items():
                taken = _edges(address, size)
                if taken:
                    edges[address] = taken
            for pending in self._pending:  # a protect forgets their marks: keep them
                pending.carried += watch.written(pending.ranges)
            try:
                self._register(watch, ranges)
                watch.protect(True, ranges)
            except OSError:
                # A range registered before was unmapped since (its memory freed), and
                # the address given out again: register afresh, once.
                watch.unregister([r for r in ranges if r in watch.ranges])
                try:
                    self._register(watch, ranges)
                    watch.protect(True, ranges)
                except OSError as exc:
                    with contextlib.suppress(OSError):
                        watch.protect(False, ranges)
                    log.debug("lazy save: no write watch (%s); version counters only", exc)
                    return None
            storages = [(a, n, p) for a, (n, p) in spans.items()]
            for address, (size, _places) in spans.items():
                if (address, size) not in self._seen:
                    self._seen.add((address, size))
                    self._to_collapse.append((address, size))
            saved = SaveWatch(self, ranges, storages, edges, spell)
            self._pending.append(saved)
            return saved

    def written(self, ranges: list[Range]) -> list[Range]:
        with self._lock:
            assert self._watch is not None
            return self._watch.written(ranges)

    def release(self, saved: SaveWatch) -> None:
        with self._lock:
            self._pending.remove(saved)
            others = [r for pending in self._pending for r in pending.ranges]
            if self._watch is not None:
                try:
                    self._watch.protect(False, _minus(saved.ranges, others))
                except OSError as exc:  # unmapped since: nothing to lift
                    log.debug("lazy save: lifting a write watch: %s", exc)

    def collapse_due(self) -> bool:
        """Whether storages watched for the first time wait for `collapse_new`."""
        with self._lock:
            return bool(self._to_collapse)

    def collapse_new(self) -> int:
        """Back the storages watched for the first time with huge pages
        (write_watch.collapse): once per storage, after its first copy, on the snapshot
        thread; their later protects cost a quarter. Returns the bytes collapsed."""
        with self._lock:
            spans, self._to_collapse = self._to_collapse, []
        done = collapse(spans)
        log.debug("lazy saves: %d of %d bytes watched now in huge pages",
                  done, sum(n for _a, n in spans))  # fmt: skip
        return done

    def close(self) -> None:
        """Lift and unregister everything (the session ends)."""
        with self._lock:
            watch, self._watch, self._pending = self._watch, None, []
            if watch is not None:
                watch.close()

    def _watch_now(self) -> WriteWatch | None:
        if self._watch is None and not self._broken:
            why = unavailable()
            if why is not None:
                self._broken = True
                log.debug("lazy saves watch version counters only: %s", why)
                return None
            self._watch = WriteWatch()
        return self._watch

    def _register(self, watch: WriteWatch, ranges: list[Range]) -> None:
        """Register what of `ranges` is not yet: a registered range overlapping a new one
        differently (memory freed and given out again) is forgotten first."""
        known = set(watch.ranges)
        new = [r for r in ranges if r not in known]
        if not new:
            return
        stale = [r for r in watch.ranges if any(r[0] < b and r[1] > a for a, b in new)]
        watch.unregister(stale)
        watch.register(new)


def watchable(tensor: Any) -> bool:
    """Whether every write to `tensor`'s storage would be marked by the kernel here: a
    plain strided tensor in this process's own host memory. Not a subclass (a DTensor
    may have no storage of its own), a sparse tensor (none at all), a device's memory
    (not this process's pages), a pinned storage (written by DMA) or a shared one
    (written by other processes).

    Example:
        >>> import torch
        >>> watchable(torch.zeros(4)), watchable(torch.zeros(4).share_memory_())
        (True, False)
    """
    import torch

    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return False
    if tensor.layout != torch.strided or tensor.device.type != "cpu":
        return False
    return not (tensor.is_pinned() or tensor.is_shared())


def _edges(address: int, size: int) -> list[tuple[int, bytes]]:
    """The bytes of the storage at `address` outside its whole pages (those `inner_pages`
    watches), with their offsets in it: copied now, compared after the copy."""
    start, end = whole_pages(address, size)
    if end <= start:
        return [(0, ctypes.string_at(address, size))]
    head, tail = start - address, address + size - end
    out = [(0, ctypes.string_at(address, head))] if head else []
    if tail:
        out.append((end - address, ctypes.string_at(end, tail)))
    return out
