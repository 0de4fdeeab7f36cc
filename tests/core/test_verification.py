"""Verification: every copy on every tier re-read, and every kind of damage reported."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

import nebulaml as nm
from nebulaml.format.checksum import CHECKSUM_ALGO


def _populate(root: Path) -> tuple[Path, Path]:
    """global_step100 (persistent), global_step200 (memory and persistent); returns the
    memory and persistent folders of global_step200."""
    nm.init(str(root), persistent_time_interval=3600, num_of_version_in_retention=5)
    for step in (100, 200):
        ckpt = nm.Checkpoint(f"global_step{step}", 2)
        ckpt.save("model", {"w": torch.arange(1000, dtype=torch.float32) * step})
        ckpt.save("optimizer", {"lr": 0.1, "step": step})
        nm.flush_persistence()
    return Path(nm.memory_tier_path(str(root))) / "global_step200", root / "global_step200"


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _failures(results: list[dict]) -> list[dict]:
    return [r for r in results if r["status"] != "ok"]


def test_every_item_on_every_tier_is_checked_newest_first(root: Path) -> None:
    # Catches: a tier or a tag skipped, or one result per tag instead of per item and tier.
    _populate(root)
    results = nm.verify_checkpoints(str(root))
    assert [(r["tag"], r["tier"], r["item"]) for r in results] == [
        ("global_step200", "memory", "model"),
        ("global_step200", "memory", "optimizer"),
        ("global_step200", "persistent", "model"),
        ("global_step200", "persistent", "optimizer"),
        ("global_step100", "persistent", "model"),
        ("global_step100", "persistent", "optimizer"),
    ]
    assert {r["status"] for r in results} == {"ok"}
    manifest = json.loads((root / "global_step100" / "manifest.json").read_text())
    model = manifest["items"][0]
    assert (
        results[4]["expected"]
        == results[4]["actual"]
        == (f"{model['size_bytes']} bytes with {CHECKSUM_ALGO} {model['checksum']['value']}")
    )
    assert results[4]["file"] == str(root / "global_step100" / "model")


def test_a_bit_flip_in_the_memory_copy_names_exactly_that_copy(root: Path) -> None:
    # Catches: verifying only one tier (the one load would use), or trusting sizes alone.
    mem, _disk = _populate(root)
    _flip_byte(mem / "model")
    (bad,) = _failures(nm.verify_checkpoints(str(root)))
    manifest = json.loads((mem / "manifest.json").read_text())
    want = manifest["items"][0]
    assert (bad["tag"], bad["tier"], bad["item"], bad["status"]) == (
        "global_step200", "memory", "model", "corrupt",
    )  # fmt: skip
    assert bad["file"] == str(mem / "model")
    assert (
        bad["expected"]
        == f"{want['size_bytes']} bytes with {CHECKSUM_ALGO} {want['checksum']['value']}"
    )
    assert bad["actual"].startswith(f"{want['size_bytes']} bytes with {CHECKSUM_ALGO} ")
    assert bad["actual"] != bad["expected"]


def test_missing_and_wrong_size_items_are_failures_not_hidden(root: Path) -> None:
    # Catches: relying on catalog.read_committed, which silently drops such tags.
    _mem, disk = _populate(root)
    (disk / "optimizer").unlink()
    (root / "global_step100" / "model").write_bytes(b"short")
    assert [c["tag"] for c in nm.list_checkpoints(str(root))] == ["global_step200"]  # hidden
    failures = _failures(nm.verify_checkpoints(str(root)))
    assert [(f["tag"], f["tier"], f["item"], f["status"], f["actual"]) for f in failures] == [
        ("global_step200", "persistent", "optimizer", "missing", "no such file"),
        ("global_step100", "persistent", "model", "corrupt", "5 bytes"),
    ]


def test_an_unreadable_manifest_is_a_failure(root: Path) -> None:
    # Catches: a corrupt manifest making the tag invisible instead of failing verification.
    _populate(root)
    manifest = root / "global_step100" / "manifest.json"
    manifest.write_text('{"schema_version": 1, "tag": ')
    (bad,) = _failures(nm.verify_checkpoints(str(root), "global_step100"))
    assert (bad["tier"], bad["item"], bad["status"], bad["file"]) == (
        "persistent", None, "corrupt", str(manifest),
    )  # fmt: skip
    assert bad["actual"].startswith("manifest is not valid JSON")


def test_one_tag_only_and_not_found(root: Path, tmp_path: Path) -> None:
    # Catches: TAG ignored, or a missing TAG reported as "all fine".
    _populate(root)
    results = nm.verify_checkpoints(str(root), "global_step100")
    assert {r["tag"] for r in results} == {"global_step100"} and len(results) == 2
    with pytest.raises(nm.CheckpointNotFoundError, match="no checkpoint 'global_step7' found"):
        nm.verify_checkpoints(str(root), "global_step7")
    nm.Checkpoint("global_step300", -2).save("model", {"w": torch.ones(1)})  # never committed
    with pytest.raises(nm.CheckpointNotFoundError):
        nm.verify_checkpoints(str(root), "global_step300")
    assert "global_step300" not in {r["tag"] for r in nm.verify_checkpoints(str(root))}
    with pytest.raises(nm.RootNotFoundError):
        nm.verify_checkpoints(str(tmp_path / "nope"))


def test_progress_counts_every_byte_in_chunks(root: Path) -> None:
    # Catches: no progress, a wrong total, or a whole item read in one piece.
    nm.init(str(root), persistent_time_interval=3600)
    nm.Checkpoint("global_step1").save("model", {"w": torch.zeros(5_000_000)})  # 20 MB
    nm.flush_persistence()
    calls: list[tuple[int, int]] = []
    results = nm.verify_checkpoints(str(root), progress=lambda *call: calls.append(call))
    size = (root / "global_step1" / "model").stat().st_size
    assert [r["status"] for r in results] == ["ok", "ok"]
    assert calls[0] == (0, 2 * size) and calls[-1] == (2 * size, 2 * size)
    assert len(calls) >= 1 + 2 * 3  # 8 MiB chunks
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(calls))


@pytest.mark.parametrize("skipped", ["manifest.json", "model"])
def test_a_scan_that_skips_a_file_is_looked_at_again(
    root: Path, monkeypatch: pytest.MonkeyPatch, skipped: str
) -> None:
    # Catches: a committed checkpoint called corrupt ("not a regular file") or an item
    # called missing because one directory scan skipped it. A scan of a folder whose
    # entries change meanwhile (readers' leases come and go) may skip an entry that was
    # there all along; this happened in CI during the operators campaign.
    from nebulaml.storage.local import LocalBackend

    _populate(root)
    real = LocalBackend.list_files
    misses = {"left": 2}

    def skipping(self: LocalBackend, parts: tuple[str, ...]) -> dict[str, int]:
        files = real(self, parts)
        if parts == ("global_step200",) and skipped in files and misses["left"]:
            misses["left"] -= 1
            del files[skipped]
        return files

    monkeypatch.setattr(LocalBackend, "list_files", skipping)
    results = nm.verify_checkpoints(str(root), "global_step200")
    assert misses["left"] == 0  # the skipping scans did happen
    assert [(r["tier"], r["item"], r["status"]) for r in results] == [
        ("memory", "model", "ok"),
        ("memory", "optimizer", "ok"),
        ("persistent", "model", "ok"),
        ("persistent", "optimizer", "ok"),
    ]
    assert nm.inspect_checkpoint(str(root), "global_step200")["tiers"] == ["memory", "persistent"]
