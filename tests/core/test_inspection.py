"""Inspection: manifests and item contents, read without running a pickle or reading data."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import uuid
import zipfile
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

import nebulaml as nm
from nebulaml.format.inert_unpickler import DTYPE_ITEMSIZE, STORAGE_DTYPES
from nebulaml.format.item_metadata import MAX_DEPTH, describe_pickle

FIXTURE_V1 = Path(__file__).parents[1] / "fixtures" / "manifests" / "v1"


def _trained_states() -> dict[str, Any]:
    """A model state dict, an AdamW state with step tensors, a Lightning-like dict."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    lightning = {
        "epoch": 3,
        "global_step": 1200,
        "pytorch-lightning_version": "2.4.0",
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 4}}}},
        "callbacks": {"ModelCheckpoint": {"best_model_score": torch.tensor(0.25), "dirpath": None}},
        "lr_schedulers": [{"base_lrs": [0.001], "last_epoch": 7}],
        "hyper_parameters": {"hidden": 4, "dropout": 0.1, "name": "tiny"},
        "state_dict": {"half": torch.ones(2, 3, dtype=torch.float16).t(), "bf": torch.ones(5)[1:3]
                       .to(torch.bfloat16), "ids": torch.arange(6).view(2, 3)[:, 1]},
    }  # fmt: skip
    return {"model": model, "optimizer": opt, "lightning": lightning}


def _torch_leaves(obj: Any, path: str = "") -> list[tuple[str, str, list[int]]]:
    """(path, dtype, shape) of every tensor in a loaded object, in stored order."""
    if isinstance(obj, torch.Tensor):
        return [(path, str(obj.dtype).removeprefix("torch."), list(obj.shape))]
    children: Any = ()
    if isinstance(obj, dict):
        children = obj.items()
    elif isinstance(obj, (list, tuple)):
        children = enumerate(obj)
    out = []
    for key, value in children:
        out += _torch_leaves(value, f"{path}.{key}" if path else str(key))
    return out


def _save(root: Path, tag: str, items: dict[str, Any], persist: bool = True) -> None:
    nm.init(str(root), persistent_time_interval=3600)
    ckpt = nm.Checkpoint(tag, len(items))
    for name, obj in items.items():
        ckpt.save(name, obj)
    if persist:
        nm.flush_persistence()


def test_tensors_described_match_what_torch_load_returns(root: Path) -> None:
    # Catches: a wrong storage->dtype map, shapes taken from strides or storages, lost
    # Parameters, or leaves out of order.
    states = _trained_states()
    _save(root, "global_step1", states)
    for name in states:
        entries = nm.describe_item(str(root), "global_step1", name)
        loaded = torch.load(root / "global_step1" / name, weights_only=True)
        tensors = [(e["path"], e["dtype"], e["shape"]) for e in entries if e["kind"] == "tensor"]
        assert tensors == _torch_leaves(loaded), name
        for e in entries:
            if e["kind"] == "tensor":
                assert e["numel"] * DTYPE_ITEMSIZE[e["dtype"]] == e["size_bytes"]
    optimizer = {e["path"]: e for e in nm.describe_item(str(root), "global_step1", "optimizer")}
    assert optimizer["state.0.step"]["shape"] == [] and optimizer["state.0.step"]["numel"] == 1
    assert optimizer["state.0.exp_avg"]["size_bytes"] == 4 * 3 * 4
    assert optimizer["param_groups.0.lr"] == {**optimizer["param_groups.0.lr"], "kind": "value",
                                              "type": "float", "value": "0.001"}  # fmt: skip
    lightning = {e["path"]: e for e in nm.describe_item(str(root), "global_step1", "lightning")}
    assert lightning["epoch"]["value"] == "3"
    assert lightning["hyper_parameters.name"]["value"] == "'tiny'"
    assert lightning["callbacks.ModelCheckpoint.dirpath"]["value"] == "None"
    assert lightning["loops.fit_loop.state_dict"]["value"] == "{}"  # empty containers are kept
    assert lightning["state_dict.half"]["size_bytes"] == 12


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_dtype_tables_agree_with_torch() -> None:
    # Catches: a dtype torch can save that the table lacks, or a wrong element size.
    dtypes = set(torch.storage._dtype_to_storage_type_map()) | set(torch.storage._new_dtypes())
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        assert DTYPE_ITEMSIZE[name] == dtype.itemsize, name
    for storage, name in STORAGE_DTYPES.items():
        assert getattr(torch, storage).dtype == getattr(torch, name), storage


