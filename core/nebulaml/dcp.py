"""PyTorch Distributed Checkpoint (DCP) through nebula: `Writer` and `Reader`.

Sharded states (FSDP2's `fully_shard`, tensor parallelism: DTensors; ShardedTensors) are
saved with `torch.distributed.checkpoint` into one nebula checkpoint, and load on any
number of ranks (DCP reshards). On every rank, after `nm.init(root)`:

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import nebulaml.dcp

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.save(state, storage_writer=nebulaml.dcp.Writer("global_step500"))
    # or: future = dcp.async_save(state, storage_writer=nebulaml.dcp.Writer(tag))

    dcp.load(state, storage_reader=nebulaml.dcp.Reader("global_step500"))  # any world size
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])

`dcp.save` returns once the checkpoint is committed in the memory tier (nebula persists it
in the background: `nm.flush_persistence()` waits); the checkpoint is listed, verified,
retained, copied and inspected as any other (`nebula list`, `nebula verify`). Its items
(`dcp_rank<r>`, one per rank, and `dcp_metadata`) load with `torch.load(weights_only=True)`;
nebulaml/integrations/dcp.py describes them.

Not for: plain (unsharded) state dicts, which `nm.Checkpoint.save` writes directly;
DCP's own folders (FileSystemWriter/Reader read and write those).
"""

from __future__ import annotations

from nebulaml.integrations.dcp import METADATA_ITEM, Reader, Writer, data_item

__all__ = ["METADATA_ITEM", "Reader", "Writer", "data_item"]
