"""The benchmark's three phases, each timing every method on the same training state.

saves   round-robin over the methods in each repeat (noise hits all alike). Each save
        follows an optimizer step (AdamW on the last backward's gradients; untimed) that
        changes every parameter and AdamW's state (all but the moments of rows no batch
        has reached): nebula skips what did not change since its buffer's last fill and
        what equals the previous persisted version (issue #30), so saving one state
        again and again would measure that, not a full checkpoint (lora.py measures it).
        One save: t0, `save` returns (blocking), [a forward+backward, untimed, if the
        method defers its fence], `wait_mutable` returns (fence), `wait_durable` returns
        (durable).
        stall = blocking + fence; durable = wall time from t0; background = durable time
        after `save` returned. Memory is sampled through the whole save (measure.py),
        less the forward/backward's own memory (calibrated) while that runs.
        Each method saves twice before its first timed save (and nebula after each
        restart of its session), so the timed saves are steady-state saves; those two
        are the cold saves (`MethodResult.cold`: what a job's first two checkpoints
        cost), timed the same way and reported beside the steady state, never mixed
        into it.
loads   the newest checkpoint of each method, in rounds: first the fastest resume
        (nebula: the memory tier; peers: their files, read once beforehand so they sit
        in the page cache), then from disk (after fsync + posix_fadvise(DONTNEED) of the
        files, and for nebula without its memory tier). Each round takes the methods in
        a different order (`load_order`): a load here runs slower right after another
        that freed much memory (this VM hands freed pages back to its host, and the next
        touch of each costs about 3 us), and in one fixed order the same method always
        paid for the same neighbour.
loop    real training steps (forward, backward, AdamW), in `steps // every` rounds, by
        default with glibc's malloc told to keep freed memory (`keep_freed_memory`).
        A method's segment: a checkpoint, then `every` steps (the method's fence waited
        before the first optimizer step), then the wait until that checkpoint is durable
        if it is not yet (counted: a save every `every` steps cannot be faster than that
        in the long run). The peers run in rounds: one segment each, and a segment of
        `every` steps without a checkpoint before and after each one (`group` = 1: this
        machine's step time drifts by 20% within a minute), the order alternating
        (forward, reversed) from round to round. nebula's session is process-wide, so
        each nebula variant runs after them in a stretch of its own, one session
        throughout, as in a training job: no-checkpoint and nebula segments in turn,
        `rounds` of each. (Restarting its session before each of its segments, among the
        peers' as an earlier version did, left the no-checkpoint segments next to
        nebula's 4-7% slower than the others, and nebula's own figure at -0.4%.) A
        segment's overhead is its time over the no-checkpoint time interpolated between
        the two that bracket it, minus 1; a method's overhead is the median over the
        rounds. The untimed first saves (nebula: once, when its stretch starts) are done
        before the segment starts.

Not for: the CLI (bench.py) or rendering (report.py).
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from measure import (
    MemorySampler,
    _libc,
    drop_page_cache,
    files_under,
    resident_fraction,
    tree_bytes,
)
from model import TrainState
from peers import Method

_T0 = time.perf_counter()
# Saves after a (re)start before the steady-state ones, each timed as a cold save. Two:
# nebula keeps two snapshot buffers (the newest committed copy and the one being filled),
# so the third save of a session is the first to reuse one made by an earlier save; DCP's
# reused stager allocates its buffers in the first.
COLD_SAVES = 2


def progress(message: str) -> None:
    """Progress goes to stderr; stdout is the table."""
    sys.stderr.write(f"[bench {time.perf_counter() - _T0:6.1f} s] {message}\n")
    sys.stderr.flush()


@dataclass(slots=True)
class SaveSample:
    """One timed save."""

    blocking_s: float
    fence_s: float
    stall_s: float
    durable_s: float
    background_s: float
    peak_extra_bytes: int
    peak_anon_bytes: int
    peak_shm_bytes: int


@dataclass(slots=True)
class MethodResult:
    """Everything measured for one method."""

    name: str
    label: str
    unavailable: str | None = None
    # cold[k]: the (k+1)-th saves after each (re)start (nebula restarts for every repeat;
    # the peers start once)
    cold: list[list[SaveSample]] = field(default_factory=lambda: [[] for _ in range(COLD_SAVES)])
    saves: list[SaveSample] = field(default_factory=list)
    written_bytes: int = 0
    load_fast_s: list[float] = field(default_factory=list)
    load_disk_s: list[float] = field(default_factory=list)
    load_disk_cache_resident: float = 0.0
    loop: dict[str, Any] = field(default_factory=dict)


class Steps:
    """Step numbers for checkpoint tags, increasing over the whole run."""

    def __init__(self) -> None:
        self._next = 0

    def __call__(self) -> int:
        self._next += 1
        return self._next


# mallopt(3) parameters
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep the memory a training step frees for the next step
    (no mmap'd allocations, no trimming); False where the C library is not glibc.

    A CPU training step allocates about 0.8 GB of temporaries (activations, gradients,
    AdamW's intermediates). With glibc's defaults, each one above 32 MiB is a fresh mmap,
    unmapped when freed: every step faults its temporaries in again (about 200,000 page
    faults, a quarter of the step's time here), and how much that costs depends on what
    else holds memory: the steps ran 20% slower for a while after any checkpoint, even
    with no checkpoint work running. That is the allocator, not the checkpoint, and it
    drowned the loop figure. Training loops on GPUs keep their memory (CUDA's caching
    allocator) and on CPUs are told to (PyTorch's tuning guide: jemalloc or tcmalloc);
    this does the same with glibc, for every method and for the no-checkpoint segments.
    """
    if not hasattr(_libc, "mallopt") or not hasattr(_libc, "gnu_get_libc_version"):
        return False
    return bool(_libc.mallopt(_M_MMAP_MAX, 0)) and bool(_libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def forward_backward_bytes(state: TrainState, repeats: int = 3) -> int:
    """The anonymous memory a forward/backward itself takes at its peak (median): not
    counted against a method whose save overlaps one."""
    peaks = []
    for _ in range(repeats):
        gc.collect()
        with MemorySampler() as mem:
            state.forward_backward()
        peaks.append(mem.peak_anon_bytes)
    return int(statistics.median(peaks))


def time_save(method: Method, state: TrainState, step: int, overlap_bytes: int = 0) -> SaveSample:
    """Time one save of `method` through durable, sampling memory, after an optimizer
    step (untimed) that changes the state. `overlap_bytes` is the forward/backward's own
    memory, discounted while it runs."""
    state.optimizer_step()  # every save is of a changed state, as in training
    gc.collect()
    retained = method.retained_bytes(state)
    with MemorySampler(method.shm_dirs(), retained_bytes=retained) as mem:
        t0 = time.perf_counter()
        pending = method.save(state, step)
        t1 = time.perf_counter()
        if method.defers_fence:
            mem.discount_bytes = overlap_bytes
            state.forward_backward()  # the next step's compute, overlapping the snapshot
            mem.discount_bytes = 0
        t2 = time.perf_counter()
        pending.wait_mutable()
        t3 = time.perf_counter()
        pending.wait_durable()
        t4 = time.perf_counter()
    return SaveSample(
        blocking_s=t1 - t0,
        fence_s=t3 - t2,
        stall_s=(t1 - t0) + (t3 - t2),
        durable_s=t4 - t0,
        background_s=t4 - t1,
        peak_extra_bytes=mem.peak_extra_bytes,
        peak_anon_bytes=mem.peak_anon_bytes,
        peak_shm_bytes=mem.peak_shm_bytes,
    )


def _ready(
    method: Method, state: TrainState, steps: Steps, result: MethodResult, overlap_bytes: int = 0
) -> None:
    """Activate `method`; after a (re)start, its `COLD_SAVES` cold saves, each recorded
    in `result.cold`."""
    if not method.activate(state):
        return
    for k in range(COLD_SAVES):
        sample = time_save(method, state, steps(), overlap_bytes)
        result.cold[k].append(sample)
        progress(f"cold save {k + 1} {method.label}: stall {sample.stall_s:.3f} s")
        method.prune()


def run_saves(
    methods: Sequence[Method],
    results: dict[str, MethodResult],
    state: TrainState,
    steps: Steps,
    repeats: int,
) -> None:
    """The save phase: `repeats` rounds, each timing one save of every method."""
    overlap = forward_backward_bytes(state)
    progress(f"a forward/backward takes {overlap / 1e9:.2f} GB of its own at its peak")
    for r in range(repeats):
        last = r == repeats - 1
        for method in methods:
            result = results[method.name]
            _ready(method, state, steps, result, overlap)
            sample = time_save(method, state, steps(), overlap)
            result.saves.append(sample)
            method.prune()
            progress(
                f"save {r + 1}/{repeats} {method.label}: stall {sample.stall_s:.3f} s, "
                f"durable {sample.durable_s:.2f} s"
            )
            method.deactivate(keep_memory=last)  # the last save stays for the loads
            if last:
                method.release()
    for method in methods:
        results[method.name].written_bytes = tree_bytes([method.latest()])


def _time_load(method: Method, state: TrainState, *, from_disk: bool) -> float:
    gc.collect()
    t0 = time.perf_counter()
    loaded = method.load(state, from_disk=from_disk)
    seconds = time.perf_counter() - t0
    del loaded
    gc.collect()
    return seconds


def _warm_page_cache(paths: list[Path]) -> None:
    buffer = bytearray(64 << 20)
    for path in files_under(paths):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def load_order(methods: Sequence[Method], round_index: int) -> list[Method]:
    """The methods in round `round_index`'s order: a shuffle seeded by the round, the
    same in every run, so that no method follows the same one in every round.

    Example:
        >>> orders = [load_order("abcdefg", r) for r in range(5)]
        >>> all(sorted(o) == list("abcdefg") for o in orders), len({tuple(o) for o in orders})
        (True, 5)
    """
    order = list(methods)
    random.Random(round_index).shuffle(order)
    return order


def run_loads(
    methods: Sequence[Method], results: dict[str, MethodResult], state: TrainState, repeats: int
) -> None:
    """The load phase: fastest resume for all methods, then from disk, in rounds of a
    different order each (`load_order`)."""
    for r in range(repeats):
        for method in load_order(methods, r):
            _warm_page_cache(method.fast_load_paths())
            seconds = _time_load(method, state, from_disk=False)
            results[method.name].load_fast_s.append(seconds)
            progress(f"load {r + 1}/{repeats} {method.label} (fastest): {seconds:.2f} s")
    for method in methods:
        method.prepare_disk_load()
    for r in range(repeats):
        for method in load_order(methods, repeats + r):
            result = results[method.name]
            drop_page_cache(method.disk_paths())
            result.load_disk_cache_resident = max(
                result.load_disk_cache_resident, resident_fraction(method.disk_paths())
            )
            seconds = _time_load(method, state, from_disk=True)
            result.load_disk_s.append(seconds)
            progress(f"load {r + 1}/{repeats} {method.label} (disk): {seconds:.2f} s")


def _segment(
    state: TrainState, method: Method | None, steps: Steps, every: int
) -> dict[str, float]:
    """One checkpoint and the `every` training steps after it (or the steps alone), until
    the checkpoint is durable; a wait left at the end is counted and reported."""
    stall = 0.0
    pending = None
    t_start = time.perf_counter()
    if method is not None:
        pending = method.save(state, steps())
        stall = time.perf_counter() - t_start
    for i in range(every):
        state.forward_backward()
        if i == 0 and pending is not None:
            t0 = time.perf_counter()
            pending.wait_mutable()  # before the optimizer step mutates the tensors
            stall += time.perf_counter() - t0
        state.optimizer_step()
    t_steps = time.perf_counter()
    if pending is not None:
        pending.wait_durable()
    t_end = time.perf_counter()
    return {"segment_s": t_end - t_start, "stall_s": stall, "wait_at_end_s": t_end - t_steps}


def _round_order(methods: Sequence[Method], group: int, reverse: bool) -> list[Method | None]:
    """Method segments in groups of `group`, a no-checkpoint segment (None) before,
    between and after the groups."""
    order: list[Method | None] = [None]
    for k in range(0, len(methods), group):
        order.extend([*methods[k : k + group], None])
    return order[::-1] if reverse else order


def run_loops(
    methods: Sequence[Method],
    results: dict[str, MethodResult],
    state: TrainState,
    steps: Steps,
    *,
    n_steps: int,
    every: int,
    folder_for: Callable[[Method], Path],
    group: int = 1,
) -> dict[str, Any]:
    """The loop phase: `n_steps // every` rounds. The methods without a process-wide
    session run together: each round, one segment per method and a no-checkpoint segment
    before, between and after groups of `group` methods, in alternating order. Then each
    method with such a session (`exclusive_session`: nebula) runs in a stretch of its own,
    one session throughout: no-checkpoint and method segments in turn, `rounds` of each.
    A method segment is compared with the no-checkpoint time interpolated (linearly, in
    time) between the two that bracket it, so that drift in the machine's load cancels;
    the method's overhead is the median over the rounds. Returns the no-checkpoint
    figures."""
    rounds = max(1, n_steps // every)
    base: list[float] = []
    segments: dict[str, list[dict[str, float]]] = {m.name: [] for m in methods}
    for method in methods:
        method.setup(folder_for(method), state)
    scratch = {m.name: MethodResult(m.name, m.label) for m in methods}

    def play(order: list[Method | None], stretch: str) -> None:
        timeline: list[tuple[Method | None, float, float]] = []  # (who, mid time, s)
        for method in order:
            if method is not None:
                _ready(method, state, steps, scratch[method.name])
            t0 = time.perf_counter()
            seg = _segment(state, method, steps, every)
            timeline.append((method, t0 + seg["segment_s"] / 2, seg["segment_s"]))
            label = "no checkpoint" if method is None else method.label
            progress(f"loop {stretch} {label}: {seg['segment_s']:.2f} s")
            if method is None:
                base.append(seg["segment_s"])
                continue
            segments[method.name].append(seg)
            method.prune()
            if not method.exclusive_session:
                method.deactivate(keep_memory=False)
        for method, mid, _s in timeline:
            if method is not None:
                segments[method.name][-1 - _later(timeline, mid, method)]["reference_s"] = (
                    _interpolate(timeline, mid)
                )

    try:
        shared = [m for m in methods if not m.exclusive_session]
        for r in range(rounds if shared else 0):
            play(_round_order(shared, group, reverse=r % 2 == 1), f"{r + 1}/{rounds}")
        for method in methods:
            if method.exclusive_session:
                play([None, *[method, None] * rounds], f"({method.label}, alone)")
                method.deactivate(keep_memory=False)
    finally:
        for method in methods:
            method.teardown()
    for method in methods:
        segs = segments[method.name]
        per_round = [s["segment_s"] / s["reference_s"] - 1 for s in segs]
        results[method.name].loop = {
            "overhead": statistics.median(per_round),
            "overhead_per_round": per_round,
            "segment_s": [s["segment_s"] for s in segs],
            "reference_s": [s["reference_s"] for s in segs],
            "stall_s": [s["stall_s"] for s in segs],
            "wait_at_end_s": [s["wait_at_end_s"] for s in segs],
            "own_session": method.exclusive_session,
        }
    med = statistics.median(base)
    return {
        "rounds": rounds,
        "steps_per_segment": every,
        "segment_s": base,
        "median_s": med,
        "spread": (max(base) - min(base)) / med,
    }


def _later(timeline: list[tuple[Method | None, float, float]], mid: float, who: Method) -> int:
    """How many segments of `who` in `timeline` come after the one at `mid`."""
    return sum(1 for w, t, _s in timeline if w is who and t > mid)


def _interpolate(timeline: list[tuple[Method | None, float, float]], mid: float) -> float:
    """The no-checkpoint segment time at `mid`, between the nearest ones before and after."""
    base = [(t, s) for who, t, s in timeline if who is None]
    before = [(t, s) for t, s in base if t <= mid]
    after = [(t, s) for t, s in base if t > mid]
    if not before or not after:
        return (before or after)[-1 if before else 0][1]
    (t0, s0), (t1, s1) = before[-1], after[0]
    return s0 + (s1 - s0) * (mid - t0) / (t1 - t0)


def usable(methods: Sequence[Method], results: dict[str, MethodResult]) -> Iterator[Method]:
    """The methods that are not unavailable."""
    return (m for m in methods if results[m.name].unavailable is None)
