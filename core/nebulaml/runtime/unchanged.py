"""What a snapshot buffer still holds: a storage known unchanged since the buffer last
received it is neither copied nor hashed again (its bytes and its pieces' digests stay).

    FillRecord       what one buffer received at its last fill: each storage's mark (who,
                     where, how large, its version counters) and each piece's digest
    BufferMemory     one buffer's record, kept on its mapping (slots.MappedFile)
    reusable         which storages of a layout the buffer still holds, by the evidence
    audit_later      the background check of what a fill did not copy, started by
                     `start_audits` (a commit)
    holds_layout_bytes  whether a buffer still holds torch's own bytes of a layout

A frozen base model, an embedding table that does not train, a teacher or an EMA copy
updated every N steps: most of a fine-tuning checkpoint does not change from one save to
the next, and copying it into the buffer is most of the stall.

## Why a skipped storage cannot make a silently stale checkpoint

A storage is skipped only with all of this evidence, gathered at the save:

1. **The same storage.** The buffer's record holds a weak reference to the storage object
   (PyTorch keeps one Python object per live storage), so a storage freed and another
   allocated at the same address is not taken for it; the data pointer and size are the
   same too (`set_`, a resize or a new tensor in the state dict all fail here).
2. **No change PyTorch counted.** Every tensor of the saved object that views the storage
   has the version counter it had at that fill (`Tensor._version`). In-place operations,
   `copy_`, writes through a view, `torch.no_grad()` updates, `load_state_dict` and every
   optimizer step bump it: a "frozen" parameter an optimizer steps is copied.
3. **Its bytes agree where they are looked at.** `SAMPLE_WINDOWS` windows of the live
   storage (its first and last bytes, and others at offsets that change with each save)
   equal the buffer's. A write PyTorch does not count (through `.data`, numpy, DLPack or
   another library) that touches the whole tensor (an EMA update, a re-initialisation, a
   scale) is caught here, and the storage is copied.
4. **Not seen changing unseen before.** A storage caught by 3 or by the audit below is
   copied at every save of the process from then on.

What 3 can miss is a partial write PyTorch does not count. So after each fill, a
background thread (`audit_later`, at low priority, pausing while a save runs, started
once the checkpoint is committed: `start_audits`) compares every skipped storage with
the buffer in full. A storage that differs is remembered with
its version counters of that save; at the next save, if its counters are still those (the
difference was not a counted change made after the save), the write is confirmed: nebula
warns, naming the checkpoint that may hold the older bytes, and copies the storage from
then on. So a stale tensor is reported within one save, never silent. Every
`FULL_EVERY`-th fill of a buffer copies everything (torch's own bytes too:
`holds_layout_bytes`), and `reuse_unchanged=False`
(`NEBULA_REUSE_UNCHANGED=0`) turns the skipping off. CUDA storages are always copied.

May import: `nebulaml.format` (torchzip's `Layout`) and runtime/crew.py. Not for: the
copy and hashing (snapshot.py), or where buffers live (slots.py).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from nebulaml.format.torchzip import Layout
from nebulaml.runtime.crew import AUDIT_CREW, QUIET, Job

log = logging.getLogger("nebulaml")

# Windows of a skipped storage compared with the buffer at each save. Each costs about a
# microsecond, two cache and TLB misses, after a training step: whole-tensor writes
# change any window, and partial ones are the audit's to find.
SAMPLE_WINDOWS = 4
SAMPLE_BYTES = 256
FULL_EVERY = 32  # every FULL_EVERY-th fill of a buffer copies every storage
_AUDIT_CHUNK_BYTES = 4 << 20

_libc = ctypes.CDLL(None)
_memcmp = _libc.memcmp
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memcmp.restype = ctypes.c_int


class StorageMark(NamedTuple):
    """Who a storage was at a fill: its object (weakly), address, size, and the version
    counters of the tensors that viewed it. (A tuple: a save makes one per storage.)"""

    ref: Any  # weakref.ref to the torch.UntypedStorage
    ptr: int
    nbytes: int
    versions: tuple[int, ...]


@dataclass(slots=True)
class FillRecord:
    """What a buffer received at its last fill, for the layout it had."""

    size_bytes: int
    regions: tuple[tuple[int, int], ...]
    segments: tuple[tuple[int, bytes], ...]
    marks: tuple[StorageMark | None, ...]  # None: a storage never skipped (CUDA)
    leaves: list[bytes]
    fills_since_full: int
    # Of pieces the next fill may hash in part (snapshot._HostFill): {where, in the piece,
    # a copy of this fill began: the leaf hasher's state over the bytes before it}.
    prefixes: dict[int, dict[int, Any]] = field(default_factory=dict)
    # What the fill copied where (snapshot._pieces), for the next fill of the same plan.
    plan: PiecePlan | None = None


class PiecePlan(NamedTuple):
    """A fill's copies, piece by piece (snapshot._pieces), and what they were made for:
    (the buffer's address, the layout's regions, the storages kept, each storage's
    (address, size)). A fill whose key is equal copies the same ranges. `todo`: the
    pieces the fill copies or hashes (all but those of kept storages alone); `helped`:
    whether a second worker copies beside the caller (enough bytes, in full pieces)."""

    key: tuple[Any, ...]
    pieces: list[Any]
    todo: list[int]
    helped: bool


class _Watch:
    """This process's storages that changed without PyTorch counting it (copied at every
    save), and those the last audits found differing, with their counters of that save."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.suspects: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self.differed: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], str, str]] = (
            weakref.WeakKeyDictionary()
        )


