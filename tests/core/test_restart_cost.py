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
from typing import Any

import pytest
import warm

import nebulaml as nm
import nebulaml.protocol.catalog as catalog
from nebulaml.format.manifest import parse_manifest
from nebulaml.format.names import INDEX_DIR, MANIFEST_NAME, WRITER_PREFIX
from nebulaml.protocol import commit_index
from nebulaml.protocol.catalog import list_committed
from nebulaml.protocol.commit_index import newest, record_begun
from nebulaml.protocol.delete import delete_checkpoint
from nebulaml.protocol.index_names import begun_path, entry_path, parse_entry
from nebulaml.protocol.sequence import note_sequence
from nebulaml.storage.store import Store


def _save(tag: str, value: int = 0, **kw: object) -> None:
    nm.Checkpoint(tag, **kw).save("m", {"v": value})  # type: ignore[arg-type]


def _fresh_process() -> None:
    """What a new process knows: no cached manifest, no kept listing."""
    catalog._MANIFESTS.clear()
    commit_index._listings.clear()
    commit_index._catalogs.clear()


def _entries(root: Path) -> list[str]:
    """The tags of the index entries of `root`, in its buckets and flat."""
    names = [p.name for p in (root / INDEX_DIR).rglob("*") if p.is_file()]
    return sorted(parsed[1] for name in names if (parsed := parse_entry(name)) is not None)


def _touch(root: Path, path: tuple[str, ...]) -> None:
    """An index file written as record_commit and record_begun write it (not synced)."""
    (root.joinpath(*path[:-1])).mkdir(parents=True, exist_ok=True)
    (root.joinpath(*path)).write_bytes(b"")


def _clone_root(root: Path, n: int) -> None:
    """A root of `global_step1` .. `global_stepN`: the first saved through the API, the
    others its clones with their own manifests (step i, sequence i), begun records and
    index entries, as persists of this version leave them (a save each would take a
    minute)."""
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
        _touch(root, begun_path(tag))
        _touch(root, entry_path(tag, clone.sequence))
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
    assert _entries(root) == ["global_step4", "global_step5"]  # retention took the others'
    shutil.rmtree(root / "global_step5")  # a bad checkpoint removed by hand
    assert _same_as_full_listing(root) == ["global_step4"]
    nm.init(str(root))  # the restart tidies the entry above the newest
    nm.shutdown()
    assert _entries(root) == ["global_step4"]


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
    assert len(_entries(root)) == committed == 4  # written by that reader, in buckets


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
    """A persist's folder cut short, as a writer of this version leaves it: its begun
    record in the index first (commit.begin_tag), then the folder, data and marker."""
    record_begun(Store(str(root)), tag)
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


_LISTINGS = ("list_dirs", "list_files", "list_prefixed", "list_file_names", "list_non_files",
             "list_versions")  # fmt: skip


def _names_listed(root: Path) -> int:
    """How many names the store's listings of `root` returned to a fresh process's
    init + get_latest_checkpoint + load (the restart #47 measures). The listings are
    counted through a patch of their own, undone on return: undoing the test's
    `monkeypatch` would undo the memory-tier base the suite gives each test too."""
    listed = [0]
    with pytest.MonkeyPatch.context() as patch:
        for method in _LISTINGS:
            original = getattr(Store, method)

            def counting(
                self: Store, *parts: str, _original: object = original, **kw: str
            ) -> object:
                out = _original(self, *parts, **kw)  # type: ignore[operator]
                if Path(self.root) == root and out is not None:
                    listed[0] += len(out)
                return out

            patch.setattr(Store, method, counting)
        _fresh_process()
        nm.init(str(root))
        latest = nm.get_latest_checkpoint()
        assert latest is not None and latest.load("m") == {"v": 0}
        latest.release()
        nm.shutdown()
    return listed[0]


