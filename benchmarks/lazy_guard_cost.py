"""What a guard over the saved tensors would cost a training step: the question a lazy
default raises (docs/benchmarks.md, "What a lazy default would cost").

A lazy save returns before its copy is taken; a default that saved lazily would have to
see every write to a saved tensor before the copy. This times one forward and backward
of the peer benchmark's GPT-2-style state (model.py) with no guard, with a no-op
`TorchDispatchMode` that reads each operator's schema for the arguments it writes (what
a guard must do at least), and with a no-op `TorchFunctionMode` (Python-level calls
only), the three alternated, and prints each median and its ratio to no guard.

    python benchmarks/lazy_guard_cost.py [--presets small default] [--runs 8]

Not a test, and not part of `make bench`: it measures an option not built.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from model import PRESETS, TrainState
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

PENDING: set[int] = set()  # the storages a guard would wait for (none: a no-op guard)


class WriteGuard(TorchDispatchMode):
    """Looks up, for every operator, the tensors it writes and whether one is pending."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        schema = func._schema
        if schema.is_mutable:
            for arg, value in zip(schema.arguments, args, strict=False):
                info = arg.alias_info
                if info is not None and info.is_write and isinstance(value, torch.Tensor):
                    _ = value.untyped_storage().data_ptr() in PENDING
        return func(*args, **(kwargs or {}))


class CallGuard(TorchFunctionMode):
    """Sees every Python-level torch call (a guard would check its tensors)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        return func(*args, **(kwargs or {}))


def timed(state: TrainState, guard: Callable[[], Any] | None) -> float:
    """Seconds of one forward and backward, under `guard()` if given."""
    start = time.perf_counter()
    if guard is None:
        state.forward_backward()
    else:
        with guard():
            state.forward_backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["small", "default"], choices=PRESETS)
    parser.add_argument("--runs", type=int, default=8, help="alternated runs of each")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.presets:
        state = TrainState(PRESETS[name])
        guards: dict[str, Callable[[], Any] | None] = {
            "none": None,
            "dispatch": WriteGuard,
            "function": CallGuard,
        }
        times: dict[str, list[float]] = {k: [] for k in guards}
        for _ in range(args.runs):
            for key, guard in guards.items():
                times[key].append(timed(state, guard))
        base = statistics.median(times["none"])
        cells = [f"{k} {statistics.median(v) * 1e3:.1f} ms ({statistics.median(v) / base:.2f}x)"
                 for k, v in times.items()]  # fmt: skip
        print(f"{name}: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
