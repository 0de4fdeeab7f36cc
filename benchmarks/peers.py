"""The checkpoint methods the benchmark compares, behind one interface (`Method`).

Each method saves `TrainState.state_dict()` (model and AdamW state) into its own folder,
one checkpoint per save, and says what the caller must wait for: `Pending.wait_mutable`
(before the next optimizer step may change the tensors) and `Pending.wait_durable` (until
the checkpoint is on disk, fsynced). The peers here:

  torch_save        `torch.save` into a new file, flush, fsync file and folder (synchronous)
  dcp_save          `torch.distributed.checkpoint.save` (FileSystemWriter fsyncs; no
                    process group: `no_dist=True`, a single process)
  dcp_async         `dcp.async_save` with its default stager (a new staged copy each save,
                    staged before the call returns; the upload runs in a thread)
  dcp_async_reused  `dcp.async_save` with one `DefaultStager` reused across saves
                    (staging buffers cached; staging itself runs in the stager's thread,
                    so the caller waits on `staging_completion` before mutating)
  torchsnapshot     `Snapshot.async_take`; torchsnapshot does not fsync, so its files are
                    fsynced in a helper thread once the snapshot completes, and that counts
                    toward "durable"

An async method waits for its previous save to be durable before it starts the next one
(DCP with a reused stager must: the staging buffers are rewritten). Nebula's methods are
in nebula_methods.py.

Not for: timing (bench.py, runner.py) or measuring memory (measure.py).
"""

from __future__ import annotations

import os
import shutil
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from measure import fsync_tree
from model import TrainState


class Unavailable(Exception):
    """The method cannot run on this machine; the message says why."""


def no_wait() -> None:
    """A `Pending` wait that has nothing to wait for."""


@dataclass(slots=True)
class Pending:
    """A save that returned: what the caller waits for afterwards."""

    wait_mutable: Callable[[], Any] = no_wait
    wait_durable: Callable[[], Any] = no_wait


@dataclass
class Method(ABC):
    """One way to checkpoint. Subclasses implement `save`, `load`, and say what they hold."""

    name: str
    label: str
    # The caller may run the next forward/backward before `wait_mutable` (the stall
    # benchmark models a real step for such methods).
    defers_fence: bool = False
    # The method's session is process-wide (nebula's): two such methods cannot both be
    # running, so `deactivate` shuts it down. The loop runs each of these in a stretch of
    # its own, one session throughout, as a training job does.
    exclusive_session: bool = False
    folder: Path = field(default=Path("."), init=False)
    saved: list[Path] = field(default_factory=list, init=False)  # oldest first
    started: bool = field(default=False, init=False)

    def setup(self, folder: Path, state: TrainState) -> None:
        """Start on an empty `folder`; raises `Unavailable` if the method cannot run."""
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        self.folder, self.saved, self.started = folder, [], False

    def activate(self, state: TrainState) -> bool:
        """Make the method ready to save; True if that (re)started it, so that the next
        save would be a first save (the caller then saves untimed first)."""
        first, self.started = not self.started, True
        return first

    def deactivate(self, *, keep_memory: bool = True) -> None:
        """Another method is about to run (nebula's session is process-wide)."""
        return None  # nothing to do, unless a subclass says otherwise

    @abstractmethod
    def save(self, state: TrainState, step: int) -> Pending:
        """Start a checkpoint of `state` tagged `step`; returns once the call unblocks."""

    @abstractmethod
    def load(self, state: TrainState, *, from_disk: bool) -> Any:
        """Resume from the newest checkpoint: the fastest way (`from_disk=False`) or
        from the persistent copy (the caller has dropped it from the page cache)."""

    def release(self) -> None:
        """The last timed save is done: free what only saving needs (loads follow)."""
        return None  # nothing to do, unless a subclass says otherwise

    def prepare_disk_load(self) -> None:
        """Make the next loads read the persistent tier (nebula drops its memory tier)."""
        return None  # nothing to do, unless a subclass says otherwise

    def latest(self) -> Path:
        """Where the newest checkpoint's files are (for sizes and page-cache control)."""
        return self.saved[-1]

    def disk_paths(self) -> list[Path]:
        """Files a load from disk reads; the caller evicts them from the page cache."""
        return [self.latest()]

    def fast_load_paths(self) -> list[Path]:
        """Files the fastest resume reads; the caller reads them once so they are cached."""
        return self.disk_paths()

    def shm_dirs(self) -> list[Path]:
        """Folders in RAM (tmpfs) that this method fills; counted as its extra memory."""
        return []

    def retained_bytes(self, state: TrainState) -> int:
        """Memory the method keeps between saves (e.g. a reused staging buffer)."""
        return 0

    def prune(self) -> None:
        """Delete all but the newest checkpoint (untimed; keeps the disk from filling)."""
        for old in self.saved[:-1]:
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
        self.saved = self.saved[-1:]

    def teardown(self) -> None:
        """Wait for what is in flight and delete everything the method wrote."""
        shutil.rmtree(self.folder, ignore_errors=True)


