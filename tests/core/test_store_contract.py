"""One storage contract, run against every backend nebula supports, with the same
assertions: the local backend (a durable disk root, the same given as a file:// URL, and
the memory tier's flavour: not durable, private), fsspec's memory:// store (the remote
backend), Azure Blob Storage (a real Azurite) and S3 (a real moto server).

A case that only one kind of backend can have (a symbolic link on a local disk, a mapped
read) runs everywhere too: elsewhere it checks what that backend does instead."""

from __future__ import annotations

import mmap
import os
import stat
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import torch

import nebulaml as nm
from nebulaml.storage.backend import Backend
from nebulaml.storage.store import MissingFileError, Store

BACKENDS = ["local", "memory-tier", "file-url", "memory", "azure", "s3"]
LOCAL = ("local", "memory-tier", "file-url")  # the local backend, in its three forms


@dataclass(frozen=True)
class Root:
    """One root of the backend under test; `open()` is a new handle on it (a writer)."""

    kind: str
    url: str
    base_options: tuple[tuple[str, Any], ...] = ()  # what reaches the server (S3's)

    @property
    def is_local(self) -> bool:
        return self.kind in LOCAL

    def open(self, options: dict[str, Any] | None = None) -> Store:
        if self.kind == "memory-tier":
            return Store(self.url, options, durable=False, private=True)
        return Store(self.url, {**dict(self.base_options), **(options or {})})


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Root]:
    kind = request.param
    if kind in ("local", "memory-tier"):
        yield Root(kind, str(tmp_path / "store"))
    elif kind == "file-url":
        yield Root(kind, f"file://{tmp_path}/store")
    elif kind == "azure":
        yield Root(kind, request.getfixturevalue("az_url"))  # credentials from the environment
    elif kind == "s3":
        server = request.getfixturevalue("s3_server")
        yield Root(kind, request.getfixturevalue("s3_url"), tuple(server.options().items()))
    else:
        import fsspec

        url = f"memory://contract-{uuid.uuid4().hex}"
        yield Root(kind, url)
        # The test's session ends first: its background threads (a persist, a release)
        # may still be removing files of this root while it is deleted.
        nm.shutdown()
        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)


def test_every_backend_implements_the_protocol(backend: Root) -> None:
    store = backend.open()
    assert isinstance(store._backend, Backend)
    assert store.is_local is backend.is_local
    assert store.capabilities.range_copy is (backend.kind in ("azure", "s3"))  # server copies
    assert store.durable is (backend.kind != "memory-tier")
    assert store.private is (backend.kind == "memory-tier")


def test_write_read_list(backend: Root) -> None:
    store = backend.open()
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


def test_listings_are_never_stale(backend: Root) -> None:
    # Catches: a cached directory listing (adlfs's dircache) hiding a file written, or
    # showing one removed, a moment ago: a committed tag would be invisible to ls.
    store = backend.open()
    store.make_dir("t")
    store.write_bytes(("t", "a"), b"1")
    assert store.list_files("t") == {"a": 1} and store.list_dirs() == ["t"]
    store.write_bytes(("t", "b"), b"22")
    assert store.list_files("t") == {"a": 1, "b": 2}
    other = backend.open()  # another handle on the same root sees the same
    other.remove("t", "a")
    assert store.list_files("t") == {"b": 2}
    other.remove_dir("t")
    assert store.list_dirs() == [] and store.list_files("t") == {}


def test_large_file_round_trip(backend: Root) -> None:
    # Catches: blocks uploaded out of order, a last partial block dropped, a block
    # boundary off by one (on Azure the writer cuts 8 MiB blocks; here, odd-sized writes).
    store = backend.open({"nebula_block_bytes": 1 << 20} if backend.kind == "azure" else None)
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


def test_missing_file_is_a_typed_error(backend: Root) -> None:
    store = backend.open()
    store.make_dir()
    with pytest.raises(MissingFileError) as err:
        store.read_bytes("nope", "item")
    assert isinstance(err.value, nm.StorageError) and isinstance(err.value, FileNotFoundError)
    assert "nope" in str(err.value)


def test_failed_write_leaves_no_file(backend: Root) -> None:
    store = backend.open()
    store.make_dir("t")
    store.write_bytes(("t", "keep"), b"k")
    with pytest.raises(RuntimeError, match="boom"), store.open_write("t", "item") as f:
        f.write(b"partial" * 300_000)
        raise RuntimeError("boom")
    assert store.list_files("t") == {"keep": 1}


