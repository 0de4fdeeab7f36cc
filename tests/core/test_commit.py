"""The commit protocol on one tier: the manifest comes last, and goes first."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import nebulaml as nm
from nebulaml.format.names import SEQUENCE_FILE, writer_marker_name
from nebulaml.protocol.catalog import list_committed, read_committed, read_sequence_file
from nebulaml.protocol.commit import begin_tag, commit_rank, write_item
from nebulaml.protocol.delete import delete_checkpoint, delete_checkpoints
from nebulaml.protocol.leases import hold_tag, is_lease_file
from nebulaml.protocol.markers import writer_record
from nebulaml.protocol.recovery import list_incomplete
from nebulaml.protocol.sequence import SequenceReservation, reserve_sequence
from nebulaml.protocol.transfer import copy_part
from nebulaml.storage.store import Store


class RecordingStore(Store):
    """A real local store that journals every completed write, publish and remove, and
    can fail the n-th remove (a fault injected at the storage boundary)."""

    def __init__(self, url: str, fail_remove_at: int | None = None) -> None:
        super().__init__(url)
        self.events: list[tuple[str, str]] = []
        self.fail_remove_at = fail_remove_at

    def publish(self, parts, data, *, create_only=True):
        super().publish(parts, data, create_only=create_only)
        self.events.append(("publish", parts[-1]))

    def open_write(self, *parts):
        inner = super().open_write(*parts)
        events = self.events

        class _Journal:
            def __enter__(self):
                return inner.__enter__()

            def __exit__(self, *exc):
                result = inner.__exit__(*exc)
                events.append(("write", parts[-1]))
                return result

        return _Journal()

    def write_bytes(self, parts, data, *, durable=True):
        super().write_bytes(parts, data, durable=durable)
        if not durable:  # a durable one goes through open_write, journalled there
            self.events.append(("write", parts[-1]))

    def remove(self, *parts, durable=True):
        removes = sum(1 for kind, _ in self.events if kind == "remove")
        if self.fail_remove_at is not None and removes + 1 == self.fail_remove_at:
            raise nm.StorageError(f"injected failure removing {parts[-1]}")
        super().remove(*parts, durable=durable)
        self.events.append(("remove", parts[-1]))


def _write_two_items(store: Store, tag: str) -> list:
    begin_tag(store, tag, rank=0, overwrite=False)
    return [
        write_item(store, tag, "model", {"w": torch.ones(4)}, rank=0),
        write_item(store, tag, "optimizer", {"lr": 0.1}, rank=0),
    ]


def test_items_without_manifest_are_invisible(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    _write_two_items(store, "global_step1")
    assert list_committed(store) == []
    assert read_committed(store, "global_step1") is None
    assert list_incomplete(store) == ["global_step1"]
    assert nm.get_latest_checkpoint(persist_path=str(tmp_path / "root")) is None


def test_manifest_is_published_last(tmp_path: Path) -> None:
    store = RecordingStore(str(tmp_path / "root"))
    items = _write_two_items(store, "global_step1")
    commit_rank(store, "global_step1", rank=0, world_size=1, items=items, created_at="t")
    kinds = [name for kind, name in store.events if kind in ("write", "publish")]
    assert kinds[-1] == "manifest.json"
    assert kinds.index("model") < kinds.index(".rank-0.json") < kinds.index("manifest.json")
    assert kinds.index("optimizer") < kinds.index("manifest.json")
    info = read_committed(store, "global_step1")
    assert info is not None and [i.name for i in info.manifest.items] == ["model", "optimizer"]
    assert list_incomplete(store) == []


def test_a_missing_item_makes_the_checkpoint_invisible(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    items = _write_two_items(store, "global_step1")
    commit_rank(store, "global_step1", rank=0, world_size=1, items=items, created_at="t")
    (tmp_path / "root" / "global_step1" / "optimizer").unlink()
    assert list_committed(store) == []


def test_delete_removes_the_manifest_first(tmp_path: Path) -> None:
    store = RecordingStore(str(tmp_path / "root"), fail_remove_at=2)
    items = _write_two_items(store, "global_step1")
    commit_rank(store, "global_step1", rank=0, world_size=1, items=items, created_at="t")
    store.events.clear()
    with pytest.raises(nm.StorageError, match="injected"):
        delete_checkpoint(store, "global_step1")
    # The delete died half-way: the data is partly there, but nothing is visible, and
    # the leftover carries a writer marker naming this process for recovery to judge.
    # Before all that, the delete claim that readers' leases are checked against.
    assert store.events[0][0] == "write" and is_lease_file(store.events[0][1])
    events = [event for event in store.events if not is_lease_file(event[1])]
    assert events == [("write", ".writer-0.json"), ("remove", "manifest.json")]
    assert (tmp_path / "root" / "global_step1" / "model").exists()
    assert list_committed(store) == []
    assert list_incomplete(store) == ["global_step1"]


class FolderJournal(Store):
    """A real local store that journals each remove (durable or not) and folder sync."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.events: list[tuple[str, str, str]] = []

    def remove(self, *parts, durable=True):
        super().remove(*parts, durable=durable)
        self.events.append(("remove" if durable else "remove-unsynced", *parts))

    def sync_folder(self, *parts):
        super().sync_folder(*parts)
        self.events.append(("sync", *parts, ""))


