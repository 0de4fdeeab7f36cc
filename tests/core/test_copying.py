"""Copying on request: `nm.copy_checkpoint` and `nm.persist_memory_tier` on real roots.

Faults at the destination (a failed or corrupting write) are injected by a real fsspec
filesystem in tests/cli/test_copy.py, where the command's exit codes are checked too.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import torch

import nebulaml as nm
from nebulaml.protocol import cowriters
from nebulaml.protocol.catalog import read_committed
from nebulaml.protocol.delete import delete_checkpoint
from nebulaml.protocol.history import HISTORY_FILE
from nebulaml.protocol.transfer import copy_checkpoint as commit_copy
from nebulaml.runtime import session
from nebulaml.storage.store import Store

STATE = {"w": torch.arange(50_000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.float64)}


def populate(root: Path) -> None:
    """global_step1 on the persistent tier only; global_step2 in the memory tier only."""
    nm.init(str(root), persistent_time_interval=3600)
    ckpt = nm.Checkpoint("global_step1", 2)
    ckpt.save("model", STATE)
    ckpt.save("optimizer", {"lr": 0.5})
    nm.flush_persistence()  # the memory copy of global_step1 is evicted by global_step2
    ckpt = nm.Checkpoint("global_step2", 2)
    ckpt.save("model", STATE)
    ckpt.save("optimizer", {"lr": 0.25})
    live = session.live()
    assert live is not None
    live.persister.settle_eviction()  # global_step2's eviction of 1 runs on its own thread


def assert_loads(root: str, tag: str, lr: float) -> None:
    ckpt = nm.get_checkpoint(tag, root)
    assert ckpt is not None
    model = ckpt.load("model")
    assert model.keys() == STATE.keys()
    assert all(torch.equal(model[k], STATE[k]) and model[k].dtype == STATE[k].dtype for k in STATE)
    assert ckpt.load("optimizer") == {"lr": lr}


def test_copy_reports_and_commits_at_the_destination(root: Path, tmp_path: Path) -> None:
    populate(root)
    dest = tmp_path / "dest"
    calls: list[tuple[int, int]] = []
    report = nm.copy_checkpoint(
        str(root),
        "global_step1",
        str(dest),
        progress=lambda done, total: calls.append((done, total)),
    )
    total = report["total_bytes"]
    assert report["source_tier"] == "persistent" and report["source"] == str(root)
    assert report["destination"] == str(dest) and report["destination_tier"] is None
    assert report["copied_items"] == ["model", "optimizer"] and report["copied_bytes"] == total
    assert report["skipped_items"] == [] and report["skipped_bytes"] == 0
    assert report["unchanged"] is False
    # progress: never backwards, never past the total, and it ends at the total
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert all(t == total for _, t in calls) and calls[-1][0] == total
    assert_loads(str(dest), "global_step1", 0.5)
    assert not any(n.startswith(".writer-") for n in os.listdir(dest / "global_step1"))


def test_copy_latest_prefers_the_memory_tier(root: Path, tmp_path: Path) -> None:
    populate(root)
    report = nm.copy_checkpoint(str(root), None, str(tmp_path / "dest"))
    assert (report["tag"], report["source_tier"]) == ("global_step2", "memory")
    assert_loads(str(tmp_path / "dest"), "global_step2", 0.25)


def test_copy_between_the_roots_own_tiers(root: Path) -> None:
    populate(root)
    up = nm.copy_checkpoint(str(root), "global_step2", "persistent")
    assert (up["source_tier"], up["destination_tier"]) == ("memory", "persistent")
    down = nm.copy_checkpoint(str(root), "global_step1", "memory")
    assert (down["source_tier"], down["destination_tier"]) == ("persistent", "memory")
    tiers = {c["tag"]: c["tiers"] for c in nm.list_checkpoints(str(root))}
    both = ["memory", "persistent"]
    assert tiers == {"global_step2": both, "global_step1": both}


def test_an_identical_copy_is_a_no_op(root: Path, tmp_path: Path) -> None:
    populate(root)
    dest = tmp_path / "dest"
    nm.copy_checkpoint(str(root), "global_step1", str(dest))
    before = {p.name: p.stat().st_mtime_ns for p in (dest / "global_step1").iterdir()}
    again = nm.copy_checkpoint(str(root), "global_step1", str(dest))
    assert again["unchanged"] is True and again["copied_bytes"] == 0
    assert {p.name: p.stat().st_mtime_ns for p in (dest / "global_step1").iterdir()} == before


def test_a_different_committed_copy_is_refused_unless_overwrite(root: Path, tmp_path: Path) -> None:
    populate(root)
    dest = tmp_path / "dest"
    nm.copy_checkpoint(str(root), "global_step1", str(dest))
    nm.Checkpoint("global_step1", overwrite=True).save("model", {"other": 1})  # memory tier
    with pytest.raises(nm.CheckpointExistsError, match="nebula copy --overwrite"):
        nm.copy_checkpoint(str(root), "global_step1", str(dest))
    assert_loads(str(dest), "global_step1", 0.5)  # untouched
    report = nm.copy_checkpoint(str(root), "global_step1", str(dest), overwrite=True)
    assert report["source_tier"] == "memory" and report["copied_items"] == ["model"]
    assert nm.get_checkpoint("global_step1", str(dest)).load("model") == {"other": 1}


def test_commit_copy_without_overwrite_never_replaces(root: Path, tmp_path: Path) -> None:
    """The bug this fixes: commit.copy_checkpoint(overwrite=False) silently replaced a
    different committed checkpoint at the destination."""
    populate(root)
    dest = Store(str(tmp_path / "dest"))
    nm.copy_checkpoint(str(root), "global_step1", dest.url)
    nm.Checkpoint("global_step1", overwrite=True).save("model", {"other": 1})
    src = read_committed(Store(nm.memory_tier_path(str(root))), "global_step1")
    assert src is not None
    with pytest.raises(nm.CheckpointExistsError):
        commit_copy(src, dest)
    assert read_committed(dest, "global_step1").manifest.item("optimizer") is not None


def test_resume_keeps_verified_items_and_rewrites_the_rest(root: Path, tmp_path: Path) -> None:
    populate(root)
    dest = tmp_path / "dest"
    nm.copy_checkpoint(str(root), "global_step1", str(dest))
    folder = dest / "global_step1"
    (folder / "manifest.json").unlink()  # as if interrupted just before the commit
    good = (folder / "model").stat()
    data = bytearray((folder / "optimizer").read_bytes())
    data[-1] ^= 0xFF  # same size, wrong bytes: must be rewritten, not trusted
    (folder / "optimizer").write_bytes(bytes(data))
    (folder / "stray").write_bytes(b"not an item of this checkpoint")
    report = nm.copy_checkpoint(str(root), "global_step1", str(dest))
    assert report["skipped_items"] == ["model"] and report["copied_items"] == ["optimizer"]
    assert report["skipped_bytes"] == good.st_size
    after = (folder / "model").stat()
    assert (after.st_ino, after.st_mtime_ns) == (good.st_ino, good.st_mtime_ns)
    assert not (folder / "stray").exists()
    assert_loads(str(dest), "global_step1", 0.5)


def test_resume_waits_for_a_live_writer_then_refuses_its_folder(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cowriters, "BUSY_WAIT_S", 0.5)
    populate(root)
    folder = tmp_path / "dest" / "global_step1"
    folder.mkdir(parents=True)
    (folder / "model").write_bytes(b"being written")
    parent = os.getppid()  # alive, on this host, and not us
    doc = f'{{"host": "{socket.gethostname()}", "pid": {parent}, "rank": 0, "started_at": "x"}}'
    (folder / ".writer-0.json").write_text(doc)
    t0 = time.monotonic()
    with pytest.raises(nm.CheckpointBusyError, match=f"pid {parent}"):
        nm.copy_checkpoint(str(root), "global_step1", str(tmp_path / "dest"))
    assert 0.5 <= time.monotonic() - t0 < 30  # it waited for the writer, then gave up
    assert "waiting for it" in caplog.text
    assert (folder / "model").read_bytes() == b"being written"


def test_a_corrupt_source_is_not_committed(root: Path, tmp_path: Path) -> None:
    populate(root)
    item = root / "global_step1" / "model"
    data = bytearray(item.read_bytes())
    data[len(data) // 2] ^= 0xFF
    item.write_bytes(bytes(data))
    with pytest.raises(nm.CorruptCheckpointError, match="corrupt item"):
        nm.copy_checkpoint(str(root), "global_step1", str(tmp_path / "dest"))
    assert nm.list_checkpoints(str(tmp_path / "dest")) == []


def test_copy_errors(root: Path, tmp_path: Path) -> None:
    with pytest.raises(nm.RootNotFoundError):
        nm.copy_checkpoint(str(tmp_path / "nope"), "global_step1", str(tmp_path / "d"))
    populate(root)
    with pytest.raises(nm.CheckpointNotFoundError, match="global_step7"):
        nm.copy_checkpoint(str(root), "global_step7", str(tmp_path / "d"))
    with pytest.raises(nm.InvalidNameError):
        nm.copy_checkpoint(str(root), "../x", str(tmp_path / "d"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(nm.CheckpointNotFoundError, match="no committed checkpoint"):
        nm.copy_checkpoint(str(empty), None, str(tmp_path / "d"))


# persist_memory_tier ------------------------------------------------------------------------------
def test_persist_memory_tier_persists_only_what_is_newer(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEBULA_KEEP_MEMORY_TIER", "1")  # the memory tier outlives the job
    populate(root)
    nm.shutdown()  # persists global_step2 at close, as a clean exit does
    assert nm.persist_memory_tier(str(root)) == []
    delete_checkpoint(Store(str(root)), "global_step2")  # the persist was lost
    rows_before = (root / HISTORY_FILE).read_text().count("\n")
    assert nm.persist_memory_tier(str(root)) == ["global_step2"]
    assert_loads(str(root), "global_step2", 0.25)
    rows = (root / HISTORY_FILE).read_text().splitlines()
    assert len(rows) == rows_before + 1 and rows[-1].startswith("global_step2,2,persistent,")
    assert nm.persist_memory_tier(str(root)) == []


def test_persist_memory_tier_errors(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(nm.RootNotFoundError):
        nm.persist_memory_tier(str(tmp_path / "nope"))
    monkeypatch.setenv("NEBULA_KEEP_MEMORY_TIER", "1")  # the memory tier outlives the job
    populate(root)
    nm.shutdown()
    delete_checkpoint(Store(str(root)), "global_step2")
    (root / "global_step2").write_text("a file where the tag folder goes")
    with pytest.raises(nm.StorageError):
        nm.persist_memory_tier(str(root))
    rows = (root / HISTORY_FILE).read_text().splitlines()
    assert rows[-1].startswith("global_step2,2,persistent,") and ",failed," in rows[-1]


def test_persist_memory_tier_takes_the_newest_of_several(root: Path) -> None:
    # catches: persisting the memory tier's oldest (or any) checkpoint instead of its newest
    populate(root)
    nm.copy_checkpoint(str(root), "global_step1", "memory")  # the memory tier holds 1 and 2
    assert nm.persist_memory_tier(str(root)) == ["global_step2"]
    assert_loads(str(root), "global_step2", 0.25)
