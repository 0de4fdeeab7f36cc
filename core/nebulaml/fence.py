"""Lazy snapshots: `save()` returns at once, the copy overlaps the next forward/backward.

With `nm.init(..., lazy_snapshot=True)` (or `NEBULA_LAZY_SNAPSHOT=1`) a save only records
what to copy; one background thread takes the snapshot (the copy of the tensors into the
memory tier), then hashes it and commits. The training loop may run its next forward and
backward meanwhile, because they read parameters without changing them. The *fence* is
where that stops: before any `optimizer.step()` (a global optimizer step pre-hook) the
training thread waits until every pending copy is done, and so does every other call into
nebula (which also waits for the commits, and raises a background failure once).

The contract, said in the docs of `init`: between a lazy save and the fence, the saved
tensors must not be changed in place by anything but the optimizer's step (which waits).
Two things hold it where a training loop would break it (`copy_small`):

- tensors whose storage is at most `COPY_NOW_BYTES` are copied by `save()` itself. A
  forward pass writes BatchNorm's running statistics in place, and without bumping their
  version counters, so nothing could see it happen: copying them now costs a few
  milliseconds (a GPT-2 state has about 1 MB of such tensors);
- every larger tensor's version counter is read at the save and again after its copy
  (`Watch`): an in-place change in between (`w.add_(1)` under `no_grad`, `copy_`, ...)
  fails the save with `SnapshotChangedError`, and the checkpoint is not committed.

What neither sees: a write through `.data`, or by a native kernel that does not bump the
version counter, into a tensor larger than `COPY_NOW_BYTES`.

Not for: what a snapshot writes (snapshot.py, checkpoint.py).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
        self._jobs: deque[tuple[Callable[[], Any], bool]] = deque()
        self._copies = 0  # copy jobs queued or running
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="nebula-snapshot", daemon=True)
        self._thread.start()
        self._hook: Any = None

    def submit(self, job: Callable[[], Any], *, copies: bool) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the snapshot worker is closed")
            self._jobs.append((job, copies))
            self._copies += int(copies)
            self._cond.notify_all()

    def wait(self, *, copies_only: bool = False, raise_error: bool = True) -> None:
        """Block until the copies (or every job) submitted so far are done; then raise
        the first background failure, once."""
        if threading.current_thread() is self._thread:
            return  # a job calling into nebula must not wait for itself
        with self._cond:
            while self._copies if copies_only else (self._jobs or self._busy):
                self._cond.wait()
            error = self._error if raise_error else None
            if error is not None:
                self._error = None
        if error is not None:
            raise error

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
            self.wait(copies_only=True, raise_error=False)

        self._hook = register_optimizer_step_pre_hook(fence)

    def close(self) -> None:
        """Run what is queued, stop the thread, remove the fence. Errors stay for `wait`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job, copies = self._jobs.popleft()
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
                    self._cond.notify_all()


COPY_NOW_BYTES = 64 * 1024  # storages this small are copied by a lazy save() itself


@dataclass(frozen=True)
class Watch:
    """The tensors a lazy save left for the background copy, each with its place in the
    object and its version counter at the save."""

    tensors: tuple[tuple[str, Any, int], ...]

    def changed(self) -> list[str]:
        """The places of the tensors changed in place since the save."""
        return [path for path, tensor, version in self.tensors if tensor._version != version]


def copy_small(obj: Any) -> tuple[Any, Watch]:
    """`obj` with every tensor whose storage is at most `COPY_NOW_BYTES` bytes copied now,
    and a `Watch` over the others.

    Dicts, OrderedDicts (with their attributes, such as a state dict's `_metadata`), lists
    and tuples are rebuilt, never changed; other objects are kept as they are, unvisited.
    What was one object stays one object, and views of one storage stay views of one
    copy, so the file is what `torch.save(obj)` would have written at the save.

    Example:
        >>> import torch
        >>> stats, weights = torch.zeros(4), torch.zeros(100_000)
        >>> saved, watch = copy_small({"stats": stats, "w": weights})
        >>> _ = stats.add_(1), weights.add_(1)
        >>> saved["stats"].sum().item(), saved["w"] is weights, watch.changed()
        (0.0, True, ["['w']"])
    """
    import torch

    memo: dict[int, Any] = {}
    storages: dict[int, Any] = {}
    watched: list[tuple[str, Any, int]] = []

    def tensor(value: Any, path: str) -> Any:
        storage = value.untyped_storage()
        plain = type(value) in (torch.Tensor, torch.nn.Parameter) and not value.__dict__
        if (
            not plain
            or storage.nbytes() > COPY_NOW_BYTES
            or value.layout != torch.strided
            or value.is_conj()
            or value.is_neg()
        ):
            watched.append((path, value, value._version))
            return value
        copied = storages.get(storage._cdata)
        if copied is None:
            copied = storages[storage._cdata] = storage.clone()
        new = torch.empty((0,), dtype=value.dtype, device=value.device)
        new.set_(copied, value.storage_offset(), value.size(), value.stride())
        if type(value) is torch.nn.Parameter:
            return torch.nn.Parameter(new, requires_grad=value.requires_grad)
        return new.requires_grad_(value.requires_grad)

    def visit(value: Any, path: str) -> Any:
        kind = type(value)
        if kind not in (dict, OrderedDict, list, tuple) and not isinstance(value, torch.Tensor):
            return value
        if id(value) in memo:
            return memo[id(value)]
        if isinstance(value, torch.Tensor):
            memo[id(value)] = tensor(value, path)
        elif kind is tuple:
            memo[id(value)] = tuple(visit(v, f"{path}[{i}]") for i, v in enumerate(value))
        elif kind is list:
            items: list[Any] = []
            memo[id(value)] = items  # first, so that a list holding itself ends
            items.extend(visit(v, f"{path}[{i}]") for i, v in enumerate(value))
        else:
            mapping = memo[id(value)] = kind()
            if kind is OrderedDict:
                mapping.__dict__.update(vars(value))
            for k, v in value.items():
                mapping[k] = visit(v, f"{path}[{k!r}]")
        return memo[id(value)]

    return visit(obj, ""), Watch(tuple(watched))
