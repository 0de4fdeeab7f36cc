"""Helpers of the framework integration tests: skip-or-fail for optional frameworks, and
launching framework children (several ranks, as torchrun would).

The frameworks are optional extras (`pip install -e '.[deepspeed,lightning,transformers]'`). A test
that needs one that is not installed is skipped with the reason, and fails under CI
(CI=true), where the extras must be installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import warm
from rendezvous import rendezvous

REPO = Path(__file__).resolve().parents[2]
EXTRAS = {
    "deepspeed": "deepspeed",
    "lightning": "lightning",
    "pytorch_lightning": "lightning",
    "transformers": "transformers",
    "accelerate": "transformers",
    "peft": "dev",
}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require(package: str) -> None:
    """Skip (fail under CI) unless `package` is importable."""
    if importlib.util.find_spec(package) is not None:
        return
    reason = (
        f"{package} is not installed: pip install -e '.[{EXTRAS.get(package, package)}]' "
        f"(make test installs it)"
    )
    if in_ci():
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


def same(a: Any, b: Any) -> bool:
    """Whether two states are equal bit for bit: tensors (dtype too), dicts, lists."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)


@dataclass(frozen=True, slots=True)
class Finished:
    """A finished child process: its exit code and what it printed (stdout and stderr)."""

    returncode: int
    output: str


def child_env(memory_tier: Path, **extra: str) -> dict[str, str]:
    """The environment of a framework child: this test's memory tier, one thread per
    process (2 cores, several ranks), DeepSpeed on the CPU, short rank timeouts."""
    env = dict(
        os.environ,
        NEBULA_MEMORY_TIER_PATH=str(memory_tier),
        NEBULA_RANK_TIMEOUT_S="60",
        OMP_NUM_THREADS="1",
        OMP_WAIT_POLICY="PASSIVE",
        DS_ACCELERATOR="cpu",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def run_ranks(
    argv: list[str], world_size: int, env: dict[str, str], *, timeout_s: float = 240
) -> list[Finished]:
    """Run `argv` as `world_size` ranks on this node, as torchrun would set them up; every
    rank is waited for (and all are killed when one runs past the timeout). The ranks meet
    at a store this process serves (tests/rendezvous.py)."""
    with rendezvous(world_size) as meeting:
        return _run_ranks(argv, world_size, dict(env, **meeting), timeout_s)


def _run_ranks(
    argv: list[str], world_size: int, env: dict[str, str], timeout_s: float
) -> list[Finished]:
    procs = []
    for rank in range(world_size):
        rank_env = dict(
            env,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        procs.append(
            warm.Popen(
                argv,
                env=rank_env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    deadline = time.monotonic() + timeout_s
    finished = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            finished.append(Finished(proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return finished


def run_script(argv: list[str], env: dict[str, str], *, timeout_s: float = 240) -> Finished:
    done = warm.run(
        [sys.executable, *argv],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    return Finished(done.returncode, done.stdout + done.stderr)
