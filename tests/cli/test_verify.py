"""`nebula verify`: every copy checked, failures named on stderr, exit codes, progress."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import warm
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app
from nebulaml.format.checksum import CHECKSUM_ALGO


def _populate(root: Path) -> Path:
    """global_step100 (persistent) and global_step200 (memory and persistent); returns the
    memory-tier folder of global_step200."""
    nm.init(str(root), persistent_time_interval=3600, num_of_version_in_retention=5)
    for step in (100, 200):
        ckpt = nm.Checkpoint(f"global_step{step}", 2)
        ckpt.save("model", {"w": torch.arange(500, dtype=torch.float32) + step})
        ckpt.save("optimizer", {"lr": 0.1, "step": step})  # each its own file
        nm.flush_persistence()
    return Path(nm.memory_tier_path(str(root))) / "global_step200"


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _item(root: Path, tag: str, name: str) -> dict[str, Any]:
    manifest = json.loads((root / tag / "manifest.json").read_text())
    return next(i for i in manifest["items"] if i["name"] == name)


def test_all_good_is_exit_0_with_one_json_document(root: Path) -> None:
    _populate(root)
    result = CliRunner().invoke(app, ["verify", str(root), "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["root"] == str(root) and doc["ok"] is True
    assert [(r["tag"], r["tier"]) for r in doc["results"]][::2] == [
        ("global_step200", "memory"), ("global_step200", "persistent"),
        ("global_step100", "persistent"),
    ]  # fmt: skip
    assert result.stderr == ""


def test_bit_flip_in_the_memory_copy_only(root: Path) -> None:
    # Catches: checking only the copy `load` would read; a failure without file/expected/actual.
    memory = _populate(root)
    _flip_byte(memory / "model")
    result = CliRunner().invoke(app, ["verify", str(root), "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["ok"] is False
    (bad,) = [r for r in doc["results"] if r["status"] != "ok"]
    assert (bad["tier"], bad["tag"], bad["item"]) == ("memory", "global_step200", "model")
    want = _item(root, "global_step200", "model")
    # Typed, not prose: the manifest's size and checksum, and what was found.
    assert bad["expected"] == {
        "size_bytes": want["size_bytes"],
        "algo": CHECKSUM_ALGO,
        "checksum": want["checksum"]["value"],
    }
    assert bad["actual"]["size_bytes"] == want["size_bytes"]
    assert bad["actual"]["algo"] == CHECKSUM_ALGO
    assert bad["actual"]["checksum"] != want["checksum"]["value"]
    expected = f"{want['size_bytes']} bytes with {CHECKSUM_ALGO} {want['checksum']['value']}"
    found = f"{want['size_bytes']} bytes with {CHECKSUM_ALGO} {bad['actual']['checksum']}"
    assert bad["detail"] == f"expected {expected}, found {found}"
    assert (
        result.stderr == f"nebula: error: {memory / 'model'}: expected {expected}, found {found}\n"
    )


def test_one_tag_and_exit_3_when_it_or_the_root_does_not_exist(root: Path, tmp_path: Path) -> None:
    _populate(root)
    _flip_byte(root / "global_step200" / "optimizer")
    result = CliRunner().invoke(app, ["verify", str(root), "global_step100", "--json"])
    assert result.exit_code == 0  # the damage is in another tag
    assert {r["tag"] for r in json.loads(result.stdout)["results"]} == {"global_step100"}
    result = CliRunner().invoke(app, ["verify", str(root), "global_step9"])
    assert (result.exit_code, result.stdout) == (3, "")
    assert result.stderr == (
        f"nebula: error: {root}: no checkpoint 'global_step9' found; "
        "did you mean 'global_step200' or 'global_step100'?\n"
    )
    result = CliRunner().invoke(app, ["verify", str(tmp_path / "nope")])
    assert (result.exit_code, result.stderr) == (
        3, f"nebula: error: {tmp_path / 'nope'}: no such checkpoint root\n",
    )  # fmt: skip


def test_corrupt_manifest_and_missing_item_fail_naming_the_files(root: Path) -> None:
    # Catches: tags that `ls` hides (bad manifest, missing file) passing verification.
    _populate(root)
    manifest = root / "global_step100" / "manifest.json"
    manifest.write_text("{")
    (root / "global_step200" / "optimizer").unlink()
    result = CliRunner().invoke(app, ["verify", str(root)], env={"COLUMNS": "200"})
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    want = _item(root, "global_step200", "optimizer")
    assert lines[0] == (
        f"nebula: error: {root / 'global_step200' / 'optimizer'}: expected "
        f"{want['size_bytes']} bytes with {CHECKSUM_ALGO} {want['checksum']['value']}, "
        "found no such file"
    )
    assert lines[1].startswith(f"nebula: error: {manifest}: expected a valid manifest, found "
                               "manifest is not valid JSON")  # fmt: skip
    assert lines[2:] == ["verified 2 checkpoint(s), 5 result(s): 2 failed"]
    assert "missing" in result.stdout and "corrupt" in result.stdout  # the table


def test_empty_root_has_nothing_to_verify(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["verify", str(tmp_path), "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"root": str(tmp_path), "ok": True, "results": []}


def test_real_command_table_and_exit_1(root: Path, memory_tier: Path) -> None:
    memory = _populate(root)
    _flip_byte(memory / "optimizer")
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier), COLUMNS="200")
    exe = Path(sys.executable).parent / "nebula"
    out = warm.run([exe, "verify", str(root)], capture_output=True, text=True, env=env,
                         timeout=60)  # fmt: skip
    assert out.returncode == 1
    assert out.stdout.count(" ok ") == 5 and out.stdout.count("corrupt") == 1
    assert out.stderr.startswith(f"nebula: error: {memory / 'optimizer'}: expected ")
    assert "Traceback" not in out.stderr


def test_progress_goes_to_a_terminal_stderr_never_to_stdout(root: Path, memory_tier: Path) -> None:
    # Catches: a progress bar (or its escape codes) written into the JSON on stdout.
    nm.init(str(root), persistent_time_interval=3600)
    nm.Checkpoint("global_step1").save("model", {"w": torch.zeros(4_000_000)})
    nm.flush_persistence()
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier), COLUMNS="100", TERM="xterm")
    env.pop("NO_COLOR", None)
    exe = Path(sys.executable).parent / "nebula"
    primary, secondary = pty.openpty()
    try:
        proc = warm.Popen([exe, "verify", str(root), "--json"], stdout=subprocess.PIPE,
                                stderr=secondary, env=env)  # fmt: skip
        os.close(secondary)
        stdout, _ = proc.communicate(timeout=60)
        terminal = b""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and select.select([primary], [], [], 0.2)[0]:
            try:
                chunk = os.read(primary, 1 << 16)
            except OSError:  # the terminal closed
                break
            if not chunk:
                break
            terminal += chunk
    finally:
        os.close(primary)
    assert proc.returncode == 0, terminal
    doc = json.loads(stdout)  # exactly one JSON document, no escape codes
    assert doc["ok"] is True and len(doc["results"]) == 2
    assert b"verifying" in terminal


def _replace_with(path: Path, kind: str) -> None:
    """Put a folder, a FIFO or a symbolic link (to a copy of its bytes, outside the tag's
    folder) where the file `path` was."""
    saved = path.read_bytes()
    path.unlink()
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        elsewhere = path.parent.parent / f"elsewhere-{path.name}"
        elsewhere.write_bytes(saved)
        path.symlink_to(elsewhere)


@pytest.mark.parametrize("kind", ["folder", "fifo", "link"])
def test_a_manifest_replaced_by_what_is_not_a_file_fails_verify(root: Path, kind: str) -> None:
    """Bug caught: a committed tag whose manifest.json became a folder, a FIFO or a
    symbolic link was taken for a save that never committed: skipped, and exit 0."""
    _populate(root)
    manifest = root / "global_step100" / "manifest.json"
    _replace_with(manifest, kind)
    result = CliRunner().invoke(app, ["verify", str(root)], env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.stdout + result.stderr
    said = [x for x in result.stderr.splitlines() if str(manifest) in x]
    assert said and "not a regular file" in said[0], result.stderr


@pytest.mark.parametrize("kind", ["folder", "fifo", "link"])
def test_an_item_replaced_by_what_is_not_a_file_is_said_so(root: Path, kind: str) -> None:
    """Bug caught: an item file that became a FIFO, a folder or a symbolic link was
    reported as "no such file", sending the operator to look for a file that is there."""
    _populate(root)
    item = root / "global_step100" / "model"
    _replace_with(item, kind)
    result = CliRunner().invoke(app, ["verify", str(root), "--json"], env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    mine = [r for r in doc["results"] if r["tag"] == "global_step100" and r["item"] == "model"]
    assert mine and {r["status"] for r in mine} == {"corrupt"}, doc
    assert all("not a regular file" in r["detail"] for r in mine), mine


def test_a_planted_delete_claim_never_hides_the_newest_from_verify(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug caught (#29): a delete claim planted in the newest tag's folder (another host's,
    dated now: it counts for an hour) made verify skip that checkpoint and exit 0."""
    import nebulaml.protocol.leases as leases

    _populate(root)
    nm.shutdown()
    stamp = time.strftime("%Y%m%dT%H%M%S000000Z", time.gmtime())
    claim = root / "global_step200" / f".lease-delete-{stamp}-4242-deadbeef-node-gone.json"
    claim.write_text("{}")
    # How long a reader waits for a live deleter to decide (10 s), shortened.
    monkeypatch.setattr(leases.read_lease.__wrapped__, "__kwdefaults__", {"wait_s": 0.2})
    result = CliRunner().invoke(app, ["verify", str(root), "--json"], env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    unchecked = [r for r in doc["results"] if r["status"] == "unchecked"]
    assert [(r["tag"], r["tier"]) for r in unchecked] == [("global_step200", "persistent")]
    assert "pid 4242 on node-gone" in unchecked[0]["detail"]
    assert "global_step200" in result.stderr and "not read" in result.stderr
    # The other checkpoint was checked, item by item.
    assert {r["status"] for r in doc["results"] if r["tag"] == "global_step100"} == {"ok"}
