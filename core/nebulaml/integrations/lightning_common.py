"""What NebulaCheckpointIO and NebulaCallback do, for either Lightning package.

Lightning ships as two packages with separate class trees, `lightning` (`lightning.pytorch`)
and `pytorch_lightning`; a Trainer of one refuses the plugins and callbacks of the other.
So the classes are declared twice, in `nebulaml/lightning.py` and
`nebulaml/pytorch_lightning.py`, from the mixins here; `nm.NebulaCheckpointIO` picks the
module of the package the program uses (`pick_module`).

Mapping: Lightning names a checkpoint by a file path; nebula stores it as the item
"checkpoint" of the tag named by the file name without `.ckpt` (`/ckpts/epoch=1-step=8.ckpt`
is the tag `epoch=1-step=8`). Nothing is written at the path itself: the path is only a
name, so a checkpoint loads by its path even where that folder does not exist. Saving a
path again replaces its checkpoint, as writing a file again would. Under DDP Lightning
saves on global rank 0 alone: the checkpoint is that rank's (`Checkpoint(ranks=[0])`), and
every rank loads it.

Not for: the checkpoint format (a Lightning checkpoint dict, saved as one nebula item that
plain `torch.load` reads) or nebula's own semantics (checkpoint.py, api.py).
"""

from __future__ import annotations

import os
import sys
import warnings
from types import ModuleType
from typing import Any

from nebulaml.api import get_checkpoint, init
from nebulaml.checkpoint import Checkpoint
from nebulaml.errors import CheckpointNotFoundError, InvalidArgumentError
from nebulaml.format.names import validate_name
from nebulaml.protocol.catalog import list_committed, read_committed
from nebulaml.protocol.delete import delete_checkpoint
from nebulaml.runtime import session as _session
from nebulaml.runtime.locate import tiers_for

ITEM = "checkpoint"  # the seed loads it with nm.get_latest_checkpoint_path("checkpoint", ...)
SUFFIX = ".ckpt"
STORAGE_OPTIONS = ("is_best", "persist_path")
BEST_LABEL = "best"


def tag_for_path(path: str | os.PathLike[str]) -> str:
    """The nebula tag of a Lightning checkpoint path: its file name without `.ckpt`.

    Example:
        >>> tag_for_path("/ckpts/epoch=1-step=8.ckpt")
        'epoch=1-step=8'
    """
    name = os.path.basename(os.fspath(path).rstrip("/\\"))
    if name.endswith(SUFFIX) and len(name) > len(SUFFIX):
        name = name[: -len(SUFFIX)]
    return validate_name("tag", name)


def _session_for(persist_path: Any) -> _session.Session:
    """The session that saves into `persist_path` (the current one when None).

    A different root re-initialises nebula for it, keeping the interval, retention and
    options of the current configuration: from then on nebula persists there.
    """
    live = _session.current_or_none()
    if persist_path is None:
        if live is None:
            init()  # NEBULA_PERSISTENT_STORAGE_PATH, else the memory tier alone
        return _session.current("NebulaCheckpointIO.save_checkpoint")
    if live is None:
        init(persist_path)
    elif tiers_for(persist_path, "NebulaCheckpointIO.save_checkpoint") is not live.tiers:
        config = live.config
        init(
            persist_path,
            config.persistent_time_interval_s,
            config.num_of_version_in_retention,
            storage_options=dict(config.storage_options),
            exit_timeout_s=config.exit_timeout_s,
            rank_timeout_s=config.rank_timeout_s,
        )
    return _session.current("NebulaCheckpointIO.save_checkpoint")


