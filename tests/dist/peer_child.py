"""One rank of a job whose nodes replicate their memory tiers to each other (run by
tests/dist/test_peer_replicas.py, not by pytest).

Usage: peer_child.py SCENARIO ROOT PORT; RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and the
node's NEBULA_MEMORY_TIER_PATH come from the environment (dist_launch.run_ranks). Each
rank saves its own shard with nebula (its memory tier keeps it: keep_memory_tier), opens
nebula's ring and replicates; what it saw goes to `<ROOT>/../out/`: `part-<rank>-<tag>.json`
(the sha256 of each file of its own part of each tag, read right after the commit) and
`status-<rank>.json`. The last line is "OK rank <r>".
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import nebulaml as nm
from nebulaml.format.names import marker_name
from nebulaml.runtime import session
from nebulaml.runtime.peers import Peers, open_ring
from nebulaml.runtime.replication import Replication, Tamper
from nebulaml.storage.store import Store

CHUNK = 16 << 10  # several messages per part: the stream's cuts are exercised


def shard(rank: int, step: int, size: int = 8192) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return {"flat_param": torch.randn(size, generator=gen), "step": torch.tensor(step)}


def save(rank: int, step: int, size: int = 8192) -> str:
    tag = f"global_step{step}"
    ckpt = nm.Checkpoint(tag, -2)
    ckpt.save(f"shard_rank{rank}", shard(rank, step, size))
    ckpt.save(f"extra_rank{rank}", {"lr": 0.1 * step})
    ckpt.commit()
    return tag


def own_part(memory: Path, tag: str, rank: int) -> dict[str, str]:
    """The sha256 of each file of this rank's part of `tag` in its memory tier."""
    marker = json.loads((memory / tag / marker_name(rank)).read_text())
    names = [marker_name(rank), *(item["file"] for item in marker["items"])]
    return {n: hashlib.sha256((memory / tag / n).read_bytes()).hexdigest() for n in names}


def flip_last_byte_of(target: str) -> Tamper:
    def tamper(tag: str, index: int, data: memoryview) -> None:
        if tag == target and index == 0:
            data[-1] ^= 0x01  # the first message's last byte: an item's
            print(f"FLIPPED a byte of {tag}", flush=True)

    return tamper


def slow_and_say_when(out: Path) -> Tamper:
    """Rank 0's sends, slowed to 20 ms a message; `out/sending` appears at the 4th."""

    def tamper(tag: str, index: int, data: memoryview) -> None:
        if index == 3:
            (out / "sending").touch()
        time.sleep(0.02)

    return tamper


def partner_killed(rank: int, memory: Store, peers: Peers, out: Path) -> int:
    """Rank 1 is SIGKILLed while rank 0's part of global_step1 is on its way to it: rank
    0's replication says so, and its next save and `replicate` go on at once."""
    if rank == 1:
        Replication(peers, memory, chunk_bytes=CHUNK).start()
        deadline = time.monotonic() + 60
        while not (out / "sending").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    replication = Replication(
        peers, memory, chunk_bytes=CHUNK, tamper=slow_and_say_when(out)
    ).start()
    replication.replicate(save(rank, 1, size=200_000))
    state = replication.wait("global_step1", 60)
    print(f"STATUS global_step1 replicated={state.replicated} link_down={state.link_down} "
          f"error={state.last_error}", flush=True)  # fmt: skip
    started = time.monotonic()
    tag = save(rank, 2)
    replication.replicate(tag)
    print(f"SAVED {tag} and asked in {time.monotonic() - started:.2f} s", flush=True)
    started = time.monotonic()
    replication.close(grace_s=1.0)
    print(f"CLOSED in {time.monotonic() - started:.2f} s", flush=True)
    try:
        nm.shutdown()
    except nm.PersistError as exc:  # rank 1's parts never reached the persistent tier
        print(f"SHUTDOWN {exc}", flush=True)
    dist.destroy_process_group()
    print(f"OK rank {rank}", flush=True)
    return 0


def main() -> int:
    scenario, root, port = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(root).parent / "out"
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    # (a job that lost a rank: the exit's persist waits for its part 3 s, not 60)
    rank_timeout = 3 if scenario == "kill" else 60
    nm.init(root, persistent_time_interval=3600, rank_timeout_s=rank_timeout, keep_memory_tier=True)
    live = session.live()
    assert live is not None
    memory = live.tiers.memory
    dist.barrier()  # together into the group's creation (the idle scenario's is short)
    timeout = timedelta(seconds=3) if scenario == "idle" else timedelta(minutes=2)
    peers = open_ring(timeout=timeout)
    assert peers is not None
    ring = peers.ring
    print(f"RING rank {rank} node {ring.node} partner {ring.partner} send_to {ring.send_to} "
          f"receive_from {list(ring.receive_from)}", flush=True)  # fmt: skip
    if scenario == "kill":
        return partner_killed(rank, memory, peers, out)
    tamper = flip_last_byte_of("global_step2") if scenario == "corrupt" and rank == 0 else None
    keepalive = 0.5 if scenario == "idle" else 60.0
    replication = Replication(
        peers, memory, chunk_bytes=CHUNK, keepalive_s=keepalive, tamper=tamper
    )
    if scenario == "late" and rank == 1:
        time.sleep(2)  # rank 0's send must not wait for this receiver
    replication.start()
    steps = (1,) if scenario in ("late", "idle", "close") else (1, 2)
    for step in steps:
        tag = save(rank, step)
        own = own_part(Path(memory.root), tag, rank)
        (out / f"part-{rank}-{tag}.json").write_text(json.dumps(own))
        if scenario == "idle":
            time.sleep(4)  # idle longer than the group's timeout: the keepalives carry it
        started = time.monotonic()
        replication.replicate(tag)
        returned = time.monotonic() - started
        right_after = replication.status()
        state = replication.wait(tag, 60)
        print(f"REPLICATE {tag} returned in {returned:.3f} s, replicated then "
              f"{right_after.replicated}, answered after {time.monotonic() - started:.2f} s",
              flush=True)  # fmt: skip
        print(f"STATUS {tag} replicated={state.replicated} refused={state.refused} "
              f"error={state.last_error}", flush=True)  # fmt: skip
    dist.barrier()  # every replica is answered: every receiver has committed its own
    (out / f"status-{rank}.json").write_text(
        json.dumps({"kept": replication.status().kept, "replicated": state.replicated})
    )
    if scenario == "close" and rank == 1:
        time.sleep(6)  # closes long after its partner gave up waiting for its BYE
    started = time.monotonic()
    replication.close(grace_s=1.0)
    print(f"CLOSED in {time.monotonic() - started:.2f} s", flush=True)
    nm.shutdown()
    if scenario != "close":
        dist.barrier()
    dist.destroy_process_group()
    print(f"OK rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
