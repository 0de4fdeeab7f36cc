"""A persist writes what changed: the bytes of an item equal to its previous version's on
the persistent tier are taken from that version's file (protocol/reuse.py), and every
version stays a complete file that torch.load reads."""

from __future__ import annotations

import io
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from disk_writes import counted_in, write_bytes
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app
from nebulaml.format.checksum import BLOCK_BYTES, LEAF_BYTES, checksum_of
from nebulaml.format.manifest import ItemEntry, ItemReuse, RankMarker, parse_marker
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


def _session(root: Path, tag: str, items: dict[str, Any], retention: int = 5) -> None:
    """A session of its own, as a process after a restart has: `tag` saved with `items`,
    persisted, and the session ended."""
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=retention)
    ckpt = nm.Checkpoint(tag, num_of_files=len(items))
    for name, value in items.items():
        ckpt.save(name, value)
    assert nm.flush_persistence()
    nm.shutdown()


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
    # From the second on (the first version is hashed in blocks too): the changed bytes
    # and at most a block at each end.
    for row in rows[1:]:
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


def test_a_lora_layout_persists_its_adapters_alone_and_loads_whole(tmp_path: Path) -> None:
    # Catches: the records the layout moves (largest first, so that a LoRA model's small
    # records lie together after the frozen weights, from a piece) breaking what reads
    # the item after the memory tier (the persist's reuse, torch.load, verify), or sent
    # again every version.
    import zipfile

    root = tmp_path / "ckpt"
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=2)
    g = torch.Generator().manual_seed(5)
    model = {}
    for layer in range(2):  # bias and adapter, then the frozen weight: as PEFT orders them
        model[f"l{layer}.bias"] = torch.randn(1_000, generator=g)
        model[f"l{layer}.adapter"] = torch.randn(ADAPTER_ELEMENTS, generator=g)
        model[f"l{layer}.base"] = torch.randn(BASE_ELEMENTS, generator=g)
    saved = []
    for step in range(1, 5):
        if step > 1:
            for layer in range(2):
                model[f"l{layer}.adapter"].add_(1.0)
        nm.Checkpoint(f"global_step{step}").save("model", model)
        assert nm.flush_persistence()
        saved.append({k: v.clone() for k, v in model.items()})
    nm.shutdown()
    with zipfile.ZipFile(root / "global_step4" / "model") as archive:
        records = [i for i in archive.infolist() if "/data/" in i.filename]
        with open(root / "global_step4" / "model", "rb") as f:
            at = {}
            for info in records:
                f.seek(info.header_offset + 26)
                lengths = f.read(4)
                data_at = info.header_offset + 30 + int.from_bytes(lengths[:2], "little")
                at[info.filename] = data_at + int.from_bytes(lengths[2:], "little")
    bases = [i.filename for i in records if i.file_size == BASE_ELEMENTS * 4]
    small = sorted(at[i.filename] for i in records if i.filename not in bases)
    assert len(bases) == 2 and max(at[b] for b in bases) < small[0]  # the bases first
    assert small[0] % LEAF_BYTES == 0  # the small records from a piece of their own
    for row in _persist_rows(root)[1:]:
        assert row["bytes_written"] <= 2 * ADAPTER_ELEMENTS * 4 + 4 * BLOCK_BYTES, row
    for tag in ("global_step3", "global_step4"):
        loaded = torch.load(root / tag / "model", weights_only=True)
        expected = saved[int(tag.removeprefix("global_step")) - 1]
        assert list(loaded) == list(expected)
        assert all(torch.equal(loaded[k], expected[k]) for k in expected), tag
    report = nm.verify_checkpoints(str(root))
    assert report and all(r["status"] == "ok" for r in report), report


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
    # skip or overlap bytes, a first version whose blocks are not hashed (the next
    # persist writes its changed pieces whole).
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
        (0, LEAF_BYTES + 5 * BLOCK_BYTES, True),
        (LEAF_BYTES + 5 * BLOCK_BYTES, BLOCK_BYTES, False),
        (LEAF_BYTES + 6 * BLOCK_BYTES, 2 * LEAF_BYTES - 6 * BLOCK_BYTES + 1000, True),
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