class CheckpointIOMixin:
    """Lightning's CheckpointIO, through nebula (the methods; the classes add the base).

    `save_checkpoint(checkpoint, path, storage_options)` saves `checkpoint` as the item
    "checkpoint" of the tag `tag_for_path(path)`; `storage_options` may hold `is_best`
    (label the checkpoint "best": retention and prune keep it) and `persist_path` (the
    persistent root to save into). `load_checkpoint` loads it back, verified, with
    weights_only=True unless the caller passes False. `remove_checkpoint` deletes it.
    """

    def __init__(self) -> None:
        super().__init__()
        # Where this process saved each tag, so that load and remove find the root that
        # a `persist_path` chose even after the session moved on.
        self._roots: dict[str, str | None] = {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        options = _storage_options(storage_options)
        tag = tag_for_path(path)
        session = _session_for(options.get("persist_path"))
        if tag in session.persister.protected():
            # The previous checkpoint of this path is still queued or being persisted;
            # replacing its memory copy now would pull the files out from under the
            # persister. Persist it first (see the report on the core's overwrite).
            from nebulaml.api import flush_persistence

            flush_persistence(tag)
        labels = (BEST_LABEL,) if options.get("is_best") else ()
        # Lightning saves on global rank 0 only (its strategies call this there): the
        # checkpoint is that rank's alone, and commits without the other ranks.
        writer = [session.rank]
        Checkpoint(tag, 1, overwrite=True, labels=labels, ranks=writer).save(ITEM, checkpoint)
        persistent = session.tiers.persistent
        self._roots[tag] = None if persistent is None else persistent.url

    def load_checkpoint(
        self, path: Any, map_location: Any = "cpu", weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint saved for `path`. As Lightning's TorchCheckpointIO, tensors
        load onto the CPU unless `map_location` says otherwise. `weights_only=None` means
        True; pass False only for a checkpoint you trust."""
        tag = tag_for_path(path)
        found = get_checkpoint(tag, self._root_of(tag))
        if found is None:
            where = tiers_for(self._root_of(tag), "NebulaCheckpointIO.load_checkpoint").display
            raise CheckpointNotFoundError(where, tag)
        return found.load(
            ITEM,
            map_location=map_location,
            weights_only=True if weights_only is None else weights_only,
        )

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint of `path` on every tier (ModelCheckpoint drops it from its
        top k). Kept: a labelled one, the newest, and one the persister still works on
        (retention removes that later)."""
        tag = tag_for_path(path)
        session = _session.current_or_none()
        if session is None:
            return
        if tag in session.persister.protected():
            return
        tiers = tiers_for(self._root_of(tag), "NebulaCheckpointIO.remove_checkpoint")
        for _tier, store in tiers.stores:
            info = read_committed(store, tag)
            if info is None or info.manifest.labels:
                continue
            newest = max(list_committed(store), key=lambda c: c.sort_key)
            if newest.tag != tag:
                delete_checkpoint(store, tag)
        self._roots.pop(tag, None)

    def teardown(self) -> None:
        """Nothing to wait for: persisting goes on in the background, and at exit."""

    def _root_of(self, tag: str) -> str | None:
        if tag in self._roots:
            return self._roots[tag]
        session = _session.current_or_none()
        if session is None:
            init()
            session = _session.current("NebulaCheckpointIO.load_checkpoint")
        persistent = session.tiers.persistent
        return None if persistent is None else persistent.url


def _storage_options(storage_options: Any) -> dict[str, Any]:
    if storage_options is None:
        return {}
    if not isinstance(storage_options, dict):
        raise InvalidArgumentError(
            f"storage_options must be a dict with keys {', '.join(STORAGE_OPTIONS)}, "
            f"not {type(storage_options).__name__}"
        )
    unknown = sorted(set(storage_options) - set(STORAGE_OPTIONS))
    if unknown:
        raise InvalidArgumentError(
            f"unknown storage option(s) {', '.join(map(repr, unknown))}; NebulaCheckpointIO "
            f"knows {', '.join(STORAGE_OPTIONS)}"
        )
    return dict(storage_options)


class CallbackMixin:
    """ModelCheckpoint that initialises nebula: `config_params` go to `nm.init`."""

    _checkpoint_io_class: type = object  # set by each package's NebulaCallback

    def __init__(
        self, *args: Any, config_params: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if kwargs.get("save_last") == "link":
            raise InvalidArgumentError(
                "NebulaCallback(save_last='link') would link local files, and nebula writes "
                "none at checkpoint paths; use save_last=True"
            )
        super().__init__(*args, **kwargs)
        self.config_params: dict[str, Any] = dict(config_params or {})
        if config_params is not None:
            init(**self.config_params)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        _refuse_checkpoints_without_checkpoint_io(trainer.strategy)
        super().setup(trainer, pl_module, stage)  # type: ignore[misc]
        if not isinstance(trainer.strategy.checkpoint_io, self._checkpoint_io_class):
            warnings.warn(
                "NebulaCallback saves through the Trainer's CheckpointIO, which is "
                f"{type(trainer.strategy.checkpoint_io).__name__}: add "
                "plugins=[nm.NebulaCheckpointIO()] to the Trainer to checkpoint with nebula",
                stacklevel=2,
            )


def _refuse_checkpoints_without_checkpoint_io(strategy: Any) -> None:
    """A strategy that saves a distributed checkpoint itself never calls the CheckpointIO:
    refused at setup, rather than training on with no nebula checkpoint (issue #19)."""
    name = type(strategy).__name__
    if getattr(strategy, "_save_distributed_checkpoint", False):  # ModelParallelStrategy
        how = f"{name}(save_distributed_checkpoint=True)"
        instead = "save_distributed_checkpoint=False"
    elif getattr(strategy, "_state_dict_type", None) == "sharded":  # FSDPStrategy
        how, instead = f"{name}(state_dict_type='sharded')", "state_dict_type='full'"
    else:
        return
    raise InvalidArgumentError(
        f"NebulaCallback cannot checkpoint with {how}: that strategy writes "
        f"torch.distributed.checkpoint files at the checkpoint path itself and never calls "
        f"the Trainer's CheckpointIO, so no nebula checkpoint would be saved. Save the "
        f"sharded state through nebula yourself, on every rank: dcp.save(state, "
        f"storage_writer=nebulaml.dcp.Writer(tag)) (it loads on any number of ranks with "
        f"nebulaml.dcp.Reader); or use {instead}, whose full checkpoint goes through the "
        f"CheckpointIO; or a plain ModelCheckpoint"
    )


# which package ------------------------------------------------------------------------
PACKAGES = (
    ("lightning", "nebulaml.lightning"),
    ("pytorch_lightning", "nebulaml.pytorch_lightning"),
)


def pick_module() -> ModuleType:
    """The nebulaml module whose classes fit the Lightning package this program uses.

    The one already imported; if neither is, the installed one (`lightning` first). With
    both imported there is no telling which Trainer the object is for: that is an error
    that names the explicit modules.
    """
    import importlib

    imported = [ours for theirs, ours in PACKAGES if theirs in sys.modules]
    if len(imported) == 2:
        raise ImportError(
            "both lightning and pytorch_lightning are imported, so nm.NebulaCheckpointIO "
            "cannot tell which Trainer it is for: use nebulaml.lightning.NebulaCheckpointIO "
            "(lightning.pytorch) or nebulaml.pytorch_lightning.NebulaCheckpointIO "
            "(and the same for NebulaCallback)"
        )
    for ours in imported or [ours for _theirs, ours in PACKAGES]:
        try:
            return importlib.import_module(ours)
        except ModuleNotFoundError as exc:
            if exc.name not in ("lightning", "pytorch_lightning"):
                raise
    raise ImportError(
        "nm.NebulaCheckpointIO and nm.NebulaCallback need Lightning: "
        "pip install 'nebula-checkpoint[lightning]' (lightning or pytorch_lightning 2.6)"
    )
