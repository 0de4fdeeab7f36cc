"""One storage contract, run against every backend nebula supports: a local path, a
file:// URL, fsspec's memory:// store, and Azure Blob Storage (a real Azurite)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import nebulaml as nm
from nebulaml.storage.store import MissingFileError, Store

BACKENDS = ["local", "file-url", "memory", "azure"]


@pytest.fixture(params=BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "store")
    elif request.param == "file-url":
        yield f"file://{tmp_path}/store"
    elif request.param == "azure":
        yield request.getfixturevalue("az_url")  # credentials from the environment
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
    # Object stores have no empty folders: a folder is listed once it holds a file.
    store.make_dir("tag2")
    store.write_bytes(("tag2", "c"), b"")
    store.make_dir(".private")
    store.write_bytes((".private", "d"), b"1")
    assert store.read_bytes("tag1", "a") == b"12345"
    with store.open_read("tag1", "b") as f:
        assert f.read() == b"x" * 10
    assert sorted(store.list_dirs()) == ["tag1", "tag2"]
    assert store.list_files("tag1") == {"a": 5, "b": 10, ".hidden": 0}
    assert store.list_files("missing") == {}
    assert store.exists("tag1", "a") and not store.exists("tag1", "zzz")
    assert store.exists() and store.exists("tag1") and not store.exists("missing")


def test_listings_are_never_stale(url: str) -> None:
    # Catches: a cached directory listing (adlfs's dircache) hiding a file written, or
    # showing one removed, a moment ago: a committed tag would be invisible to ls.
    store = Store(url)
    store.make_dir("t")
    store.write_bytes(("t", "a"), b"1")
    assert store.list_files("t") == {"a": 1} and store.list_dirs() == ["t"]
    store.write_bytes(("t", "b"), b"22")
    assert store.list_files("t") == {"a": 1, "b": 2}
    other = Store(url)  # another handle on the same root sees the same
    other.remove("t", "a")
    assert store.list_files("t") == {"b": 2}
    other.remove_dir("t")
    assert store.list_dirs() == [] and store.list_files("t") == {}


def test_large_file_round_trip(url: str) -> None:
    # Catches: blocks uploaded out of order, a last partial block dropped, a block
    # boundary off by one (on Azure the writer cuts 8 MiB blocks; here, odd-sized writes).
    store = Store(url, {"nebula_block_bytes": 1 << 20} if url.startswith("az://") else None)
    data = torch.randint(0, 256, (5 * (1 << 20) + 12345,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(3)).numpy().tobytes()  # fmt: skip
    store.make_dir("t")
    with store.open_write("t", "big") as f:
        for start in range(0, len(data), 777_777):
            f.write(data[start : start + 777_777])
    assert store.list_files("t") == {"big": len(data)}
    assert store.read_bytes("t", "big") == data
    with store.open_read("t", "big") as f:
        f.seek(len(data) - 10)
        assert f.read() == data[-10:]


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
    store.write_bytes(("t", "keep"), b"k")
    with pytest.raises(RuntimeError, match="boom"), store.open_write("t", "item") as f:
        f.write(b"partial" * 300_000)
        raise RuntimeError("boom")
    assert store.list_files("t") == {"keep": 1}


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


@pytest.mark.parametrize("url", ["local", "azure"], indirect=True)
def test_racing_publishers_one_wins(url: str) -> None:
    # Catches: a check-then-write create (two writers both see no manifest and both
    # "commit", the second overwriting the first). fsspec's memory store has no atomic
    # create, so it is not in this race.
    stores = [Store(url) for _ in range(6)]
    stores[0].make_dir("t")
    start = threading.Barrier(len(stores))
    outcome: dict[int, str] = {}

    def publish(i: int) -> None:
        start.wait()
        try:
            stores[i].publish(("t", "manifest.json"), f"writer {i}".encode())
            outcome[i] = "won"
        except nm.CommitConflictError:
            outcome[i] = "conflict"

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    winners = [i for i, what in outcome.items() if what == "won"]
    assert len(winners) == 1 and len(outcome) == len(stores), outcome
    assert stores[0].read_bytes("t", "manifest.json") == f"writer {winners[0]}".encode()


def test_append_and_remove(url: str) -> None:
    store = Store(url)
    store.make_dir("t")
    assert store.read_appended("log.csv") is None
    store.append_text(("log.csv",), "a\n")
    store.append_text(("log.csv",), "b\n")
    assert store.read_appended("log.csv") == b"a\nb\n"
    store.write_bytes(("t", "x"), b"1")
    store.remove("t", "x")
    store.remove("t", "x")  # missing is fine
    store.write_bytes(("t", "y"), b"1")
    store.remove_dir("t")
    assert "t" not in store.list_dirs()
    store.remove_dir("t")


def test_concurrent_appends_lose_nothing(url: str) -> None:
    # Catches: read-modify-write appends on an object store, where two writers read the
    # same old content and the second upload drops the first one's rows.
    store = Store(url)
    store.make_dir()
    start = threading.Barrier(4)

    def append(writer: int) -> None:
        start.wait()
        for row in range(5):
            store.append_text(("log.csv",), f"w{writer}-r{row}\n")

    threads = [threading.Thread(target=append, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    lines = (store.read_appended("log.csv") or b"").decode().splitlines()
    assert sorted(lines) == sorted(f"w{w}-r{r}" for w in range(4) for r in range(5))


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
    assert b"global_step3,3,persistent" in (
        persistent.read_appended("checkpointHistories.csv") or b""
    )
    history = nm.read_history(url)
    assert set(history["tag"]) == {"global_step1", "global_step2", "global_step3"}


def test_unknown_protocol_is_a_storage_error() -> None:
    with pytest.raises(nm.StorageError, match="bogus://x"):
        Store("bogus://x")
