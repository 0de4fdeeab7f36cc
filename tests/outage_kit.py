"""What the outage tests share (tests/core/test_outage.py, tests/azure/test_azure_outage.py):
a 1 MiB state per step, a timed save of it, and waiting, through the status call alone,
until a checkpoint is durable."""

from __future__ import annotations

import time

import torch

import nebulaml as nm

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
