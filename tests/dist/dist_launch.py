"""Launching the ranks of a gloo job as separate processes, as torchrun would: the helper
of the multi-rank tests (test_multirank.py, test_writers.py)."""

from __future__ import annotations

import os
import subprocess

import warm
import sys
import time
from pathlib import Path

from rendezvous import rendezvous

TIMEOUT_S = 180


def run_ranks(
    child: Path, scenario: str, root: Path, memory: Path, world_size: int, *, nodes: int = 1
) -> list[tuple[int, str]]:
    """`world_size` ranks of `child scenario root port`, spread over `nodes` simulated nodes
    (each with a memory tier of its own); each rank's exit code and output, in rank order.
    Every rank is killed if they are not all done within TIMEOUT_S. The ranks meet at a
    store this process serves (tests/rendezvous.py)."""
    with rendezvous(world_size) as meeting:
        return _run(child, scenario, root, memory, world_size, nodes, meeting)


def _run(
    child: Path,
    scenario: str,
    root: Path,
    memory: Path,
    world_size: int,
    nodes: int,
    meeting: dict[str, str],
) -> list[tuple[int, str]]:
    port = meeting["MASTER_PORT"]
    procs = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            # The children meet at tcp://127.0.0.1:<port> (their argument), as clients.
            TORCHELASTIC_USE_AGENT_STORE=meeting["TORCHELASTIC_USE_AGENT_STORE"],
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size // nodes),
            NEBULA_MEMORY_TIER_PATH=str(memory if nodes == 1 else memory / f"node{rank}"),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            warm.Popen(
                [sys.executable, str(child), scenario, str(root), str(port)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    results = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1, deadline - time.monotonic()))
            results.append((proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def assert_every_rank_ok(results: list[tuple[int, str]]) -> None:
    """Each rank of `run_ranks` exited 0 and printed "OK rank <r>" (its child's last word)."""
    for rank, (code, out) in enumerate(results):
        assert code == 0 and f"OK rank {rank}" in out, out
