"""One rank of a job whose checkpoints only some ranks write, or whose ranks collide on an
item name (run by tests/dist/test_writers.py, not by pytest).

Usage: writers_child.py SCENARIO ROOT PORT; RANK, WORLD_SIZE and LOCAL_WORLD_SIZE come from
the environment, as torchrun sets them. Every scenario starts a gloo process group after
`nm.init` (as programs that set nebula up first do), prints what it saw, and ends with
"OK rank <r>".
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import nebulaml as nm


def state(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(2048, generator=gen), "step": torch.tensor(step)}


def rank0_saves(rank: int, world_size: int) -> None:
    """The common `if rank == 0: save`, with `ranks=[0]`: the other ranks call nothing,
    the checkpoint commits, and every rank loads it."""
    for step in (1, 2):
        if rank == 0:
            ckpt = nm.Checkpoint(f"global_step{step}", 2, ranks=[0])
            ckpt.save("model", state(step))
            ckpt.save("optimizer", {"lr": 0.1 * step})
            print(f"SAVED global_step{step}", flush=True)
        dist.barrier()
    if rank == 0:
        nm.flush_persistence()
    dist.barrier()
    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == "global_step2", latest
    loaded = latest.load("model")
    assert all(torch.equal(loaded[k], v) for k, v in state(2).items())
    assert latest.load("optimizer") == {"lr": 0.2}
    if rank == 1:
        try:
            nm.Checkpoint("global_step3", ranks=[0]).save("model", state(3))
        except nm.InvalidArgumentError as exc:
            print(f"REFUSED {exc}", flush=True)
    dist.barrier()


def collide_one_node(rank: int, world_size: int) -> None:
    """Every rank saves "model" into one tag, rank 1 after rank 0: rank 1's save() says so."""
    ckpt = nm.Checkpoint("global_step1", -2)
    if rank == 0:
        ckpt.save("model", state(1))
    dist.barrier()
    if rank == 1:
        try:
            ckpt.save("model", state(1))
        except nm.ItemCollisionError as exc:
            print(f"COLLISION {exc}", flush=True)
        else:
            print("NO COLLISION", flush=True)
    dist.barrier()
    if rank == 0:
        try:
            ckpt.commit()  # rank 1's part never comes: a bounded wait
        except nm.RankTimeoutError as exc:
            print(f"TIMEOUT {exc}", flush=True)
        else:
            print("COMMITTED", flush=True)
    dist.barrier()
    assert nm.get_latest_checkpoint() is None


def collide_two_nodes(rank: int, world_size: int) -> None:
    """Each node's memory tier holds its rank's "model"; the parts meet on the persistent
    tier, where the checkpoint must not be committed with the item twice."""
    ckpt = nm.Checkpoint("global_step1", 2)
    ckpt.save("model", state(1))
    ckpt.save(f"extra_rank{rank}", {"rank": rank})
    dist.barrier()
    try:
        nm.flush_persistence()
    except nm.PersistError as exc:
        print(f"PERSIST {type(exc.__cause__).__name__} {exc}", flush=True)
    dist.barrier()


SCENARIOS = {
    "rank0": rank0_saves,
    "collide": collide_one_node,
    "collide_nodes": collide_two_nodes,
}


def main() -> int:
    scenario, root, port = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = 4 if scenario.startswith("collide") else 60
    nm.init(root, persistent_time_interval=0, rank_timeout_s=timeout)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    SCENARIOS[scenario](rank, world_size)
    dist.destroy_process_group()
    try:
        nm.shutdown()
    except nm.PersistError as exc:
        if not scenario.startswith("collide"):
            raise
        # A rank whose part waited for the collided one's: never durable, and its exit
        # says so (which rank sees the collision itself depends on timing).
        print(f"NOT_DURABLE {exc.tag}", flush=True)
    print(f"OK rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
