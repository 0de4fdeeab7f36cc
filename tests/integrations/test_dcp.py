"""PyTorch Distributed Checkpoint through nebula (nebulaml.dcp, issue #19): FSDP2 on 2 real
gloo processes saved with dcp.save and dcp.async_save into one nebula checkpoint, loaded
on 2 ranks and on 1 bit for bit; the item format; DTensors refused by Checkpoint.save
with a clear error; Lightning's ModelParallelStrategy refused by NebulaCallback."""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from frameworks import Finished, child_env, require, run_ranks, run_script
from shared_setup import once

import nebulaml as nm
import nebulaml.dcp
from nebulaml.integrations.dcp import _keys_for

CHILD = Path(__file__).with_name("dcp_child.py")
TAGS = ("global_step1", "global_step2")


@pytest.fixture(autouse=True)
def quiet_dcp() -> Iterator[None]:
    """DCP warns on every call without a process group, even with no_dist=True."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


def _raised(call: Any, *args: Any, **kwargs: Any) -> BaseException:
    """The exception a DCP call raised on this rank: DCP wraps every rank's exception in
    a CheckpointException (a BaseException), whose failures hold the original."""
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as info:
        call(*args, **kwargs)
    ((exc, _trace),) = info.value.failures.values()
    return exc


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where `a` and `b` differ; tensors compared bit for bit (dtype, shape, bytes)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and torch.equal(_bits(a), _bits(b))
        )
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys differ"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in _differences(x, y, f"{path}.{i}")
        ]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _emptied(obj: Any) -> Any:
    """A load target shaped as `obj`: tensors of the same shape and dtype filled with 7s
    (so that a chunk left unread shows), other values None."""
    if isinstance(obj, torch.Tensor):
        return torch.full_like(obj, 7)
    if isinstance(obj, dict):
        return {key: _emptied(value) for key, value in obj.items()}
    if isinstance(obj, list) and any(isinstance(v, (dict, torch.Tensor)) for v in obj):
        return [_emptied(value) for value in obj]
    return None


# two ranks: FSDP2 -------------------------------------------------------------------------
def _fsdp2(base: Path) -> dict[str, Any]:
    root, out, memory = base / "persistent", base / "out", base / "memory-tier"
    out.mkdir()
    env = child_env(memory)
    saved = run_ranks([sys.executable, str(CHILD), "save", str(root), str(out)], 2, env)
    loaded = []
    if all(done.returncode == 0 for done in saved):
        loaded = run_ranks([sys.executable, str(CHILD), "load", str(root), str(out)], 2, env)
    return {
        "root": str(root),
        "out": str(out),
        "saved": [[done.returncode, done.output] for done in saved],
        "loaded": [[done.returncode, done.output] for done in loaded],
    }


@pytest.fixture(scope="module")
def fsdp2_job(shared_root: Path) -> dict[str, Any]:
    """Run the save job on 2 gloo ranks, then the load job on 2 ranks (once for the whole
    run, by whichever worker needs it first: each job starts 2 Python processes with
    torch.distributed)."""
    done = once(shared_root, "fsdp2", _fsdp2)
    return {
        "root": Path(done["root"]),
        "out": Path(done["out"]),
        "saved": [Finished(code, output) for code, output in done["saved"]],
        "loaded": [Finished(code, output) for code, output in done["loaded"]],
    }


@pytest.mark.slow
def test_fsdp2_saves_one_nebula_checkpoint_through_dcp(fsdp2_job: dict[str, Any]) -> None:
    """dcp.save and dcp.async_save of an FSDP2 state on 2 ranks commit one nebula checkpoint
    each: every rank's shards an item, DCP's metadata an item, one manifest, persisted and
    verified. Bug caught: Checkpoint.save's RuntimeError on DTensors ("invalid python
    storage"), and no way to save a sharded state through nebula at all."""
    for rank, done in enumerate(fsdp2_job["saved"]):
        assert done.returncode == 0 and f"OK rank {rank}" in done.output, done.output
    root: Path = fsdp2_job["root"]
    for tag in TAGS:
        manifest = json.loads((root / tag / "manifest.json").read_text())
        assert manifest["world_size"] == 2
        items = {(item["name"], item["rank"]) for item in manifest["items"]}
        assert items == {("dcp_rank0", 0), ("dcp_rank1", 1), ("dcp_metadata", 0)}
        # Each item is a file plain torch.load reads without executing code.
        shards = torch.load(root / tag / "dcp_rank1", weights_only=True)
        assert all(isinstance(value, torch.Tensor) for value in shards.values())
        # Rank 1 holds its row of the unevenly sharded 3-row layer (rows 2..3 of 3).
        assert shards["model.2.weight"].shape == (1, 16)
        metadata = torch.load(root / tag / "dcp_metadata", weights_only=True)
        assert metadata["format"] == "nebulaml.dcp"
        entry = metadata["state_dict_metadata"]["model.2.weight"]
        assert entry["size"] == [3, 16]
        assert [c["offsets"] for c in entry["chunks"]] == [[0, 0], [2, 0]]
    listed = {c["tag"]: c for c in nm.list_checkpoints(str(root))}
    assert set(listed) == set(TAGS) and all("persistent" in c["tiers"] for c in listed.values())
    assert {row["status"] for row in nm.verify_checkpoints(str(root))} == {"ok"}
    assert nm.list_incomplete(str(root)) == []


