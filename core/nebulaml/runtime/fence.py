"""Lazy snapshots: `save()` returns at once, the copy overlaps the next forward/backward.

With `nm.init(..., lazy_snapshot=True)` (or `NEBULA_LAZY_SNAPSHOT=1`), and by default
("auto") where runtime/save.py's `_copy_now` finds every write watched, a save only records
what to copy; one background thread takes the snapshot (the copy of the tensors into the
memory tier), then hashes it and commits. The training loop may run its next forward and
backward meanwhile, because they read parameters without changing them. The *fence* is
where that stops: before any `optimizer.step()` (a global optimizer step pre-hook) the
training thread waits until every pending copy is done, and so does every other call into
nebula (which also waits for the commits, and raises a background failure once).

The contract, said in the docs of `init`: between a lazy save and the fence, the saved
tensors must not be changed in place by anything but the optimizer's step (which waits).
Three things hold it where a training loop would break it (`take`):

- storages of at most `COPY_NOW_BYTES` are copied by `save()` itself, and the background
  fills from those copies. A forward pass writes BatchNorm's running statistics in place,
  and without bumping their version counters, so nothing could see it happen; copying
  them now costs little (a GPT-2 state has about 1 MB of them);
- every larger tensor's version counter is read at the save and again after its copy
  (`Taken.changed`): an in-place change in between (`w.add_(1)` under `no_grad`, `copy_`, ...)
  fails the save with `SnapshotChangedError`, and the checkpoint is not committed;
- where the kernel records written pages (Linux 6.7, userfaultfd allowed:
  write_watch.py), the whole pages of every larger host storage are write-protected at
  the save and its few edge bytes taken at once (lazy_watch.py): a write before the copy
  by anything (`.data`, a NumPy view, a pointer, another thread, a kernel of another
  library) fails the save the same way.

What is not seen: where the kernel cannot record written pages, a write through `.data`,
or by a native kernel that does not bump the version counter, into a tensor larger than
`COPY_NOW_BYTES`; anywhere, a write by DMA or another process into a pinned or shared
storage, or into a device's memory, that bumps no version counter.

Not for: what a snapshot writes (snapshot.py, checkpoint.py).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from nebulaml._threads import start as start_thread
from nebulaml.format.torchzip import Layout
from nebulaml.runtime.lazy_watch import LazyWatch

log = logging.getLogger("nebulaml")


class SnapshotWorker:
    """Runs snapshot jobs in submission order on one thread.

    A job is a copy (it reads the caller's tensors: the fence waits for it) or a tail (it
    reads only nebula's own buffers: hashing, committing). The first failure is kept and
    raised once by `wait()`; later jobs of that checkpoint still run and fail on their own.

    Example:
        >>> worker = SnapshotWorker()
        >>> out = []
        >>> worker.submit(lambda: out.append(1), copies=True)
        >>> worker.wait()
        >>> out
        [1]
        >>> worker.close()
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs: deque[tuple[Callable[[], Any], bool, str | None]] = deque()
        self._tags: dict[str, int] = {}  # jobs queued or running, by checkpoint tag
        self._copies = 0  # copy jobs queued or running
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._held = 0  # the jobs at the queue's tail that wait (`submit`)
        self.small = SmallCopies()  # the small storages' copies, reused (`take`)
        self.watch = LazyWatch()  # the writes to what is not copied yet (lazy_watch.py)
        self.stepped = False  # a torch optimizer stepped in this session (the fence ran)
        self._thread = threading.Thread(target=self._run, name="nebula-snapshot", daemon=True)
        start_thread(self._thread)
        self._hook: Any = None

    def submit(
        self, job: Callable[[], Any], *, copies: bool, hold: bool = False, tag: str | None = None
    ) -> None:
        """Queue `job` (of checkpoint `tag`, if given: `busy_with`). A job submitted with
        `hold` waits until a job without it is submitted, or `wait` or `close` is called:
        a lazy save's copy waits for the checkpoint's commit, so that the saves of its
        next items (each a few hundred small copies in Python) do not take turns at the
        GIL with it (5-10 ms instead of 1.4 for an AdamW state's)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the snapshot worker is closed")
            self._jobs.append((job, copies, tag))
            self._copies += int(copies)
            if tag is not None:
                self._tags[tag] = self._tags.get(tag, 0) + 1
            self._held = self._held + 1 if hold else 0
            self._cond.notify_all()

    def wait(self, *, copies_only: bool = False, raise_error: bool = True) -> None:
        """Block until the copies (or every job) submitted so far are done; then raise
        the first background failure, once."""
        if threading.current_thread() is self._thread:
            return  # a job calling into nebula must not wait for itself
        with self._cond:
            self._held = 0
            self._cond.notify_all()
            while self._copies if copies_only else (self._jobs or self._busy):
                self._cond.wait()
            error = self._error if raise_error else None
            if error is not None:
                self._error = None
        if error is not None:
            raise error

    def busy_with(self, tag: str) -> bool:
        """Whether a job of checkpoint `tag` is queued or running: a new save of that tag
        (`overwrite`, Lightning's `last`) waits for it before it touches the folder."""
        with self._cond:
            return tag in self._tags

    def raise_error(self) -> None:
        """Raise the first background failure, once, without waiting for anything."""
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def install_fence(self) -> None:
        """Wait for the copies before any optimizer step changes the parameters."""
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        def fence(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            # The step is the training loop's, not nebula's: a failed snapshot is raised
            # by the next call into nebula, not from inside optimizer.step().
            self.stepped = True
            self.wait(copies_only=True, raise_error=False)

        self._hook = register_optimizer_step_pre_hook(fence)

    def close(self) -> None:
        """Run what is queued, stop the thread, remove the fence. Errors stay for `wait`."""
        with self._cond:
            self._closed = True
            self._held = 0
            self._cond.notify_all()
        self._thread.join()
        self.watch.close()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while len(self._jobs) <= self._held and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job, copies, tag = self._jobs.popleft()
                self._busy = True
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - kept, and raised by wait()
                log.error("a lazy snapshot failed: %s", exc)
                with self._cond:
                    if self._error is None:
                        self._error = exc
            finally:
                with self._cond:
                    self._busy = False
                    self._copies -= int(copies)
                    if tag is not None:
                        self._tags[tag] -= 1
                        if not self._tags[tag]:
                            del self._tags[tag]
                    self._cond.notify_all()


COPY_NOW_BYTES = 64 * 1024  # storages this small are copied by a lazy save() itself

# memmove that keeps the GIL: a lazy save() copies a few hundred small storages while the
# background fills the item saved before it, and a copy that let the GIL go would wait
# to get it back each time (ctypes.memmove lets it go: 1.1 ms instead of 0.2 for 154
# storages, measured against a fill on two threads).
_memmove_holding_gil = ctypes.PYFUNCTYPE(
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t
)(ctypes.cast(ctypes.memmove, ctypes.c_void_p).value or 0)


# A tensor's place in the object, as `take` met it: (the place of its container, its key
# there), from () for the object itself. Spelt out (`spelt`) only when it is reported:
# building every place's string costs a save 0.4 ms of its 2 for a GPT-2 state.
Place = tuple[Any, ...]


def spelt(place: Place) -> str:
    """A place as the keys that reach it: "['state']['w']"."""
    keys = []
    while place:
        place, key = place
        keys.append(f"[{key!r}]")
    return "".join(reversed(keys))


@dataclass(frozen=True)
class Taken:
    """What a lazy `save()` took at once (`take`): a copy of every storage of at most
    `COPY_NOW_BYTES` bytes, by its `_cdata`, and each larger tensor with its place in the
    object and its version counter at the save."""

    copies: dict[int, Any]
    places: tuple[tuple[Place, Any, int], ...]

    def large(self) -> list[tuple[Place, Any]]:
        """The larger tensors, each with its place (`spelt` says it)."""
        return [(place, t) for place, t, _version in self.places]

    def changed(self) -> list[str]:
        """The places of the watched tensors changed in place since the save."""
        return [spelt(place) for place, t, version in self.places if t._version != version]

    def on_copies(self, layout: Layout) -> Layout:
        """`layout` filled from the copies where it has them."""
        if not self.copies:
            return layout
        storages = tuple(self.copies.get(s._cdata, s) for s in layout.storages)
        return replace(layout, storages=storages)

    def substitute(self, obj: Any) -> Any:
        """`obj` with every tensor whose storage was copied moved onto its copy, for
        objects that torch.save writes (their layout could not be planned). Dicts,
        OrderedDicts (with their attributes, such as a state dict's `_metadata`), lists
        and tuples are rebuilt, never changed, others kept as they are; what was one
        object stays one object."""
        import torch

        memo: dict[int, Any] = {}

        def visit(value: Any) -> Any:
            kind = type(value)
            if id(value) in memo:
                return memo[id(value)]
            if kind in (torch.Tensor, torch.nn.Parameter):
                if not _plain(value):  # a sparse tensor, say: no storage to ask for
                    return value
                copy = self.copies.get(value.untyped_storage()._cdata)
                if copy is None:
                    return value
                new = torch.empty((0,), dtype=value.dtype, device=value.device)
                new.set_(copy, value.storage_offset(), value.size(), value.stride())
                if kind is torch.nn.Parameter:
                    new = torch.nn.Parameter(new, requires_grad=value.requires_grad)
                else:
                    new.requires_grad_(value.requires_grad)
                memo[id(value)] = new
            elif kind is tuple:
                memo[id(value)] = tuple(visit(v) for v in value)
            elif kind is list:
                items: list[Any] = []
                memo[id(value)] = items  # first, so that a list holding itself ends
                items.extend(visit(v) for v in value)
            elif kind in (dict, OrderedDict):
                mapping = memo[id(value)] = kind()
                if kind is OrderedDict:
                    mapping.__dict__.update(vars(value))
                for k, v in value.items():
                    mapping[k] = visit(v)
            else:
                return value
            return memo[id(value)]

        return visit(obj)


def _plain(tensor: Any) -> bool:
    import torch

    return (
        tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.__dict__
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


class SmallCopies:
    """`take` for each lazy save, with the copies of each item name's last save used
    again once its background copy is done: fresh memory costs page faults, and on a VM
    that hands freed pages back to its host, 2-30 ms for a GPT-2 state's 600 small
    storages (0.5 ms when the copies are reused).

    Example:
        >>> import torch
        >>> small = SmallCopies()
        >>> stats = torch.zeros(4)
        >>> first = small.take("model", {"stats": stats})
        >>> small.give_back("model", first)
        >>> second = small.take("model", {"stats": stats.add_(1)})
        >>> [c.data_ptr() for c in second.copies.values()] == [
        ...     c.data_ptr() for c in first.copies.values()]
        True
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[str, dict[int, Any]] = {}

    def take(self, name: str, obj: Any) -> Taken:
        """`take(obj)`, into the free copies of `name` where they fit."""
        with self._lock:
            free = self._free.pop(name, {})
        return take(obj, free)

    def give_back(self, name: str, taken: Taken) -> None:
        """The background is done with `taken`: its copies may serve the next save of
        `name` (one set is kept per name)."""
        with self._lock:
            self._free[name] = taken.copies


def take(obj: Any, free: dict[int, Any] | None = None) -> Taken:
    """Copy now every storage of at most `COPY_NOW_BYTES` bytes that `obj` reaches
    through dicts, lists and tuples, and read every other tensor's version counter.

    A host storage is copied with memmove; a CUDA storage on the current stream (before
    the save's ready event). A copy goes into `free[key]` (the copies of an earlier
    save, by the source's `_cdata`) where that is of the same size and device, else into
    new memory. The background fills from the copies (`Taken.on_copies`); a view keeps
    sharing its storage's copy.

    Example:
        >>> import torch
        >>> stats, weights = torch.zeros(4), torch.zeros(100_000)
        >>> taken = take({"stats": stats, "w": weights})
        >>> _ = stats.add_(1), weights.add_(1)
        >>> [torch.tensor([]).set_(c).sum().item() for c in taken.copies.values()]
        [0.0]
        >>> taken.changed()
        ["['w']"]
    """
    import torch

    copies: dict[int, Any] = {}
    watched: list[tuple[Place, Any, int]] = []
    seen: set[int] = set()
    free = free or {}

    def visit(value: Any, place: Place) -> None:
        kind = type(value)
        if kind not in (dict, OrderedDict, list, tuple) and not isinstance(value, torch.Tensor):
            return
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            # Subclasses (a DTensor, say) may have no storage of their own to copy.
            plain = type(value) in (torch.Tensor, torch.nn.Parameter) and _plain(value)
            storage = value.untyped_storage() if plain else None
            if storage is None or storage.nbytes() > COPY_NOW_BYTES:
                watched.append((place, value, value._version))
            elif storage._cdata not in copies:
                copies[storage._cdata] = _copy(storage, free.get(storage._cdata))
        elif kind in (list, tuple):
            for i, v in enumerate(value):
                visit(v, (place, i))
        else:
            for k, v in value.items():
                visit(v, (place, k))

    visit(obj, ())
    return Taken(copies, tuple(watched))


def _copy(storage: Any, into: Any = None) -> Any:
    import torch

    n = storage.nbytes()
    if into is None or into.nbytes() != n or into.device != storage.device:
        if storage.device.type != "cpu":
            return storage.clone()
        into = torch.UntypedStorage(n)
    if storage.device.type != "cpu":
        into.copy_(storage, non_blocking=True)
    elif n:
        _memmove_holding_gil(into.data_ptr(), storage.data_ptr(), n)
    return into
