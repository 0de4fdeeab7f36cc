"""`make bench`'s LoRA fine-tune workload (benchmarks/lora.py), run at a tiny size through
the benchmark's own command line: it must freeze what it says, count what each method
sends to the persistent tier and what reaches the disk (`write_bytes`), and check the
issue's targets from those counts."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import azurite as azurite_server
import pytest
import warm
from disk_writes import counted_in

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"
SHM = Path("/dev/shm")


@pytest.fixture
def shm_folder() -> Iterator[Path]:
    """A folder on tmpfs with the run's mark (the leak guard's), removed after."""
    if not SHM.is_dir() or not os.access(SHM, os.W_OK):
        pytest.skip("no writable /dev/shm")
    folder = Path(
        tempfile.mkdtemp(dir=SHM, prefix=f"nebula-tests-{os.environ['NEBULA_TESTS_RUN']}-")
    )
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def run_lora(
    tmp_path: Path, mb: int, *methods: str, memory: Path | None = None, work: Path | None = None
) -> tuple[dict[str, Any], str]:
    """`bench.py --workloads lora` at `mb` MB of state, one round of one timed save, in
    `work` (default: under `tmp_path`), the memory tier's base under `memory`; the JSON
    document's `lora` and the tables."""
    out, work = tmp_path / "lora.json", work or tmp_path / "work"
    env = dict(os.environ, COLUMNS="160")
    if memory is not None:  # the suite puts it under tmp_path: on disk, not tmpfs
        env["NEBULA_MEMORY_TIER_PATH"] = str(memory)
    done = warm.run(
        [sys.executable, str(BENCH), "--workloads", "lora", "--lora-mb", str(mb),
         "--lora-rounds", "1", "--lora-saves", "1", "--methods", *methods,
         "--work", str(work), "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "LoRA targets" in done.stdout
    assert not list(work.iterdir())  # its work folder is removed
    lora: dict[str, Any] = json.loads(out.read_text())["lora"]
    return lora, done.stdout


def test_frozen_base_sends_what_changed_and_the_control_sends_everything(
    tmp_path: Path, shm_folder: Path
) -> None:
    lora, tables = run_lora(
        tmp_path, 32, "torch_save", "nebula_all_changed", "nebula_own_item", "nebula",
        "nebula_sync_all_changed", "nebula_sync", memory=shm_folder,
    )  # fmt: skip
    state, methods = lora["state"], lora["methods"]
    assert lora["order"] == [
        "nebula", "nebula_own_item", "nebula_all_changed", "nebula_sync",
        "nebula_sync_all_changed", "torch_save",
    ]  # fmt: skip
    # The base is ~95% of the state; what a step changes is the rest, counted once.
    assert state["frozen_bytes"] + state["changed_bytes"] == state["state_bytes"]
    assert 0.9 < state["frozen_bytes"] / state["state_bytes"] < 0.97

    def median(name: str, key: str) -> float:
        return float(methods[name][key]["median"])

    # Every row persists a complete checkpoint: torch.save's file is the whole state.
    assert median("torch_save", "bytes_written") >= state["state_bytes"]
    for name in ("nebula", "nebula_all_changed"):
        assert median(name, "size_bytes") >= state["state_bytes"]
        assert len(methods[name]["cold_saves"]) == 2  # timed apart from the steady save
    # The control's base changes every step: nothing can be reused, all of it is sent.
    assert median("nebula_all_changed", "bytes_written") == median(
        "nebula_all_changed", "size_bytes"
    )
    # The save copies every tensor byte; torch's own bytes stay in the buffer that holds them.
    assert median("nebula_all_changed", "copied_bytes") == state["state_bytes"]
    # The frozen base is neither copied by the save nor sent by the persist.
    changed = state["changed_bytes"]
    written = median("nebula", "bytes_written")
    assert written + median("nebula", "bytes_reused") == median("nebula", "size_bytes")
    assert written <= 1.2 * changed
    assert median("nebula", "copied_bytes") <= 1.2 * changed
    ratios = {(r["name"], r["method"]): r for r in lora["ratios"]}
    assert ratios["lora_bytes_vs_changed", "nebula"]["value"] == pytest.approx(written / changed)
    assert ratios["lora_bytes_vs_changed", "nebula"]["pass"] is True
    # The stall target is the copies at save()'s: the frozen base skipped there too.
    assert median("nebula_sync", "copied_bytes") <= 1.2 * changed
    assert median("nebula_sync_all_changed", "copied_bytes") == state["state_bytes"]
    stall = ratios["lora_stall_vs_all_changed", "nebula_sync"]["value"]
    assert stall == pytest.approx(
        median("nebula_sync", "stall_s") / median("nebula_sync_all_changed", "stall_s")
    )
    assert ratios["lora_bytes_vs_changed", "nebula_azure"]["value"] is None  # not run

    # The own-item layout sends what changed too (the base item reused whole), and
    # resumes bit for bit from the persistent tier, its model put back together from two
    # items; so do the one-item rows.
    own = "nebula_own_item"
    assert median(own, "size_bytes") >= state["state_bytes"]  # a complete checkpoint
    assert median(own, "bytes_written") <= 1.2 * changed
    assert median(own, "bytes_reused") >= state["frozen_bytes"]
    assert ratios["lora_bytes_vs_changed", own]["pass"] is True
    for name in ("nebula", own, "nebula_all_changed"):
        assert methods[name]["resume_exact"] is True, methods[name]["resume_mismatches"]
    assert "resume_exact" not in methods["torch_save"]

    # What reached the disk: this machine's work folder counts its writes (ext4 here).
    assert lora["disk_writes_counted"] is counted_in(tmp_path)
    if not lora["disk_writes_counted"]:
        pytest.skip(f"{tmp_path}: the kernel does not count its writes")
    assert lora["memory_tier_writes_counted"] is False  # /dev/shm: the saves' copies are not
    assert "(write_bytes)" in tables and "disk x changed" in tables  # headers wrap
    disk = {n: median(n, "disk_bytes") for n in ("nebula", own, "nebula_all_changed", "torch_save")}
    # Every byte sent reaches the disk: a window that missed the persister's thread, or
    # closed before the persist ended, would count less than that.
    for name in ("nebula", own, "nebula_all_changed"):
        assert disk[name] >= median(name, "bytes_written")
    assert disk["torch_save"] >= median("torch_save", "size_bytes")  # its own file, fsynced
    assert disk["nebula_all_changed"] >= state["state_bytes"]
    # The base its own item: a hard link each checkpoint, no disk writes for it (with the
    # link disabled this is the whole state, 20x).
    assert disk[own] <= 1.2 * changed
    assert methods[own]["disk_vs_changed"]["median"] == pytest.approx(disk[own] / changed)
    disk_ratio = ratios["lora_disk_vs_changed", own]
    assert disk_ratio["value"] == pytest.approx(disk[own] / changed)
    assert disk_ratio["pass"] is True
    # The table shows the own-item row's disk figure and ratio, in its last two columns.
    row = next(line for line in tables.splitlines() if "nebula, frozen" in line)
    cells = [cell.strip() for cell in row.strip(" │").split("│")]
    assert cells[-2:] == [f"{disk[own] / 1e6:.1f}", f"{disk[own] / changed:.2f}"]
    if fs_type(tmp_path) == "ext4":
        # One item: the frozen base is cloned by copy_file_range, which ext4 copies in the
        # kernel: it reaches the disk all the same, though the history counts it reused.
        assert disk["nebula"] >= 0.9 * state["state_bytes"]


def fs_type(path: Path) -> str:
    """The filesystem type of the mount that holds `path` (from /proc/mounts)."""
    best, kind, real = "", "unknown", str(path.resolve())
    with open("/proc/mounts") as f:
        for line in f:
            _dev, mount, fstype, *_ = line.split()
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def test_a_folder_whose_writes_are_not_counted_says_so(tmp_path: Path, shm_folder: Path) -> None:
    # tmpfs: /proc/self/io counts nothing written there; 0 would read as "no disk writes".
    work = shm_folder / "work"
    lora, tables = run_lora(
        tmp_path, 4, "nebula_own_item", "torch_save", memory=shm_folder, work=work
    )
    assert lora["disk_writes_counted"] is False
    for name in ("nebula_own_item", "torch_save"):
        fig = lora["methods"][name]
        assert fig["disk_bytes"] is None and fig["disk_vs_changed"] is None
        assert all(s["disk_bytes"] is None for s in fig["samples"])
    assert "not counted" in tables
    ratio = {(r["name"], r["method"]): r for r in lora["ratios"]}
    assert ratio["lora_disk_vs_changed", "nebula_own_item"]["pass"] is None


@pytest.mark.slow
def test_the_azurite_row_counts_what_the_client_uploads(tmp_path: Path) -> None:
    if azurite_server.binary() is None:
        pytest.skip(azurite_server.MISSING)
    lora, _tables = run_lora(tmp_path, 8, "nebula_azure")
    fig = lora["methods"]["nebula_azure"]
    assert fig["root"] == "azurite" and "unavailable" not in fig
    sample = fig["samples"][0]
    assert sample["tag"].startswith("global_step")
    # From the checkpoint's persistent rows: uploaded + staged from the older version.
    assert sample["bytes_written"] > 0
    assert sample["bytes_written"] + sample["bytes_reused"] == sample["size_bytes"]
    assert sample["size_bytes"] >= lora["state"]["state_bytes"]
    assert sample["copied_bytes"] < sample["size_bytes"]  # the save itself skipped the base
    ratio = {r["method"]: r for r in lora["ratios"]}["nebula_azure"]
    assert ratio["value"] == pytest.approx(sample["bytes_written"] / lora["state"]["changed_bytes"])
    assert "disk_bytes" not in fig  # Azurite's writes are its own process's
