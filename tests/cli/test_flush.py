"""`nebula flush`: persist what a crashed job left in this node's memory tier.

The crash is real: a child process commits global_step1 (persisted) and global_step2
(held back by persistent_time_interval=3600), then leaves with os._exit, so no exit
handler persists anything. The child shares this test's memory tier through
NEBULA_MEMORY_TIER_PATH.
"""

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
from nebulaml.protocol.delete import delete_checkpoint
from nebulaml.protocol.history import HISTORY_FILE
from nebulaml.runtime import session
from nebulaml.storage.store import Store

EXE = Path(sys.executable).parent / "nebula"
CRASHING_JOB = """
import os, sys, torch, nebulaml as nm
nm.init(sys.argv[1], persistent_time_interval=3600)
for step in (1, 2):
    gen = torch.Generator().manual_seed(step)
    nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.randn(200, 200, generator=gen)})
    if step == 1:
        nm.flush_persistence()  # persisted; global_step2 is not due for an hour
nm.wait_for_snapshot()  # its lazy copy taken (the default): a crash keeps it
os._exit(0)  # a crash: nothing runs at exit
"""


def env(memory_tier: Path) -> dict[str, str]:
    return dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier))


def crash_a_job(root: Path, memory_tier: Path) -> None:
    warm.run([sys.executable, "-c", CRASHING_JOB, str(root)], env=env(memory_tier),
                   check=True, timeout=60)  # fmt: skip
    tiers = {c["tag"]: c["tiers"] for c in nm.list_checkpoints(str(root))}
    # global_step1 is persisted; its memory copy may be left too (the eviction a commit
    # asks for runs on a thread of its own, which a crash may not let run).
    assert tiers["global_step2"] == ["memory"]
    assert "persistent" in tiers["global_step1"] and set(tiers) == {"global_step1", "global_step2"}


def expected_w(step: int) -> torch.Tensor:
    return torch.randn(200, 200, generator=torch.Generator().manual_seed(step))


@pytest.mark.slow
def test_flush_persists_what_the_crashed_job_left(root: Path, memory_tier: Path) -> None:
    # catches: flush persisting nothing, or the wrong (older) tag, or starting a session
    crash_a_job(root, memory_tier)
    result = CliRunner().invoke(app, ["flush", str(root), "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout) == {
        "root": str(root),
        "memory_tier": nm.memory_tier_path(str(root)),
        "persisted": ["global_step2"],
    }
    assert result.stderr == ""
    assert session._session is None  # no session, no persister thread started
    w = torch.load(root / "global_step2" / "model", weights_only=True)["w"]
    assert torch.equal(w, expected_w(2))
    rows = (root / HISTORY_FILE).read_text().splitlines()
    assert rows[-1].startswith("global_step2,2,persistent,0,") and ",ok," in rows[-1]
    again = CliRunner().invoke(app, ["flush", str(root), "--json"])
    assert again.exit_code == 0 and json.loads(again.stdout)["persisted"] == []
    assert (root / HISTORY_FILE).read_text().splitlines() == rows  # a no-op writes nothing


@pytest.mark.slow
def test_flush_as_a_real_command(root: Path, memory_tier: Path) -> None:
    crash_a_job(root, memory_tier)
    run = [EXE, "flush", str(root)]
    out = warm.run(run, capture_output=True, text=True, env=env(memory_tier), timeout=60)
    assert out.returncode == 0, out.stderr
    assert (out.stdout, out.stderr) == (f"Persisted global_step2 to {root}\n", "")
    out = warm.run(run, capture_output=True, text=True, env=env(memory_tier), timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (0, "Nothing to flush\n", "")
    loaded = nm.get_checkpoint("global_step2", str(root)).load("model")
    assert torch.equal(loaded["w"], expected_w(2))


def test_nothing_to_flush_when_the_root_is_as_new(root: Path) -> None:
    # catches: re-persisting (and rewriting) a checkpoint the root already holds
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(3)})
    nm.shutdown()
    before = (root / "global_step1" / "model").stat().st_mtime_ns
    result = CliRunner().invoke(app, ["flush", str(root)])
    assert (result.exit_code, result.stdout) == (0, "Nothing to flush\n")
    assert (root / "global_step1" / "model").stat().st_mtime_ns == before


def test_missing_root_is_not_found(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["flush", str(tmp_path / "nope")])
    assert (result.exit_code, result.stdout) == (3, "")
    assert result.stderr.strip() == f"nebula: error: {tmp_path / 'nope'}: no such checkpoint root"


def test_a_storage_failure_is_one_error_line(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, keep_memory_tier=True)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(3)})
    nm.shutdown()
    delete_checkpoint(Store(str(root)), "global_step1")  # the persist was lost...
    (root / "global_step1").write_text("...and a file sits where its folder goes")
    result = CliRunner().invoke(app, ["flush", str(root), "--json"])
    assert result.exit_code == 1 and json.loads(result.stdout)["error"]["kind"] == "error"
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"nebula: error: {root}/global_step1: ")