WATCH = _Watch()


class BufferMemory:
    """One buffer's `FillRecord` and the audit of its last fill (slots.MappedFile holds
    one). A fill waits for the audit of the buffer's previous fill before it writes.

    An audit is due when its fill ends, and starts once the checkpoint is committed
    (`start_audits`): one started between a checkpoint's items would run beside the next
    item's copy until its next chunk (crew.QUIET pauses it only between chunks)."""

    def __init__(self) -> None:
        self.record: FillRecord | None = None
        self.reused_bytes = 0  # what its last fill did not write (kept storages, torch's bytes)
        self._due: Callable[[], None] | None = None  # the audit, not started yet
        self._audit: Job | None = None

    def settle(self) -> None:
        """Wait for the audit of the last fill (it reads the buffer); started now if it
        was only due (its checkpoint was never committed)."""
        self._start()
        audit, self._audit = self._audit, None
        if audit is not None:
            with QUIET.hurry():  # it waits for saves to end, and this is one
                audit.wait()

    def audit_later(self, base: int, layout: Layout, skipped: list[int], label: str) -> None:
        """Compare each skipped storage with the buffer in full, on the audit thread
        (crew.AUDIT_CREW, at low priority; module docstring), once `start_audits` is
        called; `label` names the item and checkpoint in a warning."""
        if not skipped:
            return
        held = [(layout.storages[i], layout.regions[i], layout.versions[i]) for i in skipped]
        with _DUE_LOCK:
            self._due = lambda: _audit(base, held, label)
            _DUE.append(self)

    def _start(self) -> None:
        with _DUE_LOCK:
            due, self._due = self._due, None
            if due is not None and self in _DUE:
                _DUE.remove(self)  # settled before the commit: not held on to
        if due is None:
            return
        try:
            self._audit = AUDIT_CREW.submit(due)
        except RuntimeError:  # interpreter exit: no new thread; nothing is compared
            return


_DUE: list[BufferMemory] = []  # buffers whose audit is due (`start_audits`)
_DUE_LOCK = threading.Lock()


def start_audits() -> None:
    """Start the audits of the fills done so far (a commit's, once it is done)."""
    with _DUE_LOCK:
        due = list(_DUE)
        _DUE.clear()
    for memory in due:
        memory._start()


def reusable(
    memory: BufferMemory | None,
    layout: Layout,
    base: int,
    seed: int,
    spans: tuple[tuple[int, int], ...],
) -> set[int]:
    """The indices of `layout`'s storages that the buffer at address `base` still holds
    from its last fill, by the evidence of the module docstring; none when the buffer has
    no record of the same layout, or at every `FULL_EVERY`-th fill. `spans`: each
    storage's (address, size) now."""
    record = None if memory is None else memory.record
    if (
        record is None
        or not layout.versions
        or record.size_bytes != layout.size_bytes
        or record.regions != layout.regions
        or _full_fill_due(record)
        or (record.segments is not layout.segments and record.segments != layout.segments)
    ):
        return set()
    keep: set[int] = set()
    with WATCH.lock:  # most processes have no storage under watch: not asked per storage
        watched = bool(WATCH.suspects) or bool(WATCH.differed)
    for i, (storage, mark, versions, (ptr, nbytes)) in enumerate(
        zip(layout.storages, record.marks, layout.versions, spans, strict=True)
    ):
        # Cheapest first: a changed storage's counters moved (a counted change; an audit's
        # finding then is of an older save). A mark is of a CPU storage, so the same
        # storage object on it needs no device check.
        if mark is None or versions != mark.versions or mark.ref() is not storage:
            continue
        if ptr != mark.ptr or nbytes != mark.nbytes:
            continue
        if watched and _confirmed_unseen(storage, versions):
            continue
        offset, length = layout.regions[i]
        if not _samples_agree(ptr, base + offset, length, seed + i):
            _suspect(storage, "its bytes differ from the last save's where nebula looked")
            continue
        keep.add(i)
    return keep


