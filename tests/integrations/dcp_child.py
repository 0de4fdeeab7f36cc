"""One rank of a DCP-through-nebula job (run by tests/integrations/test_dcp.py, not by pytest).

Usage: dcp_child.py SCENARIO ROOT OUT [PACKAGE]; RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT come from the environment, as torchrun sets them.

    save       FSDP2 (`fully_shard` on a CPU mesh, gloo) trains a step and saves
               global_step1 with dcp.save, trains another and saves global_step2 with
               dcp.async_save, both through nebulaml.dcp.Writer; rank 0 writes the full
               tensors of each state to OUT/expected_<tag>.pt. Also: Checkpoint.save of
               the sharded model is refused with a clear error.
    load       FSDP2 with other weights loads both tags through nebulaml.dcp.Reader and
               compares the full tensors with OUT/expected_<tag>.pt, bit for bit.
    lightning  a Trainer of PACKAGE with ModelParallelStrategy (FSDP2, one CPU process)
               and nebula's callback and plugin: fit must refuse, before any checkpoint.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

import nebulaml as nm

TAGS = ("global_step1", "global_step2")


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small MLP sharded with FSDP2 over every rank; 3 output rows shard unevenly."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 3, generator=gen)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def full(obj: Any) -> Any:
    """`obj` with every DTensor gathered into a full tensor (a collective: every rank)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.full_tensor().clone()
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {key: full(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [full(value) for value in obj]
    return obj


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, to compare bit for bit (-0.0 is not 0.0, a NaN is itself)."""
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def same(a: Any, b: Any, path: str = "") -> list[str]:
    """Where `a` and `b` differ (tensors bit for bit: dtype, shape and every byte)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(bits(a), bits(b))
        )
        return [] if ok else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for key in a for d in same(a[key], b[key], f"{path}.{key}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in same(x, y, f"{path}.{i}")
        ]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def save(root: str, out: Path, rank: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import nebulaml.dcp

    model, optimizer = build(seed=0)
    train_step(model, optimizer, seed=100)
    state = state_of(model, optimizer)
    dcp.save(state, storage_writer=nebulaml.dcp.Writer(TAGS[0]))
    expected = full(state)
    if rank == 0:
        torch.save(expected, out / f"expected_{TAGS[0]}.pt")
    train_step(model, optimizer, seed=101)
    state = state_of(model, optimizer)
    future = dcp.async_save(state, storage_writer=nebulaml.dcp.Writer(TAGS[1]))
    future.result()
    expected = full(state)
    if rank == 0:
        torch.save(expected, out / f"expected_{TAGS[1]}.pt")
    # The same sharded state through plain Checkpoint.save: a clear error, no RuntimeError.
    try:
        nm.Checkpoint("plain").save(f"model_rank{rank}", model)
    except nm.InvalidArgumentError as exc:
        print(f"REFUSED {exc}", flush=True)
    nm.flush_persistence()
    dist.barrier()


def load(out: Path, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    import nebulaml.dcp

    model, optimizer = build(seed=1)  # other weights, and other moments after its step
    train_step(model, optimizer, seed=200)
    for tag in TAGS:
        state = state_of(model, optimizer)
        dcp.load(state, storage_reader=nebulaml.dcp.Reader(tag))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        differ = same(
            full(state_of(model, optimizer)),
            torch.load(out / f"expected_{tag}.pt", weights_only=True),
        )
        print(f"LOADED {tag} rank {rank}: {differ or 'identical'}", flush=True)


def lightning(root: str, out: Path, package: str) -> None:
    import importlib

    base = "lightning.pytorch" if package == "lightning" else package
    pl = importlib.import_module(base)
    strategies = importlib.import_module(f"{base}.strategies")
    ours = importlib.import_module(f"nebulaml.{package}")

    class Sharded(pl.LightningModule):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.01)

    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4
    )
    callback = ours.NebulaCallback(
        dirpath=str(out / "ckpts"),
        every_n_train_steps=1,
        config_params={"persistent_storage_path": root, "persistent_time_interval": 0},
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategies.ModelParallelStrategy(),
        max_steps=2,
        callbacks=[callback],
        plugins=[ours.NebulaCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out / "lightning"),
    )
    try:
        trainer.fit(Sharded(), data)
    except nm.InvalidArgumentError as exc:
        print(f"REFUSED {exc}", flush=True)
    else:
        print("FIT RAN", flush=True)


def main() -> int:
    scenario, root, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    warnings.filterwarnings("ignore")  # Lightning's and DCP's chatter; errors still raise
    if scenario == "lightning":
        lightning(root, out, sys.argv[4])
        nm.shutdown()
        return 0
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    nm.init(root, persistent_time_interval=0)
    try:
        if scenario == "save":
            save(root, out, rank)
        else:
            load(out, rank)
        dist.barrier()
    finally:
        nm.shutdown()
        dist.destroy_process_group()
    print(f"OK rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