def test_publish_is_create_only(backend: Root) -> None:
    store = backend.open()
    store.make_dir("t")
    store.publish(("t", "manifest.json"), b"first")
    with pytest.raises(nm.CommitConflictError, match="'t' was committed by another writer"):
        store.publish(("t", "manifest.json"), b"second")
    assert store.read_bytes("t", "manifest.json") == b"first"
    store.publish(("t", "manifest.json"), b"third", create_only=False)
    assert store.read_bytes("t", "manifest.json") == b"third"
    assert store.list_files("t") == {"manifest.json": 5}  # no temporary files left


@pytest.mark.parametrize("backend", ["local", "memory-tier", "azure"], indirect=True)
def test_racing_publishers_one_wins(backend: Root) -> None:
    # Catches: a check-then-write create (two writers both see no manifest and both
    # "commit", the second overwriting the first). fsspec's memory store has no atomic
    # create, so it is not in this race.
    stores = [backend.open() for _ in range(6)]
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


def test_append_and_remove(backend: Root) -> None:
    store = backend.open()
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


def test_concurrent_appends_lose_nothing(backend: Root) -> None:
    # Catches: read-modify-write appends on an object store, where two writers read the
    # same old content and the second upload drops the first one's rows.
    store = backend.open()
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


# The memory tier is nm.init's own (under every root); a root given to nm.init is a URL.
@pytest.mark.parametrize("backend", ["local", "file-url", "memory", "azure"], indirect=True)
def test_checkpoint_round_trip_on_every_backend(backend: Root) -> None:
    url = backend.url
    nm.init(url, persistent_time_interval=0, num_of_version_in_retention=2)
    for step in (1, 2, 3):
        ckpt = nm.Checkpoint(f"global_step{step}", 2)
        ckpt.save("model", {"w": torch.full((8,), float(step))})
        ckpt.save("optimizer", {"step": step})
        nm.flush_persistence()
    nm.shutdown()
    persistent = backend.open()
    assert sorted(persistent.list_dirs()) == ["global_step2", "global_step3"]
    # Released here: a handle dropped unreleased ends its hold on a thread of its own,
    # which may still remove the hold's lease while the fixture deletes the root.
    with nm.get_latest_checkpoint(persist_path=url) as latest:
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


# Cases each backend must handle the same way --------------------------------------------
def test_a_missing_folder_lists_empty(backend: Root) -> None:
    # Catches: a FileNotFoundError (or a backend's own 404) escaping a listing of a root
    # that was never written, or of a folder that was never made.
    store = backend.open()
    assert store.list_dirs() == []
    assert store.list_files() == {}
    assert store.list_files("missing") == {} and store.list_files("missing", "deeper") == {}
    assert not store.exists("missing") and not store.exists("missing", "file")
    assert store.read_appended("missing.csv") is None
    assert store.modified_at("missing", "file") is None


def test_removing_what_is_missing_is_no_error(backend: Root) -> None:
    store = backend.open()
    store.remove("never", "written")  # no root yet
    store.make_dir("t")
    store.write_bytes(("t", "a"), b"1")
    store.remove("t", "never-written")
    store.remove("missing-folder", "x")
    store.remove_dir("missing-folder")
    store.remove_dir("t")
    store.remove_dir("t")
    store.remove("t", "a")
    assert store.list_files("t") == {} and "t" not in store.list_dirs()


def test_missing_files_are_typed_errors_for_every_read(backend: Root) -> None:
    store = backend.open()
    store.make_dir("t")
    store.write_bytes(("t", "a"), b"1")
    with pytest.raises(MissingFileError, match="nope"):
        store.read_bytes("t", "nope")
    with pytest.raises(MissingFileError, match="nope"), store.open_read("t", "nope"):
        pass
    # map_read and read_local give None where they cannot map (a remote store).
    if backend.is_local:
        with pytest.raises(MissingFileError, match="nope"), store.map_read("t", "nope"):
            pass
        with pytest.raises(MissingFileError, match="nope"), store.read_local("t", "nope"):
            pass


def test_create_only_publish_conflicts_name_the_tag(backend: Root) -> None:
    # Catches: a publish that replaces what another writer committed (a file written by
    # write_bytes too), a conflict raised as a plain StorageError, or one that names the
    # wrong tag or root.
    store = backend.open()
    store.make_dir("global_step7")
    store.write_bytes(("global_step7", "manifest.json"), b"theirs")
    with pytest.raises(nm.CommitConflictError) as caught:
        store.publish(("global_step7", "manifest.json"), b"ours")
    assert caught.value.tag == "global_step7" and caught.value.where == store.url
    assert isinstance(caught.value, FileExistsError)
    assert store.read_bytes("global_step7", "manifest.json") == b"theirs"
    # A file at the root: the conflict is about that name, at the root.
    store.publish(("identity.json",), b"1")
    with pytest.raises(nm.CommitConflictError) as caught:
        store.publish(("identity.json",), b"2")
    assert caught.value.tag == "identity.json" and caught.value.where == store.url
    assert store.read_bytes("identity.json") == b"1"
    store.publish(("identity.json",), b"22", create_only=False)
    assert store.read_bytes("identity.json") == b"22"
    assert store.list_files("global_step7") == {"manifest.json": 6}