def test_deleting_several_tags_makes_every_manifest_removal_durable_before_data_goes(
    tmp_path: Path,
) -> None:
    """prune's batch delete: the manifests go first, each folder is fsynced, and only
    then does any data go; a tag a reader holds stays whole. Bugs caught: data removed
    while a manifest's removal may not have reached the disk (a crash would then bring
    back a committed tag without its data), a held tag deleted, one tag's outcome given
    to another."""
    store = FolderJournal(str(tmp_path / "root"))
    tags = ["global_step1", "global_step2", "global_step3"]
    for tag in tags:
        _commit(store, tag)
    there, hold = hold_tag(store, "global_step2")
    assert there and hold is not None
    store.events.clear()
    assert delete_checkpoints(store, tags) == {
        "global_step1": True, "global_step2": False, "global_step3": True,
    }  # fmt: skip
    events = [e for e in store.events if not is_lease_file(e[2])]
    manifests = [e for e in events if e[2] == "manifest.json"]
    assert manifests == [
        ("remove-unsynced", "global_step1", "manifest.json"),
        ("remove-unsynced", "global_step3", "manifest.json"),
    ]
    syncs = [i for i, e in enumerate(events) if e[0] == "sync"]
    assert [events[i][1] for i in syncs] == ["global_step1", "global_step3"]
    first_data = min(i for i, e in enumerate(events) if e[2] in ("model", "optimizer"))
    assert max(syncs) < first_data
    assert {e[1] for e in events if e[2] in ("model", "optimizer")} == {
        "global_step1", "global_step3",
    }  # fmt: skip
    assert [info.tag for info in list_committed(store)] == ["global_step2"]
    assert sorted(
        p.name for p in (tmp_path / "root").iterdir() if p.is_dir() and not p.name.startswith(".")
    ) == ["global_step2"]


def _commit(store: Store, tag: str) -> None:
    items = _write_two_items(store, tag)
    commit_rank(store, tag, rank=0, world_size=1, items=items, created_at="t")


class TrainingBehindTheListing(Store):
    """A memory tier that training changes right after its first folder listing, before
    any manifest is read (the concurrency campaign's interleaving, made certain)."""

    def __init__(self, url: str, meanwhile) -> None:
        super().__init__(url)
        self.meanwhile = meanwhile
        self.listings = 0

    def list_dirs(self) -> list[str]:
        listed = super().list_dirs()
        self.listings += 1
        if self.meanwhile is not None:
            self.meanwhile(Store(self.url))
            self.meanwhile = None
        return listed


def test_a_listing_never_loses_the_newest_to_saves_and_evictions_meanwhile(
    tmp_path: Path,
) -> None:
    # Listed: step78 committed, step79 being written. Before either manifest is read,
    # step79 commits and evicts step78, then step80 commits and evicts step79: the tier
    # always held a newest at least as new as step78, and a listing must say so.
    def training(store: Store) -> None:
        commit_rank(store, "global_step79", rank=0, world_size=1, items=items79, created_at="t")
        assert delete_checkpoint(store, "global_step78")
        _commit(store, "global_step80")
        assert delete_checkpoint(store, "global_step79")

    store = TrainingBehindTheListing(str(tmp_path / "mem"), training)
    _commit(Store(store.url), "global_step78")
    items79 = _write_two_items(Store(store.url), "global_step79")
    assert [info.tag for info in list_committed(store)] == ["global_step80"]
    assert store.listings == 2
    # Nothing in flux: one listing, as before.
    store.listings = 0
    assert [info.tag for info in list_committed(store)] == ["global_step80"]
    assert store.listings == 1


def test_commit_refuses_a_tag_another_writer_committed(tmp_path: Path) -> None:
    first, second = Store(tmp_path / "root"), Store(tmp_path / "root")
    items = _write_two_items(first, "global_step1")
    commit_rank(first, "global_step1", rank=0, world_size=1, items=items, created_at="t")
    with pytest.raises(nm.CheckpointExistsError):
        begin_tag(second, "global_step1", rank=0, overwrite=False)
    other = [write_item(second, "global_step1", "other", {"x": 1}, rank=0)]
    with pytest.raises(nm.CommitConflictError, match="global_step1"):
        commit_rank(second, "global_step1", rank=0, world_size=1, items=other, created_at="t")
    info = read_committed(first, "global_step1")
    assert info is not None and [i.name for i in info.manifest.items] == ["model", "optimizer"]


