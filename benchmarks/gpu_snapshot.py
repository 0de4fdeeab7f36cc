"""The GPU check of issue #3: snapshot bandwidth of CUDA state against the pinned-copy limit.

Run on a machine with a CUDA GPU (one prepared script, a few minutes):

    python benchmarks/gpu_snapshot.py --gb 10 --repeats 3 --json gpu.json

It measures, in one run:
- the limit: device-to-host copy of the same number of bytes into one reused, pinned host
  buffer (`torch.empty(pin_memory=True)`, `copy_(non_blocking=True)` + synchronize);
- nebula's snapshot of a state dict of CUDA tensors of that size (`Checkpoint.save` into
  the memory tier: a reused, mapped buffer that nebula pins once, copies on a side stream),
  after a warm-up save so that the buffers are reused, as in training;
- the stall of a lazy save: save, then a stand-in for forward/backward on the GPU, then the
  wait before `optimizer.step()` may run (`nm.wait_for_snapshot()`);
- that a lazy save's small CUDA storage, copied by `save()` itself, keeps its value when
  an in-place change is queued right after (`lazy_small_copy_correct`).

Target: snapshot bandwidth >= 80% of the pinned-copy bandwidth, GPU memory not grown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

import nebulaml as nm


def _state(total_bytes: int) -> dict[str, torch.Tensor]:
    chunk = 256 << 20
    count = max(1, total_bytes // chunk)
    return {f"t{i}": torch.randn(chunk // 4, device="cuda") for i in range(count)}


def _pinned_gbps(state: dict[str, torch.Tensor]) -> float:
    total = sum(t.numel() * t.element_size() for t in state.values())
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    offset = 0
    views = []
    for t in state.values():
        n = t.numel() * t.element_size()
        views.append((host[offset : offset + n], t.view(torch.uint8).view(-1)))
        offset += n
    for dst, src in views:  # warm-up
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for dst, src in views:
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return total / (time.perf_counter() - t0) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=10.0, help="state size in GB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check runs on a GPU machine")
    state = _state(int(args.gb * 1e9))
    total = sum(t.numel() * t.element_size() for t in state.values())
    limit = statistics.median(_pinned_gbps(state) for _ in range(args.repeats))
    root = tempfile.mkdtemp()
    nm.init(root, persistent_time_interval=3600)
    mem_before = torch.cuda.memory_allocated()
    nm.Checkpoint("global_step0").save("model", state)  # lays out and pins the buffers
    times = []
    for step in range(1, args.repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        nm.Checkpoint(f"global_step{step}").save("model", state)
        times.append(time.perf_counter() - t0)
    grown = torch.cuda.memory_allocated() - mem_before
    nm.shutdown()
    nm.init(tempfile.mkdtemp(), persistent_time_interval=3600, lazy_snapshot=True)
    nm.Checkpoint("global_step0").save("model", state)
    nm.wait_for_snapshot()
    stalls = []
    work = torch.randn(8192, 8192, device="cuda")
    for step in range(1, args.repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        nm.Checkpoint(f"global_step{step}").save("model", state)
        blocked = time.perf_counter() - t0
        for _ in range(20):  # stands in for forward/backward
            work = work @ work / 8192
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        nm.wait_for_snapshot()  # what optimizer.step() would wait for
        stalls.append(blocked + time.perf_counter() - t1)
    # A small CUDA storage (BatchNorm's statistics, say) is copied by save() itself, on the
    # current stream: an in-place change queued right after must not reach the snapshot.
    stats = torch.zeros(64, device="cuda")
    nm.Checkpoint("small").save("bn", {"running_mean": stats})
    stats.add_(1)
    nm.wait_for_snapshot()
    saved_stats = nm.get_checkpoint("small").load("bn")["running_mean"].cpu()
    small_copy_correct = torch.equal(saved_stats, torch.zeros(64))
    nm.shutdown()
    snapshot_gbps = total / statistics.median(times) / 1e9
    figures = {
        "state_bytes": total,
        "pinned_copy_gbps": limit,
        "snapshot_gbps": snapshot_gbps,
        "share_of_pinned": snapshot_gbps / limit,
        "snapshot_s": times,
        "lazy_stall_s": stalls,
        "lazy_small_copy_correct": small_copy_correct,
        "gpu_memory_grown_bytes": grown,
        "device": torch.cuda.get_device_name(),
    }
    for key, value in figures.items():
        print(f"{key:<24} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
