"""Peer benchmark (issue #3): nebula against torch.save, DCP and torchsnapshot, one run.

    python benchmarks/bench.py [--preset small|default|large] [--repeats 3]
        [--load-repeats 5] [--loop-steps 50] [--every 10] [--work DIR] [--json PATH]
        [--methods NAME ...] [--workloads full lora] [--lora-mb MB]
        [--lora-rounds 2] [--lora-saves 3]
    make bench [PRESET=small]

Two workloads, both by default (`--workloads`): `full`, every byte of the state saved
every time (below), and `lora`, a LoRA fine-tune whose base (~95% of the state) is frozen
(issue #30: lora.py says how its figures are taken; 200 MB of state in the small and
default presets, `--lora-mb` for another size; about a minute at 200 MB).

The state is a GPT-2-style model in fp32 with AdamW state after one step, built in memory
(no download): small ~16M parameters (0.2 GB of state, ~2 min), default ~124M (1.5 GB,
~10-15 min on 2 cores), large ~355M (4.3 GB; needs ~20 GB of RAM). Every method
checkpoints the same state; saves, loads and loop segments are interleaved (round-robin
over the methods in each repeat), so that noise hits all methods alike.

Per method: the first and second save's stall after a start (the cold start: what a
job's first checkpoints cost), then, over the later saves, stall (the time training is
blocked: the save call, plus any wait the method imposes before the optimizer may mutate
the state, e.g. DCP's staging future or nebula's lazy fence), durable (from the save's
start until the checkpoint is fsynced on disk), GB/s (state bytes / durable), peak extra
memory (anonymous RSS above the level before the save, plus buffers the method keeps
between saves, plus its files in /dev/shm, sampled every 5 ms), resume time (fastest:
nebula's memory tier, the peers' files in the page cache; and from disk, page cache
dropped), and the share of a training loop's time lost to a checkpoint every N steps,
against the same loop without checkpoints.

The run also measures this machine's limits (copy bandwidth into reused and fresh memory,
sequential write with fsync and cold sequential read in the work folder), and checks the
issue's target ratios (pass/fail). stdout: the tables; stderr: progress; the JSON file:
every figure and every sample (sizes in bytes, times in seconds). Not a test.

Methods: torch_save, dcp_save, dcp_async, dcp_async_reused, torchsnapshot, nebula (its
default, `lazy_snapshot="auto"`: timed to the fence, as the lazy row), nebula_sync
(`lazy_snapshot=False`), nebula_lazy (`nm.init(..., lazy_snapshot=True)`; shown as
unavailable where nebulaml has no lazy mode), nebula_dcp and nebula_dcp_async (dcp.save /
dcp.async_save through nebulaml.dcp.Writer), and dlrover (DLRover's Flash Checkpoint,
memory save; issue #49): it runs in an environment of its own (.venv-dlrover,
`make venv-dlrover`), after the other methods' saves and loads, on the same preset's
state (dlrover_method.py; shown as unavailable where that environment is missing or its
run fails). runner.py says exactly how each figure is taken; report.py, the targets.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from dlrover_method import NAME as DLROVER
from dlrover_method import run_dlrover
from limits import GIB, add_disk_runs, disk_bandwidth, measure_limits
from lora import METHODS as LORA_METHODS
from lora import run_lora
from lora_report import render_lora
from measure import CpuShare
from model import PRESETS, TrainState
from nebula_methods import Nebula, NebulaDcp
from peers import DcpAsync, DcpSave, Method, TorchSave, TorchSnapshot, Unavailable
from report import method_figures, render, target_ratios
from rich.console import Console
from runner import (
    MethodResult,
    Steps,
    keep_freed_memory,
    progress,
    run_loads,
    run_loops,
    run_saves,
    usable,
)

import nebulaml as nm

RESULTS = Path(__file__).resolve().parent / "results"
NOISY_CPU_SHARE = 0.05


def all_methods() -> list[Method]:
    """Every method, in the order of the table."""
    return [
        TorchSave(),
        DcpSave(),
        DcpAsync(reused_stager=False),
        DcpAsync(reused_stager=True),
        TorchSnapshot(),
        Nebula(lazy=None),
        Nebula(lazy=False),
        Nebula(lazy=True),
        NebulaDcp(async_save=False),
        NebulaDcp(async_save=True),
    ]


WORKLOADS = ("full", "lora")


def table_order(chosen: list[str]) -> list[str]:
    """The full workload's rows among `chosen`, in the table's order: every in-process
    method, then DLRover's (run in its own environment)."""
    return [n for n in [*(m.name for m in all_methods()), DLROVER] if n in chosen]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    names = [*(m.name for m in all_methods()), DLROVER]
    names += [n for n in LORA_METHODS if n not in names]
    parser = argparse.ArgumentParser(
        prog="bench.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help="model size (default: %(default)s)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed saves per method (default: 3)"
    )
    parser.add_argument(
        "--load-repeats",
        type=int,
        default=5,
        help="timed loads per method, each way (a cold read from disk varies by 2x from one "
        "to the next on a shared machine; the median of 5 holds) (default: 5)",
    )
    parser.add_argument(
        "--loop-steps",
        type=int,
        default=50,
        help="training steps per method in the loop benchmark, run as LOOP_STEPS // EVERY "
        "rounds of EVERY steps (5 rounds: a segment varies by about 8%% from one to the "
        "next on a shared machine); 0 skips it (default: 50)",
    )
    parser.add_argument(
        "--every", type=int, default=10, help="checkpoint every N loop steps (default: 10)"
    )
    parser.add_argument(
        "--loop-malloc",
        choices=["keep", "system"],
        default="keep",
        help="the loop's allocator: 'keep' tells glibc's malloc to keep freed memory for "
        "the next step, as a tuned training loop does (runner.keep_freed_memory says why); "
        "'system' leaves its defaults, under which every step faults its temporaries in "
        "again and the loop figures swing by 20%% (default: %(default)s)",
    )
    parser.add_argument(
        "--work",
        type=Path,
        help="folder on the disk to test (a subfolder is made there and removed after); "
        "default: the system's temporary folder. Not a tmpfs, or 'durable' means RAM",
    )
    parser.add_argument(
        "--json",
        type=Path,
        help="where to write the figures (default: benchmarks/results/bench-PRESET.json; "
        "bench-PRESET-lora.json for --workloads lora alone)",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=names,
        default=names,
        metavar="NAME",
        help=f"methods to run, from: {', '.join(names)} (default: all; each workload runs "
        f"those of its own: nebula_own_item, nebula_all_changed, nebula_sync_all_changed, "
        f"nebula_azure and nebula_s3 are the LoRA workload's)",
    )
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOADS,
        default=list(WORKLOADS),
        help="full: the GPT-2 state, all of it saved each time; lora: the LoRA fine-tune "
        "(frozen base) and its all-changed control (default: both)",
    )
    parser.add_argument(
        "--lora-mb",
        type=float,
        help="the LoRA workload's state in MB (10^6 bytes; ~95%% frozen) (default: the "
        "preset's: small and default 200, large 1000)",
    )
    parser.add_argument(
        "--lora-rounds",
        type=int,
        default=2,
        help="rounds of the LoRA workload (nebula starts afresh each round) (default: 2)",
    )
    parser.add_argument(
        "--lora-saves",
        type=int,
        default=3,
        help="timed saves per method in each LoRA round, after nebula's 2 cold ones (default: 3)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.load_repeats < 1 or args.every < 1 or args.loop_steps < 0:
        parser.error("--repeats, --load-repeats and --every must be >= 1, --loop-steps >= 0")
    if args.lora_rounds < 1 or args.lora_saves < 1 or (args.lora_mb or 1) <= 0:
        parser.error("--lora-rounds and --lora-saves must be >= 1, --lora-mb > 0")
    return args


def fs_type(path: Path) -> str:
    """The type of the filesystem that holds `path` (from /proc/mounts)."""
    best, kind = "", "unknown"
    real = str(path.resolve())
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _dev, mount, fstype, *_ = line.split()
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(
                    best
                ):
                    best, kind = mount, fstype
    except OSError:
        pass
    return kind


def versions() -> dict[str, str | None]:
    try:
        import torchsnapshot

        snapshot_version: str | None = getattr(torchsnapshot, "__version__", "installed")
    except ImportError:
        snapshot_version = None
    return {
        "torch": torch.__version__,
        "nebulaml": nm.__version__,
        "nebulaml_commit": _git_commit(),
        "torchsnapshot": snapshot_version,
    }


def _git_commit() -> str | None:
    """The repository's commit, with `+dirty` when core/ has uncommitted changes (the
    figures then belong to the working tree); None outside a git checkout."""
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--", "core"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def header(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON document's first keys: what ran, on what machine, with which versions."""
    return {
        "schema": "nebula-bench/1",
        "preset": args.preset,
        "args": {
            "repeats": args.repeats,
            "load_repeats": args.load_repeats,
            "loop_steps": args.loop_steps,
            "every": args.every,
            "loop_malloc": args.loop_malloc,
            "methods": args.methods,
            "workloads": args.workloads,
            "lora_mb": lora_mb(args),
            "lora_rounds": args.lora_rounds,
            "lora_saves": args.lora_saves,
        },
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            # now, before anything is measured: core/ may be edited later
            "versions": versions(),
        },
    }


