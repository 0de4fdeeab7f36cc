"""nebulaml: fast, tiered, asynchronous checkpoints for PyTorch (the seed's API).

The training loop waits only for a snapshot into node-local memory; a background
persister copies committed checkpoints to durable storage, retires old versions, and
records every save and persist in checkpointHistories.csv.

The public names, by group:

- here (`__all__`): the training API (`init`, `Checkpoint`, listing, latest, flush,
  shutdown), configuration (`using_storage_options`; the rest is `init`'s options and the
  `NEBULA_*` settings) and the errors (every expected failure is a `NebulaError`);
- `nebulaml.ops`: what operators and the `nebula` command line do to a root (inspect,
  verify, diff, copy, export, prune, memory tiers, unlock, the history, `advise`); their
  older names here (`nm.plan_prune`) are the same objects, kept;
- the integrations, imported on first use: `nm.NebulaCheckpointIO` and
  `nm.NebulaCallback` (Lightning), `nebulaml.dcp` (PyTorch DCP), `nebulaml.transformers`
  and `nebulaml.accelerate` (docs/integrations.md).

Example:
    >>> import nebulaml as nm, tempfile, torch
    >>> nm.init(tempfile.mkdtemp(), persistent_time_interval=2)
    >>> nm.Checkpoint("global_step500").save("model", {"w": torch.ones(2)})
    >>> nm.get_latest_checkpoint().load("model")["w"]
    tensor([1., 1.])
"""

from nebulaml import ops
from nebulaml._version import __version__
from nebulaml.api import (
    PersistenceStatus,
    check_root,
    flush_persistence,
    get_checkpoint,
    get_latest_checkpoint,
    get_latest_checkpoint_path,
    init,
    list_checkpoints,
    list_incomplete,
    memory_tier_path,
    persistence_status,
    shutdown,
    wait_for_snapshot,
)
from nebulaml.checkpoint import Checkpoint
from nebulaml.errors import (
    CheckpointBusyError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointStateError,
    CommitConflictError,
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidNameError,
    ItemCollisionError,
    ItemNotFoundError,
    ManifestError,
    MemoryBudgetError,
    MemoryTierFullError,
    NebulaError,
    NotInitializedError,
    PersistError,
    PersistTimeoutError,
    RankGoneError,
    RankTimeoutError,
    RootInUseError,
    RootNotFoundError,
    SnapshotChangedError,
    StorageError,
    StorageFullError,
    StoreTimeoutError,
    TooManyItemsError,
    UnsafeCheckpointError,
    UnsafeMemoryTierError,
    UnsupportedSchemaError,
)
from nebulaml.ops import GcAction as GcAction
from nebulaml.ops import HistoryFormatError, HistoryNotFoundError
from nebulaml.ops import MemoryTierInfo as MemoryTierInfo
from nebulaml.ops import PrunePlan as PrunePlan
from nebulaml.ops import UnlockPlan as UnlockPlan
from nebulaml.ops import copy_checkpoint as copy_checkpoint
from nebulaml.ops import describe_item as describe_item
from nebulaml.ops import diff_checkpoints as diff_checkpoints
from nebulaml.ops import execute_gc as execute_gc
from nebulaml.ops import execute_prune as execute_prune
from nebulaml.ops import execute_unlock as execute_unlock
from nebulaml.ops import export_checkpoint as export_checkpoint
from nebulaml.ops import history_records as history_records
from nebulaml.ops import inspect_checkpoint as inspect_checkpoint
from nebulaml.ops import list_memory_tiers as list_memory_tiers
from nebulaml.ops import list_prune_candidates as list_prune_candidates
from nebulaml.ops import persist_memory_tier as persist_memory_tier
from nebulaml.ops import plan_gc as plan_gc
from nebulaml.ops import plan_prune as plan_prune
from nebulaml.ops import plan_unlock as plan_unlock
from nebulaml.ops import read_history as read_history
from nebulaml.ops import summarize_history as summarize_history
from nebulaml.ops import verify_checkpoints as verify_checkpoints
from nebulaml.storage.store import using_storage_options

__all__ = [
    "__version__",
    # the training API
    "init",
    "Checkpoint",
    "get_checkpoint",
    "get_latest_checkpoint",
    "get_latest_checkpoint_path",
    "list_checkpoints",
    "list_incomplete",
    "check_root",
    "memory_tier_path",
    "wait_for_snapshot",
    "flush_persistence",
    "persistence_status",
    "PersistenceStatus",
    "shutdown",
    # configuration (the rest is init's options and the NEBULA_* settings)
    "using_storage_options",
    # errors: every expected failure is a NebulaError
    "NebulaError",
    "CheckpointBusyError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointStateError",
    "CommitConflictError",
    "CorruptCheckpointError",
    "HistoryFormatError",
    "HistoryNotFoundError",
    "InvalidArgumentError",
    "InvalidNameError",
    "ItemCollisionError",
    "ItemNotFoundError",
    "ManifestError",
    "MemoryBudgetError",
    "MemoryTierFullError",
    "NotInitializedError",
    "PersistError",
    "PersistTimeoutError",
    "RankGoneError",
    "RankTimeoutError",
    "RootInUseError",
    "RootNotFoundError",
    "SnapshotChangedError",
    "StorageError",
    "StorageFullError",
    "StoreTimeoutError",
    "TooManyItemsError",
    "UnsafeCheckpointError",
    "UnsafeMemoryTierError",
    "UnsupportedSchemaError",
    # what operators do to a root (nm.ops.plan_prune, ...)
    "ops",
]

# The operator functions' names from before `nebulaml.ops` held them: the same objects,
# kept working, not in __all__ (a star import gives `ops`).
_OPS_ALIASES = (
    "GcAction",
    "MemoryTierInfo",
    "PrunePlan",
    "UnlockPlan",
    "copy_checkpoint",
    "describe_item",
    "diff_checkpoints",
    "execute_gc",
    "execute_prune",
    "execute_unlock",
    "export_checkpoint",
    "history_records",
    "inspect_checkpoint",
    "list_memory_tiers",
    "list_prune_candidates",
    "persist_memory_tier",
    "plan_gc",
    "plan_prune",
    "plan_unlock",
    "read_history",
    "summarize_history",
    "verify_checkpoints",
)

# Lightning's plugin and callback are imported on first use, from the Lightning package the
# program uses (lightning or pytorch_lightning), so that `import nebulaml` imports neither
# Lightning nor torch. They are not in __all__: `from nebulaml import *` (torch_nebula does
# it) would import Lightning.
_LIGHTNING_NAMES = ("NebulaCallback", "NebulaCheckpointIO")


def __getattr__(name: str) -> object:
    if name in _LIGHTNING_NAMES:
        from nebulaml.integrations.lightning_common import pick_module

        return getattr(pick_module(), name)
    if name == "dcp":  # nm.dcp.Writer(tag): imports torch.distributed.checkpoint on first use
        import importlib

        return importlib.import_module("nebulaml.dcp")
    raise AttributeError(f"module 'nebulaml' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LIGHTNING_NAMES, "dcp"})
