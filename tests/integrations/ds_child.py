"""One rank of a DeepSpeed job that checkpoints through nebula (run by test_deepspeed.py).

Usage: ds_child.py PHASE WORKDIR STAGES; RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT come from the environment, as a launcher sets them.

For each ZeRO stage in STAGES (comma-separated) the job uses WORKDIR/zero<stage>/:
    ds/             DeepSpeed's save_dir: its `latest` file and the placeholder files
                    DeepSpeed's Nebula engine writes there
    nebula/         the persistent root of the training run (the ds_config's
                    persistent_storage_path)
    nebula-resume/  the persistent root of the resumed run when it loads through
                    `nebula_load_path` (odd stages): nothing is ever saved there

PHASE "train": a tiny model trains 4 steps and is saved after steps 2 and 4 with
`model_engine.save_checkpoint(save_dir, client_state=...)`. PHASE "resume": a fresh process
builds the model from another seed and calls `model_engine.load_checkpoint(save_dir)`.
Each phase writes WORKDIR/<phase>-rank<r>.json: per stage, the checkpoint engine's class,
digests of the parameters and optimizer state (before and after loading), global_steps
and the client state.

Tags saved again (WORKDIR/resave<stage>/, the same ds/ and nebula/): PHASE "resave" saves
global_step2 and "best" after step 2, global_step4 and "best" again after step 4 (and
loads "best" back at once), then rolls back (`load_checkpoint(save_dir,
tag="global_step2")`), trains 2 other steps and saves global_step4 again. Each save is
made durable at once (`torch_nebula.flush_persistence()` on every rank), so that each
re-save replaces a persisted version; but for "final", saved after steps 2 and 4 too,
whose second version is left to the persister (and superseded by the later saves): the
JSON has the items of that version (name and checksum, from the memory tier). The JSON
has the state saved last under each tag (and the one it replaced); rank 0 writes the
parameters of each, by name, to expected-<key>.pt.
PHASE "reload": fresh processes load "best", then the latest tag.

PHASE "first" (args: WORKDIR STAGES RESAVE_STAGES) runs "train" in WORKDIR/plain/ and, with
NEBULA_LAZY_SNAPSHOT=1, in WORKDIR/lazy/, then "resave" in WORKDIR/resave/; PHASE "second"
runs "resume", "resume" and "reload" there: one pair of processes for what several tests
check. Each folder has its own memory tier (memory-tier/).

Killed and resumed against DeepSpeed's own checkpoints (WORKDIR/kill<stage>/): PHASE
"kill" trains 4 steps and saves after steps 2 and 4 twice, from the same state: through
nebula (save_dir ds/) and through DeepSpeed's own engine (save_dir native/); then every
rank SIGKILLs itself, before anything is flushed. PHASE "revive": fresh processes load
each save_dir's latest into an engine of another seed; nebula's then trains 2 more steps,
saves global_step6, loads global_step4 again, trains other steps and saves global_step6
again (a re-save). The JSON has the states after each load, and rank 0 writes the final
parameters to expected-global_step6.pt.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

STEPS = 4
SAVE_AFTER = (2, 4)


def ds_config(root: Path, stage: int, *, resume: bool, retention: int = 2) -> dict[str, Any]:
    nebula: dict[str, Any] = {
        "enabled": True,
        "persistent_storage_path": str(root / "nebula"),
        "persistent_time_interval": 100,
        "num_of_version_in_retention": retention,
        "enable_nebula_load": True,
    }
    if resume and stage % 2 == 1:
        nebula["persistent_storage_path"] = str(root / "nebula-resume")
        nebula["nebula_load_path"] = str(root / "nebula")
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "checkpoint": {"tag_validation": "FAIL"},
        "nebula": nebula,
        "steps_per_print": 1000,
    }


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def digest(obj: Any, hasher: Any = None) -> str:
    """sha256 over every tensor and value of a nested state, by key path."""
    top = hasher is None
    hasher = hasher or hashlib.sha256()
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        hasher.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        hasher.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        hasher.update(b"{")
        for key in sorted(obj, key=repr):
            hasher.update(repr(key).encode())
            digest(obj[key], hasher)
        hasher.update(b"}")
    elif isinstance(obj, (list, tuple)):
        hasher.update(b"[")
        for value in obj:
            digest(value, hasher)
        hasher.update(b"]")
    elif obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        hasher.update(repr(obj).encode())
    else:  # DeepSpeed's loss scaler, enums, fragment addresses: their type and attributes
        hasher.update(type(obj).__qualname__.encode())
        digest(dict(vars(obj)) if hasattr(obj, "__dict__") else repr(obj), hasher)
    return hasher.hexdigest() if top else ""


def _settle(engine: Any) -> None:
    """Wait for the collectives DeepSpeed left running: ZeRO-3's loads and gathers issue
    async all-gathers and wait for the last one only ("enqueued, not necessarily
    complete": partition_parameters.py). On CUDA one stream orders them; gloo runs them on
    worker threads, so the state read right after `load_checkpoint` was, about one run in
    ten, still being written (and right a second later). Gloo's barrier waits for every
    collective issued before it on its group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    groups = {id(g): g for g in (None, getattr(engine.optimizer, "dp_process_group", None))}
    for group in groups.values():
        dist.barrier(group=group)


def param_digest(engine: Any, stage: int) -> str:
    import deepspeed

    params = list(engine.module.parameters())
    if stage == 3:  # partitioned: gather the full parameters on every rank
        # One at a time: a gather of several issues one async all-gather per parameter and
        # waits for the last only ("enqueued, not necessarily complete": DeepSpeed 0.19.6,
        # partition_parameters.py). On CUDA one stream orders them; gloo runs them on worker
        # threads, so reading the others right away sometimes saw them half-written.
        gathered = []
        for p in params:
            with deepspeed.zero.GatheredParameters([p]):
                gathered.append(p.detach().clone())
        return digest(gathered)
    return digest([p.detach().clone() for p in params])


def state_of(engine: Any, stage: int) -> dict[str, Any]:
    return {
        "params": param_digest(engine, stage),
        "optimizer": digest(engine.optimizer.state_dict()),
        "global_steps": engine.global_steps,
    }


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(2, 8, generator=gen), torch.randn(2, 4, generator=gen)) for _ in range(STEPS)
    ]


