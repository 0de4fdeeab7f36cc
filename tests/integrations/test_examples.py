"""The integration examples run as a user runs them (examples/train.py: tests/test_demo.py).

Each example trains, checkpoints through nebula, resumes in a new process and checks that
the state is the one saved; a test fails when the seed's user code stops working."""

from __future__ import annotations

from pathlib import Path

import pytest
from frameworks import REPO, child_env, require, run_script
from shared_setup import one_at_a_time

EXAMPLES = REPO / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_lightning_example(package: str, tmp_path: Path, memory_tier: Path) -> None:
    """Bugs caught: nm.NebulaCheckpointIO / nm.NebulaCallback not resolving to the package
    the script imported, and any step of the seed's Lightning section failing."""
    require(package)
    root = tmp_path / "run"
    script = [str(EXAMPLES / "lightning_train.py"), "--root", str(root), "--package", package]
    done = run_script(script, child_env(memory_tier))
    assert done.returncode == 0, done.output[-5000:]
    assert "trained to step 24 with NebulaCheckpointIO" in done.output
    assert "saved example.ckpt as nebula tag 'example', labels ['best']" in done.output
    assert f"a file at {root / 'example.ckpt'}? False" in done.output
    assert "/checkpoint): weights identical" in done.output
    assert "resumed at step 24, finished at 48" in done.output
    assert f"lightning example ({package}) passed" in done.output


@pytest.mark.slow
def test_deepspeed_example(tmp_path: Path, memory_tier: Path, shared_root: Path) -> None:
    """Bugs caught: DeepSpeed's Nebula engine not engaged by the seed's config block, a
    resumed state that differs, checkpoints `nebula ls` does not show."""
    require("deepspeed")
    root = tmp_path / "run"
    with one_at_a_time(shared_root, "deepspeed"):  # never beside another DeepSpeed job
        done = run_script(
            [str(EXAMPLES / "deepspeed_train.py"), "--root", str(root)], child_env(memory_tier)
        )
    assert done.returncode == 0, done.output[-5000:]
    assert "checkpoint engine NebulaCheckpointEngine" in done.output
    assert (
        "global_step12/mp_rank_00_model_states.pt, step 12, NebulaCheckpointEngine" in done.output
    )
    assert "parameters and optimizer state identical to what was saved" in done.output
    listed = [
        line.split()[0] for line in done.output.splitlines() if line.startswith("global_step")
    ]
    assert {"global_step12", "global_step4"} <= set(listed)  # nebula ls, plain in a pipe
    assert "deepspeed example passed" in done.output
