"""NebulaCheckpointIO and NebulaCallback with real Trainers of `lightning` and of
`pytorch_lightning` 2.6 (every test runs once per package), in this process."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from frameworks import require

import nebulaml as nm
from nebulaml.integrations.lightning_common import tag_for_path

PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}


@dataclass(frozen=True, slots=True)
class Kit:
    """One Lightning package: its module, nebula's classes for it, and a tiny model."""

    pl: ModuleType
    ours: ModuleType
    Module: type
    Recorder: type

    def trainer(self, tmp_path: Path, **kwargs: Any) -> Any:
        options: dict[str, Any] = dict(
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(tmp_path / "lightning"),
        )
        options.update(kwargs)
        return self.pl.Trainer(**options)


def _kit(package: str) -> Kit:
    require(package)
    pl = importlib.import_module(PACKAGES[package])
    ours = importlib.import_module(f"nebulaml.{package}")

    class TinyModule(pl.LightningModule):  # type: ignore[name-defined,misc]
        def __init__(self, hidden: int = 8, lr: float = 0.05, extra: Any = None) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
            )
            self.seen_steps: list[int] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.seen_steps.append(self.trainer.global_step)
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    class Recorder(pl.Callback):  # type: ignore[name-defined,misc]
        """What the model and optimizer hold when training (re)starts."""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.params = {k: v.clone() for k, v in pl_module.state_dict().items()}
            self.optimizer = _clone(trainer.optimizers[0].state_dict()["state"])
            self.global_step = trainer.global_step

    return Kit(pl, ours, TinyModule, Recorder)


@pytest.fixture(params=sorted(PACKAGES))
def kit(request: pytest.FixtureRequest) -> Kit:
    return _kit(request.param)


def _clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    return state


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _loader() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=gen), torch.randn(32, 1, generator=gen)
    )
    return torch.utils.data.DataLoader(data, batch_size=4)


def _tags(root: Path) -> list[str]:
    return [c["tag"] for c in nm.list_checkpoints(str(root))]


# fit, callback, plugin ------------------------------------------------------------------
def test_fit_checkpoints_through_nebula(kit: Kit, tmp_path: Path) -> None:
    """The seed's Trainer(plugins=[NebulaCheckpointIO()], callbacks=[NebulaCallback(...)]).
    Bugs caught: the plugin not used (checkpoints written at the paths), a wrong tag or
    item name, config_params not reaching nm.init, a checkpoint missing Lightning's state,
    one that ModelCheckpoint keeps dropped by nebula's retention (2 versions by default),
    no pointer file for Lightning to find."""
    root = tmp_path / "tier3"
    ckpt_dir = tmp_path / "ckpts"
    callback = kit.ours.NebulaCallback(
        dirpath=str(ckpt_dir),
        every_n_train_steps=2,
        save_top_k=-1,
        config_params={"persistent_storage_path": str(root), "persistent_time_interval": 10},
    )
    model = kit.Module()
    trainer = kit.trainer(
        tmp_path, max_steps=6, plugins=[kit.ours.NebulaCheckpointIO()], callbacks=[callback]
    )
    trainer.fit(model, _loader())
    nm.flush_persistence()

    kept = ["epoch=0-step=6", "epoch=0-step=4", "epoch=0-step=2"]  # save_top_k=-1: all
    assert _tags(root) == kept
    listed = {c["tag"]: c for c in nm.list_checkpoints(str(root))}
    for tag in kept:  # none skipped for a newer one within the interval
        assert "persistent" in listed[tag]["tiers"] and listed[tag]["labels"] == ["lightning"]
    # At each path, a pointer to the checkpoint (never the checkpoint's data).
    assert sorted(p.name for p in ckpt_dir.iterdir()) == sorted(f"{t}.ckpt" for t in kept)
    for tag in kept:
        pointer = json.loads((ckpt_dir / f"{tag}.ckpt").read_text())
        assert pointer["nebula_checkpoint"] == tag and pointer["item"] == "checkpoint"
    assert Path(callback.best_model_path).name == "epoch=0-step=6.ckpt"
    path = nm.get_latest_checkpoint_path("checkpoint", str(root))
    assert path is not None and path.startswith(str(root))
    saved = torch.load(path, weights_only=True)  # a plain Lightning checkpoint
    assert saved["global_step"] == 6
    assert _same(saved["state_dict"], model.state_dict())
    assert saved["optimizer_states"] and saved["callbacks"]
    assert saved["hyper_parameters"]["hidden"] == 8