def test_begin_refuses_a_tag_another_live_process_is_writing(tmp_path: Path) -> None:
    import json
    import socket
    import subprocess
    import sys

    store = Store(tmp_path / "root")
    store.make_dir("global_step1")
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        marker = {"host": socket.gethostname(), "pid": writer.pid, "rank": 0, "started_at": "t"}
        store.write_bytes(("global_step1", ".writer-0.json"), json.dumps(marker).encode())
        store.write_bytes(("global_step1", "model"), b"half of someone else's item")
        with pytest.raises(nm.CheckpointBusyError, match=f"pid {writer.pid}"):
            begin_tag(store, "global_step1", rank=0, overwrite=False)
        assert store.read_bytes("global_step1", "model") == b"half of someone else's item"
    finally:
        writer.kill()
        writer.wait()
    begin_tag(store, "global_step1", rank=0, overwrite=False)  # the writer is gone now
    assert "model" not in store.list_files("global_step1")


def test_a_persist_between_its_last_part_and_its_manifest_is_not_a_leftover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks persist their parts; when the last part is in and the manifest is not,
    a prune of leftovers (grace 0) must see a live writer, not a dead job's folder."""
    import nebulaml.protocol.commit as commit

    memory, root = Store(tmp_path / "mem"), Store(tmp_path / "root")
    for rank in (0, 1):
        begin_tag(memory, "global_step1", rank=rank, overwrite=False, world_size=2)
        item = write_item(memory, "global_step1", f"model-{rank}", {"w": torch.ones(4)}, rank=rank)
        commit_rank(memory, "global_step1", rank=rank, world_size=2, items=[item], created_at="t")
    publish, pruned = commit.publish_manifest, []

    def prune_first(store: Store, tag: str, *args: object, **kwargs: object) -> object:
        if store.url == root.url:
            plan = nm.plan_prune(nm.list_prune_candidates(root.url, incomplete=True), 1, grace_s=0)
            pruned.append((plan, nm.execute_prune(root.url, plan)))
        return publish(store, tag, *args, **kwargs)

    monkeypatch.setattr(commit, "publish_manifest", prune_first)
    copy_part(memory, root, "global_step1", rank=0, world_size=2, timeout_s=5, wait=False)
    copy_part(memory, root, "global_step1", rank=1, world_size=2, timeout_s=5)
    [(plan, result)] = pruned
    assert result.deleted == () and plan.incomplete == ()
    assert [d.reason.split(" by ")[0] for d in plan.protected] == ["being written"]
    committed = read_committed(root, "global_step1")
    assert committed is not None and len(committed.manifest.items) == 2
    assert nm.get_checkpoint("global_step1", root.url).load("model-1")["w"].sum() == 4
    assert not [f for f in root.list_files("global_step1") if f.startswith(".writer-")]


# A save's writer marker, linked ---------------------------------------------------------
def _prepared(store: Store, name: str = ".writer-0-prepared.json") -> tuple[str, str]:
    store.make_dir(".writers")
    store.publish((".writers", name), writer_record(0), create_only=False)
    return (".writers", name)


def test_a_new_tags_writer_marker_is_the_prepared_file_linked(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "mem"), durable=False)
    marker = _prepared(store)
    assert begin_tag(store, "global_step1", rank=0, overwrite=False, marker=marker)
    written = tmp_path / "mem" / "global_step1" / writer_marker_name(0)
    assert written.stat().st_ino == (tmp_path / "mem" / marker[0] / marker[1]).stat().st_ino
    assert json.loads(written.read_bytes())["pid"] == os.getpid()
    # A folder there already goes the long way: its leftovers are cleared first.
    (tmp_path / "mem" / "global_step2").mkdir()
    (tmp_path / "mem" / "global_step2" / "model").write_bytes(b"a dead save's")
    assert begin_tag(store, "global_step2", rank=0, overwrite=False, marker=marker)
    assert sorted(store.list_files("global_step2")) == [writer_marker_name(0)]