def test_inspect_says_what_each_item_reused_and_from_which_tag(tmp_path: Path) -> None:
    # Catches: reuse not recorded at persist time, recorded against the wrong tag or item,
    # not shown by inspect (table or --json), or a marker written before the field (an
    # older nebula's) that inspect or verify can no longer read.
    root = tmp_path / "ckpt"
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=5)
    model = _model()
    ckpt = nm.Checkpoint("global_step1", 2)
    ckpt.save("model", model)
    ckpt.save("extra", {"step": torch.tensor(1)})
    assert nm.flush_persistence()
    model["adapter"].add_(1.0)
    ckpt = nm.Checkpoint("global_step2", 2)
    ckpt.save("model", model)
    ckpt.save("extra", {"step": torch.tensor(2)})
    assert nm.flush_persistence()
    nm.shutdown()
    last = _persist_rows(root)[-1]
    doc = nm.inspect_checkpoint(str(root), "global_step2")
    reused = doc["reused"]
    assert reused["model"]["from_tag"] == "global_step1"
    assert reused["model"]["bytes_reused"] > 19 << 20  # all but the adapter
    assert reused["extra"] == {"bytes_reused": 0, "from_tag": None}  # changed: written whole
    assert sum(r["bytes_reused"] for r in reused.values()) == last["bytes_reused"]
    assert nm.inspect_checkpoint(str(root), "global_step1")["reused"]["model"] == {
        "bytes_reused": 0,
        "from_tag": None,
    }
    runner = CliRunner()
    shown = runner.invoke(app, ["inspect", str(root), "global_step2"], env={"COLUMNS": "250"})
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert lines[lines.index("items") + 1].split()[-2:] == ["reused", "from"]
    model_row = next(x for x in lines if x.startswith("model ")).split()
    shown_mib = f"{reused['model']['bytes_reused'] / (1 << 20):.1f}"
    assert model_row[-3:] == [shown_mib, "MiB", "global_step1"], model_row
    as_json = runner.invoke(app, ["inspect", str(root), "global_step2", "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout)["reused"] == reused
    # A marker without the field (written before it) reads as nothing recorded.
    marker = root / "global_step2" / ".rank-0.json"
    old = json.loads(marker.read_text())
    del old["reused"]
    marker.write_text(json.dumps(old))
    assert nm.inspect_checkpoint(str(root), "global_step2")["reused"] == {}
    plain = runner.invoke(app, ["inspect", str(root), "global_step2"], env={"COLUMNS": "250"})
    assert plain.exit_code == 0, plain.output
    lines = plain.stdout.splitlines()
    assert lines[lines.index("items") + 1].split()[-1] == "checksum"
    report = nm.verify_checkpoints(str(root))
    assert report and all(r["status"] == "ok" for r in report), report


def test_a_malformed_reuse_record_is_refused_as_a_corrupt_marker() -> None:
    # Catches: a marker's reuse record trusted as it reads (an unsafe tag, a count that is
    # not one, an item of another rank).
    data = b"x" * 10
    marker = RankMarker("global_step2", 0, 1, "2026-01-01T00:00:00Z", (_entry(data),))
    good = json.loads(marker.to_bytes())
    assert "reused" not in good and parse_marker(marker.to_bytes(), "m").reused == ()
    for reused in (
        [{"file": "model", "bytes": 5, "from": "../x"}],
        [{"file": "model", "bytes": -1, "from": None}],
        [{"file": "model", "bytes": True, "from": None}],
        [{"file": "other", "bytes": 5, "from": None}],
        [{"file": "model", "bytes": 5}],
        {"model": 5},
    ):
        with pytest.raises(nm.ManifestError, match="reused"):
            parse_marker(json.dumps({**good, "reused": reused}).encode(), "m")
    ok = json.dumps({**good, "reused": [{"file": "model", "bytes": 5, "from": "global_step1"}]})
    assert parse_marker(ok.encode(), "m").reused == (ItemReuse("model", 5, "global_step1"),)


def test_a_plain_fsspec_store_writes_every_version_whole() -> None:
    # Catches: a store that cannot take ranges from an older file taken for one that can
    # (the reused ranges missing from the new file), or its persists counted as reusing.
    url = f"memory://reuse-{uuid.uuid4().hex[:12]}"  # fsspec's memory store is global
    try:
        nm.init(url, persistent_time_interval=0, num_of_version_in_retention=5)
        model = _model()
        nm.Checkpoint("global_step1").save("model", model)
        assert nm.flush_persistence()
        model["adapter"].add_(1.0)
        nm.Checkpoint("global_step2").save("model", model)
        assert nm.flush_persistence()
        nm.shutdown()
        rows = nm.read_history(url)
        rows = rows[rows["tier"] == "persistent"].to_dict("records")
        assert [r["tag"] for r in rows] == ["global_step1", "global_step2"]
        assert all(r["bytes_reused"] == 0 and r["bytes_written"] == r["size_bytes"] for r in rows)
        data = Store(url).read_bytes("global_step2", "model")
        loaded = torch.load(io.BytesIO(data), weights_only=True)
        assert all(torch.equal(loaded[k], model[k]) for k in model)
    finally:
        fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


@pytest.mark.parametrize("private", [True, False])
def test_an_item_unchanged_whole_is_a_link_and_costs_no_disk_writes(
    tmp_path: Path, private: bool
) -> None:
    # Catches: an unchanged item copied again (on ext4 copy_file_range copies in the
    # kernel: the bytes reach the disk), a link made to a file of another size or mode,
    # or a version that no longer loads once the one it links to is deleted.
    root = tmp_path / "ckpt"
    root.mkdir()
    counted = counted_in(root)
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=5, private=private)
    model = _model()
    base = {"base": model["base"], "head": model["head"]}  # frozen: its own item
    adapter = {"adapter": model["adapter"]}
    writes = []
    for step in range(1, 5):
        adapter["adapter"].add_(1.0)
        before = write_bytes()
        ckpt = nm.Checkpoint(f"global_step{step}", num_of_files=2)
        ckpt.save("base", base)
        ckpt.save("adapter", adapter)
        assert nm.flush_persistence()
        after = write_bytes()
        if before is not None and after is not None:
            writes.append(after - before)
    nm.shutdown()
    base_size = (root / "global_step1" / "base").stat().st_size
    if counted:  # the disk's own count: less than the frozen item, every checkpoint
        assert all(w < base_size // 2 for w in writes[1:]), (writes, base_size)
    inodes = {(root / f"global_step{s}" / "base").stat().st_ino for s in range(1, 5)}
    # The first version is written; the book knows its blocks from the second persist on.
    assert len(inodes) <= 2, inodes
    assert len({(root / f"global_step{s}" / "base").stat().st_ino for s in (2, 3, 4)}) == 1
    assert len({(root / f"global_step{s}" / "adapter").stat().st_ino for s in (3, 4)}) == 2
    if private:
        assert oct((root / "global_step4" / "base").stat().st_mode & 0o777) == oct(0o600)
    rows = [r for r in _persist_rows(root) if r["tag"] in ("global_step3", "global_step4")]
    assert all(r["bytes_reused"] >= base_size for r in rows), rows
    # Deleting the versions a link shares its file with leaves it whole.
    for tag in ("global_step1", "global_step2", "global_step3"):
        assert delete_checkpoint(Store(str(root)), tag)
    loaded = torch.load(root / "global_step4" / "base", weights_only=True)
    assert all(torch.equal(loaded[k], base[k]) for k in base)
    report = nm.verify_checkpoints(str(root))
    assert report and all(r["status"] == "ok" for r in report), report


def test_a_base_swapped_for_a_symlink_is_not_linked(tmp_path: Path) -> None:
    # Catches: a link made through (or to) a symbolic link planted where the previous
    # version's file was: the new version would name a file someone else controls.
    root = tmp_path / "ckpt"
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=5)
    base = {"base": _model()["base"]}
    for step in (1, 2):
        nm.Checkpoint(f"global_step{step}").save("base", base)
        assert nm.flush_persistence()
    planted = tmp_path / "planted"
    planted.write_bytes((root / "global_step2" / "base").read_bytes())
    (root / "global_step2" / "base").unlink()
    (root / "global_step2" / "base").symlink_to(planted)
    nm.Checkpoint("global_step3").save("base", base)
    assert nm.flush_persistence()
    nm.shutdown()
    made = root / "global_step3" / "base"
    assert made.is_file() and not made.is_symlink()
    assert made.stat().st_ino != planted.stat().st_ino
    assert made.lstat().st_nlink == 1
    loaded = torch.load(made, weights_only=True)
    assert torch.equal(loaded["base"], base["base"])


def test_a_restart_links_an_item_equal_to_its_newest_committed_version(tmp_path: Path) -> None:
    # Catches: the first persist of a process (whose book is empty) writing a frozen item
    # whole again after every restart, or linking one whose content changed meanwhile.
    root = tmp_path / "ckpt"
    base = {"base": _model()["base"]}
    adapter = {"adapter": torch.zeros(ADAPTER_ELEMENTS)}
    for step in (1, 2, 3):  # a process each: a session started afresh
        adapter["adapter"].add_(1.0)
        if step == 3:
            base["base"][0] += 1.0  # changed while the job was down: not equal
        _session(root, f"global_step{step}", {"base": base, "adapter": adapter})
    inode = {s: (root / f"global_step{s}" / "base").stat().st_ino for s in (1, 2, 3)}
    assert inode[1] == inode[2]  # the restart linked it
    assert inode[3] != inode[2]  # changed: written
    rows = {r["tag"]: r for r in _persist_rows(root)}
    assert rows["global_step2"]["bytes_reused"] >= BASE_ELEMENTS * 4
    assert rows["global_step3"]["bytes_reused"] == 0
    for step in (2, 3):
        loaded = torch.load(root / f"global_step{step}" / "base", weights_only=True)
        expected = _model()["base"]
        if step == 3:
            expected[0] += 1.0
        assert torch.equal(loaded["base"], expected)


def test_a_failed_lookup_of_the_newest_version_writes_the_item_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Catches: the restart's lookup (a listing and a manifest read of the tier) failing
    # the persist it only means to make cheaper.
    from nebulaml.protocol import reuse

    root = tmp_path / "ckpt"
    base = {"base": _model()["base"]}
    _session(root, "global_step1", {"base": base})

    def unreadable(*_args: object, **_kwargs: object) -> list[object]:
        raise nm.StorageError(f"{root}: the index could not be listed")

    monkeypatch.setattr(reuse, "newest", unreadable)
    _session(root, "global_step2", {"base": base})
    made = root / "global_step2" / "base"
    assert made.stat().st_ino != (root / "global_step1" / "base").stat().st_ino
    assert torch.equal(torch.load(made, weights_only=True)["base"], base["base"])


def _flip_a_byte(path: Path) -> None:
    """A write into the file in place, as a tool (or `dd conv=notrunc`) makes one: after
    a pause longer than the filesystem's clock tick, so that it changes the file's
    modification time (a write within the same few milliseconds as nebula's does not)."""
    time.sleep(0.05)
    with open(path, "r+b") as f:
        f.seek(1 << 20)
        byte = f.read(1)
        f.seek(1 << 20)
        f.write(bytes([byte[0] ^ 1]))


def test_a_file_written_in_place_since_its_persist_is_not_linked_or_cloned(
    tmp_path: Path,
) -> None:
    # Catches: a link (or clone) taken from a file that a tool wrote into after nebula
    # persisted it: the damage would carry into every later version of a frozen item.
    root = tmp_path / "ckpt"
    base = {"base": _model()["base"]}
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=5)
    nm.Checkpoint("global_step1").save("base", base)
    assert nm.flush_persistence()
    _flip_a_byte(root / "global_step1" / "base")
    nm.Checkpoint("global_step2").save("base", base)
    assert nm.flush_persistence()
    nm.shutdown()
    made = root / "global_step2" / "base"
    assert made.stat().st_ino != (root / "global_step1" / "base").stat().st_ino
    assert torch.equal(torch.load(made, weights_only=True)["base"], base["base"])
    rows = {r["tag"]: r for r in _persist_rows(root)}
    assert rows["global_step2"]["bytes_reused"] == 0
    report = {r["tag"]: r["status"] for r in nm.verify_checkpoints(str(root))}
    assert report == {"global_step1": "corrupt", "global_step2": "ok"}, report


