"""`nebula flush ROOT`: persist what a crashed job left in this node's memory tier."""

from __future__ import annotations

from ..output import JsonOpt, RootArg, StorageOpt, emit_json, handles_errors, stdout


@handles_errors
def flush_command(
    root: RootArg,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Persist memory-tier checkpoints newer than ROOT's newest (what a crashed job left).

    Run it on the node where the job ran: the memory tier is node-local. The copy is
    verified at ROOT and committed there last; no retention is applied (the job's setting
    is not known here; see nebula prune).

    Example: nebula flush /mnt/checkpoints/run1
    """
    import nebulaml as nm

    location = nm.check_root(root)
    memory_tier = nm.memory_tier_path(root)
    persisted = nm.persist_memory_tier(root)
    if as_json:
        emit_json({"root": location, "memory_tier": memory_tier, "persisted": persisted})
    elif persisted:
        stdout().print(f"Persisted {', '.join(persisted)} to {location}", highlight=False)
    else:
        stdout().print("Nothing to flush", highlight=False)