@pytest.mark.parametrize("prepared", ["gone", "a symbolic link", "a folder"])
def test_a_prepared_marker_that_is_no_file_is_written_instead(
    tmp_path: Path, prepared: str
) -> None:
    store = Store(str(tmp_path / "mem"), durable=False)
    store.make_dir(".writers")
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_bytes(b'{"host": "other", "pid": 1}')
    where = tmp_path / "mem" / ".writers" / "w.json"
    if prepared == "a symbolic link":
        where.symlink_to(elsewhere)
    elif prepared == "a folder":
        where.mkdir()
    assert not begin_tag(
        store, "global_step1", rank=0, overwrite=False, marker=(".writers", "w.json")
    )
    written = tmp_path / "mem" / "global_step1" / writer_marker_name(0)
    assert written.is_file() and not written.is_symlink()
    assert json.loads(written.read_bytes())["pid"] == os.getpid()
    assert elsewhere.read_bytes() == b'{"host": "other", "pid": 1}'


def test_a_save_links_its_marker_and_shutdown_removes_the_prepared_file(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=3600, keep_memory_tier=True)
    memory = Path(nm.memory_tier_path(str(root)))
    dead = memory / ".writers" / ".writer-0-4194304.json"  # above pid_max: no such process
    dead.parent.mkdir(parents=True, exist_ok=True)
    dead.write_bytes(writer_record(0))
    ckpt = nm.Checkpoint("global_step1", 2)
    ckpt.save("model", {"w": torch.ones(4)})
    [prepared] = (memory / ".writers").iterdir()  # this process's; the dead one's removed
    assert prepared.name == f".writer-0-{os.getpid()}.json"
    written = memory / "global_step1" / writer_marker_name(0)
    assert written.stat().st_ino == prepared.stat().st_ino and prepared.stat().st_nlink == 2
    ckpt.save("optimizer", {"step": 1})  # the commit removes the tag's name alone
    nm.wait_for_snapshot()  # the commit, left to the background by a lazy save
    assert not written.exists() and prepared.stat().st_nlink == 1
    prepared.unlink()  # another hand's: the next save writes its marker, and prepares again
    nm.Checkpoint("global_step2").save("model", {"w": torch.ones(4)})
    nm.Checkpoint("global_step3").save("model", {"w": torch.ones(4)})
    assert prepared.exists()
    assert nm.get_latest_checkpoint().tag == "global_step3"
    nm.shutdown()
    assert not list((memory / ".writers").iterdir())


# The commit sequence, reserved ahead ------------------------------------------------------
def test_a_reserved_sequence_is_taken_without_writing_the_file_again(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "mem"), durable=False)
    store.make_dir()
    reservation = SequenceReservation(store)
    first = reservation.take(0)  # nothing reserved: reserved now, as reserve_sequence does
    assert first == 1 and read_sequence_file(store) == 1
    reservation.reserve_after(first)  # between saves: the file holds the next one first
    assert read_sequence_file(store) == 2
    identity = store.file_identity(SEQUENCE_FILE)
    assert reservation.take(0) == 2
    assert store.file_identity(SEQUENCE_FILE) == identity  # the commit left the file alone
    assert reservation.take(0) == 3  # taken once: the next one is reserved afresh
    assert read_sequence_file(store) == 3


def test_another_writers_commit_voids_a_reservation(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "mem"), durable=False)
    store.make_dir()
    reservation = SequenceReservation(store)
    reservation.reserve_after(reservation.take(0))  # 2 reserved
    assert reserve_sequence(store) == 3  # another writer on this tier (a copy, a CLI)
    assert reservation.take(0) == 4  # after theirs, never the 2 it had reserved
    reservation.reserve_after(4)
    assert reservation.take(floor=9) == 10  # the persistent tier holds 9 already


@pytest.mark.parametrize(
    ("floor", "taken"),
    [
        (0, 2),  # the floor below the reservation: the reserved 2 is taken
        (1, 2),  # just below: still taken
        (2, 3),  # a tie: the other tier holds 2 already, so 2 would not come after it
        (3, 4),  # above: reserved afresh, after the floor
        (9, 10),
    ],
)
def test_a_reserved_sequence_is_taken_only_above_the_floor(
    tmp_path: Path, floor: int, taken: int
) -> None:
    # Catches: a reservation taken when it equals `sequence_floor` (>= for >): a memory-tier
    # commit numbered the same as what the persistent tier holds, not after it.
    store = Store(str(tmp_path / "mem"), durable=False)
    store.make_dir()
    reservation = SequenceReservation(store)
    reservation.reserve_after(reservation.take(0))  # 1 taken, 2 reserved
    assert read_sequence_file(store) == 2
    assert reservation.take(floor) == taken
    assert read_sequence_file(store) == taken


def test_saves_number_their_commits_one_after_another(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=3600)
    memory = Store(nm.memory_tier_path(str(root)), durable=False)
    sequences = []
    for step in range(1, 5):
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.ones(4)})
        nm.wait_for_snapshot()  # the commit, left to the background by a lazy save
        info = read_committed(memory, f"global_step{step}")
        assert info is not None
        sequences.append(info.manifest.sequence)
    assert sequences == [1, 2, 3, 4]
