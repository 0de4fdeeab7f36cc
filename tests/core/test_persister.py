"""The background persister: interval, retention on both tiers, and the history file."""

from __future__ import annotations

import csv
import time
import uuid
from pathlib import Path

import pytest
import torch

import nebulaml as nm
from nebulaml.protocol.catalog import list_committed, read_committed
from nebulaml.protocol.history import COLUMNS
from nebulaml.runtime.session import current
from nebulaml.storage.store import Store


def _tags(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if (p / "manifest.json").exists())


def _memory_tags() -> list[str]:
    """The memory tier's checkpoints once the last commit's eviction (on its own thread)
    has run."""
    current("test").persister.settle_eviction()
    return [info.tag for info in list_committed(current("test").tiers.memory)]


def test_interval_skips_superseded_checkpoints(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=3600, num_of_version_in_retention=10)
    nm.Checkpoint("global_step1").save("m", {"v": 1})
    nm.flush_persistence()  # the first persist is never held back; wait for it
    nm.Checkpoint("global_step2").save("m", {"v": 2})
    nm.Checkpoint("global_step3").save("m", {"v": 3})
    assert _tags(root) == ["global_step1"]  # 2 and 3 wait for the interval
    nm.flush_persistence()
    # global_step2 was superseded before its turn: never persisted, and gone from memory.
    assert _tags(root) == ["global_step1", "global_step3"]
    assert _memory_tags() == ["global_step3"]
    assert nm.get_checkpoint("global_step2") is None


def test_pending_checkpoint_is_persisted_when_the_interval_elapses(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0.3)
    nm.Checkpoint("global_step1").save("m", {"v": 1})
    nm.Checkpoint("global_step2").save("m", {"v": 2})
    deadline = time.monotonic() + 10
    while "global_step2" not in _tags(root) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "global_step2" in _tags(root)
    assert torch.load(root / "global_step2" / "m", weights_only=True) == {"v": 2}


def test_flush_of_a_named_older_tag(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=3600)
    nm.Checkpoint("global_step1").save("m", {"v": 1})
    nm.flush_persistence()
    nm.Checkpoint("global_step2").save("m", {"v": 2})
    nm.flush_persistence("global_step2")
    assert _tags(root) == ["global_step1", "global_step2"]
    assert nm.flush_persistence("global_step2") is True  # already durable: no-op


def test_persistent_retention_keeps_newest_n_and_labelled(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=2)
    for step in range(1, 7):
        labels = ["best"] if step == 2 else []
        nm.Checkpoint(f"global_step{step}", labels=labels).save("m", {"v": step})
        nm.flush_persistence()
    assert _tags(root) == ["global_step2", "global_step5", "global_step6"]
    assert nm.get_checkpoint("global_step2").load("m") == {"v": 2}
    # Deleted versions leave nothing behind: no folder, no stray files.
    assert sorted(
        p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
    ) == _tags(root)


def test_memory_tier_keeps_only_the_newest_once_persisted(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=5)
    for step in range(1, 5):
        nm.Checkpoint(f"global_step{step}").save("m", {"v": step})
        nm.flush_persistence()
    assert _memory_tags() == ["global_step4"]
    assert _tags(root) == [f"global_step{s}" for s in range(1, 5)]
    listed = {c["tag"]: c["tiers"] for c in nm.list_checkpoints()}
    assert listed["global_step4"] == ["memory", "persistent"]
    assert listed["global_step1"] == ["persistent"]


