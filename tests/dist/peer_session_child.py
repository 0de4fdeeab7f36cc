"""One rank of a job that checkpoints with `nm.init(..., peer_replicas=1)` (run by
tests/dist/test_peer_session.py, not by pytest): the session opens nebula's ring and
replicates each commit itself.

Usage: peer_session_child.py SCENARIO ROOT PORT; RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and the
node's NEBULA_MEMORY_TIER_PATH come from the environment (dist_launch.run_ranks). What a
rank saw goes to stdout and `<ROOT>/../out/`; its last line is "OK rank <r>".

    wired   both ranks save global_step1..3 (a shard each) and wait until
            persistence_status().replicated is global_step3; the memory tiers are kept
    slow    rank 1's receivers start 3 s late: rank 0's save and commit return at once
    one     a job on one node: one warning, no group, no replication
    kill    rank 0 alone saves (init from NEBULA_PEER_REPLICAS); rank 1 is SIGKILLed after
            global_step1 is replicated: the status says failing, saves go on and persist
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist
from peer_parts import own_part, save, shard

import nebulaml as nm
from nebulaml.runtime import replication as replication_module
from nebulaml.runtime import session


class Warnings(logging.Handler):
    """The warnings nebula logs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def wait_status(
    want: str, field: str = "replicated", timeout_s: float = 60
) -> nm.PersistenceStatus:
    deadline = time.monotonic() + timeout_s
    while True:
        status = nm.persistence_status()
        if getattr(status, field) == want or time.monotonic() > deadline:
            return status
        time.sleep(0.02)


def say(status: nm.PersistenceStatus, what: str) -> None:
    print(f"STATUS {what} replicated={status.replicated} replication={status.replication} "
          f"error={status.replication_error}", flush=True)  # fmt: skip


def wired(rank: int, root: str, out: Path) -> None:
    nm.init(root, persistent_time_interval=3600, peer_replicas=1, keep_memory_tier=True)
    live = session.live()
    assert live is not None and live.peers is not None
    memory = Path(live.tiers.memory.root)
    for step in (1, 2, 3):
        tag = save(rank, step, 65536)
    (out / f"part-{rank}-{tag}.json").write_text(json.dumps(own_part(memory, tag, rank)))
    say(wait_status(tag), tag)
    dist.barrier()  # every replica answered: each node holds its partner's
    nm.shutdown()


def slow(rank: int, root: str) -> None:
    if rank == 1:  # this rank's receivers start late: rank 0's parts wait for them
        receive = replication_module.Replication._receive_loop

        def late(self: replication_module.Replication, source: int) -> None:
            time.sleep(3)
            receive(self, source)

        replication_module.Replication._receive_loop = late  # type: ignore[method-assign]
    nm.init(root, persistent_time_interval=3600, peer_replicas=1)
    dist.barrier()
    started = time.monotonic()
    tag = save(rank, 1, 1 << 20)  # 4 MiB a rank: several messages
    returned = time.monotonic() - started
    then = nm.persistence_status().replicated
    status = wait_status(tag)
    print(f"SAVED {tag} in {returned:.3f} s, replicated then {then}, "
          f"answered after {time.monotonic() - started:.2f} s", flush=True)  # fmt: skip
    say(status, tag)
    dist.barrier()
    nm.shutdown()


def one_node(rank: int, root: str) -> None:
    handler = Warnings()
    logging.getLogger("nebulaml").addHandler(handler)
    groups = dist.distributed_c10d._world.group_count
    nm.init(root, persistent_time_interval=3600, peer_replicas=1)
    nm.init(root, persistent_time_interval=3600, peer_replicas=1)  # the same: a no-op
    live = session.live()
    assert live is not None
    made = dist.distributed_c10d._world.group_count - groups
    tag = save(rank, 1, 65536)
    status = nm.persistence_status()
    print(f"ONE NODE groups made {made}, peers {live.peers}, replication "
          f"{live.replication}", flush=True)  # fmt: skip
    say(status, tag)
    for line in handler.lines:
        print(f"WARNING {line}", flush=True)
    dist.barrier()
    nm.shutdown()


def killed(rank: int, root: str, out: Path) -> None:
    nm.init(root, persistent_time_interval=3600, rank_timeout_s=5)  # NEBULA_PEER_REPLICAS
    go = out / "kill-rank-1"
    if rank == 1:
        deadline = time.monotonic() + 60
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)

    def save(step: int) -> tuple[str, float]:
        started = time.monotonic()
        tag = f"global_step{step}"
        nm.Checkpoint(tag, ranks=[0]).save("model", shard(0, step, 1 << 18))
        return tag, time.monotonic() - started

    tag, _ = save(1)
    say(wait_status(tag), tag)
    go.touch()
    time.sleep(1)  # rank 1 is gone
    tag, took = save(2)
    print(f"SAVED {tag} in {took:.3f} s", flush=True)
    status = wait_status("failing", "replication", timeout_s=30)
    say(status, tag)
    tag, took = save(3)
    print(f"SAVED {tag} in {took:.3f} s", flush=True)
    flushed = nm.flush_persistence(timeout_s=30)
    status = nm.persistence_status()
    print(f"FLUSHED {flushed} durable={status.durable}", flush=True)
    started = time.monotonic()
    nm.shutdown()
    print(f"SHUT DOWN in {time.monotonic() - started:.2f} s", flush=True)


def main() -> int:
    scenario, root, port = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(root).parent / "out"
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    if scenario == "wired":
        wired(rank, root, out)
    elif scenario == "slow":
        slow(rank, root)
    elif scenario == "one":
        one_node(rank, root)
    elif scenario == "kill":
        killed(rank, root, out)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    dist.destroy_process_group()
    print(f"OK rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