def test_fsdp2_checkpoint_loads_on_two_ranks_bit_for_bit(fsdp2_job: dict[str, Any]) -> None:
    """Another FSDP2 model and optimizer (other weights, other moments) load both
    checkpoints through nebulaml.dcp.Reader on 2 ranks: every full tensor, gathered, is
    bit for bit what was saved."""
    assert fsdp2_job["loaded"], "the save job failed"
    for rank, done in enumerate(fsdp2_job["loaded"]):
        assert done.returncode == 0 and f"OK rank {rank}" in done.output, done.output
        for tag in TAGS:
            assert f"LOADED {tag} rank {rank}: identical" in done.output, done.output


def test_fsdp2_checkpoint_loads_on_one_rank_bit_for_bit(fsdp2_job: dict[str, Any]) -> None:
    """One process without torch.distributed loads the 2-rank checkpoints into full
    tensors (DCP reshards 2 -> 1), from the persistent tier. Bug caught: manifests that
    recorded ranks but no global shape, offsets or placement: no 1-rank load at all."""
    for done in fsdp2_job["saved"]:
        assert done.returncode == 0, done.output
    root, out = fsdp2_job["root"], fsdp2_job["out"]
    for tag in TAGS:
        expected = torch.load(out / f"expected_{tag}.pt", weights_only=True)
        target = _emptied(expected)
        reader = nebulaml.dcp.Reader(tag, persist_path=str(root))
        _dcp().load(target, storage_reader=reader, no_dist=True)
        assert _differences(target, expected) == []
        assert isinstance(target["optim"]["param_groups"][0]["lr"], float)


def test_dtensors_in_checkpoint_save_are_refused_clearly(fsdp2_job: dict[str, Any]) -> None:
    """nm.Checkpoint.save of an FSDP2 model (DTensors) says what to do instead. Bug caught:
    `RuntimeError: Attempted to access the data pointer on an invalid python storage`."""
    for done in fsdp2_job["saved"]:
        assert "REFUSED" in done.output, done.output
        line = next(x for x in done.output.splitlines() if x.startswith("REFUSED"))
        assert "'0.weight' is a DTensor" in line
        assert "nebulaml.dcp.Writer(tag)" in line
        assert "invalid python storage" not in done.output
    assert "plain" not in {c["tag"] for c in nm.list_checkpoints(str(fsdp2_job["root"]))}


