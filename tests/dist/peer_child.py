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
from peer_parts import own_part, save, shard

import nebulaml as nm
from nebulaml.format.names import REPLICA_DONE, marker_name
from nebulaml.protocol.replicas import replica_root
from nebulaml.runtime import session
from nebulaml.runtime.peers import Peers, open_ring
from nebulaml.runtime.replication import Replication, ReplicationStatus, Tamper
from nebulaml.storage.store import Store

CHUNK = 16 << 10  # several messages per part: the stream's cuts are exercised


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


# The LoRA scenarios' part: a frozen base of 12 MiB, the same at every step, and an
# adapter of 2 MiB that changes at every step (float32).
FROZEN, ADAPTER = 3 << 20, 1 << 19
_frozen: dict[int, torch.Tensor] = {}


def save_lora(rank: int, step: int, *, seed: int = 0, overwrite: bool = False) -> str:
    tag = f"global_step{step}"
    if rank not in _frozen:
        _frozen[rank] = torch.randn(FROZEN, generator=torch.Generator().manual_seed(rank))
    gen = torch.Generator().manual_seed(1000 * step + 100 * seed + rank)
    state = {"frozen": _frozen[rank], "adapter": torch.randn(ADAPTER, generator=gen)}
    ckpt = nm.Checkpoint(tag, -2, overwrite=overwrite)
    ckpt.save(f"model_rank{rank}", state)
    ckpt.commit()
    return tag


def record_part(memory: Store, out: Path, rank: int, tag: str, name: str = "") -> None:
    own = own_part(Path(memory.root), tag, rank)
    (out / f"part-{rank}-{name or tag}.json").write_text(json.dumps(own))


def await_file(path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.005)


def pause_once(tag: str, sending: Path, resume: Path) -> Tamper:
    """At the 4th message of the first send of `tag`: say so (`sending`), then wait for
    `resume`: the part is half sent meanwhile."""
    paused: list[bool] = []

    def tamper(sent: str, index: int, data: memoryview) -> None:
        if sent == tag and index == 3 and not paused:
            paused.append(True)
            sending.touch()
            await_file(resume)

    return tamper


def say(state: ReplicationStatus, tag: str) -> None:
    print(f"STATUS {tag} replicated={state.replicated} refused={state.refused} "
          f"abandoned={state.abandoned} bytes_sent={state.bytes_sent} "
          f"bytes_total={state.bytes_total} error={state.last_error}", flush=True)  # fmt: skip


