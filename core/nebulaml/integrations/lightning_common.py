"""What NebulaCheckpointIO and NebulaCallback do, for either Lightning package.

Lightning ships as two packages with separate class trees, `lightning` (`lightning.pytorch`)
and `pytorch_lightning`; a Trainer of one refuses the plugins and callbacks of the other.
So the classes are declared twice, in `nebulaml/lightning.py` and
`nebulaml/pytorch_lightning.py`, from the mixins here; `nm.NebulaCheckpointIO` picks the
module of the package the program uses (`pick_module`).

Mapping: Lightning names a checkpoint by a file path; nebula stores it as the item
"checkpoint" of the tag named by the file name without `.ckpt` (`/ckpts/epoch=1-step=8.ckpt`
is the tag `epoch=1-step=8`). The checkpoint loads by its path, even where that folder
does not exist. Saving a path again replaces its checkpoint, as writing a file again
would. Under DDP Lightning saves on global rank 0 alone: the checkpoint is that rank's
(`Checkpoint(ranks=[0])`), and every rank loads it.

A ModelCheckpoint's checkpoints (those saved into its `dirpath`: the checkpoint's
callback state says so) are managed by it, and its decisions are the retention: each
carries the label `lightning` (and `best` when it is the monitored best as it is saved),
so nebula's own count (`num_of_version_in_retention`) never drops one and the persister
never skips one for a newer; what ModelCheckpoint removes (`remove_checkpoint`) is
deleted from every tier by the persister's thread. At a local `dirpath` a small pointer
file (JSON: the tag and the root) stands in for each, so that what Lightning reads of the
folder is as with its own files: `ckpt_path="last"` finds `last.ckpt`, a new run in a
used folder saves `last-v1`. Checkpoints saved by hand (`trainer.save_checkpoint`)
elsewhere are nebula's, as any: its retention applies, `is_best` labels one to keep.

`NebulaCallback(config_params=...)` starts nebula with them (`nm.init`) as it is made;
with peer replicas (`"peer_replicas": 1`, or `NEBULA_PEER_REPLICAS`) while
torch.distributed is not initialised yet, at its `setup` instead, on every rank, once
Lightning has set the process group up: nebula's own group is opened from it.

Not for: the checkpoint format (a Lightning checkpoint dict, saved as one nebula item that
plain `torch.load` reads) or nebula's own semantics (checkpoint.py, api.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from types import ModuleType
from typing import Any

from nebulaml.api import get_checkpoint, init
from nebulaml.checkpoint import Checkpoint
from nebulaml.config import resolve_config
from nebulaml.errors import CheckpointNotFoundError, InvalidArgumentError, NebulaError
from nebulaml.format.names import validate_name
from nebulaml.protocol.catalog import read_committed
from nebulaml.protocol.delete import delete_checkpoint
from nebulaml.runtime import session as _session
from nebulaml.runtime.locate import tiers_for
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")

ITEM = "checkpoint"  # the seed loads it with nm.get_latest_checkpoint_path("checkpoint", ...)
SUFFIX = ".ckpt"
STORAGE_OPTIONS = ("is_best", "persist_path")
BEST_LABEL = "best"
MANAGED_LABEL = "lightning"  # ModelCheckpoint decides when it goes, not nebula's count


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
    options of the current configuration: from then on nebula persists there. Without
    peer replicas: Lightning saves on rank 0 alone, and opening nebula's process group
    for them is collective (every rank would have to re-initialise with it).
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
            peer_replicas=0,  # (NEBULA_PEER_REPLICAS too): this rank alone re-initialises
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
        manager = _manager_state(checkpoint, path)  # ModelCheckpoint's, if it saves this
        labels = [] if manager is None else [MANAGED_LABEL]
        if options.get("is_best") or _monitored_best(manager, path):
            labels.append(BEST_LABEL)
        # Lightning saves on global rank 0 only (its strategies call this there): the
        # checkpoint is that rank's alone, and commits without the other ranks. Saving a
        # path again replaces its checkpoint (a persist of the old one in flight first
        # finishes: Persister.release).
        writer = [session.rank]
        handle = Checkpoint(tag, 1, overwrite=True, labels=tuple(labels), ranks=writer)
        handle.save(ITEM, checkpoint)
        persistent = session.tiers.persistent
        self._roots[tag] = None if persistent is None else persistent.url
        if manager is not None:
            _write_pointer(path, tag, session.tiers.display)

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
        """Delete the checkpoint of `path` from every tier: ModelCheckpoint dropped it
        from its top k (or replaced its `last`), and its decisions are the retention.
        The pointer file goes now; the checkpoint is deleted by the persister's thread
        (`Persister.forget`), so that training never waits on the persistent tier."""
        tag = tag_for_path(path)
        _remove_pointer(path)
        session = _session.current_or_none()
        if session is None:
            return
        root = self._root_of(tag)
        self._roots.pop(tag, None)
        tiers = tiers_for(root, "NebulaCheckpointIO.remove_checkpoint")
        if tiers is session.tiers:
            session.persister.forget(tag)
            return
        # Saved to a root the session has moved on from (`persist_path`): no persister
        # of that root; deleted here, except a checkpoint a reader holds.
        for _tier, store in tiers.stores:
            if read_committed(store, tag) is not None:
                delete_checkpoint(store, tag)

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


def _manager_state(checkpoint: dict[str, Any], path: Any) -> dict[str, Any] | None:
    """The state of the ModelCheckpoint that saves `checkpoint` at `path` (the one whose
    `dirpath` holds it), from the callback states Lightning puts in the checkpoint; None
    for a checkpoint saved by hand elsewhere."""
    callbacks = checkpoint.get("callbacks")
    if not isinstance(callbacks, dict):
        return None
    folder = os.path.dirname(os.fspath(path))
    for state in callbacks.values():
        managed = isinstance(state, dict) and "best_k_models" in state
        if managed and _same_path(state.get("dirpath"), folder):
            return state
    return None


def _monitored_best(manager: dict[str, Any] | None, path: Any) -> bool:
    """Whether a ModelCheckpoint that monitors a metric names `path` its best model (it
    does so before it saves the new best)."""
    if manager is None or manager.get("monitor") is None:
        return False  # without a metric, every checkpoint is "the best" as it is saved
    return _same_path(manager.get("best_model_path"), path)


def _same_path(a: Any, b: Any) -> bool:
    if not isinstance(a, (str, os.PathLike)) or not isinstance(b, (str, os.PathLike)):
        return False
    a, b = os.fspath(a), os.fspath(b)
    return bool(a) and bool(b) and os.path.normpath(a) == os.path.normpath(b)


def _pointer_store(path: Any) -> tuple[Store, str] | None:
    """The store of a local checkpoint path's folder, and the file's name; None for a
    URL (no pointer there: training would wait on that store)."""
    text = os.fspath(path)
    if "://" in text:
        return None
    folder, name = os.path.split(os.path.abspath(text))
    return Store(folder, durable=False), name


def _write_pointer(path: Any, tag: str, root: str) -> None:
    """Write the pointer file that stands in for the checkpoint at `path` (module doc):
    published whole, never through a symbolic link. A folder that cannot take it costs
    only `ckpt_path="last"` (said once at debug level): the checkpoint is saved."""
    where = _pointer_store(path)
    if where is None:
        return
    store, name = where
    doc = {
        "nebula_checkpoint": tag,
        "item": ITEM,
        "persistent_path": root,
        "note": (
            "This file stands in for a checkpoint that nebula holds: Lightning loads it "
            "through nm.NebulaCheckpointIO (ckpt_path=this file); elsewhere "
            f"nm.get_checkpoint({tag!r}, persistent_path).load({ITEM!r})"
        ),
    }
    try:
        os.makedirs(store.root, exist_ok=True)
        store.publish((name,), (json.dumps(doc, indent=1) + "\n").encode(), create_only=False)
    except (OSError, NebulaError) as exc:
        log.debug("could not write the pointer file %s: %s", os.fspath(path), exc)


def _remove_pointer(path: Any) -> None:
    where = _pointer_store(path)
    if where is None:
        return
    store, name = where
    try:
        store.remove(name)
    except (OSError, NebulaError) as exc:
        log.debug("could not remove the pointer file %s: %s", os.fspath(path), exc)


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
        # Peer replicas open nebula's process group, which needs torch.distributed's:
        # Lightning sets that up after the callback is made, before `setup` (every rank).
        self._init_at_setup = config_params is not None and _waits_for_process_group(
            self.config_params
        )
        if config_params is not None and not self._init_at_setup:
            init(**self.config_params)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        _refuse_checkpoints_without_checkpoint_io(trainer.strategy)
        if self._init_at_setup:
            self._init_at_setup = False
            init(**self.config_params)
        super().setup(trainer, pl_module, stage)  # type: ignore[misc]
        if not isinstance(trainer.strategy.checkpoint_io, self._checkpoint_io_class):
            warnings.warn(
                "NebulaCallback saves through the Trainer's CheckpointIO, which is "
                f"{type(trainer.strategy.checkpoint_io).__name__}: add "
                "plugins=[nm.NebulaCheckpointIO()] to the Trainer to checkpoint with nebula",
                stacklevel=2,
            )


def _waits_for_process_group(config_params: dict[str, Any]) -> bool:
    """Whether `nm.init(**config_params)` asks for peer replicas (or NEBULA_PEER_REPLICAS
    does) while torch.distributed is not initialised yet: the callback then starts nebula
    at `setup`, once Lightning has set the process group up, on every rank alike. Bad
    values are refused here, as `nm.init` would."""
    options = dict(config_params)
    config = resolve_config(
        options.pop("persistent_storage_path", None),
        options.pop("persistent_time_interval", None),
        options.pop("num_of_version_in_retention", None),
        options,
    )
    dist = sys.modules.get("torch.distributed")  # never import torch just to ask
    up = dist is not None and dist.is_available() and dist.is_initialized()
    return config.peer_replicas > 0 and not up


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
