"""init() removes what this host's dead writers left half-written, and nothing else."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import torch
import warm

import nebulaml as nm


def _dead_pid() -> int:
    proc = warm.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    return int(proc.stdout)


def _half_written(root: Path, tag: str, host: str, pid: int) -> Path:
    folder = root / tag
    folder.mkdir(parents=True)
    (folder / "model").write_bytes(b"partial bytes of a crashed persist")
    marker = {"host": host, "pid": pid, "rank": 0, "started_at": "2026-01-01T00:00:00Z"}
    (folder / ".writer-0.json").write_text(json.dumps(marker))
    return folder


def test_init_cleans_persistent_leftovers_of_dead_local_writers(root: Path) -> None:
    host = socket.gethostname()
    dead = _half_written(root, "global_step1", host, _dead_pid())
    live = _half_written(root, "global_step2", host, __import__("os").getpid())
    remote = _half_written(root, "global_step3", "another-node", _dead_pid())
    foreign = root / "not-ours"
    foreign.mkdir()
    (foreign / "data").write_text("user data without our markers")
    nm.init(str(root))
    assert not dead.exists()
    assert live.exists() and remote.exists() and (foreign / "data").exists()
    # The survivors stay invisible: none of them is committed.
    assert nm.list_checkpoints() == []
    nm.Checkpoint("global_step4").save("m", {"w": torch.ones(2)})
    assert [c["tag"] for c in nm.list_checkpoints()] == ["global_step4"]
