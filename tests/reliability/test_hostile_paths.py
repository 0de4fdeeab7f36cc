"""Hostile tags, item names and manifest paths: refused before any I/O, and a sentinel
tree around the root is left exactly as it was."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app
from nebulaml.format.manifest import seal

HOSTILE = [
    "", ".", "..", "../x", "../../etc/passwd", "/etc/passwd", "/", "//", "a/b", "a/../b",
    "a\\b", "..\\x", "C:\\x", "nul\x00", "\x00", "new\nline", "cr\rhere", "tab\t",
    "\x1b[31mred", "\x7f", ".hidden", ".rank-0.json", ".writer-0.json", "x" * 256,
    "\u00e9" * 128, "\U0001f642" * 64, " lead", "trail ", "a/", "/a", "./a", "a/.",
    "...", "....//", "..%2f", "~/../x", "x/../../..", "\x00../x", "a\x85b\x01", "..\t",
]  # fmt: skip


def _tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def sentinel_root(tmp_path: Path) -> tuple[Path, Path]:
    sentinel = tmp_path / "sentinel"
    (sentinel / "etc").mkdir(parents=True)
    (sentinel / "etc" / "passwd").write_text("root:x:0:0\n")
    root = sentinel / "jobs" / "run1"
    nm.init(str(root), persistent_time_interval=0, keep_memory_tier=True)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(4)})
    nm.flush_persistence()
    return sentinel, root


def test_at_least_forty_hostile_names_are_refused_before_any_io(
    sentinel_root: tuple[Path, Path],
) -> None:
    sentinel, root = sentinel_root
    assert len(set(HOSTILE)) >= 40
    before = _tree_digest(sentinel)
    refused = 0
    for name in HOSTILE:
        for attempt in (
            lambda name=name: nm.Checkpoint(name),
            lambda name=name: nm.Checkpoint("global_step2", -2).save(name, {"x": 1}),
            lambda name=name: nm.get_checkpoint(name),
            lambda name=name: nm.get_latest_checkpoint_path(name),
            lambda name=name: nm.get_latest_checkpoint().load(name),
            lambda name=name: nm.flush_persistence(name),
        ):
            with pytest.raises(nm.InvalidNameError):
                attempt()
            refused += 1
        if name and "\x00" not in name:  # argv cannot carry NUL
            result = CliRunner().invoke(app, ["inspect", str(root), name])
            assert result.exit_code == 2, (name, result.output)
    assert refused == 6 * len(HOSTILE)
    assert _tree_digest(sentinel) == before


def _reseal(folder: Path, edit) -> None:
    path = folder / "manifest.json"
    doc = json.loads(path.read_text())
    doc.pop("checksum")
    edit(doc)
    path.write_bytes(seal(doc))


@pytest.mark.parametrize(
    "file", ["../../../etc/passwd", "/etc/passwd", "../global_step9/model", "a/b", ".rank-0.json"]
)
def test_a_manifest_listing_files_outside_its_folder_is_refused(
    sentinel_root: tuple[Path, Path], file: str
) -> None:
    sentinel, root = sentinel_root
    nm.shutdown()
    for base in (root, Path(nm.memory_tier_path(str(root)))):
        _reseal(base / "global_step1", lambda d: d["items"][0].update(file=file))
    before = _tree_digest(sentinel)
    assert nm.get_checkpoint("global_step1", str(root)) is None  # not a committed checkpoint
    results = nm.verify_checkpoints(str(root))
    assert results and all(r["status"] != "ok" for r in results)
    assert _tree_digest(sentinel) == before


@pytest.mark.parametrize("kind", ["symlink out of the root", "fifo"])
def test_an_item_that_is_a_symlink_or_a_fifo_is_never_read(
    sentinel_root: tuple[Path, Path], kind: str
) -> None:
    sentinel, root = sentinel_root
    handle = nm.get_latest_checkpoint()
    nm.shutdown()
    for base in (root, Path(nm.memory_tier_path(str(root)))):
        item = base / "global_step1" / "model"
        item.unlink()
        if kind == "fifo":
            os.mkfifo(item)  # reading it would block forever
        else:
            item.symlink_to(sentinel / "etc" / "passwd")
    with pytest.raises(nm.NebulaError):
        handle.load("model")
    assert nm.get_latest_checkpoint(str(root)) is None
    results = nm.verify_checkpoints(str(root))
    assert all(r["status"] != "ok" for r in results if r["item"] == "model")
    with pytest.raises(nm.NebulaError):
        nm.describe_item(str(root), "global_step1", "model")
