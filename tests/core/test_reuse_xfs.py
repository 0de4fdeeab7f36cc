"""On a filesystem that shares extents (XFS with reflinks), versions of a checkpoint share
what did not change: N retained versions take one full checkpoint and their changed
bytes, and deleting the oldest leaves every other version whole (protocol/reuse.py).

The filesystem is made here: a sparse image in the test's folder, `mkfs.xfs -m reflink=1`
and a loop mount (root, and xfsprogs: `make venv` installs it where it can). Without them
the test is skipped, saying why."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import nebulaml as nm

BASE_ELEMENTS = 16 << 20  # 64 MiB of float32: the frozen part
ADAPTER_ELEMENTS = 256 << 10  # 1 MiB: the part that trains
IMAGE_BYTES = 1 << 30


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "a loop mount needs root"
    if shutil.which("mkfs.xfs") is None:
        return "no mkfs.xfs (xfsprogs)"
    return None


@pytest.fixture
def xfs(tmp_path: Path) -> Iterator[Path]:
    why = _why_not()
    if why is not None:
        pytest.skip(why)
    image, mount = tmp_path / "xfs.img", tmp_path / "mnt"
    with open(image, "wb") as f:
        f.truncate(IMAGE_BYTES)
    mount.mkdir()
    subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(image)], check=True)
    done = subprocess.run(
        ["mount", "-o", "loop", str(image), str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"no loop mount here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)
        image.unlink()


def _used_bytes(path: Path) -> int:
    """Bytes in use on the filesystem of `path`, once what was deleted is freed."""
    last = -1
    for _ in range(50):
        os.sync()
        st = os.statvfs(path)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        if used == last:
            return used
        last = used
        time.sleep(0.1)  # XFS frees a deleted file's blocks in the background
    return last


def test_retained_versions_share_what_did_not_change(xfs: Path) -> None:
    # Catches: versions written whole (three full copies, as on main), clones that share
    # blocks with the version retention then deletes (a version that no longer loads),
    # or ranges cloned from the wrong place (a version that is not bit-identical).
    root = xfs / "ckpt"
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=3)
    empty = _used_bytes(xfs)
    g = torch.Generator().manual_seed(5)
    model = {
        "base": torch.randn(BASE_ELEMENTS, generator=g),
        "adapter": torch.randn(ADAPTER_ELEMENTS, generator=g),
    }
    saved: dict[str, dict[str, torch.Tensor]] = {}
    for step in range(1, 7):
        model["adapter"].add_(0.5)
        tag = f"global_step{step}"
        nm.Checkpoint(tag).save("model", model)
        assert nm.flush_persistence()
        saved[tag] = {k: v.clone() for k, v in model.items()}
    nm.shutdown()
    kept = sorted(p.name for p in root.iterdir() if p.name.startswith("global_step"))
    assert kept == ["global_step4", "global_step5", "global_step6"]
    full = (root / "global_step6" / "model").stat().st_size
    df = nm.read_history(str(root))
    persists = df[(df["tier"] == "persistent") & (df["status"] == "ok")]
    changed = persists.set_index("tag")["bytes_written"]
    assert changed["global_step5"] < 2 * ADAPTER_ELEMENTS * 4  # the adapter's blocks
    occupied = _used_bytes(xfs) - empty
    allowed = full + 1.5 * (changed["global_step5"] + changed["global_step6"])
    slack = 1 << 20  # the history file, manifests, markers and the filesystem's own
    assert occupied <= allowed + slack, (occupied, full, changed.to_dict())
    for tag in kept:
        loaded = torch.load(root / tag / "model", weights_only=True)
        assert all(torch.equal(loaded[k], saved[tag][k]) for k in saved[tag]), tag
    report = nm.verify_checkpoints(str(root))
    assert report and all(r["status"] == "ok" for r in report), report
