"""DeepSpeed with nebula checkpoints: the seed's `"nebula"` block in the DeepSpeed config.

    python examples/deepspeed_train.py [--root DIR] [--zero-stage 0-3] [--steps N]

Runs on the CPU (DS_ACCELERATOR=cpu, gloo) as a single process, or as one rank of a job
started by a launcher (`torchrun --nproc-per-node 2 examples/deepspeed_train.py ...`).
DeepSpeed's own NebulaCheckpointEngine (deepspeed 0.19.6) does the checkpointing: with

    "nebula": {"enabled": true, "persistent_storage_path": "<root>/nebula",
               "persistent_time_interval": 100, "num_of_version_in_retention": 2,
               "enable_nebula_load": true}

in the config, `model_engine.save_checkpoint(save_dir)` writes each checkpoint through
`torch_nebula` (DeepSpeed leaves only empty placeholder files and its `latest` file in
save_dir) and `model_engine.load_checkpoint(save_dir)` reads it back through nebula. No
line of the training code mentions nebula.

[1] trains a small MLP with ZeRO, saving every few steps; [2] a new process (new ranks)
builds the model from another seed, calls `load_checkpoint`, checks that parameters and
optimizer state are those saved, and trains on; [3] `nebula ls` lists the checkpoints.

Not for: GPUs or benchmarks; the model is tiny on purpose.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def ds_config(root: Path, stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10_000,
        "nebula": {
            "enabled": True,
            "persistent_storage_path": str(root / "nebula"),
            "persistent_time_interval": 100,
            "num_of_version_in_retention": 2,
            "enable_nebula_load": True,
        },
    }


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=gen)
    return x, torch.tanh(x.sum(dim=1, keepdim=True))


def state_digest(engine: Any, stage: int) -> str:
    """sha256 over the full parameters and this rank's optimizer tensors."""
    import deepspeed

    params = list(engine.module.parameters())
    hasher = hashlib.sha256()

    def add(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            hasher.update(obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        elif isinstance(obj, dict):
            for key in sorted(obj, key=repr):
                hasher.update(repr(key).encode())
                add(obj[key])
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                add(value)
        elif isinstance(obj, (int, float, str, bool)) or obj is None:
            hasher.update(repr(obj).encode())

    if stage == 3:
        with deepspeed.zero.GatheredParameters(params):
            add([p.detach().clone() for p in params])
    else:
        add([p.detach().clone() for p in params])
    add(engine.optimizer.state_dict())
    return hasher.hexdigest()


def run_rank(args: argparse.Namespace) -> int:
    """One rank of phase [1] (train) or [2] (resume)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    root = Path(args.root)
    save_dir = str(root / "ds-checkpoints")
    resume = args.phase == "resume"
    model = build_model(seed=1 if resume else 0)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(root, args.zero_stage)
    )
    say = print if rank == 0 else (lambda *_a, **_k: None)
    journal = root / f"digest-rank{rank}"
    step = 0
    if resume:
        load_path, client_state = engine.load_checkpoint(save_dir)
        step = int(client_state["step"])
        same = state_digest(engine, args.zero_stage) == journal.read_text()
        engine_name = type(engine.checkpoint_engine).__name__
        say(f"[2] load_checkpoint: {load_path}, step {step}, {engine_name}")
        verdict = "identical to" if same else "DIFFER from"
        say(f"    parameters and optimizer state {verdict} what was saved")
        if not same:
            return 2
    else:
        engine_name = type(engine.checkpoint_engine).__name__
        say(f"[1] ZeRO stage {args.zero_stage}, checkpoint engine {engine_name}")
    last = args.steps * (2 if resume else 1)
    while step < last:
        step += 1
        x, y = batch(step, rank)
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if step % args.ckpt_every == 0 and not resume:
            engine.save_checkpoint(save_dir, client_state={"step": step})
            tag = f"global_step{engine.global_steps}"
            say(f"    step {step:>3}  loss {loss.item():.4f}  save_checkpoint -> {tag}")
    if not resume:
        journal.write_text(state_digest(engine, args.zero_stage))
    else:
        say(f"    trained on to step {step}, loss {loss.item():.4f}")
    torch.distributed.barrier()
    return 0


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def launch(args: argparse.Namespace, phase: str) -> int:
    """Start the phase as a new single-rank job (what a launcher does, for one process)."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    argv = [sys.executable, os.path.abspath(__file__), "--phase", phase, "--root", args.root]
    argv += ["--zero-stage", str(args.zero_stage), "--steps", str(args.steps)]
    argv += ["--ckpt-every", str(args.ckpt_every)]
    return subprocess.run(argv, env=env, check=False).returncode


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", help="working folder (default: a new temporary one)")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=2)
    parser.add_argument("--steps", type=int, default=12, help="steps of the first run")
    parser.add_argument("--ckpt-every", type=int, default=4)
    parser.add_argument(
        "--phase", choices=("all", "train", "resume"), default="all", help=argparse.SUPPRESS
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase != "all" or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        if args.phase == "all":
            raise SystemExit("under a launcher, run --phase train, then --phase resume")
        return run_rank(args)
    started = time.monotonic()
    temporary = args.root is None
    args.root = args.root or tempfile.mkdtemp(prefix="nebula-deepspeed-")
    try:
        for phase in ("train", "resume"):
            code = launch(args, phase)
            if code != 0:
                print(f"deepspeed example FAILED in phase {phase} (exit {code})")
                return code
        print("[3] nebula ls:", flush=True)
        nebula = Path(sys.executable).parent / "nebula"
        subprocess.run([str(nebula), "ls", str(Path(args.root) / "nebula")], check=True)
    finally:
        if temporary:
            import nebulaml as nm

            shutil.rmtree(nm.memory_tier_path(str(Path(args.root) / "nebula")), ignore_errors=True)
            shutil.rmtree(args.root, ignore_errors=True)
    print(f"deepspeed example passed in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
