"""What a forked child's copy-on-write snapshot would cost a training step: the one way
to take a lazy copy that sees every writer (docs/benchmarks.md, "What a lazy default
would cost").

A save that forks returns once the child exists; the child copies the state, as it was at
the fork, into shared buffers and exits, while the parent trains on. The kernel, not a
guard, keeps the child's view unchanged: every write by the parent (any thread, a pointer,
a NumPy view, a compiled kernel) first copies its page. This times, on the peer
benchmark's GPT-2-style state (model.py), a save, the forward and backward after it, and
the optimizer step after that, for three ways of saving, alternated:

- none: no save (the baseline of the step);
- copy: the state copied by the caller into reused shared buffers (nebula's default);
- fork: `os.fork()`, the child `memmove`s the state into the same buffers and exits.

    python benchmarks/fork_snapshot_cost.py [--presets small default] [--runs 6]

Not a test, and not part of `make bench`: it measures an option not built.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import time

import torch
from model import PRESETS, TrainState, _tensors


class Buffers:
    """One shared mapping with room for every tensor of `tensors`, and their views."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        sizes = [t.numel() * t.element_size() for t in tensors]
        self.mapping = mmap.mmap(-1, sum(sizes))  # shared: a child's writes reach us
        flat = torch.frombuffer(self.mapping, dtype=torch.uint8)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.mapping))
        self.views: list[torch.Tensor] = []
        self.jobs: list[tuple[int, int, int]] = []  # (to, from, bytes) for the child
        offset = 0
        for tensor, size in zip(tensors, sizes, strict=True):
            self.views.append(flat[offset : offset + size].view(tensor.dtype).view(tensor.shape))
            self.jobs.append((base + offset, tensor.data_ptr(), size))
            offset += size
        flat.fill_(1)  # faulted in once, as reused buffers are


def copy_save(tensors: list[torch.Tensor], buffers: Buffers) -> None:
    """The caller copies every tensor before it returns."""
    for view, tensor in zip(buffers.views, tensors, strict=True):
        view.copy_(tensor)


def fork_save(buffers: Buffers) -> int:
    """A child copies the state as of now and exits; returns its pid at once."""
    pid = os.fork()
    if pid == 0:  # the child: no torch, no lock, only copies
        for to, source, size in buffers.jobs:
            ctypes.memmove(to, source, size)
        os._exit(0)
    return pid


def one(state: TrainState, tensors: list[torch.Tensor], buffers: Buffers, way: str) -> tuple:
    """(save, forward and backward, optimizer step) seconds of one step saved `way`."""
    start = time.perf_counter()
    pid = 0
    if way == "copy":
        copy_save(tensors, buffers)
    elif way == "fork":
        pid = fork_save(buffers)
    saved = time.perf_counter()
    state.forward_backward()
    computed = time.perf_counter()
    state.optimizer_step()
    stepped = time.perf_counter()
    if pid:
        os.waitpid(pid, 0)
    return saved - start, computed - saved, stepped - computed


def _storages(state: TrainState) -> list[torch.Tensor]:
    """The state's tensors, each storage once (the tied head is one with the embedding)."""
    seen: set[int] = set()
    out = []
    for tensor in _tensors(state.state_dict()):
        if tensor.numel() and tensor.untyped_storage().data_ptr() not in seen:
            assert tensor.is_contiguous()
            seen.add(tensor.untyped_storage().data_ptr())
            out.append(tensor)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["small", "default"], choices=PRESETS)
    parser.add_argument("--runs", type=int, default=6, help="alternated runs of each")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.presets:
        state = TrainState(PRESETS[name])
        tensors = _storages(state)
        buffers = Buffers(tensors)
        times: dict[str, list[tuple]] = {"none": [], "copy": [], "fork": []}
        for way in times:  # warm: each way once, untimed
            one(state, tensors, buffers, way)
        for _ in range(args.runs):
            for way in times:
                times[way].append(one(state, tensors, buffers, way))
        base = [statistics.median(r[i] for r in times["none"]) for i in range(3)]
        gb = sum(t.numel() * t.element_size() for t in tensors) / 1e9
        print(f"{name} ({gb:.2f} GB of state), medians of {args.runs}:")
        for way, rows in times.items():
            save, fb, opt = (statistics.median(r[i] for r in rows) for i in range(3))
            lost = save + (fb - base[1]) + (opt - base[2])
            print(
                f"  {way:<5} save {save * 1e3:6.1f} ms, forward+backward {fb * 1e3:6.1f} ms, "
                f"optimizer step {opt * 1e3:6.1f} ms: the step costs {lost * 1e3:+6.1f} ms"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
