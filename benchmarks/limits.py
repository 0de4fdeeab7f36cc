"""What this machine can do at best, measured in the same run as the methods.

Four figures, each a median of several runs:
  copy into a reused buffer   `dst.copy_(src)` into an already-touched tensor (memory bw)
  copy into fresh pages       `torch.empty_like(src).copy_(src)`: allocation + page faults
  sequential write            `write_bytes` to a new file in the work dir in `chunk_bytes`
                              writes of random bytes, then fsync; timed until fsync returns
  sequential read             the same file read back in `chunk_bytes` reads after
                              fsync + posix_fadvise(DONTNEED); `read_cache_resident` says
                              what fraction of it mincore still saw cached before the read
The disk figures are measured at the start and again at the end of the run (the disk's
speed varies from minute to minute on these machines); each is the median of all runs.

Not for: the methods themselves (peers.py, nebula_methods.py).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from measure import drop_page_cache, resident_fraction

GIB = 1 << 30
MIB = 1 << 20


def copy_bandwidth(size_bytes: int, repeats: int) -> dict[str, float]:
    """GB/s (10^9 bytes/s) of a tensor copy into a reused buffer and into fresh pages."""
    src = torch.ones(size_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page once
    reused, fresh = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        reused.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        new = torch.empty_like(src)
        new.copy_(src)
        fresh.append(time.perf_counter() - t0)
        del new
    nbytes = src.numel() * 4
    return {
        "copy_reused_gbps": nbytes / statistics.median(reused) / 1e9,
        "copy_fresh_gbps": nbytes / statistics.median(fresh) / 1e9,
        "copy_bytes": nbytes,
    }


def disk_bandwidth(
    work: Path, size_bytes: int = GIB, chunk_bytes: int = 64 * MIB, repeats: int = 3
) -> dict[str, Any]:
    """GB/s of a sequential write with fsync, and of a cold sequential read, in `work`."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / "limits-seqio.bin"
    chunk = memoryview(os.urandom(chunk_bytes))
    count = max(1, size_bytes // chunk_bytes)
    buffer = bytearray(chunk_bytes)
    writes, reads, resident = [], [], []
    try:
        for _ in range(repeats):
            path.unlink(missing_ok=True)
            t0 = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for _ in range(count):
                    os.write(fd, chunk)
                os.fsync(fd)
            finally:
                os.close(fd)
            writes.append(time.perf_counter() - t0)
            drop_page_cache([path])
            resident.append(resident_fraction([path]))
            t0 = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass
            reads.append(time.perf_counter() - t0)
    finally:
        path.unlink(missing_ok=True)
    nbytes = count * chunk_bytes
    return _disk_figures(
        {
            "disk_write_runs_gbps": [nbytes / s / 1e9 for s in writes],
            "disk_read_runs_gbps": [nbytes / s / 1e9 for s in reads],
            "disk_bytes": nbytes,
            "disk_chunk_bytes": chunk_bytes,
            "read_cache_drop": "fsync + posix_fadvise(POSIX_FADV_DONTNEED)",
            "read_cache_resident": max(resident),
        }
    )


def _disk_figures(figures: dict[str, Any]) -> dict[str, Any]:
    figures["disk_write_gbps"] = statistics.median(figures["disk_write_runs_gbps"])
    figures["disk_read_gbps"] = statistics.median(figures["disk_read_runs_gbps"])
    return figures


def add_disk_runs(limits: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """`limits` with the disk runs of `more` (measured later in the run) added: the disk's
    speed varies from minute to minute here, so its figures are medians over both."""
    for key in ("disk_write_runs_gbps", "disk_read_runs_gbps"):
        limits[key] = limits[key] + more[key]
    limits["read_cache_resident"] = max(limits["read_cache_resident"], more["read_cache_resident"])
    return _disk_figures(limits)


def measure_limits(work: Path, *, copy_bytes: int, repeats: int = 3) -> dict[str, Any]:
    """All four figures; `copy_bytes` is the size copied (the benchmark uses the state's
    size, at most 1 GiB)."""
    return {**copy_bandwidth(copy_bytes, repeats), **disk_bandwidth(work, repeats=repeats)}
