"""nebulaml: fast, tiered, asynchronous checkpoints for PyTorch (the seed's API).

The training loop waits only for a snapshot into node-local memory; a background
persister copies committed checkpoints to durable storage, retires old versions, and
records every save and persist in checkpointHistories.csv.

Example:
    >>> import nebulaml as nm, tempfile, torch
    >>> nm.init(tempfile.mkdtemp(), persistent_time_interval=2)
    >>> nm.Checkpoint("global_step500").save("model", {"w": torch.ones(2)})
    >>> nm.get_latest_checkpoint().load("model")["w"]
    tensor([1., 1.])
"""

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
    TooManyItemsError,
    UnsafeCheckpointError,
    UnsafeMemoryTierError,
    UnsupportedSchemaError,
)
from nebulaml.ops.copying import copy_checkpoint, persist_memory_tier
from nebulaml.ops.diff import diff_checkpoints
from nebulaml.ops.export import export_checkpoint
from nebulaml.ops.history import (
    HistoryFormatError,
    HistoryNotFoundError,
    history_records,
    read_history,
    summarize_history,
)
from nebulaml.ops.inspection import describe_item, inspect_checkpoint
from nebulaml.ops.memory_tiers import (
    GcAction,
    MemoryTierInfo,
    execute_gc,
    list_memory_tiers,
    plan_gc,
)
from nebulaml.ops.pruning import PrunePlan, execute_prune, list_prune_candidates, plan_prune
from nebulaml.ops.unlocking import UnlockPlan, execute_unlock, plan_unlock
from nebulaml.ops.verification import verify_checkpoints
from nebulaml.storage.store import using_storage_options

__all__ = [
    "Checkpoint",
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
    "NebulaError",
    "NotInitializedError",
    "PersistError",
    "PersistTimeoutError",
    "PrunePlan",
    "RankGoneError",
    "RankTimeoutError",
    "RootInUseError",
    "RootNotFoundError",
    "SnapshotChangedError",
    "StorageError",
    "StorageFullError",
    "UnsafeMemoryTierError",
    "TooManyItemsError",
    "UnsafeCheckpointError",
    "UnsupportedSchemaError",
    "__version__",
    "check_root",
    "copy_checkpoint",
    "describe_item",
    "diff_checkpoints",
    "execute_prune",
    "export_checkpoint",
    "flush_persistence",
    "persistence_status",
    "PersistenceStatus",
    "get_checkpoint",
    "get_latest_checkpoint",
    "get_latest_checkpoint_path",
    "history_records",
    "init",
    "inspect_checkpoint",
    "list_checkpoints",
    "list_incomplete",
    "list_prune_candidates",
    "memory_tier_path",
    "persist_memory_tier",
    "list_memory_tiers",
    "plan_gc",
    "plan_unlock",
    "execute_unlock",
    "UnlockPlan",
    "execute_gc",
    "MemoryTierInfo",
    "GcAction",
    "plan_prune",
    "read_history",
    "shutdown",
    "summarize_history",
    "using_storage_options",
    "verify_checkpoints",
    "wait_for_snapshot",
]

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
