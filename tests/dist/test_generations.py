"""A torchrun restart after one rank is killed mid-save: a checkpoint is never committed
from parts of two generations (one rank's part saved before the restart, another's after).

The job runs under `python -m torch.distributed.run --max-restarts 1` with 2 gloo ranks,
on one node (a shared memory tier) and on two simulated nodes (a memory tier per rank).
"""

from __future__ import annotations

import json
import os
import subprocess

import warm
import sys
from pathlib import Path

import pytest
import torch

import nebulaml as nm

CHILD = Path(__file__).with_name("elastic_child.py")


def _torchrun(root: Path, outdir: Path, nodes: int) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(var, None)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--standalone", "--max-restarts", "1", "--monitor-interval", "0.5",
        str(CHILD), str(root), str(outdir), str(nodes),
    ]  # fmt: skip
    return warm.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)


def _restarts(tag_dir: Path) -> set[int]:
    """The restart that saved each shard of a checkpoint folder."""
    return {
        int(torch.load(path, weights_only=True)["restart"]) for path in tag_dir.glob("shard_rank*")
    }


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [1, 2])
def test_a_restart_never_commits_a_checkpoint_from_two_generations(
    tmp_path: Path, nodes: int
) -> None:
    """Rank 0 wrote its part of global_step6, rank 1 was killed before writing its own,
    torchrun restarted both; after the restart both save global_step6 again, rank 1's
    part first. Bug caught (main): global_step6 was committed from rank 0's part of the
    first run and rank 1's of the second, a torn checkpoint that verifies; rank 0's own
    save of it then failed with CheckpointExistsError."""
    root, outdir = tmp_path / "persistent", tmp_path / "job"
    outdir.mkdir()
    done = _torchrun(root, outdir, nodes)
    out = done.stdout + done.stderr
    # No committed checkpoint on any tier mixes two runs.
    memory = outdir / "memory"
    for manifest in [*root.glob("*/manifest.json"), *memory.rglob("manifest.json")]:
        assert len(_restarts(manifest.parent)) == 1, f"{manifest.parent} is torn"
    assert done.returncode == 0, out[-6000:]
    assert "OK rank 0 restart 1" in out and "OK rank 1 restart 1" in out, out[-6000:]
    # After the restart every rank resumed from the same checkpoint, saved by one run.
    resumed = [json.loads((outdir / f"rank{r}-restart1.json").read_text()) for r in (0, 1)]
    assert resumed[0] == resumed[1] == {"tag": "global_step4", "restarts": [0, 0]}, resumed
    # global_step6 is the second run's, whole: both parts, one generation.
    tag_dir = root / "global_step6"
    assert (tag_dir / "manifest.json").exists()
    assert _restarts(tag_dir) == {1}
    generations = {
        json.loads((tag_dir / f".rank-{r}.json").read_text()).get("generation") for r in (0, 1)
    }
    assert len(generations) == 1 and next(iter(generations)).endswith(".1"), generations
    assert next(c["tag"] for c in nm.list_checkpoints(str(root))) == "global_step6"
    assert nm.list_incomplete(str(root)) == []