class TorchSave(Method):
    """`torch.save` (default settings) into a new file, then fsync."""

    def __init__(self) -> None:
        super().__init__("torch_save", "torch.save+fsync")

    def save(self, state: TrainState, step: int) -> Pending:
        path = self.folder / f"step{step}.pt"
        with open(path, "wb") as f:
            torch.save(state.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.saved.append(path)
        return Pending()

    def load(self, state: TrainState, *, from_disk: bool) -> Any:
        return torch.load(self.latest(), weights_only=True)


class DcpSave(Method):
    """`torch.distributed.checkpoint.save`, synchronous."""

    def __init__(self) -> None:
        super().__init__("dcp_save", "dcp.save")

    def save(self, state: TrainState, step: int) -> Pending:
        path = self.folder / f"step{step}"
        _dcp().save(state.state_dict(), checkpoint_id=path, no_dist=True)
        self.saved.append(path)
        return Pending()

    def load(self, state: TrainState, *, from_disk: bool) -> Any:
        # DCP loads in place, into the model's and optimizer's own tensors.
        target = state.state_dict()
        _dcp().load(target, checkpoint_id=self.latest(), no_dist=True)
        return target


class DcpAsync(Method):
    """`dcp.async_save`, with its default stager or with one reused `DefaultStager`."""

    def __init__(self, *, reused_stager: bool) -> None:
        if reused_stager:
            super().__init__(
                "dcp_async_reused", "dcp.async_save (reused stager)", defers_fence=True
            )
        else:
            super().__init__("dcp_async", "dcp.async_save (default stager)")
        self.reused_stager = reused_stager
        self._stager: Any = None
        self._inflight: Future[Any] | None = None

    def setup(self, folder: Path, state: TrainState) -> None:
        super().setup(folder, state)
        if self.reused_stager:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # On a CPU-only machine pinned memory and non-blocking copies do not apply
            # (DefaultStager refuses non_blocking without an accelerator); staging in the
            # stager's own thread, into cached buffers, is what it offers here.
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=torch.cuda.is_available(),
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=torch.cuda.is_available(),
                )
            )

    def save(self, state: TrainState, step: int) -> Pending:
        if self._inflight is not None:
            self._inflight.result()  # one save in flight; a reused stager's buffers are busy
        path = self.folder / f"step{step}"
        if self.reused_stager:
            response = _dcp().async_save(
                state.state_dict(), checkpoint_id=path, async_stager=self._stager, no_dist=True
            )
            self._inflight = response.upload_completion
            self.saved.append(path)
            return Pending(response.staging_completion.result, response.upload_completion.result)
        future = _dcp().async_save(state.state_dict(), checkpoint_id=path, no_dist=True)
        self._inflight = future
        self.saved.append(path)
        return Pending(no_wait, future.result)

    def load(self, state: TrainState, *, from_disk: bool) -> Any:
        target = state.state_dict()
        _dcp().load(target, checkpoint_id=self.latest(), no_dist=True)
        return target

    def retained_bytes(self, state: TrainState) -> int:
        # The stager keeps one staged copy of every storage between saves, by design.
        return state.state_bytes if self._stager is not None and self.started else 0

    def release(self) -> None:
        if self._inflight is not None:
            self._inflight.result()
            self._inflight = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def teardown(self) -> None:
        self.release()
        super().teardown()


class TorchSnapshot(Method):
    """torchsnapshot's `Snapshot.async_take`, made durable by an fsync of its files."""

    def __init__(self) -> None:
        super().__init__("torchsnapshot", "torchsnapshot async_take")
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future[None] | None = None

    def setup(self, folder: Path, state: TrainState) -> None:
        try:
            import torchsnapshot  # noqa: F401
        except ImportError as exc:
            raise Unavailable("torchsnapshot is not installed: pip install -e '.[bench]'") from exc
        super().setup(folder, state)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="bench-torchsnapshot")

    def save(self, state: TrainState, step: int) -> Pending:
        from torchsnapshot import Snapshot

        if self._inflight is not None:
            self._inflight.result()
        path = self.folder / f"step{step}"
        app_state = {"model": state.model, "optimizer": state.optimizer}
        pending = Snapshot.async_take(path=str(path), app_state=app_state)

        def complete() -> None:
            pending.wait()
            fsync_tree([path])

        assert self._executor is not None
        self._inflight = self._executor.submit(complete)
        self.saved.append(path)
        return Pending(no_wait, self._inflight.result)

    def load(self, state: TrainState, *, from_disk: bool) -> Any:
        from torchsnapshot import Snapshot

        # Restores in place, into the model's and optimizer's own tensors.
        Snapshot(path=str(self.latest())).restore(
            {"model": state.model, "optimizer": state.optimizer}
        )
        return None

    def teardown(self) -> None:
        if self._inflight is not None:
            self._inflight.result()
            self._inflight = None
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        super().teardown()


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    # DCP warns on every call without a process group, even with no_dist=True.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    return dcp
