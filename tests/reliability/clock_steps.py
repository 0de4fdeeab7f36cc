"""The clock-steps campaign (issue #18): the wall clock jumps hours back and forth between
saves, and "newest" must not care.

One process saves into a few roots in turn, with a small retention; before each save the
time the commit stamps (`committed_at`: protocol/commit.py's `utc_now`, patched here for
the campaign's length, the system clock untouched) jumps by up to +-6 hours, sometimes by
days. Tags name no step (random names, so their alphabetical order is random too), the
same step (the sequence decides), or Lightning's increasing `step=`. The job restarts at
random points (a new session: its memory tier starts empty). After every save, and again
once it is persisted:

    latest          `get_latest_checkpoint` is the checkpoint saved last, and loads its data
    listing         `list_checkpoints` is the last `keep` saved, newest first
    retention       the persistent root holds exactly the last `keep` saved: none of them
                    deleted (a wrong deletion), and no older one kept in their place
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import torch
from campaigns import Figures

import nebulaml as nm
from nebulaml.protocol import commit

ZERO = ("latest wrong", "wrong deletions", "older ones kept", "listings out of order")


class SteppingClock:
    """The commit's time source, `offset` away from the real time."""

    def __init__(self) -> None:
        self.offset = timedelta(0)

    def now(self) -> str:
        return (datetime.now(timezone.utc) + self.offset).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@contextlib.contextmanager
def _stepping_clock() -> Iterator[SteppingClock]:
    clock = SteppingClock()
    original = commit.utc_now
    commit.utc_now = clock.now
    try:
        yield clock
    finally:
        commit.utc_now = original


@contextlib.contextmanager
def _memory_base(base: Path) -> Iterator[None]:
    """The memory tiers go under `base` (never the user's /dev/shm), for the campaign."""
    previous = os.environ.get("NEBULA_MEMORY_TIER_PATH")
    os.environ["NEBULA_MEMORY_TIER_PATH"] = str(base)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["NEBULA_MEMORY_TIER_PATH"]
        else:
            os.environ["NEBULA_MEMORY_TIER_PATH"] = previous


def _no_step(i: int, rng: random.Random) -> str:
    return f"{rng.choice(['ckpt', 'best', 'eval', 'snap'])}-{rng.getrandbits(24):06x}-{i}"


def _same_step(i: int, rng: random.Random) -> str:
    return f"global_step500-{rng.getrandbits(24):06x}-{i}"


def _lightning(i: int, rng: random.Random) -> str:
    return f"epoch={i // 4}-step={(i + 1) * 10}"


SCHEMES: tuple[tuple[str, Callable[[int, random.Random], str]], ...] = (
    ("no step", _no_step),
    ("same step", _same_step),
    ("lightning", _lightning),
)


def _jump(clock: SteppingClock, rng: random.Random, figures: Figures) -> None:
    hours = rng.uniform(-6, 6) if rng.random() < 0.9 else rng.choice([-1, 1]) * rng.uniform(24, 72)
    clock.offset += timedelta(hours=hours)
    figures.add("clock jumps")
    if hours < 0:
        figures.add("clock jumps back")
    figures.counts["largest jump (hours)"] = max(
        figures.counts.get("largest jump (hours)", 0), round(abs(hours), 1)
    )


def _committed_on_disk(root: Path) -> set[str]:
    return {p.parent.name for p in root.glob("*/manifest.json")}


def _check(
    root: Path, saved: list[tuple[str, int]], keep: int, when: str, figures: Figures
) -> None:
    tag, value = saved[-1]
    latest = nm.get_latest_checkpoint()
    got = None if latest is None else (latest.tag, int(latest.load("model")["i"]))
    figures.add("latest checks")
    if got != (tag, value):
        figures.add("latest wrong")
        figures.failures.append(f"{root.name} {when} {tag!r}: latest was {got}")
    expected = [t for t, _v in saved[-keep:]]
    listed = [c["tag"] for c in nm.list_checkpoints(hold=False)]  # an observer: holds nothing
    if listed[: len(expected)] != expected[::-1]:
        figures.add("listings out of order")
        figures.failures.append(f"{root.name} {when}: listed {listed}, saved {expected}")
    if when != "persisted":
        return
    on_disk = _committed_on_disk(root)
    for gone in sorted(set(expected) - on_disk):
        figures.add("wrong deletions")
        figures.failures.append(f"{root.name}: {gone!r} deleted, one of the {keep} newest")
    for old in sorted(on_disk - set(expected)):
        figures.add("older ones kept")
        figures.failures.append(f"{root.name}: {old!r} kept beside the {keep} newest")


def _round(
    root: Path,
    scheme: Callable[[int, random.Random], str],
    saves: int,
    rng: random.Random,
    clock: SteppingClock,
    figures: Figures,
) -> None:
    keep = rng.randint(1, 3)

    def start() -> None:
        nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=keep)

    start()
    restart_at = rng.randrange(1, saves) if saves > 1 else None
    saved: list[tuple[str, int]] = []
    for i in range(saves):
        if i == restart_at or (i and rng.random() < 0.05):
            nm.shutdown()  # everything persisted: the memory tier is released
            start()
            figures.add("restarts")
        _jump(clock, rng, figures)
        tag, value = scheme(i, rng), int(figures.counts.get("saves", 0))
        nm.Checkpoint(tag).save("model", {"i": torch.tensor(value)})
        saved.append((tag, value))
        figures.add("saves")
        _check(root, saved, keep, "saved", figures)
        nm.flush_persistence()
        _check(root, saved, keep, "persisted", figures)
    nm.shutdown()


def clock_steps_campaign(work: Path, saves: int = 600, seed: int = 18) -> Figures:
    """`saves` saves over a few roots while the clock jumps; returns the figures."""
    figures = Figures("clock steps")
    rng = random.Random(seed)
    work.mkdir(parents=True, exist_ok=True)
    with _memory_base(work / "memory"), _stepping_clock() as clock:
        done = 0
        for n in range(saves):
            if done >= saves:
                break
            count = min(rng.randint(15, 40), saves - done)
            name, scheme = SCHEMES[n % len(SCHEMES)]
            _round(work / f"root{n}", scheme, count, rng, clock, figures)
            figures.add(f"roots: {name}")
            done += count
    for key in ZERO:
        figures.counts.setdefault(key, 0)
    return figures