def test_lazy_snapshots_in_fit_hold_the_state_of_their_step(kit: Kit, tmp_path: Path) -> None:
    """`lazy_snapshot=True` through config_params, with BatchNorm in the model: training
    goes on while the copy is taken. Bugs caught: a lazy copy that waits for ever in a
    Lightning loop (its commit or fence never reached), or a checkpoint holding a later
    step's weights, Adam moments or running statistics."""
    root = tmp_path / "tier3"
    callback = kit.ours.NebulaCallback(
        dirpath=str(tmp_path / "ckpts"),
        every_n_train_steps=2,
        save_top_k=-1,
        config_params={
            "persistent_storage_path": str(root),
            "persistent_time_interval": 0,
            "num_of_version_in_retention": 5,  # step 2 must stay to be compared
            "lazy_snapshot": True,
        },
    )

    class AtStep2(kit.pl.Callback):  # type: ignore[name-defined,misc]
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *_args: Any) -> None:
            if trainer.global_step == 2:
                self.params = {k: v.clone() for k, v in pl_module.state_dict().items()}
                self.optimizer = _clone(trainer.optimizers[0].state_dict()["state"])

    at_step2 = AtStep2()
    model = kit.Module()
    model.net = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    )
    trainer = kit.trainer(
        tmp_path,
        max_steps=6,
        plugins=[kit.ours.NebulaCheckpointIO()],
        callbacks=[callback, at_step2],
    )
    trainer.fit(model, _loader())
    nm.flush_persistence()

    saved = nm.get_checkpoint("epoch=0-step=2").load("checkpoint")
    assert saved["global_step"] == 2
    assert _same(saved["state_dict"], at_step2.params)
    assert _same(saved["optimizer_states"][0]["state"], at_step2.optimizer)
    assert not _same(saved["state_dict"], model.state_dict())  # training went on
    assert nm.get_latest_checkpoint().tag == "epoch=0-step=6"


def test_load_from_checkpoint_with_the_latest_path(kit: Kit, tmp_path: Path) -> None:
    """The seed's MyLightningModule.load_from_checkpoint(nm.get_latest_checkpoint_path(
    "checkpoint", persist_path)). Bug caught: an item Lightning's own loader cannot read,
    or hyper-parameters lost."""
    root = tmp_path / "tier3" / "checkpoint"
    nm.init(str(root), persistent_time_interval=0)
    model = kit.Module(hidden=6)
    trainer = kit.trainer(
        tmp_path, max_steps=3, plugins=[kit.ours.NebulaCheckpointIO()], enable_checkpointing=False
    )
    trainer.fit(model, _loader())
    trainer.save_checkpoint(str(tmp_path / "example.ckpt"))
    nm.flush_persistence()

    restored = kit.Module.load_from_checkpoint(nm.get_latest_checkpoint_path("checkpoint", root))
    assert restored.hparams.hidden == 6
    assert _same(restored.state_dict(), model.state_dict())


def test_fit_resumes_from_a_path_whose_folder_does_not_exist(kit: Kit, tmp_path: Path) -> None:
    """trainer.fit(model, ckpt_path=...) resumes from nebula alone. Bug caught: a load that
    looks for the file at the path, or restores weights but not the optimizer or step."""
    nm.init(str(tmp_path / "tier3"), persistent_time_interval=0)
    path = tmp_path / "gone" / "example.ckpt"
    first = kit.Module()
    trainer = kit.trainer(
        tmp_path, max_steps=4, plugins=[kit.ours.NebulaCheckpointIO()], enable_checkpointing=False
    )
    trainer.fit(first, _loader())
    trainer.save_checkpoint(str(path))
    saved_params = _clone(first.state_dict())
    saved_optimizer = _clone(trainer.optimizers[0].state_dict()["state"])
    assert not path.parent.exists()

    torch.manual_seed(123)
    second, recorder = kit.Module(), kit.Recorder()
    assert not _same(second.state_dict(), saved_params)
    resumed = kit.trainer(
        tmp_path,
        max_steps=8,
        plugins=[kit.ours.NebulaCheckpointIO()],  # a new plugin: it knows no earlier save
        callbacks=[recorder],
        enable_checkpointing=False,
    )
    resumed.fit(second, _loader(), ckpt_path=str(path))
    assert recorder.global_step == 4
    assert _same(recorder.params, saved_params)
    assert _same(recorder.optimizer, saved_optimizer)
    assert second.seen_steps == [4, 5, 6, 7]


