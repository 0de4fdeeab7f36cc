"""`nebula flush ROOT`: persist what a crashed job left in this node's memory tier."""

from __future__ import annotations

from rich.text import Text

from ..console import emit_json, stdout
from ..exits import handles_errors
from ..options import JsonOpt, QuietOpt, RootArg, StorageOpt
from ..progress import phases


@handles_errors
def flush_command(
    root: RootArg,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Persist memory-tier checkpoints newer than ROOT's newest (what a crashed job left).

    Run it on the node where the job ran: the memory tier is node-local. The copy is
    verified at ROOT and committed there last, with progress on stderr; no retention is
    applied (the job's setting is not known here; see nebula prune).

    Example: nebula flush /mnt/checkpoints/run1
    """
    import nebulaml as nm

    location = nm.check_root(root)
    # A root that cannot be listed fails here, as `nebula ls` does.
    nm.list_checkpoints(root, hold=False)
    memory_tier = nm.memory_tier_path(root)
    labels = [f"persisting to {location}", f"verifying at {location}"]
    with phases(labels, quiet=quiet) as (report, verified):
        persisted = nm.ops.persist_memory_tier(root, progress=report, verify_progress=verified)
    if as_json:
        emit_json({"root": location, "memory_tier": memory_tier, "persisted": persisted})
    elif persisted:
        stdout().print(Text(f"Persisted {', '.join(persisted)} to {location}"))
    else:
        stdout().print("Nothing to flush", highlight=False)