def test_a_restart_never_links_a_file_damaged_since_its_commit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Catches: a restart's first persist linking a frozen item to the newest committed
    # version's file on the word of its manifest, while the file no longer matches it:
    # the correct copy in memory is not written, and retention then deletes the last good
    # version.
    root = tmp_path / "ckpt"
    base = {"base": _model()["base"]}
    _session(root, "global_step1", {"base": base}, retention=2)
    _flip_a_byte(root / "global_step1" / "base")
    _session(root, "global_step2", {"base": base}, retention=2)
    # global_step2 was written whole (its base was damaged), and its file is its own.
    assert (root / "global_step2" / "base").stat().st_nlink == 1
    _session(root, "global_step3", {"base": base}, retention=2)
    # global_step2 was good: the restart linked global_step3 to it (read, then linked).
    assert (root / "global_step3" / "base").stat().st_ino == (
        root / "global_step2" / "base"
    ).stat().st_ino
    _flip_a_byte(root / "global_step3" / "base")  # both names: one file
    with caplog.at_level("WARNING", logger="nebulaml"):
        _session(root, "global_step4", {"base": base}, retention=2)
    made = root / "global_step4" / "base"
    assert made.stat().st_ino != (root / "global_step3" / "base").stat().st_ino
    assert torch.equal(torch.load(made, weights_only=True)["base"], base["base"])
    assert any("does not match its manifest" in r.getMessage() for r in caplog.records)
    report = {r["tag"]: r["status"] for r in nm.verify_checkpoints(str(root))}
    assert report["global_step4"] == "ok", report


