"""A restart reads what it needs, not every manifest of the root (#47): the commit index
(protocol/commit_index.py) finds the newest from one listing and the manifests at its
top, and the recovery of dead writers looks at the top and at what the memory tier
names. The newest is never missed: steps out of order, labels, sequences, copies,
deletes, damaged and newer-schema manifests, roots an older nebula wrote."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest
import warm

import nebulaml as nm
import nebulaml.protocol.catalog as catalog
from nebulaml.format.manifest import parse_manifest
from nebulaml.format.names import INDEX_DIR, MANIFEST_NAME
from nebulaml.protocol import commit_index
from nebulaml.protocol.catalog import list_committed
from nebulaml.protocol.commit_index import newest, record_commit
from nebulaml.protocol.delete import delete_checkpoint
from nebulaml.protocol.sequence import note_sequence
from nebulaml.storage.store import Store


def _save(tag: str, value: int = 0, **kw: object) -> None:
    nm.Checkpoint(tag, **kw).save("m", {"v": value})  # type: ignore[arg-type]


def _fresh_process() -> None:
    """What a new process knows: no cached manifest, no kept listing."""
    catalog._MANIFESTS.clear()
    commit_index._listings.clear()
    commit_index._catalogs.clear()


def _clone_root(root: Path, n: int) -> None:
    """A root of `global_step1` .. `global_stepN`: the first saved through the API, the
    others its clones with their own manifests (step i, sequence i) and index entries,
    as commits of this version leave them (a save each would take a minute)."""
    nm.init(str(root), persistent_time_interval=0)
    _save("global_step1")
    nm.shutdown()
    template = root / "global_step1"
    manifest = parse_manifest((template / MANIFEST_NAME).read_bytes(), "template")
    store = Store(str(root))
    for i in range(2, n + 1):
        tag = f"global_step{i}"
        folder = root / tag
        folder.mkdir()
        for item in manifest.items:
            shutil.copyfile(template / item.file, folder / item.file)
        clone = dataclasses.replace(manifest, tag=tag, step=i, sequence=manifest.sequence + i)
        record_commit(store, tag, clone.sequence)
        (folder / MANIFEST_NAME).write_bytes(clone.to_bytes())
    note_sequence(store, manifest.sequence + n)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Manifests read and tag folders listed on the persistent root ("root")."""
    counts = {"manifests": 0, "folders": 0}
    read, list_files = catalog.read_manifest, Store.list_files

    def counting_read(store: Store, tag: str) -> object:
        if Path(store.root).name == "root":
            counts["manifests"] += 1
        return read(store, tag)

    def counting_list(self: Store, *parts: str) -> dict[str, int]:
        if Path(self.root).name == "root" and parts and parts[0] != INDEX_DIR:
            counts["folders"] += 1
        return list_files(self, *parts)

    monkeypatch.setattr(catalog, "read_manifest", counting_read)
    monkeypatch.setattr(Store, "list_files", counting_list)
    return counts


def test_a_restart_reads_a_few_manifests_not_one_per_tag(
    tmp_path: Path, reads: dict[str, int]
) -> None:
    """Bug caught: init read every manifest of the root twice (the dead writers'
    recovery: a listing and a manifest per folder; the persister's retention) and
    get_latest_checkpoint once more: 0.62 s at 4,000 tags where 50 took 0.02 s."""
    root = tmp_path / "root"
    _clone_root(root, 300)
    _fresh_process()
    for key in reads:
        reads[key] = 0
    nm.init(str(root))
    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == "global_step300"
    assert latest.load("m") == {"v": 0}
    latest.release()
    nm.shutdown()
    assert reads["manifests"] <= 6, reads  # was 300+ (every tag, read again and again)
    assert reads["folders"] <= 6, reads  # was 600+ (two listings per tag)


def test_nebula_latest_and_ls_limit_read_the_top_only(
    tmp_path: Path, reads: dict[str, int]
) -> None:
    root = tmp_path / "root"
    _clone_root(root, 200)
    _fresh_process()
    for key in reads:
        reads[key] = 0
    assert nm.get_latest_checkpoint_path("m", str(root)) == str(root / "global_step200" / "m")
    assert [c["tag"] for c in nm.list_checkpoints(str(root), limit=3)] == [
        "global_step200",
        "global_step199",
        "global_step198",
    ]
    assert reads["manifests"] <= 8, reads


