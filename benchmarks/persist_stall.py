"""What a persist in flight costs the training loop (issue #49): the `save()` stall with
every checkpoint persisted while the next steps run, against the same loop whose
checkpoints stay in the memory tier.

    python benchmarks/persist_stall.py [--mb 480] [--saves 16] [--train-s 0.3] [--runs 2]
                                       [--loops optimizer in-place]
    make bench-stall

One run is a fresh process: `nm.init` on a local root, a state of `--mb` MB, and
`--saves` checkpoints, each `nm.Checkpoint(tag, n).save(...)` per item and `commit()`,
then a step and `--train-s` seconds of CPU work standing for the rest of training (matrix
products on one thread, as a loop's step would run). Two loops:

- `optimizer` (nebula's default, `lazy_snapshot="auto"`): an MLP trained with AdamW, its
  parameters and both moments `--mb` MB in all, saved as `model` and `optimizer`. The
  save defers its copy; the next forward and backward run beside it, and the wait for
  it before `optimizer.step()` (`nm.wait_for_snapshot`, which also waits for the commit)
  is stall too, as in bench.py.
- `in-place`: one tensor changed in place (every byte) before each save, no optimizer:
  the default copies at `save()` for such a loop (a copy deferred would be refused), which
  `lazy_snapshot=False` says outright.

Three kinds of run per loop, alternated so drift hits both alike:

- `idle`:      `persistent_time_interval=3600`: no persist runs while the loop does;
- `in flight`: `persistent_time_interval=0`: each checkpoint is persisted while the next
               steps run (a persist of `--mb` MB takes longer than the steps between two
               saves here, so one is in flight at almost every save);
- `in flight, no spares`: the same with `spare_buffers=False` (the memory tier keeps no
               buffer for the next save: what RAM that saves, and what it costs a save).

Also the memory tier's footprint after the last save (its files' allocated bytes) per
byte of state.

The first two saves of a run are a cold start (bench.py measures those) and are left
out. Prints, per loop, the median and p90 stall of each kind and their ratios (the
issue's targets: <= 1.2x the median, <= 1.5x the p90), and each run's samples on stderr.
Not a test.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

COLD_SAVES = 2
# Each kind of run: its persistent_time_interval (s) and spare_buffers.
KINDS = {"idle": (3600, True), "in flight": (0, True), "in flight, no spares": (0, False)}
# The loops: what each stands for.
LOOPS = {
    "optimizer": "An MLP trained with AdamW, nebula's default (lazy_snapshot='auto': each "
    "copy deferred to the next forward and backward, waited for before optimizer.step())",
    "in-place": "A state changed in place without an optimizer, copied at save() "
    "(lazy_snapshot=False, as the default does for such a loop)",
}
# A loop's step after a save: it returns how long it waited for the deferred copy (s).
StepFn = Callable[[int, Callable[[], None]], float]


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

    optimizer_loop = args.loop == "optimizer"
    # The in-place loop changes its state without an optimizer: the default copies each
    # save at save() (a copy deferred would be refused), which lazy_snapshot=False says
    # outright. The optimizer loop runs with the default ("auto": its copies deferred).
    nm.init(args.root, persistent_time_interval=args.interval, num_of_version_in_retention=2,
            spare_buffers=args.spares == "on",
            **({} if optimizer_loop else {"lazy_snapshot": False}))  # fmt: skip
    if optimizer_loop:
        step_fn, state_of, state_bytes = _optimizer_loop(torch, args.mb)
    else:
        step_fn, state_of, state_bytes = _in_place_loop(torch, args.mb)
    stalls: list[float] = []
    for step in range(1, args.saves + 1):
        t0 = time.perf_counter()
        items = state_of()
        ckpt = nm.Checkpoint(f"global_step{step}", len(items))
        for name, obj in items.items():
            ckpt.save(name, obj)
        ckpt.commit()
        stall = time.perf_counter() - t0
        # The optimizer loop's next forward and backward overlap the deferred copy; its
        # optimizer.step() may not change the state until the copy is taken: the wait for
        # it (nm.wait_for_snapshot, which also waits for the commit) is stall too.
        stall += step_fn(step, nm.wait_for_snapshot)
        stalls.append(stall)
        _train(args.train_s)
    tier = Path(os.environ["NEBULA_MEMORY_TIER_PATH"])
    held = sum(p.lstat().st_blocks * 512 for p in tier.rglob("*") if p.is_file())
    nm.flush_persistence()
    nm.shutdown()
    print(json.dumps({"stalls": stalls[COLD_SAVES:], "footprint": held / state_bytes}))


def _in_place_loop(torch: Any, mb: int) -> tuple[StepFn, Callable[[], dict[str, Any]], int]:
    """A state of `mb` MB whose every byte the step changes in place, no optimizer."""
    state = {"w": torch.zeros(mb * (1 << 20) // 4), "step": torch.tensor(0)}

    def step_fn(step: int, _wait: Callable[[], None]) -> float:
        state["w"].add_(1.0)
        state["step"].fill_(step)
        return 0.0

    step_fn(0, lambda: None)
    size = sum(t.numel() * t.element_size() for t in state.values())
    return step_fn, lambda: {"model": state}, size


def _optimizer_loop(torch: Any, mb: int) -> tuple[StepFn, Callable[[], dict[str, Any]], int]:
    """An MLP with AdamW whose parameters and optimizer state (2 moments) are `mb` MB in
    all: a step is a forward and backward on a batch of 8, then `optimizer.step()`."""
    width = 2048
    layers = max(1, round(mb * (1 << 20) / 12 / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(8, width)

    def step_fn(_step: int, wait: Callable[[], None]) -> float:
        model(batch).square().mean().backward()
        t0 = time.perf_counter()
        wait()
        waited = time.perf_counter() - t0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return waited

    step_fn(0, lambda: None)  # the moments exist from the first step on
    size = sum(p.numel() * p.element_size() * 3 for p in model.parameters())
    return step_fn, lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, size


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=480, help="state of a loop, MB")
    parser.add_argument("--saves", type=int, default=16)
    parser.add_argument("--train-s", type=float, default=0.3)
    parser.add_argument("--runs", type=int, default=2, help="runs of each kind")
    parser.add_argument(
        "--loops",
        nargs="+",
        choices=list(LOOPS),
        default=list(LOOPS),
        help="optimizer: AdamW under the default (copies deferred); in-place: a state "
        "changed in place, copied at save() (default: both)",
    )
    parser.add_argument("--loop", choices=list(LOOPS), help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--interval", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--spares", choices=("on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    for loop in args.loops:
        samples, footprints = _runs(args, loop)
        if samples is None:
            return 1
        _report(args, loop, samples, footprints)
    return 0


def _runs(
    args: argparse.Namespace, loop: str
) -> tuple[dict[str, list[float]] | None, dict[str, list[float]]]:
    """The runs of every kind for `loop`, alternated; their steady stalls and footprints
    by kind (None: a run failed, its stderr shown)."""
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
                [sys.executable, __file__, "--child", "--root", str(root), "--loop", loop,
                 "--interval", str(KINDS[kind][0]), "--spares", "on" if KINDS[kind][1] else "off",
                 "--mb", str(args.mb),
                 "--saves", str(args.saves), "--train-s", str(args.train_s)],
                env=env, capture_output=True, text=True, check=False,
            )  # fmt: skip
            if out.returncode != 0:
                sys.stderr.write(out.stderr)
                return None, footprints
            result = json.loads(out.stdout.strip().splitlines()[-1])
            stalls = result["stalls"]
            samples[kind] += stalls
            footprints[kind].append(result["footprint"])
            print(f"{loop}, {kind} run {n}: " + " ".join(f"{s * 1e3:.1f}" for s in stalls)
                  + " ms", file=sys.stderr)  # fmt: skip
    return samples, footprints


def _report(
    args: argparse.Namespace,
    loop: str,
    samples: dict[str, list[float]],
    footprints: dict[str, list[float]],
) -> None:
    """Print `loop`'s table and its ratios (the targets are reported, not enforced)."""
    idle, busy = samples["idle"], samples["in flight"]
    print(f"\n{LOOPS[loop]}")
    print(f"state {args.mb} MB, {args.saves - COLD_SAVES} steady saves x {args.runs} runs per kind")
    print("| persist | median stall | p90 stall | memory tier / state |")
    print("|---|---|---|---|")
    for kind, values in samples.items():
        median, p90 = statistics.median(values) * 1e3, _p90(values) * 1e3
        print(f"| {kind} | {median:.1f} ms | {p90:.1f} ms | {max(footprints[kind]):.2f}x |")
    print(f"in flight / idle: median {statistics.median(busy) / statistics.median(idle):.2f}x "
          f"(target <= 1.2x), p90 {_p90(busy) / _p90(idle):.2f}x (target <= 1.5x)")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