def test_is_best_is_a_label_that_retention_and_prune_keep(kit: Kit, tmp_path: Path) -> None:
    """The seed's trainer.save_checkpoint("example.ckpt", storage_options={"is_best": True,
    "persist_path": ...}). Bugs caught: is_best ignored (retention deletes the best),
    persist_path ignored (saved into init's root)."""
    first_root, root = tmp_path / "from-init", tmp_path / "tier3" / "checkpoint"
    nm.init(str(first_root), persistent_time_interval=0, num_of_version_in_retention=1)
    trainer = kit.trainer(
        tmp_path, max_steps=2, plugins=[kit.ours.NebulaCheckpointIO()], enable_checkpointing=False
    )
    trainer.fit(kit.Module(), _loader())
    storage_options = {"is_best": True, "persist_path": str(root)}
    trainer.save_checkpoint(str(tmp_path / "example.ckpt"), storage_options=storage_options)
    for name in ("later1", "later2", "later3"):
        trainer.save_checkpoint(str(tmp_path / f"{name}.ckpt"))
        nm.flush_persistence()

    assert _tags(first_root) == []
    persisted = {c["tag"]: c for c in nm.list_checkpoints(str(root)) if "persistent" in c["tiers"]}
    assert sorted(persisted) == ["example", "later3"]  # retention 1 (+ the labelled one)
    assert persisted["example"]["labels"] == ["best"]
    plan = nm.plan_prune(nm.list_prune_candidates(str(root)), keep=1)
    assert [d.tag for d in plan.protected] == ["later3", "example"]
    assert not plan.delete


def test_load_checkpoint_passes_weights_only_on(kit: Kit, tmp_path: Path) -> None:
    """Bugs caught: weights_only dropped (a pickle that needs code loads without the
    caller's consent), or True forced (the caller's explicit False ignored)."""
    nm.init(str(tmp_path / "tier3"), persistent_time_interval=0)
    model = kit.Module(extra=argparse.Namespace(note="not a tensor"))
    trainer = kit.trainer(
        tmp_path, max_steps=2, plugins=[kit.ours.NebulaCheckpointIO()], enable_checkpointing=False
    )
    trainer.fit(model, _loader())
    path = str(tmp_path / "example.ckpt")
    trainer.save_checkpoint(path)

    io = kit.ours.NebulaCheckpointIO()
    for weights_only in (None, True):
        with pytest.raises(nm.UnsafeCheckpointError, match="Namespace"):
            io.load_checkpoint(path, weights_only=weights_only)
    assert io.load_checkpoint(path, weights_only=False)["hyper_parameters"]["extra"].note
    again = kit.trainer(
        tmp_path, max_steps=3, plugins=[kit.ours.NebulaCheckpointIO()], enable_checkpointing=False
    )
    with pytest.raises(nm.UnsafeCheckpointError):
        again.fit(kit.Module(), _loader(), ckpt_path=path)
    again = kit.trainer(
        tmp_path, max_steps=3, plugins=[kit.ours.NebulaCheckpointIO()], enable_checkpointing=False
    )
    again.fit(kit.Module(), _loader(), ckpt_path=path, weights_only=False)
    assert again.global_step == 3


# the plugin on its own -----------------------------------------------------------------
def test_remove_checkpoint_deletes_from_every_tier_whatever_its_labels(
    kit: Kit, tmp_path: Path
) -> None:
    """ModelCheckpoint removes what falls out of its top k, and its decisions are the
    retention. Bugs caught: nothing deleted (storage grows), a labelled or the newest
    checkpoint kept (the persistent tier's newest is often one ModelCheckpoint dropped:
    it stayed for ever), a removed one persisted after all."""
    root = tmp_path / "tier3"
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10)
    io = kit.ours.NebulaCheckpointIO()
    for name, best in (("a", False), ("b", True), ("c", False), ("d", False)):
        io.save_checkpoint({"w": torch.ones(2)}, tmp_path / f"{name}.ckpt", {"is_best": best})
        nm.flush_persistence()
    for name in ("a", "b", "d"):
        io.remove_checkpoint(tmp_path / f"{name}.ckpt")
    nm.flush_persistence()  # the persister's thread deletes them
    assert _tags(root) == ["c"]
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith((".", "check"))) == ["c"]
    memory = Path(nm.memory_tier_path(str(root)))
    assert not [p for p in memory.iterdir() if p.name in ("a", "b", "d")]
    with pytest.raises(nm.CheckpointNotFoundError):
        io.load_checkpoint(tmp_path / "a.ckpt")
    # Removed before its persist: never persisted.
    nm.init(str(root), persistent_time_interval=3600, num_of_version_in_retention=10)
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "e.ckpt")
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "f.ckpt")  # e waits: the interval
    io.remove_checkpoint(tmp_path / "e.ckpt")
    nm.flush_persistence()
    assert _tags(root) == ["f", "c"]


