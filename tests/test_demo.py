"""`make demo` runs examples/train.py --demo: it must pass from a fresh root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train.py"


@pytest.mark.slow
def test_demo_kills_resumes_and_proves_identical_state(tmp_path: Path, memory_tier: Path) -> None:
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier), COLUMNS="120")
    root = tmp_path / "demo-checkpoints"
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--demo", "--root", str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "SIGKILL after step" in out
    assert "model, optimizer and step" in out and "identical to what was saved" in out
    assert "finished at step 40" in out
    assert "$ nebula verify" in out and "demo passed" in out
    assert (root / "global_step40" / "manifest.json").exists()
