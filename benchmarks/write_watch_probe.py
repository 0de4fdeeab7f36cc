"""Can a lazy copy see every write to the saved tensors, and at what cost? A probe of the
kernel's write tracking (docs/benchmarks.md, "What a lazy default would cost").

A lazy save returns before its copy is taken; a default that saved lazily must see every
write to a saved tensor before its copy, or refuse the save. A guard in Python misses
writes by other threads, through pointers and NumPy views, and by compiled kernels
(`lazy_guard_cost.py`). The kernel sees them all: a `userfaultfd` registered in
write-protect mode with `UFFD_FEATURE_WP_ASYNC` (Linux 6.7) lets every write through at
once and marks its page written, and the `PAGEMAP_SCAN` ioctl on /proc/self/pagemap lists
the written pages of a range. No fault handler runs, so nothing waits on the GIL. This
probe, on the peer benchmark's GPT-2-style state (model.py), after one optimizer step:

- registers the whole pages inside every storage of the state, then protects them, and
  times each (a session would register once and protect at each save);
- runs a forward and backward (which must write none of them) and scans (`written`);
- writes one element through a NumPy view, one through `.data` and one from another
  thread, and scans after each: each must be found, and nothing else;
- lifts the protection and unregisters, timing each, and times the optimizer step after
  it against one
  without a watch (a page still protected would fault on its first write).

    python benchmarks/write_watch_probe.py [--presets small default]

Not a test, and not part of `make bench`: it probes an option not built. Needs Linux 6.7
or later and userfaultfd allowed (`vm.unprivileged_userfaultfd`, or user-mode faults only,
which is what this asks for); prints why not otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import torch
from model import PRESETS, TrainState, _tensors

from nebulaml.runtime.write_watch import PAGE, WriteWatch, inner_pages, unavailable


def storage_pages(tensors: list[torch.Tensor]) -> tuple[list[tuple[int, int]], int, int]:
    """The whole pages inside the tensors' storages (each storage once), the bytes they
    hold, and the bytes of storage left out (in pages shared with other memory)."""
    spans = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    ranges, outside = inner_pages((a, n) for a, n in spans.items() if n)
    return ranges, sum(end - start for start, end in ranges), outside


def _timed(call: Callable[[], object]) -> str:
    """How long `call()` took, in milliseconds, said."""
    t0 = time.perf_counter()
    call()
    return f"{(time.perf_counter() - t0) * 1e3:.2f} ms"


def probe(name: str) -> None:
    state = TrainState(PRESETS[name])
    tensors = _tensors(state.state_dict())
    ranges, inner, edges = storage_pages(tensors)
    params = [p for p in state.model.parameters() if p.numel() * p.element_size() >= 4 * PAGE]
    base_steps = []
    for _ in range(3):
        state.forward_backward()
        t0 = time.perf_counter()
        state.optimizer_step()
        base_steps.append(time.perf_counter() - t0)
    watch = WriteWatch()
    unprotect = release = ""
    try:
        register = _timed(lambda: watch.register(ranges))
        protect = _timed(watch.protect)
        state.forward_backward()
        after_compute: list[tuple[int, int]] = []
        scan = _timed(lambda: after_compute.extend(watch.written()))
        checks = []

        def paged(tensor: torch.Tensor) -> int:
            """The index of `tensor`'s first element at the start of a page (watched)."""
            return (-tensor.data_ptr()) % PAGE // tensor.element_size()

        def seen(tensor: torch.Tensor) -> bool:
            """Whether a written run holds the page of `tensor`'s element `paged`."""
            page = tensor.data_ptr() + paged(tensor) * tensor.element_size()
            return any(lo <= page < hi for lo, hi in watch.written())

        a, b, c = (params[i] for i in (len(params) // 3, len(params) // 2, -1))
        a.detach().numpy().reshape(-1)[paged(a)] += 1.0
        checks.append(("a NumPy view", seen(a)))
        b.data.view(-1)[paged(b)] += 1.0
        checks.append(("`.data`", seen(b)))
        other = threading.Thread(target=lambda: c.detach().mul_(1.0))
        other.start()
        other.join()
        checks.append(("another thread", seen(c)))
        checks.append(("any of them (runs of written pages)", len(watch.written())))
        unprotect = _timed(lambda: watch.protect(False))
        release = _timed(watch.close)
    finally:
        if watch.ranges:
            watch.close()
    state.forward_backward()
    t0 = time.perf_counter()
    state.optimizer_step()
    after = time.perf_counter() - t0
    print(f"{name}: {len(ranges)} ranges, {inner / 1e9:.3f} GB of whole pages watched, "
          f"{edges / 1e6:.2f} MB in edge pages (not watched)")  # fmt: skip
    print(f"  register {register}, protect {protect}, scan {scan}, lift {unprotect}, "
          f"unregister {release}")  # fmt: skip
    print(f"  written after a forward and backward: {len(after_compute)} runs (must be 0)")
    for what, found in checks:
        print(f"  a write through {what}: found {found}")
    print(f"  optimizer step after the watch {after * 1e3:.1f} ms, "
          f"without one {statistics.median(base_steps) * 1e3:.1f} ms")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["small", "default"], choices=PRESETS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    why = unavailable()
    if why is not None:
        print(f"no write tracking here: {why}")
        return 1
    for name in args.presets:
        probe(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