def holds_layout_bytes(record: FillRecord | None, layout: Layout) -> bool:
    """Whether the buffer whose last fill `record` describes still holds torch's own bytes
    and the zeros of `layout`: that fill was of this very layout (its cache's object), and
    this is not the FULL_EVERY-th fill since they were last written."""
    return record is not None and record.segments is layout.segments and not _full_fill_due(record)


def _full_fill_due(record: FillRecord) -> bool:
    """Whether the fill after `record` is the FULL_EVERY-th: it relies on nothing the
    buffer holds (every storage copied, torch's own bytes written)."""
    return record.fills_since_full >= FULL_EVERY - 1


def marks_of(
    layout: Layout,
    spans: tuple[tuple[int, int], ...],
    keep: set[int],
    last: tuple[StorageMark | None, ...] | None,
) -> tuple[StorageMark | None, ...]:
    """The marks of `layout`'s storages as they are now (the record of this fill), from
    `spans`, each storage's (address, size); a storage in `keep` (the evidence found it
    as `last`, the previous fill's marks) keeps its mark there."""
    if not layout.versions:
        return (None,) * len(layout.storages)
    host = layout.on_host()
    # tuple.__new__: a mark per storage per save, without NamedTuple's Python __new__.
    ref, new, mark = weakref.ref, tuple.__new__, StorageMark
    old = last if keep else None
    marks: list[StorageMark | None] = []
    append = marks.append
    for i, (s, (ptr, nbytes), v) in enumerate(
        zip(layout.storages, spans, layout.versions, strict=True)
    ):
        if old is not None and i in keep:
            append(old[i])  # the same storage, address, size and counters
        elif host or s.device.type == "cpu":
            append(new(mark, (ref(s), ptr, nbytes, v)))
        else:
            append(None)
    return tuple(marks)


def _confirmed_unseen(storage: Any, versions: tuple[int, ...]) -> bool:
    """Whether `storage` is known to change without PyTorch counting it: a suspect, or an
    audit found it differing and its counters have not moved since (then it becomes
    one, said once)."""
    with WATCH.lock:
        if storage in WATCH.suspects:
            return True
        found = WATCH.differed.pop(storage, None)
    if found is None or found[0] != versions:
        return False  # a change PyTorch counted, after the save the audit checked
    _, label, size = found
    log.warning(
        "%s: a tensor of %s bytes changed without PyTorch's version counter seeing it "
        "(written through .data, numpy or another library); that checkpoint may hold its "
        "value from an earlier save. nebula copies it at every save from now on "
        "(reuse_unchanged=False, NEBULA_REUSE_UNCHANGED=0, copies everything)",
        label,
        size,
    )
    with WATCH.lock:
        WATCH.suspects[storage] = label
    return True


def _suspect(storage: Any, why: str) -> None:
    log.debug("a storage of %d bytes is copied at every save from now on: %s",
              storage.nbytes(), why)  # fmt: skip
    with WATCH.lock:
        WATCH.suspects[storage] = why


def _samples_agree(src: int, dst: int, length: int, seed: int) -> bool:
    """Whether SAMPLE_WINDOWS windows of `length` bytes at `src` and `dst` agree: the
    first and the last, and others spread by `seed`."""
    if length <= SAMPLE_WINDOWS * SAMPLE_BYTES:
        return _memcmp(src, dst, length) == 0
    span = length - SAMPLE_BYTES
    if _memcmp(src, dst, SAMPLE_BYTES) or _memcmp(src + span, dst + span, SAMPLE_BYTES):
        return False
    step = span // (SAMPLE_WINDOWS - 1)
    for k in range(1, SAMPLE_WINDOWS - 1):
        at = (k * step + (seed * 2654435761 + k * 40503) % step) % span
        if _memcmp(src + at, dst + at, SAMPLE_BYTES):
            return False
    return True


def _audit(base: int, held: list[tuple[Any, tuple[int, int], tuple[int, ...]]], label: str) -> None:
    """Compare each (storage, region, versions) with the buffer at `base`; remember the
    storages that differ (module docstring). Runs at low priority (AUDIT_CREW)."""
    for storage, (offset, length), versions in held:
        ptr = storage.data_ptr()
        for at in range(0, length, _AUDIT_CHUNK_BYTES):
            QUIET.pause_point()  # not beside a save (crew.py)
            # A storage resized meanwhile is not read any further (its memory may be gone).
            if storage.data_ptr() != ptr or storage.nbytes() != length:
                break
            n = min(_AUDIT_CHUNK_BYTES, length - at)
            if _memcmp(ptr + at, base + offset + at, n) != 0:
                with WATCH.lock:
                    WATCH.differed[storage] = (versions, label, str(length))
                break
