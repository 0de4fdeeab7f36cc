"""`nebula inspect`: the manifest, the items, the tensors of one item; errors and exit codes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import warm
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app


class _Canary:
    """Unpickling this runs a shell command that creates a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def _populate(root: Path) -> None:
    """global_step100 on both tiers, and no session left running: a session's threads
    would log to the stderr the CLI's output is checked on."""
    nm.init(str(root), persistent_time_interval=3600, keep_memory_tier=True)
    model = torch.nn.Linear(3, 2)
    ckpt = nm.Checkpoint("global_step100", 2, labels=["best"])
    ckpt.save("model", model)
    ckpt.save("optimizer", {"state": {0: {"step": torch.tensor(5.0)}}, "lr": 0.1})
    nm.flush_persistence()
    nm.shutdown()


def _manifest(root: Path, tag: str = "global_step100") -> dict[str, Any]:
    return json.loads((root / tag / "manifest.json").read_text())


def test_json_is_the_manifest_and_the_tiers(root: Path) -> None:
    # Catches: sizes or checksums that differ from manifest.json, or tiers left out.
    _populate(root)
    result = CliRunner().invoke(app, ["inspect", str(root), "global_step100", "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["manifest"] == _manifest(root)
    assert doc["root"] == str(root) and doc["tag"] == "global_step100"
    assert doc["tiers"] == ["memory", "persistent"]
    assert "entries" not in doc and result.stderr == ""


def test_item_json_lists_tensors_with_dtypes_shapes_and_bytes(root: Path) -> None:
    _populate(root)
    args = ["inspect", str(root), "global_step100", "--item", "model", "--json"]
    doc = json.loads(CliRunner().invoke(app, args).stdout)
    assert doc["item"] == _manifest(root)["items"][0]
    assert [(e["path"], e["dtype"], e["shape"], e["numel"], e["size_bytes"])
            for e in doc["entries"]] == [
        ("weight", "float32", [2, 3], 6, 24),
        ("bias", "float32", [2], 2, 8),
    ]  # fmt: skip


def test_table_shows_items_checksums_and_tensors(root: Path) -> None:
    _populate(root)
    env = {"COLUMNS": "200"}
    args = ["inspect", str(root), "global_step100", "--item", "optimizer"]
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0, result.stderr
    for item in _manifest(root)["items"]:
        assert item["name"] in result.stdout
        assert item["checksum"]["value"] in result.stdout
    assert "state.0.step" in result.stdout and "float32" in result.stdout
    assert "best" in result.stdout and "memory, persistent" in result.stdout


def test_not_found_is_exit_3(root: Path, tmp_path: Path) -> None:
    # Catches: tracebacks, or exit 1, for the three ways a name can be wrong.
    missing_root = CliRunner().invoke(app, ["inspect", str(tmp_path / "nope"), "global_step1"])
    assert (missing_root.exit_code, missing_root.stderr) == (
        3, f"nebula: error: {tmp_path / 'nope'}: no such checkpoint root\n",
    )  # fmt: skip
    _populate(root)
    missing_tag = CliRunner().invoke(app, ["inspect", str(root), "global_step7"])
    assert (missing_tag.exit_code, missing_tag.stderr) == (
        3, f"nebula: error: {root}: no checkpoint 'global_step7' found; did you mean "
        "'global_step100'?\n",
    )  # fmt: skip
    args = ["inspect", str(root), "global_step100", "--item", "optim"]
    missing_item = CliRunner().invoke(app, args)
    assert missing_item.exit_code == 3 and missing_item.stdout == ""
    assert "has no item 'optim'; its items: 'model', 'optimizer'" in missing_item.stderr


def test_corrupt_manifest_and_corrupt_item_are_exit_1_with_the_file(root: Path) -> None:
    # Catches: a corrupt manifest reported as "not found", a zip error as a traceback.
    _populate(root)
    memory = Path(nm.memory_tier_path(str(root))) / "global_step100"
    for folder in (memory, root / "global_step100"):
        (folder / "optimizer").write_bytes(b"garbage")
    args = ["inspect", str(root), "global_step100", "--item", "optimizer"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.startswith(
        f"nebula: error: {memory / 'optimizer'}: corrupt item, expected a torch zip archive"
    )
    assert result.stderr.count("\n") == 1
    for folder in (memory, root / "global_step100"):
        (folder / "manifest.json").write_text("[]")
    result = CliRunner().invoke(app, ["inspect", str(root), "global_step100"])
    assert (result.exit_code, result.stderr) == (
        1, f"nebula: error: {memory / 'manifest.json'}: manifest is not a JSON object\n",
    )  # fmt: skip


def test_a_damaged_copy_is_a_warning_when_another_is_good(root: Path) -> None:
    _populate(root)
    memory = Path(nm.memory_tier_path(str(root))) / "global_step100"
    (memory / "manifest.json").write_text("{")
    result = CliRunner().invoke(app, ["inspect", str(root), "global_step100", "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["tiers"] == ["persistent"]
    assert result.stderr.startswith("nebula: warning: memory copy: ")


def test_real_command_never_runs_the_pickle(root: Path, memory_tier: Path, tmp_path: Path) -> None:
    # Catches: the CLI reaching torch.load (or any unpickling that imports) on --item.
    canary = tmp_path / "canary"
    nm.init(str(root), persistent_time_interval=3600)
    nm.Checkpoint("global_step1").save("evil", {"w": torch.ones(3), "x": _Canary(canary)})
    nm.flush_persistence()
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier), COLUMNS="120")
    exe = Path(sys.executable).parent / "nebula"
    out = warm.run([exe, "inspect", str(root), "global_step1", "--item", "evil", "--json"],
                         capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    entries = {e["path"]: e for e in json.loads(out.stdout)["entries"]}
    assert entries["x"]["value"] == f"<object {os.system.__module__}.system (not loaded)>"
    assert entries["w"]["shape"] == [3]
    assert not canary.exists()
    table = warm.run([exe, "inspect", str(root), "global_step1", "--item", "evil"],
                           capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert table.returncode == 0 and "not loaded" in table.stdout and table.stderr == ""
    assert not canary.exists()