def _same_as_full_listing(root: Path, n: int = 3) -> list[str]:
    """The tags `newest` finds, checked against the full listing's newest, newest first.
    The memory tier's eviction runs on its own thread and may delete a tag between the
    two listings: a mismatch is looked at again (a tag the index misses stays missed)."""
    store = Store(str(root))
    for _ in range(5):
        _fresh_process()
        quick = [info.tag for info in newest(store, n)]
        full = [info.tag for info in list_committed(store)][::-1][:n]
        if quick == full:
            break
        time.sleep(0.1)
    assert quick == full
    return quick


def test_the_newest_is_never_missed_whatever_the_order_of_commits(root: Path) -> None:
    """Steps committed out of order, labelled tags without a step, two tags of one step,
    tags saved again, deletes: after each operation the index's answer is the full
    listing's (a seeded random walk, 40 operations)."""
    rng = random.Random(47)
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=1000)
    names = [f"global_step{rng.randrange(1, 12)}" for _ in range(8)]
    names += ["best", "last", "epoch=0-step=5", "checkpoint-a"]
    persistent = Store(str(root))
    for i in range(40):
        tag = rng.choice(names)
        if rng.random() < 0.25:
            delete_checkpoint(persistent, tag)  # as a prune does; gone or not there
        else:
            _save(tag, i, overwrite=True)
            nm.flush_persistence()
        _same_as_full_listing(root)
        _same_as_full_listing(Path(nm.memory_tier_path(str(root))))
    nm.shutdown()


def test_labelled_tags_are_ordered_by_their_sequence(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10)
    for tag in ("zeta", "alpha", "mid"):
        _save(tag)
        nm.flush_persistence()
    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == "mid"
    latest.release()
    _save("global_step1")  # a step is newer than any tag without one
    nm.flush_persistence()
    _save("best", labels=["best"])
    nm.flush_persistence()
    nm.shutdown()
    assert _same_as_full_listing(root) == ["global_step1", "best", "mid"]


def test_a_copy_keeps_its_sequence_and_its_place(root: Path, tmp_path: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10)
    for step in (3, 1, 2):
        _save(f"global_step{step}", step)
        nm.flush_persistence()
    nm.shutdown()
    other = tmp_path / "other"
    for tag in ("global_step2", "global_step3", "global_step1"):
        nm.ops.copy_checkpoint(str(root), tag, str(other))
    assert _same_as_full_listing(other) == ["global_step3", "global_step2", "global_step1"]


def test_deleted_tags_leave_no_entry_and_one_removed_by_hand_is_skipped(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=2)
    for step in range(1, 6):
        _save(f"global_step{step}", step)
        nm.flush_persistence()
    nm.shutdown()
    entries = sorted(p.name.rsplit("-", 1)[-1] for p in (root / INDEX_DIR).iterdir())
    assert entries == ["global_step4", "global_step5"]  # retention took the others'
    shutil.rmtree(root / "global_step5")  # a bad checkpoint removed by hand
    assert _same_as_full_listing(root) == ["global_step4"]
    nm.init(str(root))  # the restart tidies the entry above the newest
    nm.shutdown()
    entries = sorted(p.name.rsplit("-", 1)[-1] for p in (root / INDEX_DIR).iterdir())
    assert entries == ["global_step4"]


def test_damaged_and_newer_schema_manifests_at_the_top_are_passed_over(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10)
    for step in (1, 2, 3):
        _save(f"global_step{step}", step)
        nm.flush_persistence()
    nm.shutdown()
    (root / "global_step3" / MANIFEST_NAME).write_text("{not json")
    doc = json.loads((root / "global_step2" / MANIFEST_NAME).read_text())
    doc["schema_version"] = 99
    (root / "global_step2" / MANIFEST_NAME).write_text(json.dumps(doc))
    assert _same_as_full_listing(root) == ["global_step1"]
    assert "global_step2" in caplog.text and "global_step3" in caplog.text


