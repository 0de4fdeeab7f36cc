"""DeepSpeed's own NebulaCheckpointEngine (deepspeed==0.19.6) through `torch_nebula`.

The first tests call `torch_nebula` exactly as that engine does (no DeepSpeed needed); the
others run real DeepSpeed jobs on the CPU (gloo), ZeRO stages 0-3, world sizes 1 and 2:
train and save in one set of processes, resume in another, compare.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from frameworks import child_env, require, run_ranks, run_script
from shared_setup import once, one_at_a_time
from typer.testing import CliRunner

import nebulaml as nm
import torch_nebula
from nebula_cli.app import app

CHILD = Path(__file__).with_name("ds_child.py")
STAGES = (0, 1, 2, 3)
RESAVE_STAGES = (2, 3)


# torch_nebula as DeepSpeed's engine calls it ---------------------------------------------
def _engine_state(scale: float) -> dict[str, Any]:
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.fill_(scale)
    return {"module": model.state_dict(), "global_steps": 7, "ds_version": "0.19.6"}


def test_the_engines_calls_save_commit_find_and_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug caught: any call or argument form of DeepSpeed's engine that nebula refuses
    (None init values, -2 handles, commit's return value, tag=/persist_path= keywords,
    callable/str/device map_location), or a save that does not snapshot live tensors."""
    root = tmp_path / "nebula"
    monkeypatch.setenv("NEBULA_PERSISTENT_STORAGE_PATH", str(root))
    torch_nebula.init(
        persistent_storage_path=None,
        persistent_time_interval=None,
        num_of_version_in_retention=None,
    )
    state = _engine_state(1.0)
    checkpoint = torch_nebula.Checkpoint("global_step7", -2)
    checkpoint.save("mp_rank_00_model_states.pt", state)
    state["module"]["weight"].fill_(99.0)  # the engine trains on: the save must not see it
    assert checkpoint.commit() is True  # the engine logs an error on a falsy result
    assert torch_nebula.Checkpoint("global_step7", -2).commit() is True  # saved nothing

    found = torch_nebula.get_checkpoint(tag="global_step7", persist_path=str(root))
    latest = torch_nebula.get_latest_checkpoint(persist_path=str(root))
    assert found is not None and latest is not None and latest.tag == found.tag == "global_step7"
    for map_location in (lambda storage, loc: storage, "cpu", torch.device("cpu")):
        loaded = found.load("mp_rank_00_model_states.pt", map_location=map_location)
        assert torch.equal(loaded["module"]["weight"], torch.ones(2, 4))
        assert loaded["global_steps"] == 7


def test_the_engines_lookups_of_missing_checkpoints_return_none(tmp_path: Path) -> None:
    """Bug caught: raising where the engine expects None (it then falls back to the
    latest checkpoint, and logs that nothing was found)."""
    root = str(tmp_path / "empty")
    torch_nebula.init(persistent_storage_path=root, persistent_time_interval=100)
    assert torch_nebula.get_checkpoint(tag="global_step1", persist_path=root) is None
    assert torch_nebula.get_latest_checkpoint(persist_path=root) is None
    assert torch_nebula.get_latest_checkpoint() is None


def test_without_a_path_checkpoints_stay_in_the_memory_tier() -> None:
    """`"nebula": {"enabled": true}` alone: DeepSpeed passes None, 100 and 2. Bug caught:
    init refusing a missing path instead of running on the memory tier."""
    torch_nebula.init(
        persistent_storage_path=None, persistent_time_interval=100, num_of_version_in_retention=2
    )
    checkpoint = torch_nebula.Checkpoint("global_step1", -2)
    checkpoint.save("x.pt", {"w": torch.ones(3)})
    assert nm.list_checkpoints() == []  # -2: nothing is committed before commit()
    assert checkpoint.commit() is True
    assert [c["tiers"] for c in nm.list_checkpoints()] == [["memory"]]
    latest = torch_nebula.get_latest_checkpoint(persist_path=None)
    assert latest is not None
    assert torch.equal(latest.load("x.pt", map_location="cpu")["w"], torch.ones(3))


