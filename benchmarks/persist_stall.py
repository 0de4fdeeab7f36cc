"""What a persist in flight costs the training loop (issue #49): the `save()` stall with
every checkpoint persisted while the next steps run, against the same loop whose
checkpoints stay in the memory tier.

    python benchmarks/persist_stall.py [--mb 480] [--saves 16] [--train-s 0.3] [--runs 2]
    make bench-stall

One run is a fresh process: `nm.init` on a local root (`lazy_snapshot=False`: the copy at
`save()`, which the default takes too for a loop that changes its state without a torch
optimizer, as this one does), a state of `--mb` MB changed in
place before each save (every byte), `nm.Checkpoint(tag).save("model", state)` and
`commit()` timed (the stall), then `--train-s` seconds of CPU work standing for training
(matrix products on one thread, as a loop's step would run). Two kinds of run, alternated
so drift hits both alike:

- `idle`:      `persistent_time_interval=3600`: no persist runs while the loop does;
- `in flight`: `persistent_time_interval=0`: each checkpoint is persisted while the next
               steps run (a persist of `--mb` MB takes longer than `--train-s` here, so
               one is in flight at almost every save);
- `in flight, no spares`: the same with `spare_buffers=False` (the memory tier keeps no
               buffer for the next save: what RAM that saves, and what it costs a save).

Also the memory tier's footprint after the last save (its files' allocated bytes) per
byte of state.

The first two saves of a run are a cold start (bench.py measures those) and are left
out. Prints the median and p90 stall of each kind and their ratios (the issue's targets:
<= 1.2x the median, <= 1.5x the p90), and each run's samples on stderr. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COLD_SAVES = 2
# Each kind of run: its persistent_time_interval (s) and spare_buffers.
KINDS = {"idle": (3600, True), "in flight": (0, True), "in flight, no spares": (0, False)}


def _train(seconds: float) -> None:
    """`seconds` of matrix products: the loop's own CPU work between saves."""
    import torch

    a = torch.randn(384, 384)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a) * 0.5


def child(args: argparse.Namespace) -> None:
    """One run: prints a JSON list of the steady saves' stalls (s)."""
    import torch

    torch.set_num_threads(1)
    import nebulaml as nm

    # The state is changed in place, no optimizer: the default copies each save at save()
    # (a copy deferred would be refused), which lazy_snapshot=False says outright.
    nm.init(args.root, persistent_time_interval=args.interval, num_of_version_in_retention=2,
            spare_buffers=args.spares == "on", lazy_snapshot=False)  # fmt: skip
    state = {"w": torch.zeros(args.mb * (1 << 20) // 4), "step": torch.tensor(0)}
    stalls: list[float] = []
    for step in range(1, args.saves + 1):
        state["w"].add_(1.0)
        state["step"].fill_(step)
        t0 = time.perf_counter()
        ckpt = nm.Checkpoint(f"global_step{step}")
        ckpt.save("model", state)
        ckpt.commit()
        stalls.append(time.perf_counter() - t0)
        _train(args.train_s)
    tier = Path(os.environ["NEBULA_MEMORY_TIER_PATH"])
    held = sum(p.lstat().st_blocks * 512 for p in tier.rglob("*") if p.is_file())
    nm.flush_persistence()
    nm.shutdown()
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    print(json.dumps({"stalls": stalls[COLD_SAVES:], "footprint": held / state_bytes}))


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=480)
    parser.add_argument("--saves", type=int, default=16)
    parser.add_argument("--train-s", type=float, default=0.3)
    parser.add_argument("--runs", type=int, default=2, help="runs of each kind")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--interval", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--spares", choices=("on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
    footprints: dict[str, list[float]] = {kind: [] for kind in KINDS}
    kinds = list(KINDS)
    order = [k for i in range(args.runs) for k in (kinds if i % 2 == 0 else kinds[::-1])]
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # the memory tier's usual home
    with tempfile.TemporaryDirectory(prefix="nebula-stall-") as work, \
            tempfile.TemporaryDirectory(prefix="nebula-stall-", dir=shm) as tiers:  # fmt: skip
        for n, kind in enumerate(order):
            root = Path(work) / f"run{n}"
            env = {**os.environ, "NEBULA_MEMORY_TIER_PATH": str(Path(tiers) / f"tier{n}")}
            out = subprocess.run(
                [sys.executable, __file__, "--child", "--root", str(root),
                 "--interval", str(KINDS[kind][0]), "--spares", "on" if KINDS[kind][1] else "off",
                 "--mb", str(args.mb),
                 "--saves", str(args.saves), "--train-s", str(args.train_s)],
                env=env, capture_output=True, text=True, check=False,
            )  # fmt: skip
            if out.returncode != 0:
                sys.stderr.write(out.stderr)
                return 1
            result = json.loads(out.stdout.strip().splitlines()[-1])
            stalls = result["stalls"]
            samples[kind] += stalls
            footprints[kind].append(result["footprint"])
            print(f"{kind:9} run {n}: " + " ".join(f"{s * 1e3:.1f}" for s in stalls) + " ms",
                  file=sys.stderr)  # fmt: skip
    idle, busy = samples["idle"], samples["in flight"]
    print(f"state {args.mb} MB, {args.saves - COLD_SAVES} steady saves x {args.runs} runs per kind")
    print("| persist | median stall | p90 stall | memory tier / state |")
    print("|---|---|---|---|")
    for kind, values in samples.items():
        median, p90 = statistics.median(values) * 1e3, _p90(values) * 1e3
        print(f"| {kind} | {median:.1f} ms | {p90:.1f} ms | {max(footprints[kind]):.2f}x |")
    print(f"in flight / idle: median {statistics.median(busy) / statistics.median(idle):.2f}x "
          f"(target <= 1.2x), p90 {_p90(busy) / _p90(idle):.2f}x (target <= 1.5x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
