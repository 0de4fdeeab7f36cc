"""DLRover's Flash Checkpoint on the peer benchmark's state (issue #49); runs in .venv-dlrover.

    .venv-dlrover/bin/python benchmarks/dlrover_peer.py --preset small --json OUT.json
        [--saves 3] [--disk-saves 2] [--load-repeats 3] [--work DIR]

bench.py runs this in DLRover's own environment (`make venv-dlrover`: torch, then
dlrover[torch] and grpcio; kept out of the main one) and reads the JSON it writes
(dlrover_method.py). It imports torch, dlrover, the standard library and the benchmark's
model.py and measure.py (neither imports nebula), never nebulaml.

How it runs DLRover, as its users do without a cluster: one plain process, no
`dlrover-run` and no torchrun. `DdpCheckpointer(checkpoint_dir)` then starts DLRover's
saver itself (a daemon child process, `start_saver_process`: "if the training process is
not launched by dlrover-run"), which owns the checkpoint's metadata and persists the
shared-memory buffer to disk on request. `TORCHELASTIC_RUN_ID` is set to a name of this
run's own, as torchrun would, so that its shared memory (/dev/shm/<id>_ckpt_shm_0) and its
sockets (/tmp/ckpt_sock/<id>/) are this run's alone; both are removed at the end.

What it measures, on the GPT-2-style state of model.py (same preset, same seed as bench.py):

  saves    each after an optimizer step (untimed), as bench.py's rows:
           `save_checkpoint(step, state_dict, storage_type=StorageType.MEMORY)`; the first
           two after the start are the cold saves (the first makes the buffer), then
           `--saves` steady ones (stall: the call; DLRover copies into its buffer before
           it returns, so there is no fence). A memory save that DLRover skipped (its
           saver holds the buffer's lock while persisting) is counted, not timed.
           Memory through each save as bench.py samples it (measure.MemorySampler: this
           process's anonymous RSS above the level before the save, plus the shared-memory
           buffer's allocated bytes), the buffer's size, and the RSS (anonymous and shared)
           of this process and of the saver process after the saves.
  disk     `--disk-saves` saves with `StorageType.DISK`: the stall of the call (a memory
           save, then an event to the saver), and the time until DLRover's tracker file
           (dlrover_latest.txt) names the step: its "persisted" (the saver fsyncs the
           tracker and a done file; `torch.save` of the checkpoint itself is not fsynced).
  resume   from memory: `load_checkpoint()` (DLRover reads its buffer's metadata from the
           saver and returns tensors that are views of the buffer); each load is compared
           bit for bit with the state it saved. From disk: what DLRover does when its
           buffer is gone (`FullCheckpointEngine._load_from_storage`: the tracker, then
           `torch.load` of that step's file), with the file dropped from the page cache.
  aliasing after a resume from memory into the optimizer (`optimizer.load_state_dict`),
           whether the optimizer's state tensors are views of DLRover's buffer, and
           whether one optimizer step, with no save, changes what the next
           `load_checkpoint()` returns: what a second crash would resume.

Not for: the bench's other rows (bench.py) or reading this JSON (dlrover_method.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Before dlrover is imported: its names for shared memory and sockets read it.
RUN_ID = f"nebula-bench-dlrover-{os.getpid()}"
os.environ.setdefault("TORCHELASTIC_RUN_ID", RUN_ID)
RUN_ID = os.environ["TORCHELASTIC_RUN_ID"]

import torch  # noqa: E402
from measure import MemorySampler, drop_page_cache  # noqa: E402
from model import PRESETS, TrainState  # noqa: E402

SOCKET_ROOT = Path("/tmp/ckpt_sock")  # DLRover's (dlrover.python.common.multi_process)
SHM_FILE = Path("/dev/shm") / f"{RUN_ID}_ckpt_shm_0"  # its buffer for local shard 0
TRACKER = "dlrover_latest.txt"
_T0 = time.perf_counter()


def progress(message: str) -> None:
    sys.stderr.write(f"[dlrover {time.perf_counter() - _T0:6.1f} s] {message}\n")
    sys.stderr.flush()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dlrover_peer.py", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--saves", type=int, default=3, help="steady memory saves (default: 3)")
    parser.add_argument("--disk-saves", type=int, default=2, help="disk saves (default: 2)")
    parser.add_argument("--load-repeats", type=int, default=3, help="loads each way (default: 3)")
    parser.add_argument("--work", type=Path, help="parent of the checkpoint folder (default: tmp)")
    parser.add_argument("--json", type=Path, required=True, help="where to write the figures")
    args = parser.parse_args(argv)
    if min(args.saves, args.load_repeats) < 1 or args.disk_saves < 0:
        parser.error("--saves and --load-repeats must be >= 1, --disk-saves >= 0")
    return args


def proc_memory(pid: int | str = "self") -> dict[str, int]:
    """A process's memory from /proc/PID/smaps_rollup, in bytes: resident anonymous and
    shared-memory pages (`rss_anon`, `rss_shmem`), and the pages no other process maps
    (`private`: what it holds alone; a forked child shares its parent's pages until
    either writes them). Empty where the process is gone."""
    keys = {b"Anonymous:": "rss_anon", b"Private_Clean:": "private", b"Private_Dirty:": "private"}
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                key = keys.get(line.split(b" ", 1)[0])
                if key:
                    out[key] = out.get(key, 0) + int(line.split()[1]) * 1024
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssShmem:"):
                    out["rss_shmem"] = int(line.split()[1]) * 1024
    except OSError:
        return {}
    return out


def shm_bytes() -> dict[str, int]:
    """The buffer's size and the bytes allocated to it in /dev/shm."""
    try:
        st = SHM_FILE.stat()
    except OSError:
        return {"size": 0, "allocated": 0}
    return {"size": st.st_size, "allocated": st.st_blocks * 512}