def run_stage(phase: str, root: Path, stage: int, rank: int) -> dict[str, Any]:
    import deepspeed

    resume = phase == "resume"
    model = build_model(seed=1 if resume else 0)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=ds_config(root, stage, resume=resume),
    )
    out: dict[str, Any] = {"engine": type(engine.checkpoint_engine).__name__}
    save_dir = str(root / "ds")
    if not resume:
        for step, (x, y) in enumerate(batches(rank), start=1):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            if step in SAVE_AFTER:
                engine.save_checkpoint(save_dir, client_state={"epoch": step * 10})
        out["saved"] = state_of(engine, stage)
        # One more step after the last save, which must not reach what was saved (with
        # NEBULA_LAZY_SNAPSHOT=1 a checkpoint is written in the background after its commit).
        x, y = batches(rank)[0]
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        return out
    out["before"] = state_of(engine, stage)
    load_path, client_state = engine.load_checkpoint(save_dir)
    _settle(engine)
    out["load_path"] = load_path
    out["client_epoch"] = None if client_state is None else client_state.get("epoch")
    out["after"] = state_of(engine, stage)
    return out


def _engine(root: Path, stage: int, seed: int, *, native: bool) -> Any:
    import deepspeed

    model = build_model(seed)
    config = ds_config(root, stage, resume=False)
    if native:
        del config["nebula"]
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def _train(engine: Any, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, y in data:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


def run_kill(root: Path, stage: int, rank: int) -> None:
    """PHASE "kill" (module doc)."""
    import signal

    import torch.distributed as dist
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
        TorchCheckpointEngine,
    )

    engine = _engine(root, stage, 0, native=False)
    nebula_engine = engine.checkpoint_engine
    for step, (x, y) in enumerate(batches(rank), start=1):
        _train(engine, [(x, y)])
        if step in SAVE_AFTER:
            client_state = {"epoch": step * 10}
            engine.save_checkpoint(str(root / "ds"), client_state=client_state)
            engine.checkpoint_engine = TorchCheckpointEngine(engine._config)  # DeepSpeed's
            engine.save_checkpoint(str(root / "native"), client_state=client_state)
            engine.checkpoint_engine = nebula_engine
    dist.barrier()  # both ranks saved: now the node goes
    os.kill(os.getpid(), signal.SIGKILL)


