"""What the outage tests share (tests/core/test_outage.py, tests/azure/test_azure_outage*.py):
a 1 MiB state per step, a timed save of it, waiting, through the status call alone, until
a checkpoint is durable, and an Azurite taken away for a block (stopped, or suspended)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

import nebulaml as nm

if TYPE_CHECKING:
    from azurite import Azurite

MB = 1 << 20


def state(step: int) -> dict[str, torch.Tensor]:
    """1 MiB of `step`, and the step."""
    return {"w": torch.full((MB // 4,), float(step)), "step": torch.tensor(step)}


def timed_save(step: int) -> float:
    """Save `global_step<step>` (one item, "model"); how long the call took (s)."""
    t0 = time.perf_counter()
    nm.Checkpoint(f"global_step{step}").save("model", state(step))
    return time.perf_counter() - t0


def wait_durable(tag: str, timeout_s: float = 90) -> None:
    """Until `nm.persistence_status()` says `tag` is the newest durable checkpoint (no other
    call into nebula: the persister gets there by itself)."""
    deadline = time.monotonic() + timeout_s
    while nm.persistence_status().durable != tag:
        assert time.monotonic() < deadline, nm.persistence_status()
        time.sleep(0.05)


@contextlib.contextmanager
def store_away(server: Azurite, how: str) -> Iterator[None]:
    """The store away for the block: stopped cleanly (its data survives) and started
    again on the same port after it, or suspended (SIGSTOP: requests hang) and resumed."""
    proc = server.proc
    assert proc is not None
    if how == "stopped":
        server.stop()
    else:
        os.killpg(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if how == "stopped":
            server.restart()
        else:
            os.killpg(proc.pid, signal.SIGCONT)
