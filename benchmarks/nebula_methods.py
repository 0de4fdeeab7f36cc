"""nebula as a benchmark method: the default (synchronous snapshot) and the lazy mode.

A save is what a training script does: `Checkpoint(tag, 2)`, `save("model", ...)`,
`save("optimizer", ...)` (the second save commits in the memory tier; the persist to the
work folder runs in nebula's background thread). The caller may mutate the state once
`save` returns, or, in lazy mode, once `nm.wait_for_snapshot()` returns (lazy mode also
fences by itself before `optimizer.step()`). Durable: `nm.flush_persistence()` returned.

nebula's session is process-wide, so the two variants take turns: `activate` calls
`nm.init` for this variant's root, and `deactivate` shuts the session down and, unless
asked to keep it, deletes the variant's memory tier (RAM). After a (re)start the next
save is a first save, so the harness's first two saves of each start are its cold saves,
reported apart (the first makes its buffers; the second takes the spare ones made in the
background meanwhile; from the third on, buffers come back from evicted checkpoints).

Loading from disk: the session is shut down and the memory tier deleted
(`shutil.rmtree(nm.memory_tier_path(root))`); `nm.get_latest_checkpoint(root)` then finds
only the persistent copy, and its `load` reads (and verifies) the files in the work folder.

DCP through nebula (`NebulaDcp`): `dcp.save` or `dcp.async_save` of the same state with
`storage_writer=nebulaml.dcp.Writer(tag)` (no process group: `no_dist=True`), beside DCP's
own FileSystemWriter rows. The call returns once the checkpoint is committed in the memory
tier (async: staged by DCP's default stager; the rest runs in DCP's thread); durable: the
upload finished and `nm.flush_persistence()` returned. Loads: `dcp.load` in place through
`nebulaml.dcp.Reader`.

Not for: the peers (peers.py) or timing (runner.py).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

from model import TrainState
from peers import Method, Pending, Unavailable, no_wait

import nebulaml as nm

RETENTION = 2


def init_nebula(
    root: Path | str, *, lazy: bool | None, storage_options: dict[str, Any] | None = None
) -> str | None:
    """`nm.init` for `root` (a folder, or a URL such as az://container/path with its
    `storage_options`), with `lazy_snapshot=lazy` (None: nebula's default); returns None,
    or why the lazy mode is not available (then no session is left running)."""
    kwargs: dict[str, Any] = {"persistent_time_interval": 0, "num_of_version_in_retention": 2}
    if storage_options is not None:
        kwargs["storage_options"] = storage_options
    if lazy is False:
        kwargs["lazy_snapshot"] = False
    if not lazy:
        nm.init(str(root), **kwargs)
        return None
    if not hasattr(nm, "wait_for_snapshot"):
        return "this nebulaml has no lazy mode (no nm.wait_for_snapshot)"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            nm.init(str(root), lazy_snapshot=True, **kwargs)
        except TypeError as exc:
            return f"nm.init does not take lazy_snapshot ({exc})"
    ignored = [w for w in caught if "lazy_snapshot" in str(w.message)]
    if ignored:
        nm.shutdown()
        return f"nm.init ignored lazy_snapshot: {ignored[0].message}"
    return None


class Nebula(Method):
    """nebula: its default (`lazy=None`: `lazy_snapshot="auto"`, a copy deferred to the
    next optimizer step where every write is seen), every snapshot synchronous
    (`lazy=False`) or every one lazy (`lazy=True`); persisting into the work folder, or
    to `url` (e.g. az://container/path, with `storage_options`). `name` and `label` tell
    apart rows that save different states the same way. The default and lazy rows are
    timed to the fence (`wait_for_snapshot`, after the next forward and backward)."""

    def __init__(
        self,
        *,
        lazy: bool | None,
        name: str | None = None,
        label: str | None = None,
        url: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if lazy:
            super().__init__("nebula_lazy", "nebula lazy", defers_fence=True)
        elif lazy is None:
            super().__init__("nebula", "nebula", defers_fence=True)
        else:
            super().__init__("nebula_sync", "nebula, lazy_snapshot=False")
        self.name, self.label = name or self.name, label or self.label
        self.exclusive_session = True
        self.lazy = lazy
        self.active = False
        self.tags: list[str] = []
        self.url = url
        self.storage_options = storage_options

    @property
    def root(self) -> Path:
        return self.folder / "root"

    @property
    def root_url(self) -> str:
        """The persistent root nebula is given: `url`, else the work folder's root."""
        return self.url or str(self.root)

    def memory_tier(self) -> Path:
        with nm.using_storage_options(self.storage_options or {}):  # an S3 endpoint's
            return Path(nm.memory_tier_path(self.root_url))

    def _init(self) -> str | None:
        return init_nebula(self.root_url, lazy=self.lazy, storage_options=self.storage_options)

    def setup(self, folder: Path, state: TrainState) -> None:
        super().setup(folder, state)
        shutil.rmtree(self.memory_tier(), ignore_errors=True)
        self.tags = []
        reason = self._init()  # a probe: is this mode here?
        if reason is not None:
            raise Unavailable(reason)
        nm.shutdown()
        self.active = False

    def activate(self, state: TrainState) -> bool:
        first = super().activate(state)
        if self.active:
            return first
        reason = self._init()
        if reason is not None:  # it was available at setup
            raise RuntimeError(f"{self.label}: {reason}")
        self.active = True
        return True

    def deactivate(self, *, keep_memory: bool = True) -> None:
        if self.active:
            nm.shutdown()
            self.active = False
        if not keep_memory:
            shutil.rmtree(self.memory_tier(), ignore_errors=True)

    def save(self, state: TrainState, step: int) -> Pending:
        tag = f"global_step{step}"
        ckpt = nm.Checkpoint(tag, 2)
        ckpt.save("model", state.model.state_dict())
        ckpt.save("optimizer", state.optimizer.state_dict())
        self.tags.append(tag)
        if self.url is None:
            self.saved = [self.root / t for t in self.tags[-RETENTION:]]
        wait = no_wait if self.lazy is False else nm.wait_for_snapshot
        return Pending(wait, nm.flush_persistence)

    def load(self, state: TrainState, *, from_disk: bool) -> Any:
        ckpt = nm.get_latest_checkpoint(self.root_url)
        if ckpt is None:
            raise RuntimeError(f"{self.label}: no checkpoint under {self.root_url}")
        return {"model": ckpt.load("model"), "optimizer": ckpt.load("optimizer")}

    def prepare_disk_load(self) -> None:
        self.deactivate(keep_memory=False)
        newest = nm.list_checkpoints(self.root_url)[0]
        if newest["tiers"] != ["persistent"]:
            raise RuntimeError(f"{self.label}: {newest['tag']} is still in {newest['tiers']}")

    def disk_paths(self) -> list[Path]:
        return [self.root]

    def fast_load_paths(self) -> list[Path]:
        return []  # the memory tier is RAM already

    def shm_dirs(self) -> list[Path]:
        return [self.memory_tier()]

    def prune(self) -> None:
        """Retention (2 on the persistent tier) is nebula's own job."""

    def teardown(self) -> None:
        self.deactivate(keep_memory=False)
        super().teardown()


class NebulaDcp(Nebula):
    """`dcp.save` / `dcp.async_save` with nebula's DCP storage writer (nebulaml.dcp)."""

    def __init__(self, *, async_save: bool) -> None:
        super().__init__(lazy=False)  # DCP's own staging decides when the state is read
        if async_save:
            self.name, self.label = "nebula_dcp_async", "dcp.async_save -> nebula writer"
        else:
            self.name, self.label = "nebula_dcp", "dcp.save -> nebula writer"
        self.async_save = async_save
        self._inflight: Any = None

    def save(self, state: TrainState, step: int) -> Pending:
        import nebulaml.dcp

        dcp = _dcp()
        if self._inflight is not None:
            self._inflight.result()  # one save in flight, as for DCP's own async rows
        tag = f"global_step{step}"
        writer = nebulaml.dcp.Writer(tag)
        self.tags.append(tag)
        self.saved = [self.root / t for t in self.tags[-RETENTION:]]
        if not self.async_save:
            dcp.save(state.state_dict(), storage_writer=writer, no_dist=True)
            return Pending(no_wait, nm.flush_persistence)
        future = dcp.async_save(state.state_dict(), storage_writer=writer, no_dist=True)
        self._inflight = future

        def durable() -> None:
            future.result()
            nm.flush_persistence()

        return Pending(no_wait, durable)

    def load(self, state: TrainState, *, from_disk: bool) -> Any:
        import nebulaml.dcp

        target = state.state_dict()  # DCP loads in place, as for DCP's own rows
        reader = nebulaml.dcp.Reader(persist_path=str(self.root))
        _dcp().load(target, storage_reader=reader, no_dist=True)
        return target

    def deactivate(self, *, keep_memory: bool = True) -> None:
        if self._inflight is not None:
            self._inflight.result()
            self._inflight = None
        super().deactivate(keep_memory=keep_memory)


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    # DCP warns on every call without a process group, even with no_dist=True.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    return dcp
