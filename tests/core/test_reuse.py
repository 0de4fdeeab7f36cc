"""A persist writes what changed: the bytes of an item equal to its previous version's on
the persistent tier are taken from that version's file (protocol/reuse.py), and every
version stays a complete file that torch.load reads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app
from nebulaml.format.checksum import BLOCK_BYTES, LEAF_BYTES, checksum_of
from nebulaml.format.manifest import ItemEntry
from nebulaml.protocol.delete import delete_checkpoint
from nebulaml.protocol.history import FIRST_COLUMNS, HISTORY_FILE, append_rows, make_row
from nebulaml.protocol.reuse import ReuseBook, plan_item
from nebulaml.storage.store import Store

BASE_ELEMENTS = 4 << 20  # 16 MiB of float32: the frozen part
ADAPTER_ELEMENTS = 64 << 10  # 256 KiB: the part that trains


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "base": torch.randn(BASE_ELEMENTS, generator=g),
        "adapter": torch.randn(ADAPTER_ELEMENTS, generator=g),
        "head": torch.randn(BASE_ELEMENTS // 4, generator=g),
    }


def _persist_rows(root: Path) -> list[dict[str, object]]:
    df = nm.read_history(str(root))
    rows = df[(df["tier"] == "persistent") & (df["status"] == "ok")]
    return rows.to_dict("records")


def _entry(data: bytes) -> ItemEntry:
    return ItemEntry.written(
        "model", rank=0, size_bytes=len(data), checksum=checksum_of(data), tensor_bytes=0
    )


def test_unchanged_bytes_are_taken_from_the_previous_version(tmp_path: Path) -> None:
    # Catches: a persist that writes the frozen bytes again (bytes_written ~ the whole
    # item), a reused range taken from the wrong offset or version (a version that does
    # not load bit-identical), or reuse counted where nothing was reused.
    root = tmp_path / "ckpt"
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=3)
    model = _model()
    saved = []
    for step in range(1, 5):
        if step > 1:
            model["adapter"].add_(1.0)  # the trained part changes in place
        nm.Checkpoint(f"global_step{step}").save("model", model)
        assert nm.flush_persistence()
        saved.append({k: v.clone() for k, v in model.items()})
    nm.shutdown()
    rows = _persist_rows(root)
    assert [r["tag"] for r in rows] == [f"global_step{s}" for s in range(1, 5)]
    size = int(rows[0]["size_bytes"])
    adapter_bytes = ADAPTER_ELEMENTS * 4
    assert rows[0]["bytes_written"] == size and rows[0]["bytes_reused"] == 0
    # The second persist knows the first's pieces only: the adapter's pieces go whole.
    assert rows[1]["bytes_reused"] > size - 2 * LEAF_BYTES - adapter_bytes
    # From the third on, blocks: the changed bytes and at most a block at each end.
    for row in rows[2:]:
        assert row["bytes_written"] <= adapter_bytes + 2 * BLOCK_BYTES, row
        assert row["bytes_written"] + row["bytes_reused"] == size
    # Retention deleted the oldest; every remaining version is whole and right.
    kept = sorted(p.name for p in root.iterdir() if p.name.startswith("global_step"))
    assert kept == ["global_step2", "global_step3", "global_step4"]
    for tag in kept:
        loaded = torch.load(root / tag / "model", weights_only=True)
        expected = saved[int(tag.removeprefix("global_step")) - 1]
        assert loaded.keys() == expected.keys()
        assert all(torch.equal(loaded[k], expected[k]) for k in expected), tag
    report = nm.verify_checkpoints(str(root))
    assert report and all(r["status"] == "ok" for r in report), report
    history = nm.read_history(str(root))
    summary = nm.summarize_history(history)
    assert summary["bytes_reused"] == int(history["bytes_reused"].sum())
    assert sum(int(r["bytes_reused"]) for r in rows) > 3 * (16 << 20)
    shown = CliRunner().invoke(app, ["history", str(root)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "reused from earlier versions" in shown.stdout


def test_a_version_pruned_meanwhile_is_not_a_base(tmp_path: Path) -> None:
    # Catches: ranges cloned from a version that is no longer committed (an operator's
    # prune between two persists): the file is gone, or worse, another file in its place.
    root = tmp_path / "ckpt"
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=5)
    model = _model()
    nm.Checkpoint("global_step1").save("model", model)
    assert nm.flush_persistence()
    assert delete_checkpoint(Store(str(root)), "global_step1")  # as an operator's prune
    assert not (root / "global_step1").exists()
    model["adapter"].add_(1.0)
    nm.Checkpoint("global_step2").save("model", model)
    assert nm.flush_persistence()
    nm.shutdown()
    last = _persist_rows(root)[-1]
    assert last["tag"] == "global_step2"
    assert last["bytes_reused"] == 0 and last["bytes_written"] == last["size_bytes"]
    loaded = torch.load(root / "global_step2" / "model", weights_only=True)
    assert torch.equal(loaded["adapter"], model["adapter"])


def test_a_corrupt_memory_copy_is_refused_before_anything_is_written() -> None:
    # Catches: a plan that trusts the memory copy (a bit flipped in RAM reaches the disk).
    data = bytearray(os.urandom(3 * LEAF_BYTES))
    entry = _entry(bytes(data))
    data[LEAF_BYTES + 3] ^= 0xFF
    with pytest.raises(nm.CorruptCheckpointError, match="xxh3_64_tree_1m"):
        plan_item(memoryview(bytes(data)), "global_step2", entry, None)


def test_a_plan_reuses_exactly_the_equal_blocks() -> None:
    # Catches: block offsets computed within the piece but used in the file (or the other
    # way round), a last short block compared with the wrong length, merged ranges that
    # skip or overlap bytes.
    old = bytearray(os.urandom(3 * LEAF_BYTES + 1000))
    first = plan_item(memoryview(bytes(old)), "s1", _entry(bytes(old)), None)
    new = bytearray(old)
    new[LEAF_BYTES + 5 * BLOCK_BYTES + 7] ^= 1  # one block of piece 1
    second = plan_item(memoryview(bytes(new)), "s2", _entry(bytes(new)), first.version)
    newer = bytearray(new)
    newer[LEAF_BYTES + 9 * BLOCK_BYTES] ^= 1  # another block of piece 1
    newer[-1] ^= 1  # the short last block
    third = plan_item(memoryview(bytes(newer)), "s3", _entry(bytes(newer)), second.version)
    assert second.ranges == (
        (0, LEAF_BYTES, True),
        (LEAF_BYTES, LEAF_BYTES, False),
        (2 * LEAF_BYTES, LEAF_BYTES + 1000, True),
    )
    written = [(o, n) for o, n, reuse in third.ranges if not reuse]
    assert written == [
        (LEAF_BYTES + 9 * BLOCK_BYTES, BLOCK_BYTES),
        (3 * LEAF_BYTES, 1000),
    ]
    assert sum(n for _, n, _ in third.ranges) == len(newer)
    assert all(
        a[0] + a[1] == b[0] for a, b in zip(third.ranges[:-1], third.ranges[1:], strict=True)
    )


def test_the_book_refuses_a_base_whose_checksum_changed(tmp_path: Path) -> None:
    # Catches: a base taken on the book's word alone, though the tag was saved again
    # (overwrite) with other bytes: its ranges would be the wrong ones.
    root = tmp_path / "ckpt"
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("model", {"w": torch.zeros(1000)})
    assert nm.flush_persistence()
    nm.shutdown()
    store = Store(str(root))
    book = ReuseBook()
    data = (root / "global_step1" / "model").read_bytes()
    item = _entry(data)
    plan = plan_item(memoryview(data), "global_step1", item, None)
    book.remember(store, plan.version)
    assert book.base_for(store, "global_step2", item) is not None
    plan.version.checksum = "0" * 16  # the book's version is not the committed one
    assert book.base_for(store, "global_step2", item) is None
    plan.version.checksum = item.checksum
    assert book.base_for(store, "global_step1", item) is None  # the tag being written


def test_an_old_history_file_keeps_its_columns(tmp_path: Path) -> None:
    # Catches: new columns appended to a file whose header lacks them (its rows no longer
    # parse), or a reader that requires the new columns of an old file.
    (tmp_path / HISTORY_FILE).write_text(",".join(FIRST_COLUMNS) + "\n")
    row = make_row(
        tag="global_step1", step=1, tier="persistent", rank=0, started_at="2026-01-01T00:00:00Z",
        duration_s=1.0, blocking_s=0.0, size_bytes=100, bytes_written=10, bytes_reused=90,
    )  # fmt: skip
    append_rows(Store(str(tmp_path)), [row])
    lines = (tmp_path / HISTORY_FILE).read_text().splitlines()
    assert len(lines[1].split(",")) == len(FIRST_COLUMNS)
    df = nm.read_history(str(tmp_path))
    assert df["bytes_written"].tolist() == [100] and df["bytes_reused"].tolist() == [0]


def test_a_row_an_older_nebula_appended_reads_as_written_whole(tmp_path: Path) -> None:
    # Catches: a row without the last two fields (an older nebula appending to a newer
    # file) rejected as malformed, or read as having written nothing.
    append_rows(Store(str(tmp_path)), [make_row(
        tag="global_step1", step=1, tier="memory", rank=0, started_at="2026-01-01T00:00:00Z",
        duration_s=1.0, blocking_s=1.0, size_bytes=100,
    )])  # fmt: skip
    with open(tmp_path / HISTORY_FILE, "a", encoding="utf-8") as f:
        f.write("global_step2,2,persistent,0,2026-01-01T00:00:01Z,1,0,100,0.0,ok,\n")
    df = nm.read_history(str(tmp_path))
    assert df["bytes_written"].tolist() == [100, 100]
    assert df["bytes_reused"].tolist() == [0, 0]