def run_revive(root: Path, stage: int, rank: int) -> dict[str, Any]:
    """PHASE "revive" (module doc)."""
    out: dict[str, Any] = {}
    for native, save_dir in ((True, root / "native"), (False, root / "ds")):
        engine = _engine(root, stage, 1, native=native)
        key = "native" if native else "nebula"
        _path, client_state = engine.load_checkpoint(str(save_dir))
        _settle(engine)
        out[f"{key}_loaded"] = state_of(engine, stage)
        out[f"{key}_epoch"] = None if client_state is None else client_state.get("epoch")
    import torch_nebula

    # global_step4, recovered from the memory tier, is loaded again below: durable first
    # (global_step6 would supersede it within the interval: DeepSpeed would load that).
    torch_nebula.flush_persistence()
    _train(engine, batches(rank + 20)[:2])
    engine.save_checkpoint(str(save_dir), tag="global_step6")
    engine.load_checkpoint(str(save_dir), tag="global_step4")
    _settle(engine)
    out["nebula_rolled_back"] = state_of(engine, stage)
    _train(engine, batches(rank + 30)[:2])
    engine.save_checkpoint(str(save_dir), tag="global_step6")  # the same tag again
    params = full_params(engine, stage)
    if rank == 0:
        torch.save(params, root / "expected-global_step6.pt")
    return out


def full_params(engine: Any, stage: int) -> dict[str, torch.Tensor]:
    """The model's parameters by name, whole (gathered under ZeRO-3), in fp32."""
    import deepspeed

    out = {}
    for name, p in engine.module.named_parameters():
        if stage == 3:  # one at a time: see param_digest
            with deepspeed.zero.GatheredParameters([p]):
                out[name] = p.detach().float().clone()
        else:
            out[name] = p.detach().float().clone()
    return out


