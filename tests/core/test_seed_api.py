"""The seed's Python API, run as the seed writes it, and its documented semantics."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import nebulaml as nm
import torch_nebula


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _assert_state_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype
        assert torch.equal(a[key], b[key]), key


def test_seed_pytorch_snippets_as_written(root: Path) -> None:
    # The seed's lines, with <YOUR STORAGE PATH> and <CKPT_NAME> filled in; note the
    # seed's trailing comma makes the path a one-element tuple.
    model = _model()
    persistent_storage_path = (str(root),)
    nm.init(persistent_storage_path, persistent_time_interval=2)

    checkpoint = nm.Checkpoint("global_step500")
    checkpoint.save("checkpoint", model)

    latest_ckpt = nm.get_latest_checkpoint()
    p0 = latest_ckpt.load("checkpoint")
    _assert_state_equal(p0, model.state_dict())

    ckpts = nm.list_checkpoints()
    assert [c["tag"] for c in ckpts] == ["global_step500"]
    nm.flush_persistence()
    persisted_storage_path = str(root)
    latest_ckpt_path = nm.get_latest_checkpoint_path("checkpoint", persisted_storage_path)
    assert latest_ckpt_path == str(root / "global_step500" / "checkpoint")
    # A plain torch.load with weights_only=True reads the file, bit for bit.
    _assert_state_equal(torch.load(latest_ckpt_path, weights_only=True), model.state_dict())


def test_seed_init_minimal_form(root: Path) -> None:
    nm.init(persistent_storage_path=str(root))
    nm.Checkpoint("global_step1").save("model", {"w": torch.arange(3)})
    assert torch.equal(nm.get_latest_checkpoint().load("model")["w"], torch.arange(3))


def test_save_returns_a_snapshot_not_a_reference(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0)
    weights = torch.randn(1000)
    before = weights.clone()
    ckpt = nm.Checkpoint("global_step1", -2)
    ckpt.save("w", {"w": weights})
    weights.add_(1.0)  # the optimizer step right after save() returns
    ckpt.commit()
    nm.flush_persistence()
    loaded = nm.get_latest_checkpoint().load("w")["w"]
    assert torch.equal(loaded, before)
    assert not torch.equal(loaded, weights)
    assert torch.equal(torch.load(root / "global_step1" / "w", weights_only=True)["w"], before)


def test_optimizer_and_model_objects_are_saved_as_state_dicts(root: Path) -> None:
    nm.init(str(root))
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    ckpt = nm.Checkpoint("global_step7", 2)
    ckpt.save("model", model)
    ckpt.save("optimizer", opt)
    latest = nm.get_latest_checkpoint()
    _assert_state_equal(latest.load("model"), model.state_dict())
    loaded = latest.load("optimizer")
    fresh = torch.optim.AdamW(_model().parameters(), lr=1e-3)
    fresh.load_state_dict(loaded)
    for key, value in opt.state_dict()["state"][0].items():
        assert torch.equal(fresh.state_dict()["state"][0][key], value)


def test_num_of_files_commits_after_k_saves(root: Path) -> None:
    nm.init(str(root))
    ckpt = nm.Checkpoint("global_step3", 2)
    ckpt.save("a", {"x": 1})
    assert nm.get_latest_checkpoint() is None  # not committed after 1 of 2
    ckpt.save("b", {"x": 2})
    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == "global_step3"
    assert latest.load("b") == {"x": 2}
    with pytest.raises(nm.TooManyItemsError, match="num_of_files=2"):
        ckpt.save("c", {"x": 3})


def test_manual_commit_mode(root: Path) -> None:
    nm.init(str(root))
    ckpt = nm.Checkpoint("global_step3", -2)
    for i in range(5):
        ckpt.save(f"part{i}", {"i": i})
    assert nm.get_latest_checkpoint() is None
    assert ckpt.commit() is True
    assert ckpt.commit() is True  # idempotent
    assert nm.list_checkpoints()[0]["items"] == [f"part{i}" for i in range(5)]


@pytest.mark.parametrize("bad", [0, 1.5, "2", True, None])
def test_bad_num_of_files_is_refused(bad: object) -> None:
    with pytest.raises(nm.InvalidArgumentError, match="num_of_files"):
        nm.Checkpoint("global_step1", bad)  # type: ignore[arg-type]


def test_same_item_twice_is_refused(root: Path) -> None:
    nm.init(str(root))
    ckpt = nm.Checkpoint("global_step1", -2)
    ckpt.save("a", {})
    with pytest.raises(nm.InvalidArgumentError, match="already has an item 'a'"):
        ckpt.save("a", {})


def test_resaving_a_committed_tag_is_refused_unless_overwrite(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("m", {"v": 1})
    nm.flush_persistence()
    with pytest.raises(nm.CheckpointExistsError, match="overwrite=True"):
        nm.Checkpoint("global_step1").save("m", {"v": 2})
    assert nm.get_latest_checkpoint().load("m") == {"v": 1}  # untouched by the refusal
    nm.Checkpoint("global_step1", overwrite=True).save("m", {"v": 3})
    nm.flush_persistence()
    assert nm.get_latest_checkpoint().load("m") == {"v": 3}
    assert torch.load(root / "global_step1" / "m", weights_only=True) == {"v": 3}


def test_refused_even_when_only_the_persistent_tier_has_it(root: Path, tmp_path: Path) -> None:
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("m", {"v": 1})
    nm.flush_persistence()
    nm.shutdown()
    # A new job on another node: a fresh memory tier, the same persistent root.
    os.environ["NEBULA_MEMORY_TIER_PATH"] = str(tmp_path / "other-node")
    nm.init(str(root), persistent_time_interval=0)
    with pytest.raises(nm.CheckpointExistsError):
        nm.Checkpoint("global_step1").save("m", {"v": 2})


def test_get_checkpoint_by_tag_and_latest_ordering(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10)
    for step in (9, 10, 100, 20):  # committed out of numeric order
        nm.Checkpoint(f"global_step{step}").save("m", {"step": step})
        nm.flush_persistence()
    assert nm.get_latest_checkpoint().tag == "global_step100"
    assert [c["tag"] for c in nm.list_checkpoints()] == [
        "global_step100",
        "global_step20",
        "global_step10",
        "global_step9",
    ]
    assert nm.get_checkpoint("global_step10").load("m") == {"step": 10}
    assert nm.get_checkpoint("global_step11") is None


def test_a_handle_names_its_step_as_listings_and_ordering_do(root: Path) -> None:
    # Catches: a handle without `.step` (a resume had to parse the tag itself), or one
    # whose step is not the one "latest" ordered by and the listing and manifest record.
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10)
    for tag in ("global_step90", "epoch=3-step=120", "best", "global_step1000"):
        nm.Checkpoint(tag).save("m", {"v": 1})
        nm.flush_persistence()
    latest = nm.get_latest_checkpoint()
    assert (latest.tag, latest.step) == ("global_step1000", 1000)
    listed = {c["tag"]: c["step"] for c in nm.list_checkpoints()}
    assert listed == {"global_step1000": 1000, "epoch=3-step=120": 120, "global_step90": 90,
                      "best": None}  # fmt: skip
    for tag, step in listed.items():
        assert nm.get_checkpoint(tag).step == step
        assert json.loads((root / tag / "manifest.json").read_text())["step"] == step
    assert nm.Checkpoint("global_step7").step == 7  # before any save, too
    assert nm.Checkpoint("global_step٣").step is None  # ASCII digits only, as the order


def test_list_checkpoints_is_json_serialisable_and_names_tiers(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1", labels=["best"]).save("m", {"x": torch.ones(4)})
    nm.flush_persistence()
    (entry,) = json.loads(json.dumps(nm.list_checkpoints()))
    assert entry["tiers"] == ["memory", "persistent"]
    assert entry["step"] == 1
    assert entry["labels"] == ["best"]
    assert entry["items"] == ["m"]
    assert entry["size_bytes"] == os.path.getsize(root / "global_step1" / "m")
    assert entry["committed_at"].endswith("Z")


def test_persist_path_reads_without_init(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step4").save("m", {"v": 4})
    nm.flush_persistence()
    nm.shutdown()
    with pytest.raises(nm.NotInitializedError, match=r"nm\.init"):
        nm.get_latest_checkpoint()
    latest = nm.get_latest_checkpoint(persist_path=str(root))
    assert latest is not None and latest.load("m") == {"v": 4}
    assert nm.get_checkpoint("global_step4", persist_path=str(root)) is not None
    assert nm.get_latest_checkpoint_path("m", str(root)) == str(root / "global_step4" / "m")


def test_latest_path_falls_back_to_memory_tier_and_names_missing_items(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=3600)
    nm.Checkpoint("global_step1").save("m", {"v": 1})
    nm.flush_persistence()
    nm.Checkpoint("global_step2").save("m", {"v": 2})  # held back by the interval
    path = nm.get_latest_checkpoint_path("m")
    assert path is not None and "global_step2" in path
    assert torch.load(path, weights_only=True) == {"v": 2}
    with pytest.raises(nm.ItemNotFoundError, match="its items: 'm'"):
        nm.get_latest_checkpoint_path("optimizer")
    with pytest.raises(nm.ItemNotFoundError):
        nm.get_latest_checkpoint().load("optimizer")


def test_memory_only_when_no_persistent_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the memory-only tier is named after the folder
    nm.init()
    nm.Checkpoint("global_step1").save("m", {"v": 1})
    assert nm.flush_persistence() is True
    assert nm.list_checkpoints()[0]["tiers"] == ["memory"]
    assert nm.get_latest_checkpoint().load("m") == {"v": 1}


def test_environment_supplies_init_defaults(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEBULA_PERSISTENT_STORAGE_PATH", str(root))
    monkeypatch.setenv("NEBULA_PERSISTENT_TIME_INTERVAL", "0")
    monkeypatch.setenv("NEBULA_NUM_OF_VERSION_IN_RETENTION", "1")
    nm.init(None, None, None)  # DeepSpeed passes None for what its config leaves out
    for step in (1, 2, 3):
        nm.Checkpoint(f"global_step{step}").save("m", {"v": step})
        nm.flush_persistence()
    assert sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) == [
        "global_step3"
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"persistent_time_interval": -1}, "persistent_time_interval must be at least 0"),
        ({"persistent_time_interval": "soon"}, "persistent_time_interval must be a float"),
        ({"num_of_version_in_retention": 0}, "num_of_version_in_retention must be at least 1"),
        ({"num_of_version_in_retention": 2.5}, "num_of_version_in_retention must be a int"),
        ({"storage_options": "x"}, "storage_options must be a dict"),
    ],
)
def test_bad_init_values_are_refused(root: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(nm.InvalidArgumentError, match=match):
        nm.init(str(root), **kwargs)


def test_bad_env_value_names_the_variable(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEBULA_PERSISTENT_TIME_INTERVAL", "ten")
    with pytest.raises(nm.InvalidArgumentError, match="NEBULA_PERSISTENT_TIME_INTERVAL"):
        nm.init(str(root))


def test_unknown_init_option_is_a_type_error(root: Path) -> None:
    # A typo (path= for persistent_storage_path=) would otherwise run memory-only.
    with pytest.raises(TypeError, match="'enable_turbo'"):
        nm.init(str(root), enable_turbo=True)
    assert not root.exists()


def test_init_is_idempotent_and_can_switch_roots(root: Path, tmp_path: Path) -> None:
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1", -2).save("a", {})
    nm.init(str(root), persistent_time_interval=0)  # same config: the open handle survives
    nm.init(str(root), persistent_time_interval=0)
    nm.get_latest_checkpoint()
    other = tmp_path / "other-root"
    nm.init(str(other), persistent_time_interval=0)
    nm.Checkpoint("global_step9").save("m", {"v": 9})
    nm.flush_persistence()
    assert nm.get_latest_checkpoint().tag == "global_step9"
    assert (other / "global_step9" / "manifest.json").exists()
    assert not (root / "global_step9").exists()


def test_torch_nebula_is_the_same_library(root: Path) -> None:
    assert issubclass(torch_nebula.Checkpoint, nm.Checkpoint)  # overwrite=True: DeepSpeed's
    assert torch_nebula.init.__wrapped__ is nm.init  # reads DeepSpeed's "nebula" block too
    assert set(torch_nebula.__all__) == set(nm.__all__)
    torch_nebula.init(str(root))
    torch_nebula.Checkpoint("global_step2", -2).save("m", {"v": 2})
    assert nm.get_latest_checkpoint() is None
    assert nm.list_checkpoints() == []


def test_api_before_init_is_a_clear_error() -> None:
    with pytest.raises(nm.NotInitializedError, match=r"nm\.init"):
        nm.Checkpoint("global_step1").save("m", {})
    with pytest.raises(nm.NotInitializedError):
        nm.flush_persistence()


def test_saving_leaves_torch_serialization_config_as_it_was(root: Path) -> None:
    from torch.utils.serialization import config

    nm.init(str(root))
    assert config.save.compute_crc32 is True
    nm.Checkpoint("global_step1").save("m", {"w": torch.ones(8)})
    assert config.save.compute_crc32 is True
    config.save.compute_crc32 = False
    try:
        nm.Checkpoint("global_step2").save("m", {"w": torch.ones(8)})
        assert config.save.compute_crc32 is False
    finally:
        config.save.compute_crc32 = True