def test_a_root_an_older_nebula_wrote_is_listed_in_full_and_indexed(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10)
    for tag in ("b", "a", "global_step1", "c"):
        _save(tag)
        nm.flush_persistence()
    nm.shutdown()
    shutil.rmtree(root / INDEX_DIR)  # as an older nebula leaves a root
    assert _same_as_full_listing(root) == ["global_step1", "c", "a"]
    committed = len(list_committed(Store(str(root))))
    assert len(list((root / INDEX_DIR).iterdir())) == committed == 4  # written by that reader


def test_a_folder_copied_in_by_hand_is_indexed_by_a_full_listing(
    root: Path, tmp_path: Path
) -> None:
    nm.init(str(root), persistent_time_interval=0)
    _save("global_step1")
    nm.flush_persistence()
    nm.shutdown()
    elsewhere = tmp_path / "elsewhere"
    nm.init(str(elsewhere), persistent_time_interval=0)
    _save("global_step9")
    nm.flush_persistence()
    nm.shutdown()
    shutil.copytree(elsewhere / "global_step9", root / "global_step9")
    assert next(c["tag"] for c in nm.list_checkpoints(str(root))) == "global_step9"
    assert _same_as_full_listing(root) == ["global_step9", "global_step1"]


def test_a_tag_too_long_for_an_entry_name_is_found(root: Path) -> None:
    long_tag = "global_step7-" + "x" * 220
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10)
    _save("global_step3")
    _save(long_tag)
    nm.flush_persistence()
    nm.shutdown()
    assert _same_as_full_listing(root)[0] == long_tag


def _dead_pid() -> int:
    proc = warm.run([sys.executable, "-c", "import os; print(os.getpid())"],
                    capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    return int(proc.stdout)


def _half_written(root: Path, tag: str, pid: int) -> Path:
    folder = root / tag
    folder.mkdir(parents=True)
    (folder / "m").write_bytes(b"partial bytes of a crashed persist")
    marker = {"host": socket.gethostname(), "pid": pid, "rank": 0,
              "started_at": "2026-01-01T00:00:00Z"}  # fmt: skip
    (folder / ".writer-0.json").write_text(json.dumps(marker))
    return folder


def test_a_dead_writers_leftover_at_the_top_is_removed_at_init_below_it_later(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    _clone_root(root, 50)
    dead = _dead_pid()
    top = _half_written(root, "global_step51", dead)  # a persist cut short
    low = _half_written(root, "global_step0", dead)  # a retention's delete cut short
    _fresh_process()
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=100)
    assert not top.exists()
    assert low.exists()  # not looked at by init: the first retention's listing clears it
    _save("global_step52")
    nm.flush_persistence()
    nm.shutdown()
    assert not low.exists()
    latest = nm.get_latest_checkpoint(str(root))
    assert latest is not None and latest.tag == "global_step52"
    latest.release()


def test_the_full_catalog_is_kept_while_the_root_is_the_same(
    tmp_path: Path, reads: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug caught: every list_checkpoints() stat'ed each manifest and item of the root
    again (0.57 s a call at 10,000 tags); now a call reads nothing while the root's
    folders and index are those it was listed under, and sees a change at once."""
    root = tmp_path / "root"
    _clone_root(root, 100)
    _fresh_process()
    assert len(nm.list_checkpoints(str(root))) == 100  # not at init: on demand
    stats = []
    identity = Store.file_identity

    def counting(self: Store, *parts: str) -> object:
        stats.append(parts)
        return identity(self, *parts)

    monkeypatch.setattr(Store, "file_identity", counting)
    for key in reads:
        reads[key] = 0
    assert len(nm.list_checkpoints(str(root))) == 100
    assert reads == {"manifests": 0, "folders": 0}
    assert len(stats) < 10, stats  # was 2 a tag: its manifest's identity, its item's size
    delete_checkpoint(Store(str(root)), "global_step100")
    listed = nm.list_checkpoints(str(root))
    assert len(listed) == 99 and listed[0]["tag"] == "global_step99"
