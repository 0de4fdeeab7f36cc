"""Layer 5, `ops`: what operators (and the `nebula` command line) do to a root.

`nebulaml.ops` is the public home of the operator functions, beside the training API of
`nebulaml`: choosing from a listing (listing), copying and flushing (copying), pruning
(pruning), inspection (inspection), verification (verification), this user's memory
tiers and the replicas of other nodes' parts they keep (memory_tiers), reading the
history file back (history), advising how often to checkpoint from it (advice),
comparing two checkpoints (diff), exporting items as plain .pt or .safetensors files
(export) and breaking a root's job hold (unlocking). Use them
as `nm.ops.plan_prune(...)`; the names in `__all__` below are the public ones (the
submodules are not: they may move). The operator functions `nebulaml` held before this
package was their home are still there, as the same objects.

Example:
    >>> import nebulaml as nm, tempfile
    >>> nm.ops.list_prune_candidates(tempfile.mkdtemp()).versions
    ()
    >>> nm.plan_prune is nm.ops.plan_prune      # the older name, kept
    True

May import: every layer below (`errors`, `format`, `storage`, `protocol`, `runtime`).
Not for: the training API (api.py, checkpoint.py: the layer above, which ops never
imports; the package's namespace re-exports ops, and integrations/deepspeed.py uses it).
"""

from nebulaml.ops.advice import (
    Advice,
    Interruption,
    Schedule,
    advise,
    daly_interval,
    expected_waste,
    format_duration,
    parse_duration,
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
from nebulaml.ops.listing import checkpoint_item_path, select_checkpoints
from nebulaml.ops.memory_tiers import (
    GcAction,
    GcResult,
    MemoryTierInfo,
    ReplicaInfo,
    execute_gc,
    list_memory_tiers,
    list_replicas,
    memory_tiers_folder,
    plan_gc,
)
from nebulaml.ops.pruning import (
    PruneListing,
    PrunePlan,
    PruneResult,
    execute_prune,
    list_prune_candidates,
    plan_prune,
)
from nebulaml.ops.unlocking import UnlockPlan, execute_unlock, plan_unlock
from nebulaml.ops.verification import verify_checkpoints

__all__ = [
    # choosing from a listing
    "select_checkpoints",
    "checkpoint_item_path",
    # a checkpoint
    "inspect_checkpoint",
    "describe_item",
    "verify_checkpoints",
    "diff_checkpoints",
    # moving checkpoints
    "copy_checkpoint",
    "persist_memory_tier",
    "export_checkpoint",
    # deleting
    "list_prune_candidates",
    "plan_prune",
    "execute_prune",
    "PruneListing",
    "PrunePlan",
    "PruneResult",
    # this node's memory tiers
    "memory_tiers_folder",
    "list_memory_tiers",
    "list_replicas",
    "plan_gc",
    "execute_gc",
    "MemoryTierInfo",
    "ReplicaInfo",
    "GcAction",
    "GcResult",
    # a root's job hold
    "plan_unlock",
    "execute_unlock",
    "UnlockPlan",
    # the history
    "read_history",
    "summarize_history",
    "history_records",
    "HistoryFormatError",
    "HistoryNotFoundError",
    # how often to checkpoint
    "advise",
    "Advice",
    "Schedule",
    "Interruption",
    "daly_interval",
    "expected_waste",
    "parse_duration",
    "format_duration",
]
