"""What this process sent toward the disk, as the kernel counts it: for the tests that
check bytes where they land (tests/core/test_reuse.py, tests/test_bench_lora.py). The
benchmarks have their own reader (benchmarks/measure.py), which the bench tests check
against this one.

May import: nothing of the suite."""

from __future__ import annotations

import os
from pathlib import Path


def write_bytes() -> int | None:
    """This process's `write_bytes` (/proc/self/io: what every thread of it made reach, or
    be bound for, a block device), or None where the kernel does not say."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))
    except (OSError, StopIteration):
        return None


def counted_in(folder: Path) -> bool:
    """Whether `write_bytes` grows by what a file of 1 MiB written and fsynced in `folder`
    holds (not on tmpfs, nor without the kernel's task I/O accounting); the file is
    removed."""
    before = write_bytes()
    probe = folder / "probe"
    with open(probe, "wb") as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
    after = write_bytes()
    probe.unlink()
    return before is not None and after is not None and after - before >= 1 << 20
