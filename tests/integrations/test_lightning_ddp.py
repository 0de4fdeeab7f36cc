"""NebulaCheckpointIO under Lightning DDP (2 CPU ranks, gloo), the README's usage unchanged:
launched by torchrun, and by Lightning's own launcher. Lightning saves on global rank 0
alone; every rank loads, and resumes bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import warm
from frameworks import REPO, require
from rendezvous import rendezvous

import nebulaml as nm

CHILD = Path(__file__).with_name("lightning_ddp_child.py")


def _run(
    how: str, phase: str, work: Path, memory_tier: Path, *args: str
) -> subprocess.CompletedProcess[str]:
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
    argv = [str(CHILD), phase, str(work), *args]
    if how == "torchrun":  # --standalone: torchrun binds its own store on a free port
        argv = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", *argv]
        return _launch(argv, env)
    # Lightning's launcher takes MASTER_PORT when it is set (else it probes for a port)
    with rendezvous(2) as meeting:
        return _launch(argv, dict(env, **meeting))


def _launch(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return warm.run(
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
    # save_top_k=-1: ModelCheckpoint keeps every one, and so does nebula
    assert tags == ["epoch=0-step=6", "epoch=0-step=4", "epoch=0-step=2"], tags
    manifest = json.loads((root / "epoch=0-step=4" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["ranks"] == [0], manifest
    assert [(i["name"], i["rank"]) for i in manifest["items"]] == [("checkpoint", 0)]
    # At each path a pointer file, written once (rank 0), never the checkpoint's data.
    assert sorted(p.name for p in (work / "ckpts").iterdir()) == [f"{t}.ckpt" for t in tags[::-1]]
    assert nm.list_incomplete(str(root)) == []

    trained = json.loads((work / "train-rank0.json").read_text())
    assert trained["global_step"] == 4 and trained["world_size"] == 2
    for rank in (0, 1):
        resumed = json.loads((work / f"resume-rank{rank}.json").read_text())
        assert resumed["global_step"] == 4, resumed
        assert resumed["params"] == trained["params"], rank  # bit for bit
        assert resumed["optimizer"] == trained["optimizer"], rank
        assert resumed["optimizer"], "the optimizer's state was not restored"


def _managed(work: Path, memory_tier: Path, ckpt: str, kill_at: int = 0) -> dict[str, Any]:
    """lightning_ddp_child.py's "managed" phase under torchrun; rank 0's record, or the
    failed run's output when rank 1 was killed."""
    done = _run("torchrun", "managed", work, memory_tier, ckpt, str(kill_at))
    out = done.stdout + done.stderr
    if kill_at:
        assert done.returncode != 0 and "OK rank" not in out, out[-6000:]
        return {}
    assert done.returncode == 0, out[-6000:]
    assert "OK rank 0 managed" in out and "OK rank 1 managed" in out, out[-6000:]
    return json.loads((work / "managed-rank0.json").read_text())


def _durable_is_what_modelcheckpoint_keeps(
    work: Path, memory_tier: Path, record: dict[str, Any]
) -> None:
    root = work / "root"
    kept = {Path(p).stem for p in [*record["best_k_models"], record["last_model_path"]]}
    persisted = {c["tag"] for c in nm.list_checkpoints(str(root)) if "persistent" in c["tiers"]}
    assert persisted == kept, (persisted, record)
    assert {p.stem for p in (work / "ckpts").iterdir()} == kept  # the pointer files
    assert nm.list_incomplete(str(root)) == []
    tags = ("epoch", "last")
    left = [p for p in memory_tier.rglob("*") if p.is_dir() and p.name.startswith(tags)]
    assert left == [], left  # every rank's memory tier released at the clean exit


@pytest.mark.slow
def test_ddp_killed_mid_epoch_resumes_from_last_and_keeps_what_modelcheckpoint_keeps(
    tmp_path: Path, memory_tier: Path
) -> None:
    """ModelCheckpoint(monitor="train_loss", save_top_k=2, save_last=True) on 2 DDP ranks
    (torchrun), 6 epochs. One run goes through; another loses rank 1 in epoch 3
    (SIGKILL), resumes with ckpt_path="last", loses rank 1 again in epoch 5, and resumes
    with ckpt_path=<dirpath>/last.ckpt. Bugs caught: "last" deleted by nebula's retention
    on the next init (CheckpointNotFoundError), ckpt_path="last" silently training from
    scratch (Lightning found no file), a checkpoint ModelCheckpoint keeps never persisted
    (skipped for a newer one) or one it removed left on the persistent tier, rank 0's
    parts left in the memory tier after a clean exit."""
    require("lightning")
    full = tmp_path / "full"
    full.mkdir()
    straight = _managed(full, memory_tier, "none")
    assert straight["global_step"] == 24
    _durable_is_what_modelcheckpoint_keeps(full, memory_tier, straight)

    work = tmp_path / "killed"
    work.mkdir()
    _managed(work, memory_tier, "none", kill_at=14)  # epoch 3 of 0..5, after epoch 2's save
    _managed(work, memory_tier, "last", kill_at=22)
    resumed = _managed(work, memory_tier, str(work / "ckpts" / "last.ckpt"))
    assert resumed["global_step"] == 24
    assert resumed["params"] == straight["params"]  # bit for bit
    assert resumed["optimizer"] == straight["optimizer"]
    assert resumed["best_k_models"] == straight["best_k_models"]
    _durable_is_what_modelcheckpoint_keeps(work, memory_tier, resumed)
