"""What a persist's pieces cost a training loop: real training steps while a background
thread (at nice 10, as nebula's persister) does one piece of a persist's work on a
state-sized buffer: copy it, hash it, write it to disk buffered, or write it with O_DIRECT.

    python -m benchmarks.interference [--preset default] [--rounds 5] [--every 10]

Each round runs one segment of `--every` steps per action, in alternating order; the
figure is the median segment time against the median with no background work.

Measured by this script's prototype (the same jobs and loop) on the 2-core CI-sized
machine (default preset, 1.49 GB, 5 rounds):
none 9.65 s, O_DIRECT write -0.3%, copy +0.1%, hash -2.9% (noise), buffered write +7.5%
(+10.0% in a 3-round run). The page cache is what costs: its copy, its writeback, and the
reclaim it forces on training's allocations.

Not for: nebula's own figures (bench.py runs the real methods side by side).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import xxhash

from .model import PRESETS, TrainState

CHUNK = 64 << 20
ALIGN = 4096


def _nice() -> None:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def _touched(size: int, value: int) -> mmap.mmap:
    buf = mmap.mmap(-1, size)
    for i in range(0, size, mmap.PAGESIZE):
        buf[i] = value
    return buf


def actions(size: int, folder: Path) -> dict[str, Callable[[], None] | None]:
    """The background jobs, each on `size` bytes kept between rounds (as nebula's slots)."""
    src, dst = _touched(size, 1), _touched(size, 2)
    out = folder / "persist.bin"

    def copy() -> None:
        memoryview(dst)[:] = memoryview(src)

    def hash_() -> None:
        hasher = xxhash.xxh3_64()
        view = memoryview(src)
        for start in range(0, size, CHUNK):
            hasher.update(view[start : start + CHUNK])

    def write(direct: bool) -> None:
        out.unlink(missing_ok=True)
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o644)
        view = memoryview(src)
        aligned = size - size % ALIGN if direct else size
        try:
            for start in range(0, aligned, CHUNK):
                os.write(fd, view[start : min(aligned, start + CHUNK)])
            os.fsync(fd)
        finally:
            os.close(fd)

    return {
        "none": None,
        "copy": copy,
        "hash": hash_,
        "write buffered": lambda: write(False),
        "write O_DIRECT": lambda: write(True),
    }


def run(preset: str, rounds: int, every: int) -> dict[str, list[float]]:
    """Segment times (s) per action."""
    state = TrainState(PRESETS[preset])
    for _ in range(3):
        state.step()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/var/tmp")) as folder:
        jobs = actions(state.state_bytes, Path(folder))
        names = list(jobs)
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                job = jobs[name]
                thread = None
                if job is not None:
                    thread = threading.Thread(target=lambda job=job: (_nice(), job()))
                    thread.start()
                t0 = time.perf_counter()
                for _ in range(every):
                    state.step()
                times[name].append(time.perf_counter() - t0)
                if thread is not None:
                    thread.join()
                print(f"round {r + 1}/{rounds} {name}: {times[name][-1]:.2f} s", flush=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="default", choices=sorted(PRESETS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--every", type=int, default=10, help="training steps per segment")
    args = parser.parse_args()
    times = run(args.preset, args.rounds, args.every)
    base = statistics.median(times["none"])
    print(f"\n{'background job':<16} {'median s':>9} {'overhead':>9}")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name:<16} {med:>9.2f} {100 * (med / base - 1):>8.1f}%")


if __name__ == "__main__":
    main()