# real DeepSpeed jobs -------------------------------------------------------------------
def _job(
    workdir: Path, memory_tier: Path, world_size: int, stages: tuple[int, ...], lazy: bool
) -> dict:
    """Train and save, then resume in new processes; the per-rank JSON of both phases."""
    require("deepspeed")
    env = child_env(memory_tier, NEBULA_LAZY_SNAPSHOT="1" if lazy else "0")
    results: dict[str, list[dict]] = {}
    for phase in ("train", "resume"):
        argv = [sys.executable, str(CHILD), phase, str(workdir), ",".join(map(str, stages))]
        finished = run_ranks(argv, world_size, env)
        for rank, done in enumerate(finished):
            assert done.returncode == 0, f"{phase} rank {rank}:\n{done.output[-6000:]}"
        results[phase] = [
            json.loads((workdir / f"{phase}-rank{rank}.json").read_text())
            for rank in range(world_size)
        ]
    return results


Job = Callable[..., tuple[Path, dict]]


def _two_rank_jobs(base: Path) -> dict[str, dict[str, list[dict]]]:
    """Every 2-rank job but the killed one, in one pair of processes per phase
    (ds_child.py's "first" and "second": DeepSpeed's import alone costs ~6 s of CPU per
    process): {folder: {phase: per-rank JSON}} for "plain" and "lazy" (train, resume,
    every ZeRO stage) and "resave" (resave, reload, RESAVE_STAGES)."""
    require("deepspeed")
    env = child_env(base / "memory-tier")  # each part's own, set by the child
    stages, resave = ",".join(map(str, STAGES)), ",".join(map(str, RESAVE_STAGES))
    with one_at_a_time(base.parent, "deepspeed"):
        for phase in ("first", "second"):
            argv = [sys.executable, str(CHILD), phase, str(base), stages, resave]
            for rank, done in enumerate(run_ranks(argv, 2, env, timeout_s=600)):
                assert done.returncode == 0, f"{phase} rank {rank}:\n{done.output[-6000:]}"
    parts = {"plain": ("train", "resume"), "lazy": ("train", "resume"),
             "resave": ("resave", "reload")}  # fmt: skip
    return {
        folder: {
            phase: [
                json.loads((base / folder / f"{phase}-rank{rank}.json").read_text())
                for rank in range(2)
            ]
            for phase in phases
        }
        for folder, phases in parts.items()
    }


TWO_RANKS = "ds-world2"  # the shared folder of _two_rank_jobs