def run_resave(phase: str, root: Path, stage: int, rank: int) -> dict[str, Any]:
    import deepspeed

    reload = phase == "reload"
    model = build_model(seed=1 if reload else 0)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=ds_config(root, stage, resume=False, retention=5),
    )
    save_dir = str(root / "ds")
    out: dict[str, Any] = {"engine": type(engine.checkpoint_engine).__name__}
    if reload:
        for tag in ("best", None):
            load_path, _ = engine.load_checkpoint(save_dir, tag=tag)
            _settle(engine)
            out["latest" if tag is None else tag] = state_of(engine, stage)
            out[f"load_path_{tag or 'latest'}"] = load_path
        return out

    def train(data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for x, y in data:
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()

    def save(tag: str | None, key: str, durable: bool = True) -> None:
        import torch_nebula

        engine.save_checkpoint(save_dir, tag=tag)
        if durable:
            torch_nebula.flush_persistence()
        out[key] = state_of(engine, stage)
        params = full_params(engine, stage)
        if rank == 0:
            torch.save(params, root / f"expected-{key}.pt")

    data = batches(rank)
    train(data[:2])
    save(None, "global_step2")
    save("best", "best_replaced")
    save("final", "final_replaced")
    train(data[2:])
    save(None, "global_step4_replaced")
    save("best", "best")  # the same tag again: replaces it
    save("final", "final", durable=False)
    import nebulaml as nm

    manifest = Path(nm.memory_tier_path(root / "nebula")) / "final" / "manifest.json"
    items = json.loads(manifest.read_text())["items"]
    out["final_items"] = sorted([i["name"], i["checksum"]["value"]] for i in items)
    engine.load_checkpoint(save_dir, tag="best")  # in the job: the new version
    _settle(engine)
    out["best_loaded_in_job"] = state_of(engine, stage)
    engine.load_checkpoint(save_dir, tag="global_step2")  # a rollback...
    _settle(engine)
    train(batches(rank + 10)[:2])  # ... and other steps, up to global_step4 again
    save(None, "latest")
    out["global_steps"] = engine.global_steps
    return out


def zero_to_fp32(root: Path, tags: tuple[str | None, ...] = ("best", None)) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for tag in tags:
        for save_dir, name in (("ds", ""), ("native", "native-")):
            if (root / save_dir / (tag or "")).exists():
                fp32 = get_fp32_state_dict_from_zero_checkpoint(str(root / save_dir), tag=tag)
                torch.save(dict(fp32), root / f"zero_to_fp32-{name}{tag or 'latest'}.pt")


def main() -> int:
    phase, workdir, stages = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if phase == "fp32":
        for stage in stages.split(","):
            zero_to_fp32(workdir / f"resave{stage}")
        print("OK fp32", flush=True)
        return 0
    if phase == "fp32-kill":
        for stage in stages.split(","):
            zero_to_fp32(workdir / f"kill{stage}", ("global_step4", "global_step6"))
        print("OK fp32", flush=True)
        return 0
    import deepspeed  # here, not at the top: pytest collects this file for doctests

    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    if phase in PARTS:
        resave_stages = sys.argv[4]
        for name, part, lazy in PARTS[phase]:
            folder = workdir / name
            folder.mkdir(exist_ok=True)
            # Read by each init: every part has its own memory tier, as its own job would.
            os.environ["NEBULA_MEMORY_TIER_PATH"] = str(folder / "memory-tier")
            os.environ["NEBULA_LAZY_SNAPSHOT"] = "1" if lazy else "0"
            run_phase(part, folder, resave_stages if name == "resave" else stages, rank)
        print(f"OK {phase} rank {rank}", flush=True)
        return 0
    run_phase(phase, workdir, stages, rank)
    print(f"OK {phase} rank {rank}", flush=True)
    return 0


# What one pair of processes runs for several tests (DeepSpeed's import alone costs ~6 s of
# CPU per process): (folder, phase, NEBULA_LAZY_SNAPSHOT) in turn.
PARTS = {
    "first": (("plain", "train", False), ("lazy", "train", True), ("resave", "resave", False)),
    "second": (("plain", "resume", False), ("lazy", "resume", True), ("resave", "reload", False)),
}


def run_phase(phase: str, workdir: Path, stages: str, rank: int) -> None:
    """PHASE for each ZeRO stage of STAGES; the per-rank JSON, then a barrier."""
    results = {}
    for stage in (int(s) for s in stages.split(",")):
        t0 = time.perf_counter()
        if phase in ("resave", "reload"):
            results[str(stage)] = run_resave(phase, workdir / f"resave{stage}", stage, rank)
        elif phase == "kill":
            run_kill(workdir / f"kill{stage}", stage, rank)
        elif phase == "revive":
            results[str(stage)] = run_revive(workdir / f"kill{stage}", stage, rank)
        else:
            results[str(stage)] = run_stage(phase, workdir / f"zero{stage}", stage, rank)
        print(f"{phase} zero{stage} rank {rank}: {time.perf_counter() - t0:.1f} s", flush=True)
    (workdir / f"{phase}-rank{rank}.json").write_text(json.dumps(results, indent=1))
    torch.distributed.barrier()


if __name__ == "__main__":
    sys.exit(main())
