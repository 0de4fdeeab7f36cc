"""One storage contract, run against every backend nebula supports in this suite.

Azure (Azurite) joins the parametrisation with the Azure issue.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import nebulaml as nm
from nebulaml.storage import MissingFileError, Store


@pytest.fixture(params=["local", "file-url", "memory"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "store")
    elif request.param == "file-url":
        yield f"file://{tmp_path}/store"
    else:
        import fsspec

        url = f"memory://contract-{uuid.uuid4().hex}"
        yield url
        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)


def test_write_read_list(url: str) -> None:
    store = Store(url)
    store.make_dir("tag1")
    store.write_bytes(("tag1", "a"), b"12345")
    with store.open_write("tag1", "b") as f:
        f.write(b"x" * 10)
    store.write_bytes(("tag1", ".hidden"), b"")
    store.make_dir("tag2")
    store.make_dir(".private")
    assert store.read_bytes("tag1", "a") == b"12345"
    with store.open_read("tag1", "b") as f:
        assert f.read() == b"x" * 10
    assert sorted(store.list_dirs()) == ["tag1", "tag2"]
    assert store.list_files("tag1") == {"a": 5, "b": 10, ".hidden": 0}
    assert store.list_files("missing") == {}
    assert store.exists("tag1", "a") and not store.exists("tag1", "zzz")


def test_missing_file_is_a_typed_error(url: str) -> None:
    store = Store(url)
    store.make_dir()
    with pytest.raises(MissingFileError) as err:
        store.read_bytes("nope", "item")
    assert isinstance(err.value, nm.StorageError) and isinstance(err.value, FileNotFoundError)
    assert "nope" in str(err.value)


def test_failed_write_leaves_no_file(url: str) -> None:
    store = Store(url)
    store.make_dir("t")
    with pytest.raises(RuntimeError, match="boom"), store.open_write("t", "item") as f:
        f.write(b"partial")
        raise RuntimeError("boom")
    assert store.list_files("t") == {}


def test_publish_is_create_only(url: str) -> None:
    store = Store(url)
    store.make_dir("t")
    store.publish(("t", "manifest.json"), b"first")
    with pytest.raises(nm.CommitConflictError, match="'t' was committed by another writer"):
        store.publish(("t", "manifest.json"), b"second")
    assert store.read_bytes("t", "manifest.json") == b"first"
    store.publish(("t", "manifest.json"), b"third", create_only=False)
    assert store.read_bytes("t", "manifest.json") == b"third"
    assert store.list_files("t") == {"manifest.json": 5}  # no temporary files left


def test_append_and_remove(url: str) -> None:
    store = Store(url)
    store.make_dir("t")
    store.append_text(("log.csv",), "a\n")
    store.append_text(("log.csv",), "b\n")
    assert store.read_bytes("log.csv") == b"a\nb\n"
    store.write_bytes(("t", "x"), b"1")
    store.remove("t", "x")
    store.remove("t", "x")  # missing is fine
    store.write_bytes(("t", "y"), b"1")
    store.remove_dir("t")
    assert "t" not in store.list_dirs()
    store.remove_dir("t")


def test_checkpoint_round_trip_on_every_backend(url: str) -> None:
    nm.init(url, persistent_time_interval=0, num_of_version_in_retention=2)
    for step in (1, 2, 3):
        ckpt = nm.Checkpoint(f"global_step{step}", 2)
        ckpt.save("model", {"w": torch.full((8,), float(step))})
        ckpt.save("optimizer", {"step": step})
        nm.flush_persistence()
    nm.shutdown()
    persistent = Store(url)
    assert sorted(persistent.list_dirs()) == ["global_step2", "global_step3"]
    latest = nm.get_latest_checkpoint(persist_path=url)
    assert latest.tag == "global_step3"
    assert torch.equal(latest.load("model")["w"], torch.full((8,), 3.0))
    assert b"global_step3,3,persistent" in persistent.read_bytes("checkpointHistories.csv")


def test_unknown_protocol_is_a_storage_error() -> None:
    with pytest.raises(nm.StorageError, match="bogus://x"):
        Store("bogus://x")
