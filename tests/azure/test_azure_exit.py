"""Exit on an az:// root (Azurite): a script that ends without nm.shutdown(), by return,
exception, SIGTERM or Ctrl-C, has its last checkpoint persisted by the exit persist, which runs
while the interpreter's thread pools still take work (issue #16: it used to fail with
"cannot schedule new futures after shutdown" and leave the checkpoint only in RAM).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import warm

import nebulaml as nm
from nebulaml.storage.store import Store

CHILD = Path(__file__).resolve().parent / "children" / "exit_child.py"
TIMEOUT_S = 120

# Ctrl-C: Python's own exit for an uncaught KeyboardInterrupt is death by SIGINT (130 in a shell).
CASES = [("return", 0), ("raise", 1), ("sigterm", 128 + signal.SIGTERM), ("sigint", -signal.SIGINT)]


@pytest.mark.slow
@pytest.mark.parametrize(("how", "status"), CASES, ids=[c[0] for c in CASES])
def test_exit_persists_the_last_checkpoint_to_azure(
    az_url: str, memory_tier: Path, how: str, status: int
) -> None:
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier), PYTHONUNBUFFERED="1")
    proc = warm.Popen(
        [sys.executable, str(CHILD), az_url, how],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        assert ready.strip() == "READY", ready + (proc.stderr.read() if proc.stderr else "")
        if how in ("sigterm", "sigint"):
            proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGINT)
        _, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert proc.returncode == status, err
    assert "not persisted" not in err and "nebula: error" not in err, err
    # No asyncio reports of abandoned requests (issue #18, case 8).
    for noise in ("Unclosed", "Task was destroyed", "never retrieved", "Exception ignored"):
        assert noise not in err, err
    persisted = [c["tag"] for c in nm.list_checkpoints(az_url) if "persistent" in c["tiers"]]
    assert sorted(persisted) == ["global_step1", "global_step2"], err
    # The persistent copy itself (the memory tier may hold one too), bit for bit.
    loaded = torch.load(io.BytesIO(Store(az_url).read_bytes("global_step2", "model")),
                        weights_only=True)  # fmt: skip
    expected = torch.randn(1 << 16, generator=torch.Generator().manual_seed(1002))
    assert torch.equal(loaded["w"], expected)
