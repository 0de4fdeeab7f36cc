"""One rank of the node-loss campaign's job (tests/reliability/node_loss.py; started by
the campaign, not by pytest).

Usage: node_loss_worker.py ROOT JOURNAL_DIR INTERVAL_S PAUSE_S. The campaign sets RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE=1 and GROUP_RANK (every rank a node of its own),
MASTER_ADDR and MASTER_PORT (a store it serves), TORCHELASTIC_RUN_ID and
TORCHELASTIC_RESTART_COUNT (the job and its incarnation) and NEBULA_MEMORY_TIER_PATH (the
node's own folder).

Each rank, in every incarnation: joins a gloo process group (env://);
`nm.init(ROOT, persistent_time_interval=INTERVAL_S, peer_replicas=1)`, which recovers a
lost node's parts from its partner; resumes from `nm.get_latest_checkpoint()`, loading
every item of it and comparing each with the deterministic state of its step (a FAIL line
in the rank's results file when one differs or does not load: a torn or mixed
checkpoint); journals "resumed"; then trains: each step a `dist.all_reduce` (the ranks
are coupled, as in training), then "save <N>" journalled, a checkpoint `global_step<N>`
of this rank's part (`part_rank<r>`: a frozen 4 MiB base, the same at every step, and a
64 KiB adapter, the step and the incarnation, which change) and, on rank 0, a small
`meta` item, committed; once that returned, "ack <N>". Between steps (PAUSE_S) it polls
`nm.persistence_status()`: "replicated <N>" once `replicated` names a newer step (the
partner holds this rank's part of it, verified), "durable <N>" once `durable` does. Every
journal line is appended and fsynced. The ranks stop together at the first step after
the campaign created JOURNAL_DIR/stop, call `nm.shutdown()` and exit 0.

Files in JOURNAL_DIR, per rank r: rank<r>.journal (start, joined, resumed, save, ack,
replicated, durable, done lines: the ground truth of what each rank saw),
results-rank<r>.txt (OK and FAIL lines, by incarnation).
"""

from __future__ import annotations

import os
import sys
import time
from functools import cache
from pathlib import Path
from typing import Any

FROZEN_FLOATS = 1 << 20  # a 4 MiB frozen base per rank: the same at every step
ADAPTER_FLOATS = 16 << 10  # 64 KiB that change at every step


def write_line(path: Path, line: str) -> None:
    """Append one line to `path` and fsync it: once this returns, the line is durable."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


@cache
def frozen(rank: int) -> Any:
    """Rank `rank`'s frozen base: one tensor per process, saved again at every step."""
    import torch

    return torch.randn(FROZEN_FLOATS, generator=torch.Generator().manual_seed(104729 + rank))


def part(rank: int, step: int, lineage: int) -> dict[str, Any]:
    """Rank `rank`'s part of the checkpoint of `step` saved by incarnation `lineage`: the
    same for the same (rank, step, lineage), another for a step saved again after a
    restart (so that a checkpoint mixed from two runs' parts does not pass for whole)."""
    import torch

    gen = torch.Generator().manual_seed(7919 * step + 104729 * lineage + rank)
    return {
        "frozen": frozen(rank),
        "adapter": torch.randn(ADAPTER_FLOATS, generator=gen),
        "step": torch.tensor(step),
        "rank": torch.tensor(rank),
        "lineage": torch.tensor(lineage),
    }


def meta(step: int, world_size: int, lineage: int) -> dict[str, int]:
    return {"step": step, "world_size": world_size, "lineage": lineage}


def step_of(tag: str | None) -> int:
    return 0 if tag is None else int(tag.removeprefix("global_step"))


def check_loaded(handle: Any, step: int, world_size: int) -> tuple[int | None, list[str]]:
    """Load every item of the checkpoint `handle` and compare it, bit for bit, with step
    `step`'s state as the incarnation that saved it (its `meta` says which) saved it: that
    incarnation (None: unknown) and what differs (a torn or mixed checkpoint) or fails to
    load."""
    import torch

    import nebulaml as nm

    problems = []
    try:
        got_meta = handle.load("meta")
    except nm.NebulaError as exc:
        return None, [f"{handle.tag} meta did not load: {type(exc).__name__}: {exc}"]
    lineage = got_meta.get("lineage") if isinstance(got_meta, dict) else None
    if not isinstance(lineage, int) or got_meta != meta(step, world_size, lineage):
        return None, [f"{handle.tag} meta is {got_meta}, not step {step}'s"]
    for other in range(world_size):
        name = f"part_rank{other}"
        try:
            got = handle.load(name)
        except nm.NebulaError as exc:
            problems.append(f"{handle.tag} {name} did not load: {type(exc).__name__}: {exc}")
            continue
        want = part(other, step, lineage)
        same = isinstance(got, dict) and got.keys() == want.keys()
        same = same and all(
            got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want
        )
        if not same:
            held = (got.get("step"), got.get("lineage")) if isinstance(got, dict) else got
            problems.append(f"{handle.tag} {name} is not the state of step {step} saved by "
                            f"incarnation {lineage} (step, incarnation: {held})")  # fmt: skip
    return lineage, problems