class _Canary:
    """An object whose unpickling runs a shell command that creates a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def test_a_pickle_that_would_run_code_is_described_not_run(root: Path, tmp_path: Path) -> None:
    # Catches: a find_class that imports or calls what the pickle names.
    canary = tmp_path / "canary"
    _save(root, "global_step1", {"evil": {"w": torch.ones(2), "payload": _Canary(canary)}})
    entries = nm.describe_item(str(root), "global_step1", "evil")
    assert not canary.exists()
    payload = next(e for e in entries if e["path"] == "payload")
    assert payload["kind"] == "object"
    assert payload["value"] == f"<object {os.system.__module__}.system (not loaded)>"
    assert [e["path"] for e in entries if e["kind"] == "tensor"] == ["w"]
    # The canary is live: trusting the file runs it.
    torch.load(root / "global_step1" / "evil", weights_only=False)
    assert canary.exists()


def test_hostile_pickle_shapes_do_not_hang_or_crash() -> None:
    # Catches: a recursive walk of a self-referencing pickle, or a traceback on garbage.
    loop: list[Any] = [1]
    loop.append(loop)
    entries = describe_pickle(pickle.dumps({"loop": loop}, protocol=2), "f")
    assert [e["value"] for e in entries] == ["1", "<cycle>"]
    with pytest.raises(nm.CorruptCheckpointError, match="f: corrupt item, expected a complete"):
        describe_pickle(pickle.dumps({"a": list(range(100))}, protocol=2)[:40], "f")
    with pytest.raises(nm.CorruptCheckpointError):  # a dtype is not a callable
        describe_pickle(b"\x80\x02ctorch\nfloat32\n)R.", "f")
    with pytest.raises(nm.CorruptCheckpointError, match="may not rebuild"):  # BUILD on a dtype
        describe_pickle(b"\x80\x02ctorch\nfloat32\n}X\x01\x00\x00\x00tK\x05sb.", "f")
    (huge,) = describe_pickle(pickle.dumps(10**5000, protocol=2), "f")
    assert huge["value"] == "<int too large to show>"
    deep = 100_000  # nested lists, built by opcodes: a recursive walk would overflow
    (leaf,) = describe_pickle(b"\x80\x02" + b"]" * deep + b"a" * (deep - 1) + b".", "f")
    assert leaf["path"] == ".".join(["0"] * MAX_DEPTH)
    assert leaf["value"] == f"<nested deeper than {MAX_DEPTH}>"


def _memory_item(root: Path, tag: str, name: str) -> Path:
    return Path(nm.memory_tier_path(str(root))) / tag / name


def test_an_item_that_is_not_a_zip_or_is_truncated_is_a_clear_error(root: Path) -> None:
    # Catches: zipfile/pickle tracebacks leaking out; no fallback to the persistent copy.
    _save(root, "global_step1", {"model": {"w": torch.ones(100)}})
    mem, disk = _memory_item(root, "global_step1", "model"), root / "global_step1" / "model"
    mem.write_bytes(b"not a zip file at all")
    assert nm.describe_item(str(root), "global_step1", "model")[0]["shape"] == [100]
    disk.write_bytes(disk.read_bytes()[:300])
    with pytest.raises(nm.CorruptCheckpointError) as err:
        nm.describe_item(str(root), "global_step1", "model")
    assert str(err.value).startswith(f"{mem}: corrupt item, expected a torch zip archive")


def test_inspect_checkpoint_gives_the_manifest_and_the_tiers(root: Path) -> None:
    _save(root, "global_step1", {"model": {"w": torch.ones(10)}, "optimizer": {"lr": 0.1}})
    doc = nm.inspect_checkpoint(str(root), "global_step1")
    on_disk = json.loads((root / "global_step1" / "manifest.json").read_text())
    assert doc["manifest"]["items"] == on_disk["items"]
    assert doc["tiers"] == ["memory", "persistent"] and doc["root"] == str(root)
    assert [c["problem"] for c in doc["copies"]] == [None, None]
    nm.Checkpoint("global_step2").save("model", {"w": torch.ones(3)})  # not persisted
    assert nm.inspect_checkpoint(str(root), "global_step2")["tiers"] == ["memory"]


def test_inspect_checkpoint_errors(root: Path, tmp_path: Path) -> None:
    # Catches: a missing tag or root read as "empty"; an item typo without the choices.
    with pytest.raises(nm.RootNotFoundError):
        nm.inspect_checkpoint(str(tmp_path / "nope"), "global_step1")
    _save(root, "global_step1", {"model": {"w": torch.ones(1)}})
    with pytest.raises(nm.CheckpointNotFoundError, match="no checkpoint 'global_step9' found"):
        nm.inspect_checkpoint(str(root), "global_step9")
    with pytest.raises(nm.ItemNotFoundError, match="its items: 'model'"):
        nm.describe_item(str(root), "global_step1", "optim")


def test_a_corrupt_manifest_is_reported_not_hidden(root: Path) -> None:
    # Catches: catalog.read_manifest's silent "None" turning a corrupt manifest into
    # "not found", and a corrupt copy hiding a good one.
    _save(root, "global_step1", {"model": {"w": torch.ones(1)}})
    (_memory_item(root, "global_step1", "manifest.json")).write_text("{not json")
    doc = nm.inspect_checkpoint(str(root), "global_step1")
    assert doc["tiers"] == ["persistent"]
    assert "manifest is not valid JSON" in doc["copies"][0]["problem"]
    (root / "global_step1" / "manifest.json").write_text('{"schema_version": 99}')
    with pytest.raises(nm.ManifestError, match=r"memory-tier.*manifest is not valid JSON"):
        nm.inspect_checkpoint(str(root), "global_step1")


def test_released_v1_fixture_is_described(tmp_path: Path) -> None:
    # Catches: a reader that only understands what this version writes.
    root = tmp_path / "fixture"
    shutil.copytree(FIXTURE_V1, root)
    doc = nm.inspect_checkpoint(str(root), "global_step500")
    assert [i["name"] for i in doc["manifest"]["items"]] == ["model", "optimizer"]
    for item in ("model", "optimizer"):
        loaded = torch.load(root / "global_step500" / item, weights_only=True)
        entries = nm.describe_item(str(root), "global_step500", item)
        tensors = [(e["path"], e["dtype"], e["shape"]) for e in entries if e["kind"] == "tensor"]
        assert tensors == _torch_leaves(loaded)


# Reading no tensor data: a real fsspec filesystem that counts the bytes it hands out. ------
class _CountingFS(AbstractFileSystem):
    """Local files, through fsspec (not a LocalFileSystem, which Store reads directly)."""

    protocol: Any = ("countfs",)
    root_marker = "/"
    cachable = False
    bytes_read = 0

    def __init__(self, **storage_options: Any) -> None:
        super().__init__(**storage_options)
        self._local = LocalFileSystem()

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        assert mode == "rb", mode
        return _CountingFile(type(self), self._local.open(path, mode))

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self._local.ls(path, detail=detail)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self._local.info(path)


class _CountingFile:
    def __init__(self, fs_cls: type[_CountingFS], raw: Any) -> None:
        self._cls, self._raw = fs_cls, raw

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        self._cls.bytes_read += len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._raw.close()

    def __enter__(self) -> _CountingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def test_describing_a_200_mb_item_reads_under_1_mb(root: Path) -> None:
    # Catches: torch.load, zipfile.read of the archive, or any read of the data members.
    _save(root, "global_step1", {"model": {"w": torch.zeros(50_000_000), "b": torch.zeros(4)}})
    protocol = f"countfs{uuid.uuid4().hex[:10]}"
    counting = type(f"CountingFS_{protocol}", (_CountingFS,), {"protocol": (protocol,)})
    fsspec.register_implementation(protocol, counting, clobber=True)
    url = f"{protocol}://{root}"
    entries = nm.describe_item(url, "global_step1", "model")
    assert [(e["path"], e["size_bytes"]) for e in entries] == [("w", 200_000_000), ("b", 16)]
    assert counting.bytes_read < 1 << 20
    assert zipfile.is_zipfile(root / "global_step1" / "model")
    # The counter counts data reads: verifying the same item reads all of it.
    counting.bytes_read = 0
    (result,) = nm.verify_checkpoints(url, "global_step1")
    assert result["status"] == "ok" and counting.bytes_read > 200_000_000