def test_a_restarts_listings_do_not_grow_with_the_number_of_tags(tmp_path: Path) -> None:
    """Bug caught: a restart listed every name of the commit index (to find the newest)
    and every folder of the root (to find those at the top): 20 ms of a 46-63 ms restart
    at 10,000 tags, 2.46x the restart at 100. Now the index's highest buckets and the
    begun records there: what a restart lists is bounded by a bucket (1,000 steps), not
    by the number of tags."""
    small, large = tmp_path / "small" / "root", tmp_path / "large" / "root"
    _clone_root(small, 50)
    _clone_root(large, 2_000)
    at_50 = _names_listed(small)
    at_2000 = _names_listed(large)
    # Was 100+ at 50 and 4,000+ at 2,000 (every entry, every folder).
    assert at_2000 <= 2 * at_50, (at_50, at_2000)


def test_a_leftover_at_the_top_is_found_from_its_begun_record_not_by_listing_the_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    _clone_root(root, 50)
    dead = _dead_pid()
    top = _half_written(root, "global_step51", dead)
    roots_listed = []
    list_dirs = Store.list_dirs

    def counting(self: Store, *parts: str) -> list[str]:
        if Path(self.root) == root and not parts:
            roots_listed.append(parts)
        return list_dirs(self, *parts)

    monkeypatch.setattr(Store, "list_dirs", counting)
    _fresh_process()
    nm.init(str(root), persistent_time_interval=0)
    nm.shutdown()
    assert not top.exists()  # recovered at init
    assert roots_listed == []  # from the index's top bucket, not a listing of the root
    assert not list(root.joinpath(*begun_path("global_step51")[:-1]).glob("*+global_step51"))


def test_a_root_without_begun_records_is_listed_for_its_leftovers(tmp_path: Path) -> None:
    """A root an older nebula wrote (no begun record: the newest has none): the folders
    at the top are found by listing the root, as before, and a dead writer's leftover
    there, which its writer never announced, is removed at init."""
    root = tmp_path / "root"
    _clone_root(root, 20)
    for path in (root / INDEX_DIR).rglob("*+*"):
        path.unlink()  # as an older nebula's persists leave a root
    dead = _dead_pid()
    top = _half_written(root, "global_step21", dead)
    for path in (root / INDEX_DIR).rglob("*+*"):
        path.unlink()  # its writer, too, wrote none
    _fresh_process()
    nm.init(str(root), persistent_time_interval=0)
    nm.shutdown()
    assert not top.exists()


def test_a_hostile_begun_record_never_makes_recovery_touch_another_folder(
    tmp_path: Path,
) -> None:
    """Begun records are hints: one naming a committed tag, one whose file names a path
    outside the root (a hashed record), one for a folder that never came: init removes
    nothing of them, reads no wrong data, and the newest is still the newest."""
    root = tmp_path / "root"
    _clone_root(root, 10)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ".writer-0.json").write_text(
        json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "rank": 0})
    )
    store = Store(str(root))
    record_begun(store, "global_step10")  # committed: not a leftover
    record_begun(store, "global_step12")  # never came
    hashed = begun_path("global_step11-" + "x" * 250)
    root.joinpath(*hashed).write_text("../outside")
    _fresh_process()
    nm.init(str(root), persistent_time_interval=0)
    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == "global_step10"
    latest.release()
    nm.shutdown()
    assert (root / "global_step10" / MANIFEST_NAME).exists()
    assert (outside / ".writer-0.json").exists()


def test_begin_tag_writes_the_begun_record_before_the_writer_marker(tmp_path: Path) -> None:
    """Every writer of a tag folder outside the memory tier announces it before its writer
    marker (the record a restart finds leftovers by: a folder is a leftover only once it
    holds a marker); the memory tier's saves do not."""
    from nebulaml.protocol.commit import begin_tag

    store = Store(str(tmp_path / "root"))
    made = []
    publish = Store.publish

    def checking(self: Store, parts: tuple[str, ...], *args: Any, **kwargs: Any) -> None:
        if parts[-1].startswith(WRITER_PREFIX):  # the writer marker
            made.append(self.exists(*begun_path(parts[0])))
        publish(self, parts, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Store, "publish", checking)
        begin_tag(store, "global_step3", rank=0, overwrite=False)
        begin_tag(store, "global_step4", rank=0, overwrite=False, announce=False)
    assert made == [True, False]
