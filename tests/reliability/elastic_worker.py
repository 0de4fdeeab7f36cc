"""One rank of the elastic-restart campaign's torchrun job (tests/reliability/elastic.py;
run by torchrun, not by pytest).

Usage: elastic_worker.py ROOT JOURNAL_DIR MAX_STEP PAUSE_S. torchrun sets RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT and TORCHELASTIC_RESTART_COUNT; the campaign sets
NEBULA_MEMORY_TIER_PATH.

Each rank, in every incarnation: joins a gloo process group through torchrun's store;
`nm.init(ROOT, persistent_time_interval=0)`; resumes from `nm.get_latest_checkpoint()`,
loading every item of it and comparing each with the deterministic state of its step (a
torn or mixed checkpoint, or one that does not load, is a FAIL line in the rank's results
file); journals "resumed <step> <wallclock> <restart>"; then trains: each step a
`dist.all_reduce` (the ranks are coupled as in real training), a checkpoint
`global_step<N>` of this rank's part (`part_rank<r>`: 2M float32, 8 MB, derived from
(rank, step)) and, on rank 0, a small `meta` item, committed with `commit()`; once that
returned, "ack <N> <wallclock>" is appended to the rank's journal and fsynced. The ranks
stop together at MAX_STEP or at the first step after the campaign created
JOURNAL_DIR/stop, call `nm.shutdown()` and exit 0.

Files in JOURNAL_DIR, per rank r: rank<r>.journal (start, resumed, ack, done lines: the
ground truth of what was acknowledged), results-rank<r>.txt (OK and FAIL lines),
seen-rank<r>.jsonl (what the rank saw on both tiers before it resumed: for diagnosis).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PART_FLOATS = 2 * 1024 * 1024  # 8 MiB of float32 per rank and step


def write_line(path: Path, line: str) -> None:
    """Append one line to `path` and fsync it: once this returns, the line is durable."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def part(rank: int, step: int) -> dict[str, Any]:
    """Rank `rank`'s part of the checkpoint of `step`: the same for the same (rank, step)."""
    import torch

    gen = torch.Generator().manual_seed(7919 * step + rank)
    return {
        "data": torch.randn(PART_FLOATS, generator=gen),
        "step": torch.tensor(step),
        "rank": torch.tensor(rank),
    }


def meta(step: int, world_size: int) -> dict[str, int]:
    return {"step": step, "world_size": world_size}


def step_of(tag: str) -> int:
    return int(tag.removeprefix("global_step"))


def check_loaded(handle: Any, step: int, world_size: int) -> list[str]:
    """Load every item of the checkpoint `handle` and compare it with step `step`'s state:
    what differs (a torn or mixed checkpoint) or fails to load, one line each."""
    import torch

    import nebulaml as nm

    problems = []
    for other in range(world_size):
        name = f"part_rank{other}"
        try:
            got = handle.load(name)
        except nm.NebulaError as exc:
            problems.append(f"{handle.tag} {name} did not load: {type(exc).__name__}: {exc}")
            continue
        want = part(other, step)
        same = isinstance(got, dict) and got.keys() == want.keys()
        same = same and all(torch.equal(got[k], want[k]) for k in want)
        if not same:
            held = got.get("step") if isinstance(got, dict) else type(got).__name__
            problems.append(f"{handle.tag} {name} is not step {step}'s state (step {held})")
    try:
        got_meta = handle.load("meta")
    except nm.NebulaError as exc:
        problems.append(f"{handle.tag} meta did not load: {type(exc).__name__}: {exc}")
    else:
        if got_meta != meta(step, world_size):
            problems.append(f"{handle.tag} meta is {got_meta}, not step {step}'s")
    return problems


def seen(root: str) -> dict[str, Any]:
    """What the tiers hold, as this rank sees them before it resumes (for diagnosis)."""
    import nebulaml as nm

    out: dict[str, Any] = {}
    try:
        out["committed"] = [
            (c["tag"], c["tiers"], c["committed_at"]) for c in nm.list_checkpoints(root, hold=False)
        ]
        out["incomplete"] = [
            (c["tag"], c["tier"], c["files"], [w.get("rank") for w in c["writers"]])
            for c in nm.list_incomplete(root)
        ]
    except Exception as exc:  # noqa: BLE001 - a diagnosis only: recorded, never fatal
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def main() -> int:
    root, journal_dir = sys.argv[1], Path(sys.argv[2])
    max_step, pause_s = int(sys.argv[3]), float(sys.argv[4])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    journal = journal_dir / f"rank{rank}.journal"
    results = journal_dir / f"results-rank{rank}.txt"
    write_line(journal, f"start {restart} {os.getpid()} {time.time():.6f}")

    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import nebulaml as nm

    torch.set_num_threads(1)
    # torchrun's store (MASTER_ADDR:MASTER_PORT, 127.0.0.1 under the campaign's
    # --local-addr) outlives a restart, and gloo finds the other ranks' addresses in it: a
    # rank that comes late would read the previous incarnation's. A prefix per restart.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timedelta(seconds=120),
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"restart{restart}", store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
    )
    nm.init(root, persistent_time_interval=0)

    before = seen(root)
    latest = nm.get_latest_checkpoint()
    step = 0
    tag = None
    if latest is not None:
        tag = latest.tag
        step = step_of(tag)
        with latest:
            problems = check_loaded(latest, step, world_size)
        for problem in problems:
            write_line(results, f"FAIL {restart} torn: {problem}")
        if not problems:
            write_line(results, f"OK {restart} resumed {tag}")
    write_line(journal, f"resumed {step} {time.time():.6f} {restart}")
    before.update(restart=restart, pid=os.getpid(), latest=tag,
                  master_addr=os.environ["MASTER_ADDR"])  # fmt: skip
    write_line(journal_dir / f"seen-rank{rank}.jsonl", json.dumps(before))

    # Both ranks must resume the same step: the smallest and the largest, in one reduce.
    both = torch.tensor([step, -step], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if int(both[0]) != -int(both[1]):
        write_line(results, f"FAIL {restart} ranks resumed different steps: "
                            f"{-int(both[1])} to {int(both[0])}")  # fmt: skip
        step = int(both[0])

    weight = sum(r + 1 for r in range(world_size))
    while True:
        step += 1
        # The training step: every rank's gradient summed (and whether to stop, so that
        # both stop at the same step).
        stop = 1.0 if (journal_dir / "stop").exists() or step >= max_step else 0.0
        grads = torch.tensor([float((rank + 1) * step), stop], dtype=torch.float64)
        dist.all_reduce(grads)
        if int(grads[0]) != weight * step:
            write_line(results, f"FAIL {restart} all_reduce of step {step}: {grads.tolist()}")
        try:
            ckpt = nm.Checkpoint(f"global_step{step}", -2)
            ckpt.save(f"part_rank{rank}", part(rank, step))
            if rank == 0:
                ckpt.save("meta", meta(step, world_size))
            ckpt.commit()
        except nm.NebulaError as exc:
            write_line(results, f"FAIL {restart} save of global_step{step}: "
                                f"{type(exc).__name__}: {exc}")  # fmt: skip
            raise
        write_line(journal, f"ack {step} {time.time():.6f}")
        if grads[1] > 0:
            break
        time.sleep(pause_s)

    try:
        nm.shutdown()
    except nm.NebulaError as exc:
        write_line(results, f"FAIL {restart} shutdown: {type(exc).__name__}: {exc}")
    dist.barrier()
    dist.destroy_process_group()
    write_line(journal, f"done {step} {time.time():.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
