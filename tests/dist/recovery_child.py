"""One rank of a job that replicates its nodes' memory tiers, is killed, and restarts
(run by tests/dist/test_peer_recovery.py, not by pytest).

Usage: recovery_child.py PHASE ROOT PORT; RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and the
node's NEBULA_MEMORY_TIER_PATH come from the environment (dist_launch.run_ranks).

    save     saves global_step1..3 (persistent_time_interval=3600: only global_step1 is
             persisted, waited for), each replicated to the partner node once every rank
             committed its own part, and answered; writes
             `<ROOT>/../out/part-<rank>-<tag>.json` (the sha256 of each file of its own
             part), evicts what the memory tier no longer needs, then every rank SIGKILLs
             itself (the job dies; the test then deletes, or damages, what a lost node
             loses)
    ahead    saves global_step1..2 as `save` does, then global_step3, which no rank
             replicates (the lost node's replica of it never reached its partner:
             replication is asynchronous); prints HELD (the steps of its own parts left
             after the eviction global_step3's commit asked for), then SIGKILLs itself
    restart  `nm.init`, nebula's ring, `recover_from_peers`; prints RESULT, LATEST (what
             `get_latest_checkpoint()` returns) and LOADED (its shard, compared with what
             was saved at that step); writes `restored-<rank>-<tag>.json` (the sha256 of
             the files of its part now in its memory tier); the last line is "OK rank <r>"
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from peer_parts import own_part, save, shard

import nebulaml as nm
from nebulaml.format.names import marker_name
from nebulaml.runtime import session
from nebulaml.runtime.peer_recovery import recover_from_peers
from nebulaml.runtime.peers import open_ring
from nebulaml.runtime.replication import Replication

CHUNK = 16 << 10  # several messages per part: the stream's cuts are exercised


def wait_for(path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.02)


def save_and_die(rank: int, root: str, out: Path, *, ahead: bool = False) -> int:
    live = session.live()
    assert live is not None
    memory = live.tiers.memory
    peers = open_ring(timeout=timedelta(minutes=2))
    assert peers is not None
    replication = Replication(peers, memory, chunk_bytes=CHUNK).start()
    for step in (1, 2) if ahead else (1, 2, 3):
        tag = save(rank, step)
        part = own_part(Path(memory.root), tag, rank)
        (out / f"part-{rank}-{tag}.json").write_text(json.dumps(part))
        # Every rank's own part is committed before its partner's replica comes: the
        # receiver keeps the newest replica alone (protocol/replicas.py keep_only).
        dist.barrier()
        replication.replicate(tag)
        state = replication.wait(tag, 60)
        assert state.replicated == tag, state
        if step == 1:  # the first commit is persisted at once; the interval holds the rest
            wait_for(Path(root) / tag / "manifest.json")
    dist.barrier()  # every replica answered: each receiver committed its own
    if ahead:
        save(rank, 3)  # never replicated
        live.persister.settle_eviction()  # what its commit asked for, evicted now
    else:
        live.persister.evict_memory()  # what the next commit would evict
    held = sorted(
        p.parent.name for p in Path(memory.root).glob(f"global_step*/{marker_name(rank)}")
    )
    print(f"HELD rank {rank} {' '.join(held)}", flush=True)
    dist.barrier()
    print(f"SAVED rank {rank}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    return 1


def restart(rank: int, out: Path) -> int:
    live = session.live()
    assert live is not None
    peers = open_ring(timeout=timedelta(minutes=2))
    assert peers is not None
    result = recover_from_peers(peers, live.tiers, live.ranks, persister=live.persister)
    received = [(m.tag, m.rank, m.holder) for m in result.received]
    sent = [(m.tag, m.rank, m.holder) for m in result.sent]
    print(f"RESULT tag={result.tag} source={result.source} received={received} sent={sent} "
          f"refused={len(result.refused)} durable={result.durable} "
          f"seconds={result.seconds:.2f}", flush=True)  # fmt: skip
    memory = Path(live.tiers.memory.root)
    for moved in result.received:
        part = own_part(memory, moved.tag, rank)
        (out / f"restored-{rank}-{moved.tag}.json").write_text(json.dumps(part))
    latest = nm.get_latest_checkpoint()
    print(f"LATEST rank {rank} {latest.tag if latest else None}", flush=True)
    if latest is not None:
        step = int(latest.tag.removeprefix("global_step"))
        loaded = latest.load(f"shard_rank{rank}")
        same = all(torch.equal(loaded[k], v) for k, v in shard(rank, step).items())
        extra = latest.load(f"extra_rank{rank}")
        print(f"LOADED rank {rank} {latest.tag} equal={same and extra == {'lr': 0.1 * step}}",
              flush=True)  # fmt: skip
        latest.release()
    nm.shutdown()
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK rank {rank}", flush=True)
    return 0


def main() -> int:
    phase, root, port = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = Path(root).parent / "out"
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    nm.init(root, persistent_time_interval=3600, rank_timeout_s=30, keep_memory_tier=True)
    dist.barrier()  # together into the group's creation
    if phase in ("save", "ahead"):
        return save_and_die(rank, root, out, ahead=phase == "ahead")
    return restart(rank, out)


if __name__ == "__main__":
    sys.exit(main())
