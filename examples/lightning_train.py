"""Lightning with nebula checkpoints, as the seed's Lightning section writes it.

    python examples/lightning_train.py [--root DIR] [--package lightning|pytorch_lightning]

[1] trains a small regression model with
        Trainer(plugins=[nm.NebulaCheckpointIO()],
                callbacks=[nm.NebulaCallback(<ModelCheckpoint arguments>,
                                             config_params=config_params)])
    (ModelCheckpoint saves every few steps, through nebula), then saves by hand with
        trainer.save_checkpoint("example.ckpt",
                                storage_options={"is_best": True, "persist_path": ...})
[2] a new process loads the newest checkpoint with
        MyLightningModule.load_from_checkpoint(
            nm.get_latest_checkpoint_path("checkpoint", persist_path))
    checks that its weights are those saved, and resumes training with
        trainer.fit(model, ckpt_path=".../example.ckpt")
    although no file exists at that path: nebula holds the checkpoint.

Either Lightning package works; `--package` chooses which one this script imports, and
`nm.NebulaCheckpointIO` / `nm.NebulaCallback` follow it.

Single process, for brevity: under DDP (torchrun, or Lightning's own launcher) the same
code saves on rank 0 alone, and every rank resumes from it (docs/integrations.md).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import nebulaml as nm

PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}


def lightning_module_class(pl: Any) -> type:
    """MyLightningModule, for the chosen package."""

    class MyLightningModule(pl.LightningModule):
        """y = f(x) for a fixed random f: a two-layer MLP learns it in a few dozen steps."""

        def __init__(self, hidden: int = 32, lr: float = 0.01) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def on_train_start(self) -> None:
            self.first_step = self.trainer.global_step  # where fit started (or resumed)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    return MyLightningModule


def data_loader() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=gen)
    y = torch.tanh(x @ torch.randn(16, 1, generator=gen))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def weights_digest(model: torch.nn.Module) -> str:
    hasher = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        hasher.update(name.encode())
        hasher.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return hasher.hexdigest()


def quiet_trainer_options(workdir: Path) -> dict[str, Any]:
    return dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(workdir),
    )


def train(args: argparse.Namespace, pl: Any) -> str:
    """[1]: fit with NebulaCallback + NebulaCheckpointIO, then save example.ckpt by hand."""
    MyLightningModule = lightning_module_class(pl)
    workdir = Path(args.root)
    persist_path = str(workdir / "tier3" / "checkpoint")

    # define NebulaCallback (the seed's code)
    config_params = dict()
    config_params["persistent_storage_path"] = persist_path
    config_params["persistent_time_interval"] = 10
    nebula_checkpoint_callback = nm.NebulaCallback(
        dirpath=str(workdir / "checkpoints"),  # Original ModelCheckpoint params
        every_n_train_steps=args.ckpt_every,
        save_top_k=-1,
        config_params=config_params,  # customize the config of init nebula
    )
    trainer = pl.Trainer(
        max_steps=args.steps,
        plugins=[nm.NebulaCheckpointIO()],  # add NebulaCheckpointIO as a plugin
        callbacks=[nebula_checkpoint_callback],  # use NebulaCallback as a plugin
        **quiet_trainer_options(workdir),
    )
    model = MyLightningModule()
    trainer.fit(model, data_loader())
    plugin = type(trainer.strategy.checkpoint_io).__name__
    print(f"[1] trained to step {trainer.global_step} with {plugin}")
    print(f"    ModelCheckpoint saved through nebula: {[c['tag'] for c in nm.list_checkpoints()]}")

    # Saving checkpoints by hand (the seed's code)
    storage_options = {}
    storage_options["is_best"] = True
    storage_options["persist_path"] = persist_path
    trainer.save_checkpoint(
        str(workdir / "example.ckpt"),
        storage_options=storage_options,  # customize the config of Nebula saving checkpoint
    )
    digest = weights_digest(model)
    labels = next(c["labels"] for c in nm.list_checkpoints(persist_path) if c["tag"] == "example")
    print(f"    saved example.ckpt as nebula tag 'example', labels {labels} (sha256 {digest[:16]})")
    print(f"    a file at {workdir / 'example.ckpt'}? {(workdir / 'example.ckpt').exists()}")
    nm.shutdown()  # persist what is pending before the next process starts (exit does it too)
    return digest


def resume(args: argparse.Namespace, pl: Any) -> int:
    """[2], in a new process: load_from_checkpoint the newest, then fit from example.ckpt."""
    MyLightningModule = lightning_module_class(pl)
    workdir = Path(args.root)
    persist_path = str(workdir / "tier3" / "checkpoint")

    latest_ckpt_path = nm.get_latest_checkpoint_path("checkpoint", persist_path)
    model = MyLightningModule.load_from_checkpoint(latest_ckpt_path)
    digest = weights_digest(model)
    same = digest == args.expect
    print(
        f"[2] load_from_checkpoint({latest_ckpt_path}): weights {'identical' if same else 'DIFFER'}"
    )
    if not same:
        return 2

    config_params = {"persistent_storage_path": persist_path, "persistent_time_interval": 10}
    nebula_checkpoint_callback = nm.NebulaCallback(
        dirpath=str(workdir / "checkpoints"),
        every_n_train_steps=args.ckpt_every,
        save_top_k=-1,
        config_params=config_params,
    )
    trainer = pl.Trainer(
        max_steps=2 * args.steps,
        plugins=[nm.NebulaCheckpointIO()],
        callbacks=[nebula_checkpoint_callback],
        **quiet_trainer_options(workdir),
    )
    fresh = MyLightningModule()
    trainer.fit(fresh, data_loader(), ckpt_path=str(workdir / "example.ckpt"))
    started = fresh.first_step
    finished = trainer.global_step
    print(
        f"    trainer.fit(ckpt_path=example.ckpt) resumed at step {started}, finished at {finished}"
    )
    print(f"    checkpoints: {[c['tag'] for c in nm.list_checkpoints(persist_path)]}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", help="working folder (default: a new temporary one)")
    parser.add_argument("--package", choices=sorted(PACKAGES), default="lightning")
    parser.add_argument("--steps", type=int, default=24, help="steps of the first run")
    parser.add_argument("--ckpt-every", type=int, default=8)
    parser.add_argument("--phase", choices=("all", "resume"), default="all", help=argparse.SUPPRESS)
    parser.add_argument("--expect", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pl = importlib.import_module(PACKAGES[args.package])  # the one package this program uses
    if args.phase == "resume":
        return resume(args, pl)
    started = time.monotonic()
    temporary = args.root is None
    args.root = args.root or tempfile.mkdtemp(prefix="nebula-lightning-")
    try:
        digest = train(args, pl)
        child = [sys.executable, os.path.abspath(__file__), "--phase", "resume", "--expect", digest]
        child += ["--root", args.root, "--package", args.package, "--steps", str(args.steps)]
        child += ["--ckpt-every", str(args.ckpt_every)]
        returncode = subprocess.run(child, check=False).returncode
    finally:
        if temporary:
            shutil.rmtree(args.root, ignore_errors=True)
            shutil.rmtree(
                nm.memory_tier_path(str(Path(args.root) / "tier3" / "checkpoint")),
                ignore_errors=True,
            )
    if returncode == 0:
        print(f"lightning example ({args.package}) passed in {time.monotonic() - started:.0f} s")
    return returncode


if __name__ == "__main__":
    sys.exit(main())
