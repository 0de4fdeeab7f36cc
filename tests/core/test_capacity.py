"""A memory tier on a small filesystem (Docker's /dev/shm is 64 MiB): saves go on.

An item the memory tier's filesystem cannot hold is written straight to the persistent
tier, as one over NEBULA_MEMORY_BUFFER_SIZE is, with one warning per checkpoint that
names the sizes and the fix. Bugs these catch: `nm.init` failing on a full /dev/shm, a
save larger than the free space failing with StorageFullError (or a SIGBUS), a 2-item
checkpoint whose second item does not fit losing its first, the lazy copy failing where
the plain save would not, a race (the space gone between the check and the write)
failing the save, and a memory-only job getting an unclear error.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import nebulaml as nm
from nebulaml.runtime import budget as nm_budget

MB = 1 << 20


@pytest.fixture
def small_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int], Path]]:
    """`small_tier(size_bytes)` mounts a tmpfs of that size and makes it the memory tier's
    base folder (NEBULA_MEMORY_TIER_PATH); returns the mount point. Unmounted after the
    test, and everything the test wrote under tmp_path is removed."""
    mounted: list[Path] = []

    def mount(size_bytes: int) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root (CI runs the tests as root)")
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(point)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.fail(f"cannot mount a tmpfs as root: {done.stderr.strip()}")
        mounted.append(point)
        monkeypatch.setenv("NEBULA_MEMORY_TIER_PATH", str(point / "memory"))
        return point

    try:
        yield mount
    finally:
        # The session maps the tier's files: it goes before the unmount.
        with contextlib.suppress(nm.NebulaError):
            nm.shutdown(timeout_s=30)
        for point in mounted:
            if subprocess.run(["umount", str(point)], check=False).returncode != 0:
                subprocess.run(["umount", "-l", str(point)], check=False)
        for child in tmp_path.iterdir():  # hundreds of MB of persistent checkpoints
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink()


def _state(seed: int, tensors: int, mb_each: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = int(mb_each * MB) // 4
    return {f"t{i}": torch.randn(n, generator=gen) for i in range(tensors)}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def _capacity_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "nebulaml" and r.levelno == logging.WARNING and "--shm-size" in r.getMessage()
    ]


def _assert_names_sizes(message: str, point: Path, item_bytes: int) -> None:
    needs = re.search(r"needs (\d+) bytes", message)
    free = re.search(r"has (\d+) bytes free", message)
    assert needs and free, message
    assert int(needs.group(1)) >= item_bytes
    assert int(free.group(1)) < item_bytes
    assert str(point) in message
    assert "NEBULA_MEMORY_TIER_PATH" in message and "docker run --shm-size=" in message


def _fill(point: Path) -> Path:
    """Fill the tmpfs to the last byte."""
    filler = point / "filler.bin"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, bytes(MB))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    return filler


def _free(point: Path) -> int:
    st = os.statvfs(point)
    return st.f_bavail * st.f_frsize


@pytest.mark.parametrize("lazy", [False, True], ids=["plain", "lazy"])
def test_a_state_larger_than_a_64mib_tier_is_written_to_the_persistent_tier(
    small_tier: Callable[[int], Path],
    root: Path,
    caplog: pytest.LogCaptureFixture,
    lazy: bool,
) -> None:
    caplog.set_level(logging.WARNING, logger="nebulaml")
    point = small_tier(64 * MB)  # Docker's default /dev/shm
    nm.init(str(root), persistent_time_interval=0, lazy_snapshot=lazy)
    for step in (1, 2):
        state = _state(step, 4, 50)  # 200 MB
        nm.Checkpoint(f"global_step{step}").save("model", state)
        nm.wait_for_snapshot()
        assert _free(point) > 0  # the tier did not fill up
        nm.flush_persistence()
        latest = nm.get_latest_checkpoint()
        assert latest is not None and latest.tag == f"global_step{step}"
        _assert_equal(latest.load("model"), state)
        warnings = _capacity_warnings(caplog)
        assert len(warnings) == 1, warnings  # once for the job, not once per checkpoint
        _assert_names_sizes(warnings[0], point, 200 * MB)
    assert (root / "global_step2" / "manifest.json").exists()


def test_an_item_that_does_not_fit_moves_the_whole_checkpoint(
    small_tier: Callable[[int], Path], root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="nebulaml")
    point = small_tier(4 * MB)
    nm.init(str(root), persistent_time_interval=0)
    model, optimizer = _state(1, 1, 1), _state(2, 2, 3)  # 1 MB fits, 6 MB does not
    ckpt = nm.Checkpoint("global_step1", 2)
    ckpt.save("model", model)
    ckpt.save("optimizer", optimizer)
    assert (root / "global_step1" / "manifest.json").exists()  # committed there directly
    nm.flush_persistence()
    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == "global_step1"
    _assert_equal(latest.load("model"), model)
    _assert_equal(latest.load("optimizer"), optimizer)
    _assert_equal(torch.load(root / "global_step1" / "model", weights_only=True), model)
    (warning,) = _capacity_warnings(caplog)
    _assert_names_sizes(warning, point, 6 * MB)
    assert "'optimizer'" in warning


def test_init_on_a_full_tier_works_and_saves_go_to_the_persistent_tier(
    small_tier: Callable[[int], Path], root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="nebulaml")
    point = small_tier(4 * MB)
    _fill(point)
    assert _free(point) == 0
    nm.init(str(root), persistent_time_interval=0)
    state = _state(3, 2, 0.25)
    nm.Checkpoint("global_step1").save("model", state)
    assert (root / "global_step1" / "manifest.json").exists()
    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == "global_step1"
    _assert_equal(latest.load("model"), state)
    (warning,) = _capacity_warnings(caplog)
    _assert_names_sizes(warning, point, MB // 2)


def test_a_tier_filled_after_the_check_still_saves(
    small_tier: Callable[[int], Path],
    root: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Another process takes the space between the check and the write: the write's
    # StorageFullError moves the checkpoint, as the check would have.
    caplog.set_level(logging.WARNING, logger="nebulaml")
    point = small_tier(4 * MB)
    nm.init(str(root), persistent_time_interval=0)
    monkeypatch.setattr(nm_budget, "free_bytes", lambda _path: 1 << 40)
    for step, state in ((1, _state(4, 2, 4)), (2, {"w": torch.arange(2 * MB), "f": print})):
        # A reused buffer (fallocate), then torch.save (an object the layout cannot map).
        nm.Checkpoint(f"global_step{step}").save("model", state)
        latest = nm.get_latest_checkpoint()
        assert latest is not None and latest.tag == f"global_step{step}"
        got = latest.load("model", weights_only=False)
        assert torch.equal(got["w" if step == 2 else "t0"], state["w" if step == 2 else "t0"])
    assert len(_capacity_warnings(caplog)) == 1  # once for the job
    assert _free(point) > 0


def test_without_a_persistent_tier_a_full_tier_is_a_clear_error(
    small_tier: Callable[[int], Path],
) -> None:
    small_tier(4 * MB)
    nm.init(None)
    nm.Checkpoint("global_step1").save("model", _state(5, 1, 1))
    with pytest.raises(nm.MemoryBudgetError, match=r"has [0-9]+ bytes free.*--shm-size") as err:
        nm.Checkpoint("global_step2").save("model", _state(6, 2, 4))
    assert "there is no persistent tier" in str(err.value)
    _assert_equal(nm.get_latest_checkpoint().load("model"), _state(5, 1, 1))


def test_free_bytes_of_a_folder_not_made_yet(small_tier: Callable[[int], Path]) -> None:
    point = small_tier(4 * MB)
    assert nm_budget.free_bytes(str(point / "memory" / "not-yet")) == _free(point)
    assert 0 < _free(point) <= 4 * MB
