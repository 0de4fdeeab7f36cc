"""nebula's cost to a training loop, measured alone: one process, one session for the
whole run, as in a training job.

    python -m benchmarks.loop_alone [--lazy] [--rounds 4] [--every 10] [--preset default]

The loop part of `make bench` for nebula alone, in a few minutes: one process, one
session for the whole run, as in a training job (`make bench` now runs each nebula
variant's loop segments the same way, after the peers'; it used to restart the session
before each of them, among the peers' segments, which slowed the no-checkpoint segments
next to nebula's and put its figure below zero). Segments of `every` training steps with
and without a checkpoint alternate (a save at the segment's start, the lazy fence before
the first optimizer step, then `flush_persistence()` at its end, counted), in the order
(with, without), (without, with), ... so that drift cancels. Each segment is compared
with the mean of the two no-checkpoint segments nearest it; the overhead is the median.
glibc's malloc keeps freed memory, as in `make bench` (runner.py says why).

Prints each segment (with its step times) and the overhead. Not a test.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model import PRESETS, TrainState
from runner import keep_freed_memory

import nebulaml as nm


def _segment(state: TrainState, every: int, *, checkpoint: bool, lazy: bool, tag: str) -> float:
    t0 = time.perf_counter()
    if checkpoint:
        ckpt = nm.Checkpoint(tag, 2)
        ckpt.save("model", state.model.state_dict())
        ckpt.save("optimizer", state.optimizer.state_dict())
    steps = []
    for i in range(every):
        t = time.perf_counter()
        state.forward_backward()
        if i == 0 and checkpoint and lazy:
            nm.wait_for_snapshot()
        state.optimizer_step()
        steps.append(time.perf_counter() - t)
    if checkpoint:
        nm.flush_persistence()
    seconds = time.perf_counter() - t0
    label = "checkpoint" if checkpoint else "no checkpoint"
    print(f"{label:14s} {seconds:6.2f} s  steps " + " ".join(f"{s:.2f}" for s in steps))
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loop_alone", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lazy", action="store_true", help="nm.init(..., lazy_snapshot=True)")
    parser.add_argument("--rounds", type=int, default=4, help="pairs of segments (default 4)")
    parser.add_argument("--every", type=int, default=10, help="steps per segment (default 10)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--work", type=Path, help="folder on the disk to test (default: /tmp)")
    args = parser.parse_args(argv)
    kept = keep_freed_memory()
    state = TrainState(PRESETS[args.preset])
    gc.collect()
    gc.freeze()
    work = Path(tempfile.mkdtemp(prefix="nebula-loop-", dir=args.work))
    root = str(work / "root")
    nm.init(
        root, persistent_time_interval=0, num_of_version_in_retention=2, lazy_snapshot=args.lazy
    )
    try:
        for k in range(3):  # the first saves of a session fill fresh buffers: untimed
            _segment(state, 1, checkpoint=True, lazy=args.lazy, tag=f"warmup{k}")
        timeline: list[tuple[bool, float]] = []
        for r in range(args.rounds):
            for checkpoint in (True, False) if r % 2 == 0 else (False, True):
                tag = f"global_step{len(timeline)}"
                s = _segment(state, args.every, checkpoint=checkpoint, lazy=args.lazy, tag=tag)
                timeline.append((checkpoint, s))
    finally:
        nm.shutdown()
        shutil.rmtree(nm.memory_tier_path(root), ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    base = [i for i, (c, _) in enumerate(timeline) if not c]
    overheads = []
    for i, (checkpoint, seconds) in enumerate(timeline):
        if checkpoint:
            near = sorted(base, key=lambda j: abs(j - i))[:2]
            overheads.append(seconds / statistics.mean(timeline[j][1] for j in near) - 1)
    mode = "lazy" if args.lazy else "synchronous"
    print(
        f"nebula ({mode}), checkpoint every {args.every} steps, malloc "
        f"{'keep' if kept else 'system'}: overhead {statistics.median(overheads):+.1%} "
        f"(rounds {', '.join(f'{o:+.1%}' for o in overheads)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
