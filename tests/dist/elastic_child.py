"""One rank of a torchrun job with `--max-restarts 1` whose rank 1 is SIGKILLed mid-save
(run by tests/dist/test_generations.py under torchrun, not by pytest).

Usage: elastic_child.py ROOT OUTDIR NODES. torchrun sets RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_RUN_ID and TORCHELASTIC_RESTART_COUNT. NODES=2 simulates two
nodes on this one: each rank gets a memory tier of its own (OUTDIR/memory/node<r>) and
LOCAL_WORLD_SIZE=1; NODES=1 shares one memory tier.

Every rank resumes from the newest checkpoint (global_step<N>, items shard_rank<r>) and
saves global_step2, 4 and 6 from there; every shard records the restart that saved it.
The first incarnation: rank 0 writes its part of global_step6, rank 1 is killed before it
writes its own, torchrun restarts both. The second: both resume and save global_step6
again, rank 0 a little after rank 1 (a straggler). OUTDIR/rank<r>-restart<n>.json says
what each incarnation resumed from.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch


def shard(rank: int, step: int, restart: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * restart + rank)
    return {
        "flat_param": torch.randn(4096, generator=gen),
        "step": torch.tensor(step),
        "restart": torch.tensor(restart),
    }


def main() -> int:
    root, outdir, nodes = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    rank = int(os.environ["RANK"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if nodes == 2:  # this rank is alone on its node
        os.environ["NEBULA_MEMORY_TIER_PATH"] = str(outdir / "memory" / f"node{rank}")
        os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"] = "1", "0"
    else:
        os.environ["NEBULA_MEMORY_TIER_PATH"] = str(outdir / "memory" / "node0")

    import torch.distributed as dist

    import nebulaml as nm

    nm.init(root, persistent_time_interval=0, rank_timeout_s=20, exit_timeout_s=2)
    # torchrun's store outlives a restart, and gloo finds the other ranks' addresses in it:
    # a rank that comes late would read the first run's. A prefix per restart avoids that.
    world_size = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"restart{restart}", store),
        rank=rank,
        world_size=world_size,
    )

    latest = nm.get_latest_checkpoint()
    resumed: dict[str, object] = {"tag": None, "restarts": []}
    start = 0
    if latest is not None:
        resumed["tag"] = latest.tag
        resumed["restarts"] = [
            int(latest.load(f"shard_rank{r}")["restart"]) for r in range(world_size)
        ]
        start = int(latest.load(f"shard_rank{rank}")["step"])
    (outdir / f"rank{rank}-restart{restart}.json").write_text(json.dumps(resumed))
    dist.barrier()

    for step in (2, 4, 6):
        if step <= start:
            continue
        ckpt = nm.Checkpoint(f"global_step{step}", -2)
        if restart == 0 and step == 6:
            # Rank 0's part is written; rank 1 dies before it writes its own.
            if rank == 0:
                ckpt.save(f"shard_rank{rank}", shard(rank, step, restart))
            dist.barrier()
            if rank == 1:
                time.sleep(1.5)
                os.kill(os.getpid(), signal.SIGKILL)
            ckpt.commit()
            time.sleep(120)  # torchrun stops this rank once rank 1 is gone
            return 1
        if restart > 0 and step == 6 and rank == 0:
            time.sleep(2)  # a straggler: rank 1's part comes first
        ckpt.save(f"shard_rank{rank}", shard(rank, step, restart))
        ckpt.commit()
        nm.flush_persistence()
        dist.barrier()

    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == "global_step6", latest
    for other in range(world_size):
        loaded = latest.load(f"shard_rank{other}")
        expected = shard(other, 6, restart)
        assert all(torch.equal(loaded[k], v) for k, v in expected.items()), other
    dist.barrier()
    dist.destroy_process_group()
    nm.shutdown()
    print(f"OK rank {rank} restart {restart}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
