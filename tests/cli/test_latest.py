"""`nebula latest`: the bare tag or path for scripts, --json, exit 3 when there is none."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import warm
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app


def _populate(root: Path, *, memory_only_newest: bool = True) -> None:
    nm.init(str(root), persistent_time_interval=3600)
    for step in (100, 200):
        ckpt = nm.Checkpoint(f"global_step{step}", 2)
        ckpt.save("model", {"w": torch.full((4,), float(step))})
        ckpt.save("optimizer", {"lr": 0.1})
        nm.flush_persistence()
    if memory_only_newest:
        nm.Checkpoint("global_step300").save("model", {"w": torch.full((4,), 300.0)})
    nm.Checkpoint("global_step400", -2).save("model", {"w": torch.ones(1)})  # never committed


def test_plain_output_is_exactly_the_newest_tag(root: Path) -> None:
    # Catches: Rich markup or wrapping in script output; memory-only or uncommitted tags
    # handled wrongly (300 is committed in memory, 400 never committed).
    _populate(root)
    result = CliRunner().invoke(app, ["latest", str(root)])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "global_step300\n"
    assert result.stderr == ""


def test_path_prefers_the_persistent_copy(root: Path) -> None:
    # Catches: printing the tag instead of the path, or a memory path when a durable one exists.
    _populate(root, memory_only_newest=False)
    result = CliRunner().invoke(app, ["latest", str(root), "--path", "optimizer"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"{root / 'global_step200' / 'optimizer'}\n"


def test_path_of_a_memory_only_checkpoint_is_its_memory_file(root: Path) -> None:
    _populate(root)
    out = CliRunner().invoke(app, ["latest", str(root), "--path", "model"]).stdout
    assert out == f"{Path(nm.memory_tier_path(str(root))) / 'global_step300' / 'model'}\n"
    assert torch.load(out.strip(), weights_only=True)["w"][0] == 300


def test_json_document(root: Path) -> None:
    _populate(root)
    result = CliRunner().invoke(app, ["latest", str(root), "--json", "--path", "model"])
    doc = json.loads(result.stdout)
    assert doc["root"] == str(root) and doc["tag"] == "global_step300" and doc["step"] == 300
    assert doc["tiers"] == ["memory"] and doc["item"] == "model"
    assert doc["path"].endswith("/global_step300/model")
    assert doc["committed_at"].endswith("Z") and isinstance(doc["size_bytes"], int)


def test_none_committed_is_exit_3(tmp_path: Path) -> None:
    # Catches: an empty line and exit 0, which `$(...)` would turn into a wrong path.
    result = CliRunner().invoke(app, ["latest", str(tmp_path)])
    assert result.exit_code == 3
    assert result.stdout == ""
    assert result.stderr == f"nebula: error: {tmp_path}: no committed checkpoint found\n"


def test_missing_root_and_missing_item_are_exit_3(root: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["latest", str(tmp_path / "nope")])
    assert (result.exit_code, result.stderr) == (
        3, f"nebula: error: {tmp_path / 'nope'}: no such checkpoint root\n",
    )  # fmt: skip
    _populate(root, memory_only_newest=False)
    result = CliRunner().invoke(app, ["latest", str(root), "--path", "optim"])
    assert result.exit_code == 3 and result.stdout == ""
    assert result.stderr == (
        "nebula: error: checkpoint 'global_step200' has no item 'optim'; "
        "its items: 'model', 'optimizer'; did you mean 'optimizer'?\n"
    )


@pytest.mark.slow
def test_a_real_shell_substitution_loads_the_latest_item(root: Path, memory_tier: Path) -> None:
    # Catches: anything on stdout besides the path (colour codes, a trailing table).
    _populate(root, memory_only_newest=False)
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier))
    exe = Path(sys.executable).parent / "nebula"
    script = (
        f'"{sys.executable}" -c "import sys, torch; '
        f"print(torch.load(sys.argv[1], weights_only=True)['w'][0].item())\" "
        f'"$("{exe}" latest "{root}" --path model)"'
    )
    out = warm.run(["bash", "-c", script], capture_output=True, text=True, env=env,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout == "200.0\n"
    missing = warm.run([exe, "latest", str(root / "nope")], capture_output=True, text=True,
                             env=env, timeout=60)  # fmt: skip
    assert missing.returncode == 3 and missing.stdout == ""
    assert missing.stderr.startswith("nebula: error: ") and "Traceback" not in missing.stderr