class Status:
    """What this rank has journalled of `persistence_status()`: newer steps only."""

    def __init__(self, journal: Path) -> None:
        self.journal = journal
        self.replicated = 0
        self.durable = 0

    def poll(self) -> None:
        import nebulaml as nm

        status = nm.persistence_status()
        replicated, durable = step_of(status.replicated), step_of(status.durable)
        now = time.time()
        if replicated > self.replicated:
            self.replicated = replicated
            write_line(self.journal, f"replicated {replicated} {now:.6f}")
        if durable > self.durable:
            self.durable = durable
            write_line(self.journal, f"durable {durable} {now:.6f}")


def main() -> int:
    root, journal_dir = sys.argv[1], Path(sys.argv[2])
    interval_s, pause_s = float(sys.argv[3]), float(sys.argv[4])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    incarnation = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    journal = journal_dir / f"rank{rank}.journal"
    results = journal_dir / f"results-rank{rank}.txt"
    write_line(journal, f"start {incarnation} {os.getpid()} {time.time():.6f}")

    import logging
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import nebulaml as nm
    from nebulaml.runtime import session

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s rank" + str(rank) + " %(levelname)s %(message)s"
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
    write_line(journal, f"joined {time.time():.6f}")  # nm.init and its recovery next
    started = time.monotonic()
    nm.init(root, persistent_time_interval=interval_s, peer_replicas=1, rank_timeout_s=30)
    init_s = time.monotonic() - started
    live = session.live()
    received = live.peer_recovered if live is not None else None

    latest = nm.get_latest_checkpoint()
    step, lineage = 0, None
    if latest is not None:
        step = step_of(latest.tag)
        with latest:
            lineage, problems = check_loaded(latest, step, world_size)
        for problem in problems:
            write_line(results, f"FAIL {incarnation} torn: {problem}")
        if not problems:
            write_line(results, f"OK {incarnation} resumed {latest.tag}")
    write_line(journal, f"resumed {step} {time.time():.6f} {init_s:.3f} {received or '-'} "
                        f"{'-' if lineage is None else lineage}")  # fmt: skip

    # Every rank must resume the same step: the smallest and the largest, in one reduce.
    both = torch.tensor([step, -step], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if int(both[0]) != -int(both[1]):
        write_line(results, f"FAIL {incarnation} ranks resumed different steps: "
                            f"{-int(both[1])} to {int(both[0])}")  # fmt: skip
        step = int(both[0])

    status = Status(journal)
    weight = sum(r + 1 for r in range(world_size))
    while True:
        step += 1
        stop = 1.0 if (journal_dir / "stop").exists() else 0.0
        grads = torch.tensor([float((rank + 1) * step), stop], dtype=torch.float64)
        dist.all_reduce(grads)
        if int(grads[0]) != weight * step:
            write_line(results, f"FAIL {incarnation} all_reduce of step {step}: {grads.tolist()}")
        write_line(journal, f"save {step} {time.time():.6f}")
        try:
            ckpt = nm.Checkpoint(f"global_step{step}", -2)
            ckpt.save(f"part_rank{rank}", part(rank, step, incarnation))
            if rank == 0:
                ckpt.save("meta", meta(step, world_size, incarnation))
            ckpt.commit()
        except nm.NebulaError as exc:
            write_line(results, f"FAIL {incarnation} save of global_step{step}: "
                                f"{type(exc).__name__}: {exc}")  # fmt: skip
            raise
        write_line(journal, f"ack {step} {time.time():.6f}")
        if grads[1] > 0:
            break
        deadline = time.monotonic() + pause_s
        while True:
            status.poll()
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)

    try:
        nm.shutdown()
    except nm.NebulaError as exc:
        write_line(results, f"FAIL {incarnation} shutdown: {type(exc).__name__}: {exc}")
    dist.barrier()
    dist.destroy_process_group()
    write_line(journal, f"done {step} {time.time():.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
