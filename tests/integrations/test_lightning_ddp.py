"""NebulaCheckpointIO under Lightning DDP (2 CPU ranks, gloo), the README's usage unchanged:
launched by torchrun, and by Lightning's own launcher. Lightning saves on global rank 0
alone; every rank loads, and resumes bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from frameworks import REPO, require
from rendezvous import rendezvous

import nebulaml as nm

CHILD = Path(__file__).with_name("lightning_ddp_child.py")


def _run(how: str, phase: str, work: Path, memory_tier: Path) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")
        and not k.startswith(("TORCHELASTIC_", "MASTER_", "PL_"))
    }
    env.update(
        NEBULA_MEMORY_TIER_PATH=str(memory_tier),
        NEBULA_RANK_TIMEOUT_S="60",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    argv = [str(CHILD), phase, str(work)]
    if how == "torchrun":  # --standalone: torchrun binds its own store on a free port
        argv = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", *argv]
        return _launch(argv, env)
    # Lightning's launcher takes MASTER_PORT when it is set (else it probes for a port)
    with rendezvous(2) as meeting:
        return _launch(argv, dict(env, **meeting))


def _launch(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize("how", ["torchrun", "lightning"])
def test_ddp_saves_on_rank_0_and_every_rank_resumes_bit_for_bit(
    how: str, tmp_path: Path, memory_tier: Path
) -> None:
    """`strategy="ddp"`, launched by torchrun and by Lightning's launcher. Bugs caught
    (main): under torchrun the first save raised "NebulaCheckpointIO supports
    single-process training for now" (rank 1 then died on a closed gloo connection);
    under Lightning's launcher each rank took another world size, and the checkpoints
    said world_size 1."""
    require("lightning")
    work = tmp_path / "job"
    work.mkdir()
    for phase in ("train", "resume"):
        done = _run(how, phase, work, memory_tier)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out[-6000:]
        assert f"OK rank 0 {phase}" in out and f"OK rank 1 {phase}" in out, out[-6000:]

    root = work / "root"
    tags = [c["tag"] for c in nm.list_checkpoints(str(root))]
    assert tags == ["epoch=0-step=6", "epoch=0-step=4"], tags  # retention keeps 2
    manifest = json.loads((root / "epoch=0-step=4" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["ranks"] == [0], manifest
    assert [(i["name"], i["rank"]) for i in manifest["items"]] == [("checkpoint", 0)]
    assert not list(work.rglob("*.ckpt"))  # nothing written at the paths
    assert nm.list_incomplete(str(root)) == []

    trained = json.loads((work / "train-rank0.json").read_text())
    assert trained["global_step"] == 4 and trained["world_size"] == 2
    for rank in (0, 1):
        resumed = json.loads((work / f"resume-rank{rank}.json").read_text())
        assert resumed["global_step"] == 4, resumed
        assert resumed["params"] == trained["params"], rank  # bit for bit
        assert resumed["optimizer"] == trained["optimizer"], rank
        assert resumed["optimizer"], "the optimizer's state was not restored"
