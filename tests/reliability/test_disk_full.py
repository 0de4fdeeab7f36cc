"""Disk full: a small tmpfs (and a loop-mounted ext4, where persists write with O_DIRECT)
as the persistent root (and a tmpfs as the memory tier), filling up at different points of
a save. With `on_persist_error="raise"` a typed error reaches the caller, training goes
on, nothing partial is committed, the previous checkpoint loads, and the next save after
space is freed succeeds."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import nebulaml as nm

MB = 1 << 20


def _mount_tmpfs(path: Path, size_bytes: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        _cannot("mount a tmpfs", done.stderr)


def _cannot(what: str, stderr: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"cannot {what} for the disk-full tests: {stderr}")
    pytest.skip(f"cannot {what} here: {stderr.strip()}")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, 4 * MB)
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture
def small_ext4(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB ext4 image, loop-mounted: a real disk filesystem, where O_DIRECT works."""
    image, disk = tmp_path / "disk.ext4", tmp_path / "ext4"
    disk.mkdir()
    with image.open("wb") as f:
        f.truncate(8 * MB)
    for args in (
        ["mkfs.ext4", "-q", "-F", str(image)],
        ["mount", "-o", "loop", str(image), str(disk)],
    ):
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            _cannot(f"run {args[0]}", done.stderr)
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _state(value: float, mb: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((int(mb * MB) // 4,), value)}


def _fill(disk: Path, leave_free_bytes: int) -> Path:
    """A filler file that leaves about `leave_free_bytes` free on the tmpfs."""
    st = os.statvfs(disk)
    free = st.f_bavail * st.f_frsize
    filler = disk / "filler.bin"
    filler.write_bytes(b"\0" * max(0, free - leave_free_bytes))
    return filler


@pytest.mark.parametrize(
    "free_bytes",
    # tmpfs counts 4 KiB pages: each 1 MiB item (plus its zip framing) takes 257 pages and
    # each marker or manifest one page, so these leave room to fail at each step.
    [int(0.3 * MB), int(1.2 * MB), (2 * 257 + 1) * 4096, (2 * 257 + 2) * 4096],
    ids=["mid-first-item", "mid-second-item", "at-the-rank-marker", "at-the-manifest"],
)
def test_persistent_tier_fills_up(small_disk: Path, free_bytes: int) -> None:
    _fills_up_during_a_persist(small_disk, free_bytes)


@pytest.mark.parametrize(
    "free_bytes", [int(0.3 * MB), int(1.2 * MB)], ids=["mid-first-item", "mid-second-item"]
)
def test_persistent_ext4_fills_up_during_direct_writes(small_ext4: Path, free_bytes: int) -> None:
    _fills_up_during_a_persist(small_ext4, free_bytes)


def _fills_up_during_a_persist(small_disk: Path, free_bytes: int) -> None:
    root = small_disk / "root"
    # The opt-in contract (a typed error for the caller); by default a full disk is waited
    # out in the background (tests/core/test_outage.py).
    nm.init(
        str(root),
        persistent_time_interval=0,
        num_of_version_in_retention=1,
        on_persist_error="raise",
    )
    ckpt = nm.Checkpoint("global_step1", 2)
    ckpt.save("model", _state(1.0, 0.2))
    ckpt.save("optimizer", _state(1.0, 0.2))
    nm.flush_persistence()
    filler = _fill(small_disk, free_bytes)
    ckpt = nm.Checkpoint("global_step2", 2)
    ckpt.save("model", _state(2.0, 1.0))
    # The persist starts at the commit (the second save) and may fail before that call
    # returns: the error is raised by whichever call comes next, the commit or the flush.
    with pytest.raises(nm.PersistError) as err:
        ckpt.save("optimizer", _state(2.0, 1.0))
        nm.flush_persistence()
    assert isinstance(err.value.__cause__, nm.StorageFullError), repr(err.value.__cause__)
    assert "global_step2" in str(err.value)
    # Training goes on: the next call works, and nothing partial is committed anywhere.
    assert not (root / "global_step2" / "manifest.json").exists()
    durable = nm.get_checkpoint("global_step1")
    assert durable is not None and torch.equal(durable.load("model")["w"], _state(1.0, 0.2)["w"])
    assert nm.get_latest_checkpoint().tag == "global_step2"  # still whole in the memory tier
    # Space is freed: the next save persists, and the leftover of the failed one is gone.
    filler.unlink()
    ckpt = nm.Checkpoint("global_step3", 2)
    ckpt.save("model", _state(3.0, 1.0))
    ckpt.save("optimizer", _state(3.0, 1.0))
    nm.flush_persistence()
    assert (root / "global_step3" / "manifest.json").exists()
    loaded = torch.load(root / "global_step3" / "model", weights_only=True)
    assert torch.equal(loaded["w"], _state(3.0, 1.0)["w"])


def test_memory_tier_fills_up(small_disk: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("NEBULA_MEMORY_TIER_PATH", str(small_disk / "memory"))
    root = tmp_path / "root"
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("model", _state(1.0, 0.5))
    nm.flush_persistence()
    filler = _fill(small_disk, int(0.3 * MB))
    # No room in RAM: the save goes straight to the persistent tier, with one warning.
    nm.Checkpoint("global_step2").save("model", _state(2.0, 1.0))
    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == "global_step2"
    assert torch.equal(latest.load("model")["w"], _state(2.0, 1.0)["w"])
    assert nm.list_checkpoints()[0]["tiers"] == ["persistent"]
    filler.unlink()
    nm.Checkpoint("global_step3").save("model", _state(3.0, 1.0))
    nm.flush_persistence()
    assert nm.get_latest_checkpoint().tag == "global_step3"
