"""DeepSpeed (0.19.6): what its Nebula checkpoint engine needs beyond the seed's API.

DeepSpeed's `NebulaCheckpointEngine` imports `torch_nebula` and calls
`torch_nebula.Checkpoint(tag, -2)`, `.save(file name, state)` once per file, then
`.commit()` on every rank; into its `save_dir` it writes only empty placeholder files
(`torch.save("", path)`), which its `load_checkpoint` finds tags through.

    Checkpoint    `torch_nebula.Checkpoint`: `nebulaml.Checkpoint` whose re-save of a tag
                  replaces it (overwrite=True by default), as DeepSpeed's own engine
                  overwrites its files: `save_checkpoint(dir, tag="best")` twice, or the
                  steps saved again after a rollback
    materialize   the real files of a saved tag in `save_dir`, over the placeholders, for
                  DeepSpeed's tools that read files (zero_to_fp32.py, a load without nebula)
    get_checkpoint  `torch_nebula.get_checkpoint`: `nebulaml.get_checkpoint`, which warns,
                  once per process and tag, when the tag is not there, naming the tag
                  DeepSpeed's engine loads instead (it falls back to the newest, silently:
                  `load_checkpoint(tag="global_step4")` after the memory tier that held
                  global_step4 was lost before its persist)
    init          `torch_nebula.init`: `nebulaml.init`, which also takes nebula's own
                  keys of the ds_config's `"nebula"` block (`peer_replicas`) that
                  DeepSpeed's engine does not pass (it passes the path, the interval
                  and the retention alone)

May import: the public API and the layers below. DeepSpeed itself is not imported: its
engine imports `torch_nebula`, and `materialize` runs without it.

Not for: nebula's own semantics (checkpoint.py); exporting items (ops/export.py, which
`materialize` goes through).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nebulaml.api import get_checkpoint as _get_checkpoint
from nebulaml.api import get_latest_checkpoint as _get_latest_checkpoint
from nebulaml.api import init as _init
from nebulaml.checkpoint import Checkpoint as _Checkpoint
from nebulaml.errors import CheckpointNotFoundError, NebulaError
from nebulaml.format.names import validate_name
from nebulaml.ops.export import export_checkpoint
from nebulaml.protocol.delete import delete_checkpoint
from nebulaml.runtime import session as _session

log = logging.getLogger("nebulaml")

PathLike = str | os.PathLike[str]
LATEST_FILE = "latest"  # DeepSpeed's save_dir/latest: the tag of the last save
# nm.init's options the ds_config's "nebula" block may hold beside DeepSpeed's own keys
# (DeepSpeed's config reads its five keys and drops the rest; `init` reads these).
BLOCK_OPTIONS = ("peer_replicas",)
_ENGINE = "NebulaCheckpointEngine"  # DeepSpeed's class that calls torch_nebula.init
_SAID_MISSING: set[tuple[str, str]] = set()  # (root, tag): get_checkpoint warned of it


def init(
    persistent_storage_path: PathLike | None = None,
    persistent_time_interval: float | None = None,
    num_of_version_in_retention: int | None = None,
    **kwargs: Any,
) -> None:
    """`nebulaml.init`, as DeepSpeed's Nebula engine calls it (`torch_nebula.init`). The
    engine passes the block's `persistent_storage_path`, `persistent_time_interval` and
    `num_of_version_in_retention` alone; the other keys of nm.init's that the block holds
    (`BLOCK_OPTIONS`: `"peer_replicas": 1`) are read from the ds_config and passed too.
    Arguments win over the block, the block over the environment (`NEBULA_PEER_REPLICAS`).
    Called from anywhere else, it is `nebulaml.init`.

    Example:
        >>> import tempfile, nebulaml as nm, torch_nebula
        >>> torch_nebula.init(tempfile.mkdtemp(), 100, 2)
        >>> torch_nebula.init.__wrapped__ is nm.init
        True
    """
    block = _engine_block(sys._getframe(1))
    for key in BLOCK_OPTIONS:
        if key in block and key not in kwargs:
            kwargs[key] = block[key]
    _init(persistent_storage_path, persistent_time_interval, num_of_version_in_retention, **kwargs)


init.__wrapped__ = _init  # type: ignore[attr-defined]


def _engine_block(frame: Any) -> dict[str, Any]:
    """The ds_config's `"nebula"` block, when `frame` is DeepSpeed's
    `NebulaCheckpointEngine.__init__` calling `init`: its `config_params` (the block as
    DeepSpeed read it, without the other keys) is the `nebula_config` of the DeepSpeed
    config a caller of the engine holds, whose `_param_dict` is the whole ds_config. {}
    otherwise: called by anything else, or a DeepSpeed that keeps its config otherwise."""
    engine = frame.f_locals.get("self")
    params = frame.f_locals.get("config_params")
    if type(engine).__name__ != _ENGINE or params is None:
        return {}
    outer = frame.f_back
    for _ in range(4):  # create_checkpoint_engine(config_params=<DeepSpeedConfig>, ...)
        if outer is None:
            break
        for value in list(outer.f_locals.values()):
            whole = getattr(value, "_param_dict", None)
            if getattr(value, "nebula_config", None) is params and isinstance(whole, dict):
                block = whole.get("nebula")
                return dict(block) if isinstance(block, dict) else {}
        outer = outer.f_back
    return {}


class Checkpoint(_Checkpoint):
    """`nebulaml.Checkpoint` as DeepSpeed's engine uses it: saving a tag that is already
    committed replaces it (`overwrite=True` unless told otherwise), as DeepSpeed's default
    engine overwrites the files of a tag saved again. Everything else is the same:
    `isinstance(c, nebulaml.Checkpoint)` holds, and what it saves is found, listed and
    loaded through `nebulaml` as any other checkpoint.

    The version replaced is gone from every tier before the new one is committed: its
    persistent copy too, so that a new version that is never persisted (superseded by a
    newer checkpoint within `persistent_time_interval`) does not leave the old one to be
    loaded after the job. With several ranks under torch.distributed (DeepSpeed calls
    `commit()` on every rank) the ranks meet twice in `commit()`: once every rank's old
    part is gone from its memory tier (and no persist of it is running), rank 0 deletes
    the persistent copy, and only then does any rank commit; so no rank's new part is
    ever committed, or persisted, with another's old one.

    Example:
        >>> import nebulaml as nm, tempfile, torch_nebula
        >>> torch_nebula.init(tempfile.mkdtemp())
        >>> for value in (1, 2):
        ...     ckpt = torch_nebula.Checkpoint("best", -2)
        ...     ckpt.save("mp_rank_00_model_states.pt", {"v": value})
        ...     _ = ckpt.commit()
        >>> nm.get_checkpoint("best").load("mp_rank_00_model_states.pt")
        {'v': 2}
    """

    def __init__(
        self, tag: str, num_of_files: int = 1, *, overwrite: bool = True, **options: Any
    ) -> None:
        super().__init__(tag, num_of_files, overwrite=overwrite, **options)

    def save(self, name: str, obj: Any) -> None:
        job = self._job
        if self.overwrite and not (job.names or job.committed or job.sealed):
            session = _session.current("Checkpoint.save", fence=False)
            if session.world_size == 1:  # before the first item: it may be streamed there
                _delete_persistent(session, self.tag)
        super().save(name, obj)

    def commit(self) -> bool:
        job = self._job
        if self.overwrite and not (job.committed or job.sealed):
            session = _session.current("Checkpoint.commit", raise_pending=False, fence=False)
            dist = _process_group(session.world_size)
            if dist is not None:
                if not job._begun:  # a rank that saved nothing: its old part goes now
                    job._begin(session, time.perf_counter())
                dist.barrier()  # every rank's old part is gone, no persist of it runs
                if session.rank == 0:
                    _delete_persistent(session, self.tag)
                dist.barrier()  # the persistent copy is gone: now the ranks commit
        return super().commit()


def get_checkpoint(tag: str, persist_path: PathLike | None = None) -> _Checkpoint | None:
    """`nebulaml.get_checkpoint`, as DeepSpeed's engine calls it: when `tag` is not
    there, a warning says so, since DeepSpeed's engine then loads the newest checkpoint
    instead and says nothing above its info level.

    Example:
        >>> import tempfile, nebulaml as nm
        >>> nm.init(tempfile.mkdtemp())
        >>> get_checkpoint("global_step4") is None
        True
        >>> nm.shutdown()
    """
    found = _get_checkpoint(tag, persist_path)
    where = os.fspath(persist_path) if persist_path else "this job's root"
    if found is None and (where, tag) not in _SAID_MISSING:
        # The engine asks once per file it loads: said once per process.
        _SAID_MISSING.add((where, tag))
        latest = _get_latest_checkpoint(persist_path)
        if latest is None:
            instead = "finds no checkpoint to load instead"
        else:
            instead = f"loads {latest.tag!r}, the newest, instead"
            latest.release()
        log.warning(
            "checkpoint %r is neither in %s nor in this node's memory tier: DeepSpeed's "
            "Nebula engine %s. A checkpoint is in the memory tier alone until it is "
            "persisted: one not yet persisted when the memory tier was lost (a lost node, "
            "a reboot, /dev/shm cleared) is gone, and so is one a newer checkpoint "
            "superseded before its persist (the newest is persisted at most every "
            "persistent_time_interval). torch_nebula.flush_persistence() after a save "
            "makes it durable at once",
            tag, where, instead,
        )  # fmt: skip
    return found


get_checkpoint.__wrapped__ = _get_checkpoint  # type: ignore[attr-defined]


def _process_group(world_size: int) -> Any:
    """torch.distributed, when this job of `world_size` > 1 ranks has its process group."""
    dist = sys.modules.get("torch.distributed")  # DeepSpeed imported it: never import it here
    if world_size == 1 or dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist if dist.get_world_size() == world_size else None


def _delete_persistent(session: Any, tag: str) -> None:
    """Delete the persistent copy of `tag`, a version being replaced (committed or not),
    once this rank's persister is not copying it. Warns, and goes on, if it cannot: the
    persister replaces it when it persists the new version."""
    persistent = session.tiers.persistent
    if persistent is None:
        return
    session.persister.release(tag)
    try:
        if persistent.exists(tag) and not delete_checkpoint(persistent, tag):
            log.warning("%s: being read; the persist of its new version replaces it", tag)
    except NebulaError as exc:
        log.warning("could not delete the replaced version of %r: %s", tag, exc)


def materialize(
    save_dir: PathLike, tag: str | None = None, *, persist_path: PathLike | None = None
) -> list[str]:
    """Write every file of the DeepSpeed checkpoint `tag` (default: the tag in
    `save_dir/latest`, as DeepSpeed's tools read it) into `save_dir/<tag>/`, replacing the
    placeholders the Nebula engine left there, so that tools that read DeepSpeed's files
    work on `save_dir`: `python save_dir/zero_to_fp32.py save_dir out`,
    `get_fp32_state_dict_from_zero_checkpoint(save_dir)`, `load_checkpoint` with
    `"enable_nebula_load": false`.

    The files come from the committed nebula checkpoint of `tag` in `persist_path` (the
    ds_config's `persistent_storage_path`; default: this process's nebula root, while
    DeepSpeed's engine runs), from its fastest tier, each verified against the manifest
    on the way (`nebulaml.export_checkpoint`), and each renamed into place once whole:
    copies, never links into nebula's tiers, so retention and a later save of the tag
    never change them (a later save of the tag puts placeholders back). Call it from one
    process. Returns the paths written. Raises `CheckpointNotFoundError` (no `latest`
    file, or no such checkpoint), `CorruptCheckpointError`.

    Example:
        >>> import tempfile, torch, torch_nebula
        >>> from nebulaml.integrations.deepspeed import materialize
        >>> torch_nebula.init(tempfile.mkdtemp())
        >>> save_dir = Path(tempfile.mkdtemp())
        >>> (save_dir / "global_step1").mkdir()
        >>> torch.save("", save_dir / "global_step1" / "mp_rank_00_model_states.pt")
        >>> _ = (save_dir / "latest").write_text("global_step1")
        >>> ckpt = torch_nebula.Checkpoint("global_step1", -2)
        >>> ckpt.save("mp_rank_00_model_states.pt", {"module": {"w": torch.ones(2)}})
        >>> _ = ckpt.commit()
        >>> [Path(p).name for p in materialize(save_dir)]
        ['mp_rank_00_model_states.pt']
        >>> path = save_dir / "global_step1" / "mp_rank_00_model_states.pt"
        >>> torch.load(path, weights_only=True)["module"]["w"]
        tensor([1., 1.])
    """
    save = Path(save_dir)
    if tag is None:
        latest = save / LATEST_FILE
        try:
            tag = latest.read_text().strip()
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{save} (no {LATEST_FILE} file: name the tag)") from None
    validate_name("tag", tag)
    if persist_path is None:
        _session.current("materialize")  # NotInitializedError: name persist_path
    folder = save / tag
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    # Staged beside the files (same filesystem: each rename is atomic), and removed after.
    with tempfile.TemporaryDirectory(prefix=".nebula-materialize-", dir=folder) as staging:
        exported = export_checkpoint(persist_path, tag, staging, format="pt")  # type: ignore[arg-type]
        for file in exported["files"]:
            target = folder / file["item"]
            os.replace(file["path"], target)
            written.append(str(target))
    return written