# one process: the writer and reader themselves ----------------------------------------------
class Opaque:
    """A value DCP pickles whole (BYTE_IO); unpickling it needs code: not weights-only."""

    def __init__(self, value: int) -> None:
        self.value = value


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    return {
        "model": {"w": torch.randn(5, 4, generator=gen), "b": torch.arange(4, dtype=torch.int64)},
        "view": torch.randn(64, generator=gen)[8:16],  # a view of a larger storage
        "half": torch.randn(3, generator=gen).to(torch.bfloat16),
        "meta": {"step": 12, "name": "run", "betas": (0.9, 0.99)},
    }


def test_single_process_round_trip_and_item_format(root: Path) -> None:
    """A plain state, saved and loaded in one process (no_dist=True): tensors bit for bit,
    values as they were; the view is saved as its own bytes, not its whole storage."""
    nm.init(str(root), persistent_time_interval=0)
    state = _state()
    dcp = _dcp()
    dcp.save(state, storage_writer=nebulaml.dcp.Writer("global_step12"), no_dist=True)
    target = _emptied(state)
    dcp.load(target, storage_reader=nebulaml.dcp.Reader("global_step12"), no_dist=True)
    assert _differences(target, state) == []
    nm.flush_persistence()
    stored = torch.load(root / "global_step12" / "dcp_rank0", weights_only=True)
    assert sorted(stored) == [
        "half",
        "meta.betas",
        "meta.name",
        "meta.step",
        "model.b",
        "model.w",
        "view",
    ]
    assert stored["view"].untyped_storage().nbytes() == 8 * 4
    assert stored["meta.step"].dtype == torch.uint8  # DCP's pickled bytes of the value
    # checkpoint_id names the tag; a Reader without a tag reads the newest.
    dcp.save(
        state, checkpoint_id="global_step13", storage_writer=nebulaml.dcp.Writer(), no_dist=True
    )
    reader = nebulaml.dcp.Reader()
    target = _emptied(state)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert _differences(target, state) == [] and reader.tag == "global_step13"
    dcp.save(state, storage_writer=nebulaml.dcp.Writer("global_step14"), no_dist=True)
    dcp.load(_emptied(state), storage_reader=reader, no_dist=True)  # the same reader again
    assert reader.tag == "global_step14"


def test_a_committed_tag_is_refused_unless_overwrite(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0)
    dcp = _dcp()
    dcp.save(_state(), storage_writer=nebulaml.dcp.Writer("global_step1"), no_dist=True)
    exc = _raised(
        dcp.save, _state(), storage_writer=nebulaml.dcp.Writer("global_step1"), no_dist=True
    )
    assert isinstance(exc, nm.CheckpointExistsError), exc
    changed = _state()
    changed["model"]["w"] += 1
    dcp.save(
        changed, storage_writer=nebulaml.dcp.Writer("global_step1", overwrite=True), no_dist=True
    )
    target = _emptied(changed)
    dcp.load(target, storage_reader=nebulaml.dcp.Reader("global_step1"), no_dist=True)
    assert _differences(target, changed) == []


def test_pickled_values_that_need_code_are_refused_unless_trusted(root: Path) -> None:
    """DCP unpickles non-tensor values with weights_only=False; nebula's reader first
    checks them weights-only, as every nebula load does."""
    nm.init(str(root), persistent_time_interval=0)
    dcp = _dcp()
    dcp.save(
        {"obj": Opaque(5), "w": torch.ones(2)},
        storage_writer=nebulaml.dcp.Writer("global_step1"),
        no_dist=True,
    )
    target: dict[str, Any] = {"obj": None, "w": torch.zeros(2)}
    exc = _raised(
        dcp.load, target, storage_reader=nebulaml.dcp.Reader("global_step1"), no_dist=True
    )
    assert isinstance(exc, nm.UnsafeCheckpointError) and "Opaque" in str(exc), exc
    assert target["obj"] is None
    trusted = nebulaml.dcp.Reader("global_step1", weights_only=False)
    dcp.load(target, storage_reader=trusted, no_dist=True)
    assert isinstance(target["obj"], Opaque) and target["obj"].value == 5