def test_memory_only_retention(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    nm.init(num_of_version_in_retention=2)
    for step in range(1, 5):
        nm.Checkpoint(f"global_step{step}").save("m", {"v": step})
    # The job's own listing, right after its save, sees what retention keeps.
    assert [c["tag"] for c in nm.list_checkpoints()] == ["global_step4", "global_step3"]
    assert _memory_tags() == ["global_step3", "global_step4"]


def test_history_has_a_row_per_save_and_per_persist(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0)
    for step in (1, 2):
        ckpt = nm.Checkpoint(f"global_step{step}", 2)
        ckpt.save("model", {"w": torch.zeros(1000)})
        ckpt.save("optimizer", {"s": torch.zeros(10)})
        nm.flush_persistence()
    with open(root / "checkpointHistories.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0].keys()) == COLUMNS
    assert sorted((r["tag"], r["tier"]) for r in rows) == [
        ("global_step1", "memory"),
        ("global_step1", "persistent"),
        ("global_step2", "memory"),
        ("global_step2", "persistent"),
    ]
    sizes = {
        "global_step1": sum(
            p.stat().st_size
            for p in (root / "global_step1").iterdir()
            if not p.name.startswith((".", "manifest"))
        ),
    }
    for row in rows:
        assert row["status"] == "ok" and row["error"] == ""
        assert float(row["duration_s"]) > 0
        assert float(row["throughput_mb_s"]) > 0
        assert row["step"] == row["tag"].removeprefix("global_step")
        assert row["started_at"].endswith("Z")
        if row["tier"] == "persistent":
            assert float(row["blocking_s"]) == 0.0
        else:
            assert 0 < float(row["blocking_s"]) <= float(row["duration_s"]) + 1e-3
    step1 = [r for r in rows if r["tag"] == "global_step1"]
    assert {int(r["size_bytes"]) for r in step1} == {sizes["global_step1"]}


def test_tags_without_steps_order_by_commit_time(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=5)
    for tag in ("warmup", "alpha", "middle"):
        nm.Checkpoint(tag).save("m", {"t": tag})
        nm.flush_persistence()
    assert nm.get_latest_checkpoint().tag == "middle"
    nm.Checkpoint("global_step1").save("m", {"t": 1})
    assert nm.get_latest_checkpoint().tag == "global_step1"  # a step beats no step


def test_history_header_is_written_once_by_racing_writers(tmp_path: Path) -> None:
    import threading

    from nebulaml.protocol.history import HISTORY_FILE, append_rows, make_row
    from nebulaml.storage.store import Store

    store = Store(tmp_path / "root")
    row = make_row(tag="global_step1", step=1, tier="memory", rank=0, started_at="t",
                   duration_s=1.0, blocking_s=1.0, size_bytes=10)  # fmt: skip
    barrier = threading.Barrier(8)

    def append() -> None:
        barrier.wait()
        append_rows(store, [row])

    threads = [threading.Thread(target=append) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = (tmp_path / "root" / HISTORY_FILE).read_text().splitlines()
    assert lines[0] == ",".join(COLUMNS)
    assert len(lines) == 9 and lines.count(lines[0]) == 1


def test_a_failed_row_has_no_throughput() -> None:
    from nebulaml.protocol.history import make_row

    row = make_row(
        tag="t",
        step=None,
        tier="persistent",
        rank=0,
        started_at="t",
        duration_s=0.5,
        blocking_s=0.0,
        size_bytes=10**6,
        error=OSError("disk"),
    )
    assert row.status == "failed" and row.throughput_mb_s == 0.0 and row.error == "disk"


def test_flush_of_a_tag_resaved_with_overwrite_persists_the_new_version(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=3600)
    nm.Checkpoint("global_step1").save("model", {"v": 1})
    nm.flush_persistence()
    nm.Checkpoint("global_step1", overwrite=True).save("model", {"v": 2})
    nm.flush_persistence("global_step1")
    assert torch.load(root / "global_step1" / "model", weights_only=True) == {"v": 2}


@pytest.mark.slow
def test_resaving_a_tag_while_it_is_being_persisted_never_loses_it(root: Path) -> None:
    # Lightning saves last.ckpt again and again: every overwrite races the persister.
    nm.init(str(root), persistent_time_interval=0)
    for i in range(60):
        ckpt = nm.Checkpoint("last", overwrite=True)
        ckpt.save("checkpoint", {"w": torch.full((1 << 16,), float(i))})
    nm.flush_persistence()
    (listed,) = nm.list_checkpoints()
    assert listed["tag"] == "last" and "persistent" in listed["tiers"]
    assert float(torch.load(root / "last" / "checkpoint", weights_only=True)["w"][0]) == 59.0


def test_a_background_failure_is_raised_by_the_next_call_not_by_a_commit(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    # The opt-in contract: by default a failed persist is tried again (test_outage.py).
    nm.init(str(root), persistent_time_interval=0, on_persist_error="raise")
    (root / "global_step1").write_text("a file where the tag's folder must go")
    ckpt = nm.Checkpoint("global_step2", -2)
    ckpt.save("m", {"v": 2})  # items written; the commit comes after the failure below
    nm.Checkpoint("global_step1").save("m", {"v": 1})  # its persist fails in the background
    persister = current("test", raise_pending=False).persister
    deadline = time.monotonic() + 30
    while persister.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert persister.error is not None
    assert ckpt.commit() is True  # committed: the failure is not this checkpoint's
    with pytest.raises(nm.PersistError, match="global_step1"):
        nm.flush_persistence()  # the next call says so
    assert nm.get_latest_checkpoint().tag == "global_step2"
    assert nm.get_latest_checkpoint().load("m") == {"v": 2}


def test_a_corrupt_memory_copy_is_never_persisted_to_an_fsspec_root() -> None:
    # Catches: copy_item's check after writing on the fsspec path (a store that does not
    # clone: memory://, S3, GCS) left out; a bit flipped in RAM after the save was
    # persisted and the checkpoint reported durable on the persistent tier.
    url = f"memory://persister-{uuid.uuid4().hex[:12]}/root"  # fsspec's memory store is global
    nm.init(url, persistent_time_interval=3600)
    nm.Checkpoint("global_step1").save("model", {"w": torch.arange(10_000, dtype=torch.float32)})
    item = Path(nm.memory_tier_path(url)) / "global_step1" / "model"
    with item.open("r+b") as f:  # one bit of the memory copy flips after the commit
        f.seek(item.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x10]))
    with pytest.raises(nm.PersistError, match="corrupt item"):
        nm.flush_persistence()
    assert read_committed(Store(url), "global_step1") is None  # never committed there
    assert nm.persistence_status().durable is None
    assert [c["tiers"] for c in nm.list_checkpoints(url)] == [["memory"]]
