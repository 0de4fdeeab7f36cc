"""One rank of a two-node job whose ranks save several checkpoints back to back (run by
tests/dist/test_follower_catches_up.py, not by pytest).

Usage: follower_child.py SCENARIO ROOT PORT; RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and the
node's NEBULA_MEMORY_TIER_PATH come from the environment (dist_launch.run_ranks).

Each rank (persistent_time_interval=3600, rank_timeout_s=30):
    flush   rank 1 saves global_step1..4 at once; then rank 0 saves global_step1, waits
            until its persist of it has begun (its marker on the persistent root: the
            job's first persist is never held back) and saves global_step2..4; then
            flush_persistence(timeout_s=20): "FLUSHED <result> in <s> s, durable <tag>"
    exit    the same, without the flush: the exit persists them
    again   rank 1 saves global_step1 and at once again (overwrite=True); then rank 0
            saves it, waits until its persist of it has begun (its marker on the
            persistent root: the job's first persist is never held back) and saves it
            again: "AGAIN in <s> s"; then both save global_step2..4 and flush
    steady  both ranks save global_step1..12 in step (a barrier and 0.3 s of "training"
            between saves), then print the tags of which the rank's memory tier holds
            its part ("PARTS <tag> <tag> ..."), then flush as above
Then `nm.shutdown()`: "SHUTDOWN in <s> s". The last line is "OK rank <r>".
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import nebulaml as nm
from nebulaml.format.names import marker_name


def save(rank: int, step: int, *, overwrite: bool = False) -> None:
    gen = torch.Generator().manual_seed(1000 * step + 10 * overwrite + rank)
    ckpt = nm.Checkpoint(f"global_step{step}", -2, overwrite=overwrite)
    ckpt.save(f"shard_rank{rank}", {"w": torch.randn(4096, generator=gen), "step": step})
    ckpt.commit()


def persist_begun(root: Path, tag: str) -> None:
    """Wait until rank 0's persist of `tag` has begun: its marker on the persistent root."""
    deadline = time.monotonic() + 30
    while not (root / tag / marker_name(0)).exists():
        assert time.monotonic() < deadline, f"rank 0 never began persisting {tag}"
        time.sleep(0.01)


def follower_ahead(rank: int, root: Path) -> None:
    """Rank 1 saves global_step1..4 before rank 0's persist of global_step1 begins."""
    if rank == 1:
        for step in (1, 2, 3, 4):
            save(rank, step)
    dist.barrier()
    if rank == 0:
        save(rank, 1)
        persist_begun(root, "global_step1")
        for step in (2, 3, 4):
            save(rank, step)


def saved_again(rank: int, root: Path) -> None:
    """global_step1 saved twice by each rank, rank 1 first (see the module's docstring)."""
    if rank == 1:
        save(rank, 1)
        save(rank, 1, overwrite=True)
    dist.barrier()
    if rank == 0:
        save(rank, 1)
        persist_begun(root, "global_step1")
        started = time.monotonic()
        save(rank, 1, overwrite=True)
        print(f"AGAIN in {time.monotonic() - started:.2f} s", flush=True)
    for step in (2, 3, 4):
        save(rank, step)


def in_step(rank: int) -> None:
    """global_step1..12, every rank in step (see the module's docstring)."""
    for step in range(1, 13):
        save(rank, step)
        dist.barrier()
        time.sleep(0.3)
    memory = Path(os.environ["NEBULA_MEMORY_TIER_PATH"])
    held = sorted({p.parent.name for p in memory.rglob(marker_name(rank))},
                  key=lambda t: int(t.removeprefix("global_step")))  # fmt: skip
    print("PARTS " + " ".join(held), flush=True)


def main() -> int:
    scenario, root, port = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    nm.init(root, persistent_time_interval=3600, rank_timeout_s=30)
    dist.barrier()
    if scenario == "again":
        saved_again(rank, Path(root))
    elif scenario == "steady":
        in_step(rank)
    else:
        follower_ahead(rank, Path(root))
    dist.barrier()  # every rank has committed global_step4 in its memory tier
    if scenario in ("flush", "again", "steady"):
        started = time.monotonic()
        try:
            flushed: object = nm.flush_persistence(timeout_s=20)
        except nm.NebulaError as exc:
            flushed = f"{type(exc).__name__}: {exc}"
        status = nm.persistence_status()
        print(f"FLUSHED {flushed} in {time.monotonic() - started:.2f} s, durable "
              f"{status.durable}", flush=True)  # fmt: skip
    started = time.monotonic()
    nm.shutdown()
    print(f"SHUTDOWN in {time.monotonic() - started:.2f} s", flush=True)
    dist.destroy_process_group()
    print(f"OK rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
