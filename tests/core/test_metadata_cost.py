"""What a commit and a persist read, however many checkpoints the root holds (#29): the
root's commit sequence in one file, retention reading only manifests it has not read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import nebulaml as nm
import nebulaml.protocol.catalog as catalog
from nebulaml.format.names import SEQUENCE_FILE
from nebulaml.protocol.catalog import list_committed, scan_sequence, tag_folders
from nebulaml.storage.store import Store


def _save(step: int) -> None:
    nm.Checkpoint(f"global_step{step}").save("m", {"v": step})


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many manifests each tier's root had read (by the root's folder name)."""
    reads: dict[str, int] = {}
    read = catalog.read_manifest

    def counting(store: Store, tag: str) -> object:
        key = Path(store.root).name
        reads[key] = reads.get(key, 0) + 1
        return read(store, tag)

    monkeypatch.setattr(catalog, "read_manifest", counting)
    return reads


def test_a_persist_reads_a_few_manifests_not_every_one_of_the_root(
    root: Path, counted: dict[str, int]
) -> None:
    """Bug caught: each commit and persist read every manifest of the root (the next
    commit sequence, and retention's listing): 600 checkpoints made the last persists
    6.4x slower than the first, one request per tag on Azure each time."""
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=1000)
    for step in range(1, 41):
        _save(step)
        nm.flush_persistence()
    counted.clear()
    for step in (41, 42, 43):
        _save(step)
        nm.flush_persistence()
    on_root = counted.get(root.name, 0)
    assert on_root <= 3 * 4, counted  # a few per persist, never 40
    nm.shutdown()
    tags = [c.tag for c in list_committed(Store(str(root)))]
    assert len(tags) == 43 and tags[-1] == "global_step43"


def test_retention_still_keeps_the_newest_n_after_reading_each_manifest_once(
    root: Path,
) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=3)
    for step in range(1, 9):
        _save(step)
        nm.flush_persistence()
    nm.Checkpoint("best", labels=["best"]).save("m", {"v": 0})
    nm.flush_persistence()
    for step in (9, 10):
        _save(step)
        nm.flush_persistence()
    nm.shutdown()
    tags = sorted(c.tag for c in list_committed(Store(str(root))))
    assert tags == ["best", "global_step10", "global_step8", "global_step9"]


def test_the_manifest_cache_holds_only_the_tags_that_exist(root: Path) -> None:
    """Bug caught: the process's cache of parsed manifests kept every tag it had read,
    retired ones too, until 200,000 entries (RSS grew about 2.7 KB a save)."""
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=2)
    memory = Store(nm.memory_tier_path(str(root)))
    persistent = Store(str(root))

    def cached(store: Store) -> set[str]:
        return set(catalog._MANIFESTS.get(store.location, {}))

    for step in range(1, 31):
        _save(step)
        nm.flush_persistence()
        # Retention's listing bounds it: what is kept, and what it has just deleted.
        assert len(cached(persistent)) <= 3, (step, sorted(cached(persistent)))
        assert len(cached(memory)) <= 3, (step, sorted(cached(memory)))
    nm.list_checkpoints()  # a listing of both tiers: no tag that is gone stays
    for store in (memory, persistent):
        assert cached(store) and cached(store) <= set(tag_folders(store)), store.url
    nm.shutdown()


def test_the_sequence_file_is_rebuilt_from_the_manifests_when_missing_or_forged(
    root: Path,
) -> None:
    """The file gone (an older nebula's root, an operator) or not what it should be: the
    next commit reads the manifests once and comes after all of them."""
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10)
    for step in (1, 2):
        _save(step)
        nm.flush_persistence()
    store = Store(str(root))
    assert json.loads((root / SEQUENCE_FILE).read_text())["sequence"] == scan_sequence(store)
    for forged in (None, b"not json", b'{"sequence": -4}', b'{"sequence": "9"}'):
        (root / SEQUENCE_FILE).unlink()
        if forged is not None:
            (root / SEQUENCE_FILE).write_bytes(forged)
        before = scan_sequence(store)
        _save(3 if forged is None else 4 + len(forged))
        nm.flush_persistence()
        newest = list_committed(store)[-1]
        assert newest.sequence > before
        assert nm.get_latest_checkpoint().tag == newest.tag
    nm.shutdown()


def test_a_link_at_the_sequence_file_is_replaced_never_written_through(
    root: Path, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    nm.init(str(root), persistent_time_interval=0)
    _save(1)
    nm.flush_persistence()
    (root / SEQUENCE_FILE).unlink()
    os.symlink(victim, root / SEQUENCE_FILE)
    _save(2)
    nm.flush_persistence()
    nm.shutdown()
    assert victim.read_text() == "keep me"
    assert [c.tag for c in list_committed(Store(str(root)))][-1] == "global_step2"


def test_something_planted_at_the_sequence_file_never_fails_a_commit(root: Path) -> None:
    """Found by the junk campaign: a folder (or a FIFO) planted at .nebula-sequence.json
    made every commit fail; the file only saves reading the manifests."""
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10)
    _save(1)
    nm.flush_persistence()
    (root / SEQUENCE_FILE).unlink()
    (root / SEQUENCE_FILE).mkdir()
    for step in (2, 3):
        _save(step)
        nm.flush_persistence()
    nm.shutdown()
    store = Store(str(root))
    newest = list_committed(store)
    assert [c.tag for c in newest] == ["global_step1", "global_step2", "global_step3"]
    assert newest[-1].sequence > newest[-2].sequence > newest[-3].sequence