def test_writer_and_reader_refuse_what_they_cannot_do(root: Path) -> None:
    dcp = _dcp()
    exc = _raised(
        dcp.save, _state(), storage_writer=nebulaml.dcp.Writer("global_step1"), no_dist=True
    )
    assert isinstance(exc, nm.NotInitializedError), exc
    nm.init(str(root), persistent_time_interval=0)
    exc = _raised(dcp.save, _state(), storage_writer=nebulaml.dcp.Writer(), no_dist=True)
    assert isinstance(exc, nm.InvalidArgumentError) and "has no tag" in str(exc), exc
    with pytest.raises(nm.InvalidArgumentError, match="not a path"):
        nebulaml.dcp.Writer(root / "x")  # type: ignore[arg-type]
    with pytest.raises(nm.InvalidNameError):
        nebulaml.dcp.Reader("../up")
    exc = _raised(
        dcp.load,
        _emptied(_state()),
        storage_reader=nebulaml.dcp.Reader("global_step9"),
        no_dist=True,
    )
    # DCP reports a failed read_metadata as an AssertionError naming the cause.
    assert "no checkpoint 'global_step9' found" in str(exc), exc
    assert nm.list_checkpoints(str(root)) == []
    assert nm.dcp.Writer is nebulaml.dcp.Writer  # nm.dcp, imported on first use


def test_several_chunks_of_one_tensor_on_a_rank_get_their_own_keys() -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    items = [
        WriteItem(MetadataIndex("a", [0, 0]), WriteItemType.SHARD),
        WriteItem(MetadataIndex("a", [4, 0]), WriteItemType.SHARD),
        WriteItem(MetadataIndex("b", [0]), WriteItemType.TENSOR),
        WriteItem(MetadataIndex("c"), WriteItemType.BYTE_IO),
    ]
    assert list(_keys_for(items).values()) == ["a@0_0", "a@4_0", "b", "c"]


# one process with a gloo group of one: a DTensor ----------------------------------------------
def test_a_dtensor_in_checkpoint_save_is_refused_clearly(root: Path) -> None:
    """The same refusal in this process, for a DTensor inside a nested state."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
        nm.init(str(root), persistent_time_interval=0)
        state = {"model": {"layer": {"weight": sharded}}, "step": 3}
        with pytest.raises(nm.InvalidArgumentError, match=r"'model\.layer\.weight' is a DTensor"):
            nm.Checkpoint("global_step3").save("state", state)
        nm.shutdown()
    finally:
        dist.destroy_process_group()
    assert nm.list_checkpoints(str(root)) == []


# Lightning ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_lightning_model_parallel_strategy_is_refused_not_skipped(
    tmp_path: Path, memory_tier: Path, package: str
) -> None:
    """ModelParallelStrategy (FSDP2) with its distributed checkpoint writes DCP files at the
    path and never calls the CheckpointIO. Bug caught: NebulaCallback and the plugin
    training on with no nebula checkpoint, no warning."""
    require(package)
    root, out = tmp_path / "persistent", tmp_path / "out"
    out.mkdir()
    done = run_script(
        [str(CHILD), "lightning", str(root), str(out), package], child_env(memory_tier)
    )
    assert done.returncode == 0, done.output
    assert "FIT RAN" not in done.output, done.output
    assert "REFUSED NebulaCallback cannot checkpoint with ModelParallelStrategy" in done.output
    assert "nebulaml.dcp.Writer(tag)" in done.output
    assert not (out / "ckpts").exists() or os.listdir(out / "ckpts") == []
    assert nm.list_checkpoints(str(root)) == []


def test_lightning_fsdp_strategy_with_sharded_checkpoints_is_refused() -> None:
    """FSDPStrategy(state_dict_type='sharded') also writes DCP files itself."""
    require("lightning")
    from lightning.pytorch.strategies import FSDPStrategy

    from nebulaml.lightning import NebulaCallback

    trainer = SimpleNamespace(strategy=FSDPStrategy(state_dict_type="sharded"))
    with pytest.raises(nm.InvalidArgumentError, match="state_dict_type='full'"):
        NebulaCallback().setup(trainer, None, "fit")