def test_a_copy_of_tags_in_turn_links_what_did_not_change_at_its_destination(
    tmp_path: Path,
) -> None:
    # Catches: `nebula copy` (ops.copy_checkpoint) of several tags writing a frozen item
    # once per tag, or linking a destination's file to the source's (the copy must be
    # its own files).
    root, dest = tmp_path / "ckpt", tmp_path / "backup"
    base = {"base": _model()["base"]}
    adapter = {"adapter": torch.zeros(ADAPTER_ELEMENTS)}
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=5)
    for step in (1, 2):
        adapter["adapter"].add_(1.0)
        ckpt = nm.Checkpoint(f"global_step{step}", num_of_files=2)
        ckpt.save("base", base)
        ckpt.save("adapter", adapter)
        assert nm.flush_persistence()
    nm.shutdown()
    for step in (1, 2):
        nm.ops.copy_checkpoint(str(root), f"global_step{step}", str(dest))
    copied = {s: (dest / f"global_step{s}" / "base").stat().st_ino for s in (1, 2)}
    assert copied[1] == copied[2]  # linked at the destination
    assert copied[1] not in {(root / f"global_step{s}" / "base").stat().st_ino for s in (1, 2)}
    assert (dest / "global_step2" / "adapter").stat().st_nlink == 1
    report = nm.verify_checkpoints(str(dest))
    assert report and all(r["status"] == "ok" for r in report), report


def test_a_memory_tier_never_shares_a_file(tmp_path: Path) -> None:
    # Catches: a link made in a memory tier, whose slot pool recycles an evicted
    # checkpoint's file and writes the next save into it in place: a checkpoint sharing
    # that file would change under its readers.
    data = os.urandom(3 << 20)
    for durable in (True, False):
        store = Store(str(tmp_path / f"durable-{durable}"), durable=durable)
        store.make_dir("t1")
        store.make_dir("t2")
        store.write_bytes(("t1", "model"), data)
        stamp = store.file_stamp("t1", "model")
        done = store.write_ranges(
            ("t2", "model"), memoryview(data), [(0, len(data), True)], ("t1", "model"),
            base_stamp=stamp,
        )  # fmt: skip
        assert done.reused == len(data)
        shared = (Path(store.root) / "t2" / "model").stat().st_nlink == 2
        assert shared == durable, durable
        assert (Path(store.root) / "t2" / "model").read_bytes() == data