def tensors(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a nested state dict, by its path: tensors and plain values."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(tensors(v, f"{prefix}/{k}"))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(tensors(v, f"{prefix}/{i}"))
        return out
    return {prefix: obj}


def snapshot(state: TrainState) -> dict[str, Any]:
    """A copy of every leaf of the state as it is now (the reference for the loads)."""
    return {
        k: v.detach().clone() if isinstance(v, torch.Tensor) else v
        for k, v in tensors(state.state_dict()).items()
    }


def mismatches(loaded: Any, reference: dict[str, Any]) -> list[str]:
    """The paths where `loaded` differs from `reference`, bit for bit (empty: equal)."""
    got = tensors(loaded)
    bad = sorted(set(got) ^ set(reference))
    for k in set(got) & set(reference):
        a, b = got[k], reference[k]
        if isinstance(b, torch.Tensor):
            same = (
                isinstance(a, torch.Tensor)
                and a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(
                    a.reshape(-1).view(torch.uint8),
                    b.reshape(-1).view(torch.uint8),
                )
            )
        else:
            same = a == b
        if not same:
            bad.append(k)
    return sorted(bad)


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, linear between the nearest ranks."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def buffer_range() -> tuple[int, int]:
    """The address range where this process maps DLRover's buffer (from /proc/self/maps)."""
    name = str(SHM_FILE)
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(name):
                start, end = line.split()[0].split("-")
                return int(start, 16), int(end, 16)
    return 0, 0


def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

    preset = PRESETS[args.preset]
    progress(f"building the {preset.name} state ...")
    state = TrainState(preset)
    gc.collect()
    gc.freeze()
    state_bytes = state.state_bytes
    rss_before = proc_memory()
    ckpt_dir = folder / "checkpoints"
    t0 = time.perf_counter()
    checkpointer = DdpCheckpointer(str(ckpt_dir))
    start_s = time.perf_counter() - t0
    engine = checkpointer._engine  # its saver process and cached step, read only
    saver = engine.saver_proc
    progress(f"DdpCheckpointer ready in {start_s:.2f} s (saver pid {saver and saver.pid})")
    step = 0
    skipped = 0

    def timed_save(kind: Any) -> dict[str, Any]:
        nonlocal step, skipped
        state.optimizer_step()  # every save is of a changed state, as in bench.py
        step += 1
        gc.collect()
        with MemorySampler([SHM_FILE]) as mem:
            t = time.perf_counter()
            checkpointer.save_checkpoint(step, state.state_dict(), storage_type=kind)
            stall = time.perf_counter() - t
        ok = engine._cached_step == step
        skipped += not ok
        return {
            "step": step,
            "stall_s": stall,
            "saved": ok,
            "peak_extra_bytes": mem.peak_extra_bytes,
            "peak_anon_bytes": mem.peak_anon_bytes,
            "peak_shm_bytes": mem.peak_shm_bytes,
        }

    cold = []
    for k in range(2):
        cold.append(timed_save(StorageType.MEMORY))
        progress(f"cold save {k + 1}: stall {cold[-1]['stall_s']:.3f} s")
    saves = []
    while len([s for s in saves if s["saved"]]) < args.saves and len(saves) < 3 * args.saves:
        saves.append(timed_save(StorageType.MEMORY))
        progress(f"memory save {len(saves)}: stall {saves[-1]['stall_s']:.3f} s")
    memory = {
        "state_bytes": state_bytes,
        "shm": shm_bytes(),
        "trainer_before": rss_before,
        "trainer_after": proc_memory(),
        "saver": proc_memory(saver.pid) if saver else {},
    }
    reference = snapshot(state)  # the state the newest memory save holds

    loads_memory, exact_memory = [], []
    for r in range(args.load_repeats):
        gc.collect()
        t = time.perf_counter()
        loaded = checkpointer.load_checkpoint()
        loads_memory.append(time.perf_counter() - t)
        bad = mismatches(loaded, reference)
        exact_memory.append(not bad)
        progress(f"load {r + 1} from memory: {loads_memory[-1]:.3f} s, {len(bad)} mismatches")
        del loaded

    disk = []
    for _ in range(args.disk_saves):
        sample = timed_save(StorageType.DISK)
        t = time.perf_counter() - sample["stall_s"]
        tracker = ckpt_dir / TRACKER
        deadline = time.perf_counter() + 600
        while time.perf_counter() < deadline:
            try:
                if sample["saved"] and int(tracker.read_text().strip() or 0) == sample["step"]:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.005)
        sample["persisted_s"] = time.perf_counter() - t
        disk.append(sample)
        progress(
            f"disk save: stall {sample['stall_s']:.3f} s, tracker at "
            f"{sample['persisted_s']:.2f} s, saved={sample['saved']}"
        )
    if disk:
        reference = snapshot(state)  # the newest save is now the last disk save's

    loads_disk, exact_disk, written = [], [], 0
    if disk:
        newest = ckpt_dir / str(disk[-1]["step"]) / "rank_0.pt"
        written = newest.stat().st_size
        for r in range(args.load_repeats):
            drop_page_cache([newest])
            gc.collect()
            t = time.perf_counter()
            loaded = engine._load_from_storage()
            loads_disk.append(time.perf_counter() - t)
            bad = mismatches(loaded, reference)
            exact_disk.append(not bad)
            progress(f"load {r + 1} from disk: {loads_disk[-1]:.3f} s, {len(bad)} mismatches")
            del loaded

    # Resume from memory into the optimizer, as a restarted job would, then one step.
    resumed = checkpointer.load_checkpoint()
    state.optimizer.load_state_dict(resumed["optimizer"])
    lo, hi = buffer_range()
    views = [
        t.untyped_storage().data_ptr()
        for s in state.optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.numel() > 1
    ]
    in_buffer = sum(lo <= p < hi for p in views)
    del resumed
    state.forward_backward()
    state.optimizer_step()  # no save after this step
    after_step = mismatches(checkpointer.load_checkpoint(), reference)
    aliasing = {
        "optimizer_tensors": len(views),
        "optimizer_tensors_in_buffer": in_buffer,
        "memory_copy_changed_by_a_step_without_save": bool(after_step),
        "changed_leaves": len(after_step),
        # what changed, by the last key of each leaf's path (e.g. exp_avg, step)
        "changed_kinds": sorted({k.rsplit("/", 1)[-1] for k in after_step}),
    }
    progress(f"aliasing: {aliasing}")

    engine.close()
    return {
        "schema": "nebula-bench-dlrover/1",
        "preset": args.preset,
        "versions": {"torch": torch.__version__, "dlrover": _dist_version("dlrover")},
        "run": "one process, no dlrover-run: DdpCheckpointer starts its saver process",
        "state_bytes": state_bytes,
        "checkpointer_start_s": start_s,
        "cold": cold,
        "saves": saves,
        "skipped_saves": skipped,
        "stall_s": _stats([s["stall_s"] for s in saves if s["saved"]]),
        "memory": memory,
        "load_memory_s": _stats(loads_memory),
        "load_memory_exact": all(exact_memory),
        "disk_saves": disk,
        "written_bytes": written,
        "load_disk_s": _stats(loads_disk),
        "load_disk_exact": all(exact_disk) if exact_disk else None,
        "aliasing": aliasing,
    }


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "median": statistics.median(values),
        "p90": percentile(values, 0.9),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cleanup() -> None:
    """Stop DLRover's saver and remove its buffer and sockets (this run's only)."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(10)
    SHM_FILE.unlink(missing_ok=True)
    shutil.rmtree(SOCKET_ROOT / RUN_ID, ignore_errors=True)
    with contextlib.suppress(OSError):
        SOCKET_ROOT.rmdir()  # only if no other job's sockets are there


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parent = args.work or Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="dlrover-", dir=parent))
    try:
        doc = run(args, folder)
    finally:
        cleanup()
        shutil.rmtree(folder, ignore_errors=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