def test_appends_from_two_writers_are_all_kept_in_order(backend: Root) -> None:
    # Catches: a second handle (another process's) that rewrites the file from what it
    # read, dropping the first writer's rows; rows read back out of the order written;
    # a file written whole before the appends lost (on object stores it is their head).
    first, second = backend.open(), backend.open()
    first.make_dir()
    first.write_bytes(("log.csv",), b"header\n")
    for row in range(3):
        first.append_text(("log.csv",), f"first-{row}\n")
        second.append_text(("log.csv",), f"second-{row}\n")
    expected = ["header"] + [f"{w}-{r}" for r in range(3) for w in ("first", "second")]
    for reader in (first, second, backend.open()):
        assert (reader.read_appended("log.csv") or b"").decode().splitlines() == expected
    start = threading.Barrier(2)

    def append(store: Store, who: str) -> None:
        start.wait()
        for row in range(5):
            store.append_text(("log.csv",), f"{who}-late-{row}\n")

    writers = ((first, "a"), (second, "b"))
    threads = [threading.Thread(target=append, args=writer) for writer in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    lines = (backend.open().read_appended("log.csv") or b"").decode().splitlines()
    assert lines[: len(expected)] == expected
    late = sorted(f"{w}-late-{r}" for w in "ab" for r in range(5))
    assert sorted(lines[len(expected) :]) == late


def test_modified_at_is_an_aware_time(backend: Root) -> None:
    store = backend.open()
    store.make_dir("t")
    store.write_bytes(("t", "a"), b"1")
    when = store.modified_at("t", "a")
    assert when is not None and when.tzinfo is not None
    assert abs(when - datetime.now(timezone.utc)) < timedelta(hours=1)
    store.remove("t", "a")
    assert store.modified_at("t", "a") is None


def test_write_view_writes_every_piece_and_a_failure_leaves_no_file(backend: Root) -> None:
    # Catches: a piece hashed but not written (or out of order) on one backend, and a
    # failed write that leaves a partial file (a local DirectFile, an fsspec upload).
    store = backend.open()
    store.make_dir("t")
    size = (1 << 20) + 12345
    src = mmap.mmap(-1, size)
    src[:] = os.urandom(size)
    seen: list[bytes] = []
    with memoryview(src) as view:
        store.write_view(("t", "item"), view, lambda piece: seen.append(bytes(piece)))
    assert store.read_bytes("t", "item") == src[:] == b"".join(seen)

    def refuse(_piece: memoryview) -> None:
        raise RuntimeError("boom")

    with memoryview(src) as view, pytest.raises(RuntimeError, match="boom"):
        store.write_view(("t", "other"), view, refuse)
    assert store.list_files("t") == {"item": size}
    src.close()


def test_mapped_reads_only_on_local_disks(backend: Root) -> None:
    # Catches: a mapped read that is not the file's bytes, an empty file mapped (mmap
    # refuses length 0), or a remote store that pretends to map.
    store = backend.open()
    store.make_dir("t")
    store.write_bytes(("t", "a"), b"abc" * 1000)
    store.write_bytes(("t", "empty"), b"")
    with store.map_read("t", "a") as view:
        assert (bytes(view) if view is not None else None) == (
            b"abc" * 1000 if backend.is_local else None
        )
    with store.read_local("t", "a") as read:
        assert (bytes(read.view) if read is not None else None) == (
            b"abc" * 1000 if backend.is_local else None
        )
    with store.map_read("t", "empty") as view, store.read_local("t", "empty") as read:
        assert view is None and read is None
    assert store.local_path("t", "a") == (
        os.path.join(store.root, "t", "a") if backend.is_local else None
    )


def test_what_is_no_regular_file_is_listed_apart(backend: Root, tmp_path: Path) -> None:
    # Catches: a FIFO, a link or a folder planted in a tag folder that no listing names
    # (a delete could never empty the folder), or an object store that lists any.
    store = backend.open()
    store.make_dir("t")
    store.write_bytes(("t", "a"), b"abc")
    assert store.list_non_files("missing") == []
    if backend.is_local:
        folder = Path(os.path.join(store.root, "t"))
        os.mkfifo(folder / ".lease-x.json")
        (folder / "link").symlink_to(tmp_path)
        (folder / "sub").mkdir()
        assert sorted(store.list_non_files("t")) == [".lease-x.json", "link", "sub"]
    else:
        assert store.list_non_files("t") == []
    assert store.list_files("t") == {"a": 3}


def test_a_symbolic_link_is_never_followed(backend: Root, tmp_path: Path) -> None:
    # Catches: `ln -s ~/project ROOT/global_step9` making a listing, read, write, publish,
    # append or removal reach ~/project; an item that is a link read through it.
    store = backend.open()
    store.make_dir("t")
    if not backend.is_local:  # no links on object stores: a name is only ever an object
        assert store.local_path("t") is None
        return
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"keep")
    os.symlink(outside, Path(store.root) / "global_step9")
    refused = [
        lambda: store.list_files("global_step9"),
        lambda: store.read_bytes("global_step9", "victim"),
        lambda: store.exists("global_step9", "victim"),
        lambda: store.write_bytes(("global_step9", "x"), b"1"),
        lambda: store.publish(("global_step9", "manifest.json"), b"{}"),
        lambda: store.append_text(("global_step9", "log.csv"), "row\n"),
        lambda: store.make_dir("global_step9", "sub"),
        lambda: store.remove("global_step9", "victim"),
        lambda: store.remove_dir("global_step9"),
    ]
    for operation in refused:
        with pytest.raises(nm.StorageError, match="global_step9: is a symbolic link"):
            operation()
    assert "global_step9" not in store.list_dirs()  # a link is not a tag folder
    # An item that is a link: never read through; removed as a name alone.
    os.symlink(outside / "victim", Path(store.root) / "t" / "item")
    with pytest.raises(nm.StorageError, match="symbolic link"):
        store.read_bytes("t", "item")
    store.remove("t", "item")
    assert sorted(os.listdir(outside)) == ["victim"]
    assert (outside / "victim").read_bytes() == b"keep"


