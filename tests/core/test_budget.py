"""NEBULA_MEMORY_BUFFER_SIZE is a limit, not a hint: the memory tier never holds more.

Bugs these catch: a save that overwrites the only committed copy to make room, a budget
counted but not enforced, a checkpoint larger than the budget that fails (or fills the
memory) instead of going to the persistent tier, and waiting forever for room.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import nebulaml as nm

MB = 1 << 20


def _usage(folder: str) -> int | None:
    """Bytes of the files under `folder` at one moment, each file once; None when files
    went during the walk. A walk is not atomic: it could count a file the pool moved
    from `.slots/` into a tag twice, or the file an eviction removed (one a load still
    holds is not reused) and the one the next save then made, which never coexisted."""
    files: dict[str, tuple[int, int, int]] = {}
    for here, _dirs, names in os.walk(folder):
        for name in names:
            path = os.path.join(here, name)
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(path)
                files[path] = (st.st_dev, st.st_ino, st.st_size)
    for path, (dev, ino, _size) in files.items():
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if (st.st_dev, st.st_ino) != (dev, ino):
            return None
    return sum(size for _dev, _ino, size in {v[:2]: v for v in files.values()}.values())


class UsageSampler:
    """The memory tier's size, sampled about every millisecond while a test saves."""

    def __init__(self, folder: str) -> None:
        self.folder, self.peak = folder, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _usage(self.folder) or 0)
            self._stop.wait(0.001)

    def __enter__(self) -> UsageSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _usage(self.folder) or 0)


@pytest.fixture
def budget(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """Half of NEBULA_MEMORY_BUFFER_SIZE is the checkpoints' share (the seed's rule)."""
    monkeypatch.setenv("NEBULA_MEMORY_BUFFER_SIZE", str(2 * int(1.5 * MB)))
    yield int(1.5 * MB)


def _state(step: int, size_bytes: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((size_bytes // 4,), float(step))}


def test_a_state_larger_than_the_budget_goes_to_the_persistent_tier(
    root: Path, budget: int, caplog: pytest.LogCaptureFixture
) -> None:
    nm.init(str(root), persistent_time_interval=3600, num_of_version_in_retention=2)
    memory = nm.memory_tier_path(str(root))
    with UsageSampler(memory) as sampler:
        for step in (1, 2, 3):
            ckpt = nm.Checkpoint(f"global_step{step}", 2)
            ckpt.save("model", _state(step, MB // 2))  # fits alone
            ckpt.save("optimizer", _state(step, 2 * MB))  # the whole does not
    assert sampler.peak <= budget
    said = [r for r in caplog.records if "does not fit the memory budget" in r.getMessage()]
    warned = [r for r in said if r.levelno >= logging.WARNING]
    assert len(warned) == 1, said  # warned once, not per save (later ones at debug)
    assert (root / "global_step3" / "manifest.json").exists()
    assert not os.path.exists(os.path.join(memory, "global_step3"))
    assert sorted(c["tag"] for c in nm.list_checkpoints()) == ["global_step2", "global_step3"]
    latest = nm.get_latest_checkpoint()
    assert torch.equal(latest.load("model")["w"], _state(3, MB // 2)["w"])
    assert torch.equal(latest.load("optimizer")["w"], _state(3, 2 * MB)["w"])
    nm.flush_persistence()
    records = nm.history_records(nm.read_history(str(root)))
    rows = [r for r in records if r["tag"] == "global_step3"]
    assert [r["tier"] for r in rows] == ["persistent"]


def test_room_for_one_copy_waits_for_the_older_persist_never_overwrites_it(
    root: Path, budget: int
) -> None:
    # Room for one 1 MB copy: each save must wait until the previous checkpoint is
    # durable before its memory copy may be reused; it never waits for the interval.
    nm.init(str(root), persistent_time_interval=3600, num_of_version_in_retention=10)
    memory = nm.memory_tier_path(str(root))
    with UsageSampler(memory) as sampler:
        for step in range(1, 6):
            nm.Checkpoint(f"global_step{step}").save("model", _state(step, MB))
            for older in range(1, step + 1):  # every committed checkpoint still loads right
                got = nm.get_checkpoint(f"global_step{older}").load("model")["w"]
                assert torch.equal(got, _state(older, MB)["w"])
    assert sampler.peak <= budget
    persisted = sorted(p.name for p in root.iterdir() if (p / "manifest.json").exists())
    assert persisted == [f"global_step{s}" for s in range(1, 5)]  # the 5th is the newest


def test_without_a_persistent_tier_a_state_over_budget_is_refused(budget: int) -> None:
    nm.init(None)
    nm.Checkpoint("global_step1").save("model", _state(1, MB // 4))
    with pytest.raises(nm.MemoryBudgetError, match="NEBULA_MEMORY_BUFFER_SIZE"):
        nm.Checkpoint("global_step2").save("model", _state(2, 2 * MB))
    assert torch.equal(nm.get_latest_checkpoint().load("model")["w"], _state(1, MB // 4)["w"])
