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

from ._version import __version__
from .api import (
    check_root,
    flush_persistence,
    get_checkpoint,
    get_latest_checkpoint,
    get_latest_checkpoint_path,
    init,
    list_checkpoints,
    list_incomplete,
    memory_tier_path,
    shutdown,
)
from .checkpoint import Checkpoint
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointStateError,
    CommitConflictError,
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidNameError,
    ItemNotFoundError,
    ManifestError,
    NebulaError,
    NotInitializedError,
    PersistError,
    PersistTimeoutError,
    RootNotFoundError,
    StorageError,
    StorageFullError,
    TooManyItemsError,
    UnsafeCheckpointError,
    UnsupportedSchemaError,
)

__all__ = [
    "Checkpoint",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointStateError",
    "CommitConflictError",
    "CorruptCheckpointError",
    "InvalidArgumentError",
    "InvalidNameError",
    "ItemNotFoundError",
    "ManifestError",
    "NebulaError",
    "NotInitializedError",
    "PersistError",
    "PersistTimeoutError",
    "RootNotFoundError",
    "StorageError",
    "StorageFullError",
    "TooManyItemsError",
    "UnsafeCheckpointError",
    "UnsupportedSchemaError",
    "__version__",
    "check_root",
    "flush_persistence",
    "get_checkpoint",
    "get_latest_checkpoint",
    "get_latest_checkpoint_path",
    "init",
    "list_checkpoints",
    "list_incomplete",
    "memory_tier_path",
    "shutdown",
]