@pytest.fixture(scope="module")
def ds_jobs(shared_root: Path) -> Job:
    """The job of a world size (run once for the whole run, by whichever worker needs it
    first), every ZeRO stage in it: DeepSpeed's import alone costs seconds per process.
    `lazy`: with NEBULA_LAZY_SNAPSHOT=1. Those of 2 ranks are parts of one job
    (`_two_rank_jobs`)."""

    def get(world_size: int, lazy: bool = False) -> tuple[Path, dict]:
        if world_size == 2:
            folder = "lazy" if lazy else "plain"
            results = once(shared_root, TWO_RANKS, _two_rank_jobs)[folder]
            return shared_root / TWO_RANKS / folder, results
        key = f"ds-world{world_size}{'-lazy' if lazy else ''}"

        def make(base: Path) -> dict:
            with one_at_a_time(shared_root, "deepspeed"):
                return _job(base, base / "memory-tier", world_size, STAGES, lazy)

        results = once(shared_root, key, make)
        return shared_root / key, results

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "lazy"), [(1, False), (2, False), (2, True)], ids=["1", "2", "2-lazy"]
)
@pytest.mark.parametrize("stage", STAGES)
def test_save_and_resume_go_through_nebula_with_identical_state(
    ds_jobs: Job, stage: int, world_size: int, lazy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bugs caught: DeepSpeed falling back to torch.save (torch_nebula not importable), an
    item DeepSpeed cannot load back (its LossScaler, ZeroStageEnum, fragment_address under
    weights_only), a rank's part missing from the commit, a wrong tag or item on load, and
    `nebula_load_path` ignored (odd stages resume from an empty root and must load through
    it). Lazy: the same with NEBULA_LAZY_SNAPSHOT=1, every rank's items written in the
    background after DeepSpeed's commit, and one more step after the last save. (This
    model's tensors are all under 64 KiB, which `save` copies itself, so the fence before
    ZeRO's optimizer step is not what holds here: test_lazy.py tests it.)"""
    workdir, results = ds_jobs(world_size, lazy)
    monkeypatch.setenv("NEBULA_MEMORY_TIER_PATH", str(workdir / "memory-tier"))
    root = workdir / f"zero{stage}"
    for rank in range(world_size):
        train = results["train"][rank][str(stage)]
        resume = results["resume"][rank][str(stage)]
        assert train["engine"] == resume["engine"] == "NebulaCheckpointEngine"
        # The check has teeth: a fresh engine differs from the saved one...
        assert resume["before"]["params"] != train["saved"]["params"]
        assert resume["before"]["optimizer"] != train["saved"]["optimizer"]
        # ... and after load_checkpoint it is the saved one, bit for bit.
        assert resume["after"] == train["saved"], f"rank {rank}"
        assert resume["after"]["global_steps"] == 4
        assert resume["client_epoch"] == 40  # client_state of the last save
        assert resume["load_path"].endswith("global_step4/" + Path(resume["load_path"]).name)

    # DeepSpeed's save_dir holds only the engine's placeholders: the data is nebula's.
    for placeholder in (root / "ds" / "global_step4").glob("*.pt"):
        assert torch.load(placeholder, weights_only=True) == ""
    assert (root / "ds" / "latest").read_text() == "global_step4"
    # Both saves are committed, with every rank's part, on the persistent tier.
    listed = {c["tag"]: c for c in nm.list_checkpoints(str(root / "nebula"))}
    assert set(listed) == {"global_step2", "global_step4"}
    assert "persistent" in listed["global_step4"]["tiers"]
    manifest = json.loads((root / "nebula" / "global_step4" / "manifest.json").read_text())
    assert manifest["world_size"] == world_size
    ranks_with_items = {item["rank"] for item in manifest["items"]}
    assert ranks_with_items == ({0} if stage == 0 else set(range(world_size)))
    if stage % 2 == 1:  # resumed with persistent_storage_path=nebula-resume
        assert nm.list_checkpoints(str(root / "nebula-resume")) == []


@pytest.mark.parametrize("world_size", [1, 2])
def test_nebula_ls_shows_deepspeeds_checkpoints(
    ds_jobs: Job, world_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug caught: checkpoints DeepSpeed wrote that the operator CLI cannot see."""
    workdir, _results = ds_jobs(world_size)
    monkeypatch.setenv("NEBULA_MEMORY_TIER_PATH", str(workdir / "memory-tier"))
    for stage in STAGES:
        result = CliRunner().invoke(app, ["ls", str(workdir / f"zero{stage}" / "nebula"), "--json"])
        assert result.exit_code == 0, result.output
        tags = [c["tag"] for c in json.loads(result.stdout)["checkpoints"]]
        assert tags == ["global_step4", "global_step2"]


@pytest.mark.slow
def test_outside_deepspeed_its_classes_are_still_refused(
    ds_jobs: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed's classes are allowed only while DeepSpeed's engine loads. Bug caught: an
    allowlist that leaks into every load of the process (or into torch's global list)."""
    workdir, _results = ds_jobs(1)
    monkeypatch.setenv("NEBULA_MEMORY_TIER_PATH", str(workdir / "memory-tier"))
    assert "deepspeed" not in sys.modules
    latest = nm.get_latest_checkpoint(str(workdir / "zero1" / "nebula"))
    assert latest is not None
    name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with pytest.raises(nm.UnsafeCheckpointError, match="deepspeed"):
        latest.load(name)
    trusted = latest.load(name, weights_only=False)  # the caller trusts it: explicit
    assert "optimizer_state_dict" in trusted
    allowed = torch.serialization.get_safe_globals()
    assert not [g for g in allowed if "deepspeed" in getattr(g, "__module__", "")]


# tags saved again, and DeepSpeed's zero_to_fp32 ----------------------------------------
def test_the_engines_resave_of_a_tag_replaces_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed's default engine overwrites a tag saved again; so does its Nebula engine's
    `torch_nebula.Checkpoint` (nm.Checkpoint still refuses it unless overwrite=True). Bug
    caught: CheckpointExistsError on a re-save of "best", or the first state loaded."""
    root = tmp_path / "nebula"
    torch_nebula.init(persistent_storage_path=str(root), persistent_time_interval=100)
    for scale in (1.0, 2.0):
        checkpoint = torch_nebula.Checkpoint("best", -2)
        checkpoint.save("mp_rank_00_model_states.pt", _engine_state(scale))
        assert checkpoint.commit() is True
        if scale == 1.0:
            nm.flush_persistence()  # the version to replace is durable
    assert isinstance(checkpoint, nm.Checkpoint)
    for persist_path in (None, str(root)):
        found = torch_nebula.get_checkpoint(tag="best", persist_path=persist_path)
        assert found is not None
        loaded = found.load("mp_rank_00_model_states.pt", map_location="cpu")
        assert torch.equal(loaded["module"]["weight"], torch.full((2, 4), 2.0))
    with pytest.raises(nm.CheckpointExistsError):
        nm.Checkpoint("best", -2).save("mp_rank_00_model_states.pt", _engine_state(3.0))
    # A newer save supersedes "best" before its persist: at exit only the newer one is
    # persisted, and "best" is gone: never the version it replaced.
    newer = torch_nebula.Checkpoint("global_step9", -2)
    newer.save("mp_rank_00_model_states.pt", _engine_state(9.0))
    newer.commit()
    nm.shutdown()
    assert [c["tag"] for c in nm.list_checkpoints(str(root))] == ["global_step9"]
    assert torch_nebula.get_checkpoint(tag="best", persist_path=str(root)) is None


# A DeepSpeed config whose "nebula" block holds nebula's own keys; its engine is made
# (create_checkpoint_engine, as deepspeed.initialize does) and the session reports.
ENGINE_WITH_BLOCK = """
import sys
from deepspeed.runtime.checkpoint_engine.utils import create_checkpoint_engine
from deepspeed.runtime.config import DeepSpeedConfig
from nebulaml.runtime import session
for value in (2, 1):
    block = {"enabled": True, "persistent_storage_path": sys.argv[1],
             "persistent_time_interval": 7, "num_of_version_in_retention": 2,
             "peer_replicas": value}
    config = DeepSpeedConfig({"train_batch_size": 1, "nebula": block})
    try:
        create_checkpoint_engine(config_params=config, groups=None, zero_stage=0,
                                 has_moe_layers=False, optimize_dp_state=False)
    except Exception as exc:
        print("REFUSED", value, type(exc).__name__, exc)
    else:
        live = session.live()
        print("CONFIG", live.config.peer_replicas, live.config.persistent_time_interval_s)
"""


@pytest.mark.slow
def test_the_blocks_peer_replicas_reaches_nm_init(tmp_path: Path) -> None:
    """`"nebula": {..., "peer_replicas": 1}` in the ds_config, which DeepSpeed's config
    drops (its engine passes the path, interval and retention alone): torch_nebula.init
    reads it. Bugs caught: the key lost on the way (replication never on under
    DeepSpeed), a bad value in the block accepted."""
    require("deepspeed")
    argv = ["-c", ENGINE_WITH_BLOCK, str(tmp_path / "root")]
    done = run_script(argv, child_env(tmp_path / "memory-tier"))
    assert done.returncode == 0, done.output
    assert "REFUSED 2 InvalidArgumentError peer_replicas must be 0" in done.output
    assert "CONFIG 1 7.0" in done.output


@pytest.fixture(scope="module")
def resave_job(shared_root: Path) -> tuple[Path, dict]:
    """ds_child's "resave" then "reload" phases, 2 ranks, RESAVE_STAGES: the per-rank JSON
    (run once for the whole run, a part of `_two_rank_jobs`)."""
    results = once(shared_root, TWO_RANKS, _two_rank_jobs)["resave"]
    return shared_root / TWO_RANKS / "resave", results


@pytest.mark.slow
@pytest.mark.parametrize("stage", RESAVE_STAGES)
def test_deepspeed_saving_a_tag_again_replaces_it(
    resave_job: tuple[Path, dict], stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 gloo ranks save "best" twice, and global_step4 again after a rollback to
    global_step2 and 2 other steps; fresh processes load both. Bugs caught: the re-save
    refused on every rank (CheckpointExistsError), and a load that returns the state the
    re-save replaced, or one rank's new part with the other's old one (which a version
    never persisted left committed on the persistent tier: rank 1's persister took rank 0's
    marker of the old version for the new one's)."""
    workdir, results = resave_job
    monkeypatch.setenv("NEBULA_MEMORY_TIER_PATH", str(workdir / "memory-tier"))
    root = workdir / f"resave{stage}"
    for rank in range(2):
        saved = results["resave"][rank][str(stage)]
        loaded = results["reload"][rank][str(stage)]
        assert saved["engine"] == loaded["engine"] == "NebulaCheckpointEngine"
        assert saved["global_steps"] == 4
        # The replaced states differ from the new ones: the check has teeth.
        assert saved["best"]["params"] != saved["best_replaced"]["params"]
        assert saved["latest"]["params"] != saved["global_step4_replaced"]["params"]
        assert saved["best_loaded_in_job"] == saved["best"], f"rank {rank}"
        assert loaded["best"] == saved["best"], f"rank {rank}"
        assert loaded["latest"] == saved["latest"], f"rank {rank}"
        assert loaded["load_path_best"].endswith("/best/" + Path(loaded["load_path_best"]).name)
        assert "/global_step4/" in loaded["load_path_latest"]
    assert (root / "ds" / "latest").read_text() == "global_step4"
    listed = {c["tag"]: c for c in nm.list_checkpoints(str(root / "nebula"))}
    assert {"global_step2", "global_step4", "best"} <= set(listed)
    for tag in ("best", "global_step4"):  # persisted, both ranks' parts
        assert "persistent" in listed[tag]["tiers"]
        manifest = json.loads((root / "nebula" / tag / "manifest.json").read_text())
        assert {item["rank"] for item in manifest["items"]} == {0, 1}
    # "final"'s second version was superseded before its persist: the persistent tier
    # holds that version or none, never the first one, nor one rank's part of each.
    if "final" in listed:
        manifest = json.loads((root / "nebula" / "final" / "manifest.json").read_text())
        items = sorted([i["name"], i["checksum"]["value"]] for i in manifest["items"])
        assert items == results["resave"][0][str(stage)]["final_items"]


@pytest.mark.slow
def test_zero_to_fp32_reads_the_save_dir_once_materialized(
    resave_job: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`materialize(save_dir, tag, persist_path=root)` after the job writes the files over
    the engine's placeholders; DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint` on
    save_dir then returns the trained model's fp32 weights, of "best" and of the latest
    tag, both saved twice (ZeRO 2 and 3, 2 ranks). Bug caught: zero_to_fp32's
    AttributeError on the placeholders ('str' object has no attribute 'get'), and the
    files of a replaced save."""
    from nebulaml.integrations.deepspeed import materialize

    workdir, _results = resave_job
    monkeypatch.setenv("NEBULA_MEMORY_TIER_PATH", str(workdir / "memory-tier"))
    for stage in RESAVE_STAGES:
        root = workdir / f"resave{stage}"
        save_dir = root / "ds"
        placeholders = sorted(p.name for p in (save_dir / "global_step4").glob("*.pt"))
        for name in placeholders:  # what zero_to_fp32 fails on
            assert torch.load(save_dir / "global_step4" / name, weights_only=True) == ""
        files = materialize(save_dir, "best", persist_path=root / "nebula")
        files += materialize(save_dir, persist_path=root / "nebula")  # save_dir/latest's tag
        assert sorted(Path(f).name for f in files if "/global_step4/" in f) == placeholders
        optim = {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)}
        assert optim <= set(placeholders)
        assert not [p for p in (save_dir / "best").iterdir() if p.name.startswith(".")]

    stages = ",".join(map(str, RESAVE_STAGES))
    done = run_script(
        [str(CHILD), "fp32", str(workdir), stages], child_env(workdir / "memory-tier")
    )
    assert done.returncode == 0, done.output[-6000:]
    for stage in RESAVE_STAGES:
        root = workdir / f"resave{stage}"
        for key in ("best", "latest"):
            fp32 = torch.load(root / f"zero_to_fp32-{key}.pt", weights_only=True)
            expected = torch.load(root / f"expected-{key}.pt", weights_only=True)
            assert sorted(fp32) == sorted(expected) and expected
            for name, tensor in expected.items():
                assert fp32[name].dtype == tensor.dtype == torch.float32
                # The same bits: a NaN the gathered weights hold (ZeRO-3's, once in a CI
                # run) is NaN on both sides, which torch.equal calls different.
                same = torch.equal(fp32[name].view(torch.int32), tensor.view(torch.int32))
                assert same, f"zero{stage} {key} {name}"


@pytest.mark.slow
def test_zero3_killed_resumes_and_resaves_as_deepspeeds_own_checkpoints(
    tmp_path: Path, memory_tier: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ZeRO-3 on 2 gloo ranks: each save made twice from the same state, through nebula
    and through DeepSpeed's own engine; both ranks SIGKILLed after the last (nothing
    flushed: nebula's copy is in the memory tier alone). Fresh processes load each; nebula's
    then trains, saves global_step6, rolls back to global_step4 and saves global_step6
    again; zero_to_fp32 reads both save_dirs (nebula's once materialized). Bugs caught: a
    resume from the memory tier after the kill that differs from DeepSpeed's own by a bit
    (parameters, Adam state, client state), a rollback that loads another version, a
    re-save whose fp32 weights are the first global_step6's, fp32 weights of global_step4
    that differ from those of DeepSpeed's own files."""
    require("deepspeed")
    from nebulaml.integrations.deepspeed import materialize

    env = child_env(memory_tier)
    with one_at_a_time(tmp_path.parent, "deepspeed"):
        for phase in ("kill", "revive"):
            argv = [sys.executable, str(CHILD), phase, str(tmp_path), "3"]
            for rank, done in enumerate(run_ranks(argv, 2, env)):
                expected = -9 if phase == "kill" else 0
                assert done.returncode == expected, f"{phase} {rank}:\n{done.output[-6000:]}"
    root = tmp_path / "kill3"
    for rank in range(2):
        revived = json.loads((tmp_path / f"revive-rank{rank}.json").read_text())["3"]
        assert revived["nebula_loaded"] == revived["native_loaded"], f"rank {rank}"
        assert revived["nebula_loaded"]["global_steps"] == 4
        assert revived["nebula_epoch"] == revived["native_epoch"] == 40
        assert revived["nebula_rolled_back"] == revived["nebula_loaded"], f"rank {rank}"

    monkeypatch.setenv("NEBULA_MEMORY_TIER_PATH", str(memory_tier))
    for tag in ("global_step4", "global_step6"):
        materialize(root / "ds", tag, persist_path=root / "nebula")
    done = run_script([str(CHILD), "fp32-kill", str(tmp_path), "3"], env)
    assert done.returncode == 0, done.output[-6000:]

    def fp32(name: str) -> dict[str, torch.Tensor]:
        return torch.load(root / f"zero_to_fp32-{name}.pt", weights_only=True)

    def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
        # A NaN the gathered weights hold is NaN on both sides: torch.equal calls it
        # different (see test_zero_to_fp32_reads_the_save_dir_once_materialized).
        return a.dtype == b.dtype == torch.float32 and torch.equal(
            a.view(torch.int32), b.view(torch.int32)
        )

    ours, theirs = fp32("global_step4"), fp32("native-global_step4")
    assert ours.keys() == theirs.keys() and ours
    assert [k for k in theirs if not same_bits(ours[k], theirs[k])] == []
    final = torch.load(root / "expected-global_step6.pt", weights_only=True)
    resaved = fp32("global_step6")
    assert [k for k in final if not same_bits(resaved[k], final[k])] == []
