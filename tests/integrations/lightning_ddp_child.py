"""A Lightning DDP job (2 CPU ranks, gloo) that checkpoints through nebula, as the README
shows it (run by test_lightning_ddp.py, not by pytest).

Usage: lightning_ddp_child.py PHASE WORKDIR. Launched by torchrun (RANK, WORLD_SIZE and
the rest set before the script starts) or alone, in which case Lightning's own launcher
starts rank 1 as a copy of this script; either way `nm.NebulaCallback(config_params=...)`
sets nebula up before DDP starts.

PHASE "train": 4 steps, a checkpoint every 2 (`epoch=0-step=2`, `epoch=0-step=4`); each
rank writes WORKDIR/train-rank<r>.json: digests of its parameters and optimizer state at
the end. PHASE "resume": a model of another seed resumes with `ckpt_path` set to the
step-4 checkpoint's path; each rank writes WORKDIR/resume-rank<r>.json: the same digests
as training starts again, and the global step.

PHASE "managed CKPT KILL_AT": ModelCheckpoint as users write it (monitor="train_loss",
save_top_k=2, save_last=True: a checkpoint at each epoch's end), 6 epochs of 4 steps;
`ckpt_path` CKPT ("none", "last", or a path), and rank 1 SIGKILLs itself as it starts
global step KILL_AT (0: never). Each rank writes WORKDIR/managed-rank<r>.json at the end:
the digests, the global step, and ModelCheckpoint's best_k_models and last_model_path.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

import nebulaml as nm


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def digests(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    state = optimizer.state_dict()["state"]
    return {
        "params": {k: digest(v) for k, v in module.state_dict().items()},
        "optimizer": {
            f"{i}.{k}": digest(v)
            for i, s in sorted(state.items())
            for k, v in sorted(s.items())
            if isinstance(v, torch.Tensor)
        },
    }


class TinyModule(pl.LightningModule):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.05)


class Recorder(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if "resume" in self.path.name:
            self._write(trainer, pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if "train" in self.path.name:
            self._write(trainer, pl_module)

    def _write(self, trainer: Any, pl_module: Any) -> None:
        record = digests(pl_module, trainer.optimizers[0])
        record["global_step"] = trainer.global_step
        record["world_size"] = trainer.world_size
        path = self.path.with_name(self.path.name.replace("RANK", str(trainer.global_rank)))
        path.write_text(json.dumps(record))


def loader(samples: int = 64) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(samples, 4, generator=gen), torch.randn(samples, 1, generator=gen)
    )
    return torch.utils.data.DataLoader(data, batch_size=4)


class KillRank1(pl.Callback):
    """Rank 1 SIGKILLs itself as it starts global step `at` (a node lost mid-epoch)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer: Any, *_args: Any) -> None:
        if self.at and trainer.global_rank == 1 and trainer.global_step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


class TrainLoss(TinyModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss


def managed(work: Path, ckpt: str, kill_at: int) -> int:
    callback = nm.NebulaCallback(
        dirpath=str(work / "ckpts"),
        monitor="train_loss",
        save_top_k=2,
        save_last=True,
        config_params={
            "persistent_storage_path": str(work / "root"),
            "persistent_time_interval": 10,
        },
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=6,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(work / "lightning"),
        plugins=[nm.NebulaCheckpointIO()],
        callbacks=[callback, KillRank1(kill_at)],
    )
    model = TrainLoss(seed=0 if ckpt == "none" else 1)
    trainer.fit(model, loader(32), ckpt_path=None if ckpt == "none" else ckpt)
    record = digests(model, trainer.optimizers[0])
    record["global_step"] = trainer.global_step
    record["best_k_models"] = sorted(Path(p).name for p in callback.best_k_models)
    record["last_model_path"] = Path(callback.last_model_path).name
    (work / f"managed-rank{trainer.global_rank}.json").write_text(json.dumps(record))
    print(f"OK rank {trainer.global_rank} managed", flush=True)
    return 0  # no flush: the exit persists what ModelCheckpoint keeps


def main() -> int:
    phase, work = sys.argv[1], Path(sys.argv[2])
    if phase == "managed":
        return managed(work, sys.argv[3], int(sys.argv[4]))
    callback = nm.NebulaCallback(
        dirpath=str(work / "ckpts"),
        every_n_train_steps=2,
        save_top_k=-1,
        config_params={
            "persistent_storage_path": str(work / "root"),
            "persistent_time_interval": 10,
        },
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=4 if phase == "train" else 6,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(work / "lightning"),
        plugins=[nm.NebulaCheckpointIO()],
        callbacks=[callback, Recorder(work / f"{phase}-rankRANK.json")],
    )
    if phase == "train":
        trainer.fit(TinyModule(seed=0), loader())
    else:
        ckpt = str(work / "ckpts" / "epoch=0-step=4.ckpt")
        trainer.fit(TinyModule(seed=1), loader(), ckpt_path=ckpt)
    nm.flush_persistence()
    print(f"OK rank {trainer.global_rank} {phase}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
