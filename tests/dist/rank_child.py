"""One rank of a multi-rank test job (run by tests/dist/test_multirank.py, not by pytest).

Usage: rank_child.py SCENARIO ROOT PORT; RANK, WORLD_SIZE and LOCAL_WORLD_SIZE come from
the environment, as torchrun sets them.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

import nebulaml as nm


def shard(rank: int, step: int) -> dict[str, torch.Tensor]:
    """FSDP-style per-rank state: each rank holds its own shard of parameters and moments."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return {
        "flat_param": torch.randn(4096, generator=gen),
        "exp_avg": torch.randn(4096, generator=gen),
        "step": torch.tensor(step),
    }


def save_step(rank: int, step: int, *, tag: str | None = None, overwrite: bool = False) -> None:
    ckpt = nm.Checkpoint(tag or f"global_step{step}", -2, overwrite=overwrite)
    ckpt.save(f"shard_rank{rank}", shard(rank, step))
    if rank == 0:
        ckpt.save("meta", {"step": step})
    ckpt.commit()


def check_loaded(latest: nm.Checkpoint | None, world_size: int, step: int) -> None:
    assert latest is not None, "no checkpoint"
    for other in range(world_size):  # any rank loads any rank's item (elastic loads)
        loaded = latest.load(f"shard_rank{other}")
        expected = shard(other, step)
        same = all(torch.equal(loaded[k], expected[k]) for k in expected)
        assert same, f"shard_rank{other} of {latest.tag} is of step {int(loaded['step'])}"
    assert latest.load("meta") == {"step": step}


def check_every_rank(world_size: int, step: int) -> None:
    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == f"global_step{step}", latest
    check_loaded(latest, world_size, step)


def meet(folder: Path, rank: int, world_size: int, timeout_s: float = 120) -> None:
    """A barrier through files: every rank's file in `folder`, or TimeoutError."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / str(rank)).touch()
    deadline = time.monotonic() + timeout_s
    while len(list(folder.iterdir())) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank started within {timeout_s} s")
        time.sleep(0.02)


def wait_until_persisted(root: str, tag: str, timeout_s: float = 120) -> None:
    """Until `tag` is committed on the persistent tier (the persister's own doing)."""
    deadline = time.monotonic() + timeout_s
    while not (Path(root) / tag / "manifest.json").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{tag} was not persisted within {timeout_s} s")
        time.sleep(0.05)


def main() -> int:
    scenario, root, port = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if scenario in ("train", "nodes"):
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        # "nodes": every rank on its own node (its own memory tier); the interval holds
        # global_step2 back, so rank 0 persists 1 and 3 and the others must follow it.
        interval = 0 if scenario == "train" else 3600
        nm.init(root, persistent_time_interval=interval, rank_timeout_s=60)
        for step in (1, 2, 3):
            save_step(rank, step)
            dist.barrier()
            if step == 1 and scenario == "nodes":
                # The persister takes the newest committed checkpoint when it wakes: on a
                # busy machine global_step2 could come first. Its own persist of 1 first.
                wait_until_persisted(root, "global_step1")
                dist.barrier()
        nm.flush_persistence()
        dist.barrier()
        check_every_rank(world_size, 3)
        nm.shutdown()
        dist.barrier()
        dist.destroy_process_group()
    elif scenario == "exit":
        import torch.distributed as dist

        # A clean exit without a flush: each rank's exit persists its part of the newest,
        # rank 0's commits it, and every rank releases its memory tier.
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        nm.init(root, persistent_time_interval=0, rank_timeout_s=60)
        for step in (1, 2, 3):
            save_step(rank, step)
            dist.barrier()
        nm.shutdown()
        dist.barrier()
        dist.destroy_process_group()
    elif scenario == "overwrite":
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        nm.init(root, persistent_time_interval=0, rank_timeout_s=60)
        save_step(rank, 1, tag="global_step1")
        nm.flush_persistence()
        dist.barrier()
        # The same tag again (DeepSpeed's save_checkpoint with a tag it saved before), the
        # last rank late: the first ranks' new parts must wait for its new part, not be
        # committed with its old one, which is still in the tag folder.
        if rank == world_size - 1:
            time.sleep(2)
        save_step(rank, 2, tag="global_step1", overwrite=True)
        check_loaded(nm.get_checkpoint("global_step1"), world_size, 2)
        nm.flush_persistence()
        dist.barrier()
        nm.shutdown()
        dist.barrier()
        dist.destroy_process_group()
    elif scenario == "kill":
        nm.init(root, persistent_time_interval=0, rank_timeout_s=3)
        # The ranks start together (no process group here): on a busy machine one that
        # came up 3 s late would time the others out of global_step1.
        meet(Path(root).parent / "started", rank, int(os.environ["WORLD_SIZE"]))
        save_step(rank, 1)
        nm.flush_persistence()
        if rank == 1:
            ckpt = nm.Checkpoint("global_step2", -2)
            ckpt.save(f"shard_rank{rank}", shard(rank, 2))
            os.kill(os.getpid(), signal.SIGKILL)  # dies between its items and its marker
        try:
            save_step(rank, 2)
        except nm.RankTimeoutError as exc:
            print(f"TIMEOUT {exc}", flush=True)
        else:
            print("NO TIMEOUT", flush=True)
            return 1
        check_every_rank(world_size, 1)
    elif scenario in ("crash", "flush-first"):
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        nm.init(root, persistent_time_interval=3600, rank_timeout_s=60)
        if scenario == "crash":
            # global_step1 persisted; global_step2 held back by the interval, in the
            # memory tier alone when every rank is killed.
            save_step(rank, 1)
            nm.flush_persistence()
            dist.barrier()
            save_step(rank, 2)
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        # The next run flushes before its first save (DeepSpeed: load, flush, train): the
        # flush covers global_step2, which the crashed run left in the memory tier.
        nm.flush_persistence()
        if rank == 0:  # the leader's flush returns once the checkpoint is committed
            durable = (Path(root) / "global_step2" / "manifest.json").exists()
            print(f"DURABLE {durable}", flush=True)
        dist.barrier()
        check_every_rank(world_size, 2)
        nm.shutdown()
        dist.barrier()
        dist.destroy_process_group()
    elif scenario == "survivor":
        from nebulaml.protocol.rank_presence import rank_gone
        from nebulaml.runtime import session

        # Rank 1 dies once global_step2 is committed in the memory tier; rank 0's exit
        # persists it (as torchrun's SIGTERM makes it), rank 1's part with its own.
        nm.init(root, persistent_time_interval=3600, rank_timeout_s=60)
        meet(Path(root).parent / "started", rank, world_size)
        save_step(rank, 1)
        save_step(rank, 2)
        meet(Path(root).parent / "saved", rank, world_size)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        live = session.live()
        assert live is not None
        deadline = time.monotonic() + 60
        while not rank_gone(live.tiers.memory, 1):
            assert time.monotonic() < deadline, "rank 1 still alive"
            time.sleep(0.05)
        started = time.monotonic()
        nm.shutdown()
        print(f"EXIT {time.monotonic() - started:.1f} s", flush=True)
    print(f"OK rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