@pytest.mark.slow
def test_saving_a_path_again_replaces_its_checkpoint(kit: Kit, tmp_path: Path) -> None:
    """last.ckpt is saved again and again. Bug caught: CheckpointExistsError on the second
    save, or the persister losing the tag while it is replaced (PersistError)."""
    root = tmp_path / "tier3"
    nm.init(str(root), persistent_time_interval=0)
    io = kit.ours.NebulaCheckpointIO()
    for value in range(20):
        io.save_checkpoint({"w": torch.full((1 << 16,), float(value))}, tmp_path / "last.ckpt")
    nm.flush_persistence()
    assert io.load_checkpoint(tmp_path / "last.ckpt")["w"][0] == 19.0
    persisted = torch.load(root / "last" / "checkpoint", weights_only=True)
    assert persisted["w"][0] == 19.0


def test_paths_name_tags_and_bad_ones_are_refused(kit: Kit, tmp_path: Path) -> None:
    """Bugs caught: a path that climbs out of the root, an unknown storage option or a
    several-rank job accepted silently."""
    assert tag_for_path("/a/b/epoch=1-step=8.ckpt") == "epoch=1-step=8"
    assert tag_for_path(Path("last.ckpt")) == "last"
    assert tag_for_path("s3://bucket/run/model.v2") == "model.v2"
    io = kit.ours.NebulaCheckpointIO()
    nm.init(str(tmp_path / "tier3"))
    with pytest.raises(nm.InvalidNameError):
        io.save_checkpoint({}, tmp_path / ".hidden.ckpt")
    with pytest.raises(nm.InvalidNameError):
        io.load_checkpoint(tmp_path / "..ckpt")
    with pytest.raises(nm.InvalidArgumentError, match="is_best, persist_path"):
        io.save_checkpoint({}, tmp_path / "x.ckpt", {"best": True})
    assert _tags(tmp_path / "tier3") == []