def lora_mb(args: argparse.Namespace) -> float:
    """The LoRA workload's state in MB: `--lora-mb`, else the preset's."""
    return float(args.lora_mb or PRESETS[args.preset].lora_mb)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The full-change workload: build the state, measure the limits and every method;
    return its part of the JSON document."""
    preset = PRESETS[args.preset]
    progress(f"building the {preset.name} state ({preset.about} parameters) ...")
    state = TrainState(preset)
    # What exists now (torch's, the peers' and the state's objects) lives to the end: out
    # of the collector's way, each gc.collect() before a measurement takes microseconds,
    # not 0.15 s.
    gc.collect()
    gc.freeze()
    step_s = state.time_step(3)
    state_bytes = state.state_bytes
    progress(
        f"{state.num_params / 1e6:.1f}M parameters, {state_bytes / 1e9:.2f} GB, step {step_s:.2f} s"
    )
    progress("measuring this machine's limits ...")
    limits = measure_limits(work / "limits", copy_bytes=min(state_bytes, GIB))
    limits["work_fs_type"] = fs_type(work)

    methods = [m for m in all_methods() if m.name in args.methods]
    results = {m.name: MethodResult(m.name, m.label) for m in methods}
    for method in methods:
        try:
            method.setup(work / method.name, state)
        except Unavailable as exc:
            results[method.name].unavailable = str(exc)
            progress(f"{method.label}: unavailable: {exc}")
    ready = list(usable(methods, results))
    steps = Steps()
    try:
        run_saves(ready, results, state, steps, args.repeats)
        run_loads(ready, results, state, args.load_repeats)
    finally:
        for method in ready:
            method.teardown()
    dlrover = None
    if DLROVER in args.methods:
        progress("DLRover's Flash Checkpoint, in its own environment ...")
        dlrover = run_dlrover(
            work,
            preset=args.preset,
            saves=args.repeats,
            load_repeats=args.load_repeats,
            progress=progress,
        )
        if "unavailable" in dlrover:
            progress(f"{dlrover['label']}: unavailable: {dlrover['unavailable']}")
    loop_baseline: dict[str, Any] = {}
    if args.loop_steps > 0 and ready:
        kept = args.loop_malloc == "keep" and keep_freed_memory()
        progress(f"the loop's allocator: {'keep freed memory' if kept else 'system defaults'}")
        loop_baseline = run_loops(
            ready,
            results,
            state,
            steps,
            n_steps=args.loop_steps,
            every=args.every,
            folder_for=lambda m: work / "loop" / m.name,
        )
        loop_baseline["malloc"] = "keep" if kept else "system"
    progress("measuring the disk again ...")
    limits = add_disk_runs(limits, disk_bandwidth(work / "limits"))
    figures = {m.name: method_figures(results[m.name], state_bytes) for m in methods}
    if dlrover is not None:
        figures[DLROVER] = dlrover
    return {
        "state": {
            "num_params": state.num_params,
            "state_bytes": state_bytes,
            "batch": preset.batch,
            "seq_len": preset.seq_len,
            "step_s": step_s,
        },
        "limits": limits,
        "methods": figures,
        "loop_baseline": loop_baseline,
        "ratios": target_ratios(figures, limits, state_bytes),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parent = args.work or Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="nebula-bench-", dir=parent))
    kind = fs_type(work)
    if kind in ("tmpfs", "ramfs"):
        progress(f"warning: {work} is on {kind}: 'durable' and 'disk' figures measure RAM")
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
    t0 = time.perf_counter()
    cpu = CpuShare()
    doc = header(args)
    try:
        if "full" in args.workloads:
            doc.update(run(args, work))
        if "lora" in args.workloads:
            doc["lora"] = run_lora(
                work,
                int(lora_mb(args) * 1e6),
                names=args.methods,
                rounds=args.lora_rounds,
                saves=args.lora_saves,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc["started_at"] = started_at
    doc["duration_s"] = time.perf_counter() - t0
    doc["machine"]["other_cpu_share"] = other = cpu.other_share()
    if other > NOISY_CPU_SHARE:
        progress(
            f"warning: other processes used {other:.0%} of the CPUs during this run; "
            f"the timings (the loop's above all) are disturbed: run it again on a quiet machine"
        )
    console = Console() if sys.stdout.isatty() else Console(width=160)
    if "methods" in doc:
        render(console, doc, table_order(args.methods))
    if "lora" in doc:
        render_lora(console, doc["lora"])
    only_lora = "full" not in args.workloads
    out = args.json or RESULTS / f"bench-{args.preset}{'-lora' if only_lora else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    progress(f"wrote {out} ({doc['duration_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