def test_a_folder_swapped_for_a_link_during_a_delete_is_not_followed(tmp_path: Path) -> None:
    # Catches: a delete that checked each folder on the way (lstat) and then unlinked by
    # path; another local user swapping the tag folder for a link to ~/project between the
    # two made it delete ~/project's file of that name.
    import nebulaml.storage.local as local

    store = Store(tmp_path / "root")
    store.make_dir("global_step9")
    store.write_bytes(("global_step9", "model"), b"ours")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model").write_bytes(b"keep")
    folder = Path(store.root) / "global_step9"
    real_lstat = os.lstat

    def swap_after_the_check(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        result = real_lstat(path, *args, **kwargs)
        if str(path) == str(folder) and not folder.is_symlink():
            folder.rename(folder.with_name("moved"))
            folder.symlink_to(outside)
        return result

    with pytest.MonkeyPatch.context() as patch:  # the test's own patches stay
        patch.setattr(local.os, "lstat", swap_after_the_check)
        store.remove("global_step9", "model")  # walks open folders: no check to race
    assert (outside / "model").read_bytes() == b"keep"
    assert not folder.is_symlink() and not (folder / "model").exists()
    # Swapped before the delete: refused, the link named.
    store.write_bytes(("global_step9", "model"), b"ours")
    folder.rename(folder.with_name("moved"))
    folder.symlink_to(outside)
    with pytest.raises(nm.StorageError, match="global_step9: is a symbolic link"):
        store.remove("global_step9", "model")
    assert (outside / "model").read_bytes() == b"keep"


def test_file_modes_follow_the_roots_privacy(backend: Root) -> None:
    # Catches: a memory-tier file or folder that another user could read (the tier holds
    # model weights in shared /dev/shm), whichever operation made it.
    store = backend.open()
    store.make_dir("t")
    store.write_bytes(("t", "written"), b"1")
    store.publish(("t", "published"), b"1")
    store.append_text(("t", "appended"), "1\n")
    with memoryview(mmap.mmap(-1, 4096)) as view:
        store.write_view(("t", "viewed"), view, lambda _p: None)
    if not backend.is_local:  # object stores have no modes
        return
    umask = os.umask(0)
    os.umask(umask)
    folder = Path(store.root) / "t"
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
    if backend.kind == "memory-tier":
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert modes == dict.fromkeys(("written", "published", "appended", "viewed"), 0o600)
    else:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~umask
        assert modes["appended"] == 0o644 & ~umask
        for name in ("written", "published", "viewed"):
            assert modes[name] == 0o666 & ~umask
