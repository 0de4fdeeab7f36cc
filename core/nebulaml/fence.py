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
Buffers a forward pass updates (BatchNorm's running statistics) break it: such models
save without `lazy_snapshot`.

Not for: what a snapshot writes (snapshot.py, checkpoint.py).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
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