def test_rank_0_of_several_commits_its_checkpoint_alone(
    kit: Kit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning saves on rank 0 only: the checkpoint is rank 0's (`ranks=[0]`) and commits
    without the other ranks (real DDP jobs: test_lightning_ddp.py). Bug caught: rank 0
    waiting rank_timeout_s for parts that never come, then failing."""
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(var, value)
    nm.init(str(tmp_path / "tier3"), persistent_time_interval=0, rank_timeout_s=30)
    started = time.monotonic()
    kit.ours.NebulaCheckpointIO().save_checkpoint({"step": 1}, tmp_path / "x.ckpt")
    nm.flush_persistence()
    assert time.monotonic() - started < 20
    found = nm.get_checkpoint("x", str(tmp_path / "tier3"))
    assert found is not None and found.load("checkpoint") == {"step": 1}
    assert nm.list_incomplete(str(tmp_path / "tier3")) == []


def test_the_callback_warns_without_the_plugin_and_refuses_link(kit: Kit, tmp_path: Path) -> None:
    """Bugs caught: a NebulaCallback that silently checkpoints with torch.save, and
    save_last='link' (a symlink to a file nebula never writes)."""
    callback = kit.ours.NebulaCallback(dirpath=str(tmp_path / "ckpts"))
    trainer = kit.trainer(tmp_path, max_steps=1, callbacks=[callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(kit.Module(), _loader())
    assert any("plugins=[nm.NebulaCheckpointIO()]" in str(w.message) for w in caught)
    with pytest.raises(nm.InvalidArgumentError, match="save_last=True"):
        kit.ours.NebulaCallback(save_last="link")


def test_peer_replicas_reach_nm_init_at_setup(
    kit: Kit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`config_params={"peer_replicas": 1}` before torch.distributed is up (Lightning sets
    the process group up after the callback is made): nebula starts at the callback's
    `setup` (a one-device Trainer makes no group: replication is off, said once). Bugs
    caught: the key dropped on its way to nm.init, nebula started at construction (or
    from the environment by the plugin) without it, a bad value accepted."""
    from nebulaml.runtime import peers, session

    monkeypatch.setattr(peers, "_warned", set())
    with pytest.raises(nm.InvalidArgumentError, match="peer_replicas must be 0"):
        kit.ours.NebulaCallback(config_params={"peer_replicas": 2})
    root = tmp_path / "tier3"
    params = {"persistent_storage_path": str(root), "peer_replicas": 1}
    callback = kit.ours.NebulaCallback(
        dirpath=str(tmp_path / "ckpts"), every_n_train_steps=2, config_params=params
    )
    assert session.live() is None  # not yet: at setup
    trainer = kit.trainer(
        tmp_path, max_steps=2, plugins=[kit.ours.NebulaCheckpointIO()], callbacks=[callback]
    )
    trainer.fit(kit.Module(), _loader())
    live = session.live()
    assert live is not None and live.config.peer_replicas == 1 and live.peers is None
    assert live.config.persistent_storage_path == str(root)
    nm.flush_persistence()
    assert _tags(root) == ["epoch=0-step=2"]


def test_nm_names_pick_the_package_in_use() -> None:
    """`nm.NebulaCheckpointIO` is the class for the package the program imported; with both
    imported it cannot know. Bug caught: a Trainer given the other package's plugin."""
    for package in PACKAGES:
        require(package)
    # Both are imported in this process (the tests above): the choice is refused, clearly.
    importlib.import_module("lightning.pytorch")
    importlib.import_module("pytorch_lightning")
    with pytest.raises(ImportError, match=r"nebulaml\.pytorch_lightning\.NebulaCheckpointIO"):
        nm.NebulaCheckpointIO()
    assert "NebulaCallback" in dir(nm) and "NebulaCheckpointIO" not in nm.__all__
    assert sys.modules["nebulaml.lightning"].NebulaCheckpointIO.__module__ == "nebulaml.lightning"


def test_ckpt_path_best_and_last_load_what_modelcheckpoint_names(kit: Kit, tmp_path: Path) -> None:
    """After fit, trainer.validate(ckpt_path="best") and ckpt_path="last", as Lightning
    supports them. Bugs caught: "last" not found (Lightning looks for a file in dirpath:
    in fit a silent fresh start), "best" loading another checkpoint, or one that nebula's
    retention (1 version here) dropped; the monitored best not labelled."""
    loaded: list[dict[str, torch.Tensor]] = []

    class WithValidation(kit.Module):  # type: ignore[misc,valid-type]
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", F.mse_loss(self.net(x), y))

    class Seen(kit.pl.Callback):  # type: ignore[name-defined,misc]
        def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
            loaded.append(_clone(pl_module.state_dict()))

    root = tmp_path / "tier3"
    callback = kit.ours.NebulaCallback(
        dirpath=str(tmp_path / "ckpts"),
        monitor="val_loss",
        mode="max",  # the worst: "best" is then an early checkpoint, not the newest
        save_top_k=2,
        save_last=True,
        config_params={
            "persistent_storage_path": str(root),
            "persistent_time_interval": 0,
            "num_of_version_in_retention": 1,
        },
    )
    trainer = kit.trainer(
        tmp_path,
        max_epochs=4,
        num_sanity_val_steps=0,
        plugins=[kit.ours.NebulaCheckpointIO()],
        callbacks=[callback, Seen()],
    )
    trainer.fit(WithValidation(), _loader(), _loader())
    nm.flush_persistence()
    best = Path(callback.best_model_path).stem
    kept = sorted(Path(p).stem for p in callback.best_k_models)
    assert best in kept and sorted(t for t in _tags(root) if t != "last") == kept
    labels = {c["tag"]: c["labels"] for c in nm.list_checkpoints(str(root))}
    assert labels[best] == ["best", "lightning"] and labels["last"] == ["lightning"]

    del loaded[:]
    trainer.validate(WithValidation(), _loader(), ckpt_path="best")
    trainer.validate(WithValidation(), _loader(), ckpt_path="last")
    saved = {t: nm.get_checkpoint(t, str(root)).load("checkpoint") for t in (best, "last")}
    assert saved[best]["global_step"] < saved["last"]["global_step"]
    assert _same(loaded[0], saved[best]["state_dict"])
    assert _same(loaded[1], saved["last"]["state_dict"])
    assert not _same(loaded[0], loaded[1])