def lora_scenario(scenario: str, rank: int, memory: Store, peers: Peers, out: Path) -> int:
    """delta: two steps, the second sent as what changed; base: rank 1 flips a byte of
    the replica it holds of rank 0's first step before the second comes; hold: each rank
    saves twice more while its first step is half sent (its eviction would reuse that
    step's buffers); overwrite: each rank saves its first step again while it is half
    sent."""
    live = session.live()
    assert live is not None
    tamper = None
    if scenario in ("hold", "overwrite"):
        sending, resume = out / f"sending-{rank}", out / f"resume-{rank}"
        tamper = pause_once("global_step1", sending, resume)
    chunk = (64 << 10) if tamper else (1 << 20)
    replication = Replication(
        peers, memory, chunk_bytes=chunk, tamper=tamper, leaves=live.pool.leaves_of
    ).start()
    if scenario == "overwrite":
        # The job's first checkpoint is persisted at once; the second waits for the
        # interval, so that saving it again waits for no persist of it.
        save_lora(rank, 0)
    tag = save_lora(rank, 1)
    record_part(memory, out, rank, tag)
    if scenario == "hold":
        # Durable, global_step1 is the memory tier's to evict once a newer one commits.
        assert nm.flush_persistence(tag, timeout_s=30)
    replication.replicate(tag)
    if scenario == "hold":
        await_file(sending)
        for step in (2, 3):  # each commit evicts what it supersedes: global_step1 is held
            save_lora(rank, step)
        print(f"HELD global_step1 kept={memory.exists('global_step1', marker_name(rank))}",
              flush=True)  # fmt: skip
        resume.touch()
    if scenario == "overwrite":
        await_file(sending)
        save_lora(rank, 1, seed=1, overwrite=True)
        record_part(memory, out, rank, tag, "global_step1-again")
        resume.touch()
    state = replication.wait(tag, 60)
    say(state, tag)
    if scenario == "overwrite":  # the newer part, asked for again
        replication.replicate(tag)
        say(replication.wait(tag, 60), tag)
    if scenario == "hold":
        dist.barrier()  # every replica of global_step1 is committed: its bytes, recorded
        (source,) = peers.ring.receive_from
        folder = Path(replica_root(memory, source).root) / tag
        held = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()
                if p.name != REPLICA_DONE}  # fmt: skip
        (out / f"replica-{source}-{tag}.json").write_text(json.dumps(held))
        tag = save_lora(rank, 4)
        # The partner's replica of global_step1 goes once its replica of global_step4 is
        # whole (every own part of global_step4 committed first): the eviction after it
        # takes global_step1, no longer held, and no longer the tag of a replica here.
        dist.barrier()
        replication.replicate(tag)
        say(replication.wait(tag, 60), tag)
        dist.barrier()
        live.persister.settle_eviction()
        live.persister.evict_memory()
        print(f"AFTER global_step1 kept={memory.exists('global_step1', marker_name(rank))}",
              flush=True)  # fmt: skip
    if scenario in ("delta", "base"):
        dist.barrier()  # every replica of global_step1 is committed
        if scenario == "base" and rank == 1:
            item = Path(replica_root(memory, 0).root) / "global_step1" / "model_rank0"
            data = bytearray(item.read_bytes())
            data[len(data) // 3] ^= 0x01  # a byte of the frozen base, which is not sent again
            item.write_bytes(bytes(data))
            print("FLIPPED a byte of the replica of rank 0's global_step1", flush=True)
        dist.barrier()
        tag = save_lora(rank, 2)
        record_part(memory, out, rank, tag)
        files = memory.list_files(tag)
        documents = sum(files.get(n, 0) for n in (marker_name(rank), "manifest.json"))
        replication.replicate(tag)
        say(replication.wait(tag, 60), tag)
        print(f"SIZES documents={documents} changed={ADAPTER * 4}", flush=True)
        if scenario == "base" and rank == 0:  # refused: sent again, whole
            replication.replicate(tag)
            say(replication.wait(tag, 60), f"{tag}-again")
    dist.barrier()  # every replica is answered
    replication.close(grace_s=1.0)
    nm.shutdown()
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK rank {rank}", flush=True)
    return 0


def slow_partner(rank: int, memory: Store, peers: Peers) -> int:
    """Rank 1 starts receiving only after rank 0 saved and replicated global_step1..8
    (4 MiB shards, back to back): rank 0's memory tier holds the part it is sending and
    the newest, never a queue of the ones in between, which no replica ever gets."""
    replication = Replication(peers, memory, chunk_bytes=CHUNK)
    if rank == 0:
        replication.start()
        for step in range(1, 9):
            tag = f"global_step{step}"
            nm.Checkpoint(tag, ranks=[0]).save("shard_rank0", shard(rank, step, 1 << 20))
            replication.replicate(tag)
        live = session.live()
        assert live is not None
        live.persister.settle_eviction()  # what the last commit superseded, evicted now
        held_tags = sorted(
            p.parent.name for p in Path(memory.root).glob(f"global_step*/{marker_name(0)}")
        )
        print("HELD " + " ".join(held_tags), flush=True)
        dist.barrier()  # rank 1 starts receiving now
        state = replication.wait("global_step8", 60)
        print(f"STATUS replicated={state.replicated} refused={state.refused}", flush=True)
    else:
        dist.barrier()
        replication.start()
        deadline = time.monotonic() + 60
        while replication.status().kept.get(0) != "global_step8" and time.monotonic() < deadline:
            time.sleep(0.05)
        kept = sorted(p.name for p in Path(replica_root(memory, 0).root).iterdir())
        print("KEPT " + " ".join(kept), flush=True)
    dist.barrier()
    replication.close(grace_s=1.0)
    nm.shutdown()
    dist.barrier()
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
    if scenario == "slow":
        return slow_partner(rank, memory, peers)
    if scenario in ("delta", "base", "hold", "overwrite"):
        return lora_scenario(scenario, rank, memory, peers, out)
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
        if scenario == "replicate":
            # Every rank's own part of the tag is committed before its partner's replica
            # comes: the replica before goes then (protocol/replicas.py keep_only).
            dist.barrier()
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
