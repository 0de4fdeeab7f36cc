"""`nebula ls`: committed checkpoints newest first, tiers, --all, --json, errors."""

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


def _populate(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=3600, num_of_version_in_retention=5)
    for step in (100, 200, 300):
        ckpt = nm.Checkpoint(f"global_step{step}", 2, labels=["best"] if step == 100 else [])
        ckpt.save("model", {"w": torch.ones(1000)})
        ckpt.save("optimizer", {"lr": 0.1})
        if step < 300:
            nm.flush_persistence()  # global_step300 stays in the memory tier only
    nm.Checkpoint("global_step400", -2).save("model", {"w": torch.ones(10)})  # never committed


def test_ls_json_lists_committed_newest_first_with_tiers(root: Path) -> None:
    _populate(root)
    result = CliRunner().invoke(app, ["ls", str(root), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["root"] == str(root)
    assert [(c["tag"], c["tiers"]) for c in doc["checkpoints"]] == [
        ("global_step300", ["memory"]),
        ("global_step200", ["persistent"]),
        ("global_step100", ["persistent"]),
    ]
    assert doc["checkpoints"][2]["labels"] == ["best"]
    assert doc["checkpoints"][0]["size_bytes"] > 4000
    assert "incomplete" not in doc


def test_ls_all_marks_incomplete_tags(root: Path) -> None:
    _populate(root)
    doc = json.loads(CliRunner().invoke(app, ["ls", str(root), "--all", "--json"]).stdout)
    (incomplete,) = doc["incomplete"]
    assert incomplete["tag"] == "global_step400" and incomplete["tier"] == "memory"
    assert incomplete["files"] == ["model"]
    assert incomplete["writers"][0]["pid"] == os.getpid()
    table = CliRunner().invoke(app, ["ls", str(root), "--all"]).stdout
    assert "global_step400" in table and "incomplete" in table
    assert table.index("global_step300") < table.index("global_step200")


def test_ls_table_as_a_real_command(root: Path, memory_tier: Path) -> None:
    _populate(root)
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier), COLUMNS="120")
    exe = Path(sys.executable).parent / "nebula"
    out = warm.run([exe, "ls", str(root)], capture_output=True, text=True, env=env,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    for tag in ("global_step100", "global_step200", "global_step300"):
        assert tag in out.stdout
    assert "global_step400" not in out.stdout
    assert "best" in out.stdout


def test_ls_missing_root_is_not_found(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["ls", str(tmp_path / "nope")])
    assert result.exit_code == 3
    assert result.stdout == ""
    assert result.stderr.strip() == f"nebula: error: {tmp_path / 'nope'}: no such checkpoint root"


def test_ls_empty_root_is_an_empty_list(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["ls", str(tmp_path), "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["checkpoints"] == []


def test_ls_of_an_empty_folder_says_so(tmp_path: Path) -> None:
    # main: a table header alone, as if the command had failed to read something.
    result = CliRunner().invoke(app, ["ls", str(tmp_path)])
    assert result.exit_code == 0 and result.stdout == ""
    assert result.stderr == f"No checkpoints under {tmp_path}\n"


def test_ls_of_a_checkpoint_folder_names_its_root(root: Path) -> None:
    # main: `nebula ls ROOT/global_step100` (a checkpoint folder taken for a root) printed
    # a header alone.
    _populate(root)
    result = CliRunner().invoke(app, ["ls", str(root / "global_step100")])
    assert result.exit_code == 0 and result.stdout == ""
    assert result.stderr == (
        f"{root / 'global_step100'} is a checkpoint folder, not a root: checkpoint "
        f"'global_step100' of the root {root} (nebula ls {root})\n"
    )


def test_ls_of_a_root_with_only_incomplete_checkpoints_points_to_all(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=3600)
    nm.Checkpoint("global_step1", 2).save("model", {"w": torch.ones(10)})  # 1 item of 2
    result = CliRunner().invoke(app, ["ls", str(root)])
    assert result.exit_code == 0 and result.stdout == ""
    assert result.stderr.startswith(f"No committed checkpoints under {root}; 1 incomplete")
    assert result.stderr.endswith(f": nebula ls --all {root}\n")
    listed = CliRunner().invoke(app, ["ls", str(root), "--all"])
    assert "global_step1" in listed.stdout and "incomplete" in listed.stdout


def test_every_reading_command_maps_a_bad_name_to_a_usage_error(root: Path) -> None:
    _populate(root)
    for args in (["inspect", str(root), "../x"], ["verify", str(root), "a/b"],
                 ["latest", str(root), "--path", "../model"]):  # fmt: skip
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert result.stderr.startswith("nebula: error: invalid ")
        assert result.stdout == ""


def test_strings_from_a_forged_manifest_never_reach_the_terminal_raw(tmp_path: Path) -> None:
    """A manifest someone else wrote (re-sealed: its checksum matches) whose labels and
    producer host carry escape sequences. Bug caught: `ls` and `inspect` printed them raw
    (the terminal cleared, text turned red)."""
    from nebulaml.format.manifest import seal

    root = tmp_path / "root"
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(2)})
    assert nm.flush_persistence() is True
    nm.shutdown()
    manifest = root / "global_step1" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc.pop("checksum")
    doc["labels"] = ["\x1b[2J\x1b[31mPWNED"]
    doc["producer"]["host"] = "evil\x1b]0;title\x07\u202e"
    manifest.write_bytes(seal(doc))
    runner = CliRunner()
    for args in (["ls", str(root)], ["inspect", str(root), "global_step1"]):
        done = runner.invoke(app, args, env={"COLUMNS": "200"})
        out = done.stdout + done.stderr
        assert done.exit_code == 0, out
        assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out, repr(out)
        assert "\\x1b[2J\\x1b[31mPWNED" in out or args[0] == "inspect", out
    shown = runner.invoke(app, ["inspect", str(root), "global_step1"], env={"COLUMNS": "200"})
    # (rich drops the bell itself; the escape and the bidi override are shown escaped)
    assert "evil\\x1b]0;title" in shown.stdout and "\\u202e" in shown.stdout, shown.stdout


# An az:// root with no credential: the Azure SDK's log stays out of the way --------------
def _no_credential_env(memory_tier: Path) -> dict[str, str]:
    """No Azure key, SAS or connection string; DefaultAzureCredential limited to the
    developer tools (none installed), and a managed identity endpoint, should one be
    tried, on a closed port here: nothing leaves this machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AZURE_", "NEBULA_"))}
    env.update(NEBULA_MEMORY_TIER_PATH=str(memory_tier), NEBULA_STORAGE_RETRIES="0",
               AZURE_TOKEN_CREDENTIALS="dev",
               AZURE_POD_IDENTITY_AUTHORITY_HOST="http://127.0.0.1:9")  # fmt: skip
    return env


@pytest.mark.parametrize("verbose", [False, True])
def test_an_azure_root_without_credentials_says_one_line(memory_tier: Path, verbose: bool) -> None:
    # main: a dozen lines of the SDK's log ("DefaultAzureCredential failed to retrieve a
    # token ... Attempted credentials: ...") came before nebula's one-line error.
    pytest.importorskip("adlfs")
    exe = Path(sys.executable).parent / "nebula"
    args = ["verify", "az://ckpt/run1", "--storage-option", "account_name=devstoreaccount1",
            "--storage-option", "account_url=https://127.0.0.1:9/devstoreaccount1",
            *(["--verbose"] if verbose else [])]  # fmt: skip
    out = warm.run([exe, *args], capture_output=True, text=True, timeout=60,
                         env=_no_credential_env(memory_tier))  # fmt: skip
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert lines[-1].startswith("nebula: error: az://ckpt/run1: ") and "credential" in lines[-1]
    if verbose:  # asked for: the SDK's own account of what it tried
        assert any("Attempted credentials" in line for line in lines[:-1]), out.stderr
    else:
        assert lines == lines[-1:], out.stderr
    ls = warm.run([exe, "ls", *args[1:6]], capture_output=True, text=True, timeout=60,
                        env=_no_credential_env(memory_tier))  # fmt: skip
    assert ls.returncode == 1 and len(ls.stderr.splitlines()) == 1, ls.stderr
