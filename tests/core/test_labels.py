"""Labelled checkpoints and the persist queue: a labelled checkpoint is always persisted
(never superseded, never evicted from the memory tier before its persist) and kept by
retention; an unlabelled one superseded before its persist gets a `skipped` history row."""

from __future__ import annotations

import csv
import threading
import time
from pathlib import Path

import pytest
import torch

import nebulaml as nm
from nebulaml.protocol.catalog import list_committed
from nebulaml.protocol.history import HISTORY_FILE
from nebulaml.runtime.persist_actions import Persisting
from nebulaml.runtime.session import current


def _state(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4096, generator=gen), "b": torch.randn(7, generator=gen)}


def _tags(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if (p / "manifest.json").exists())


def _memory_tags() -> list[str]:
    return [info.tag for info in list_committed(current("test").tiers.memory)]


def _persists(root: Path) -> list[tuple[str, str, str]]:
    """(tag, status, error) of the persistent tier's rows, by tag (a skipped row is written
    when the newer commit comes, which may be before an earlier persist started)."""
    with open(root / HISTORY_FILE, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return sorted((r["tag"], r["status"], r["error"]) for r in rows if r["tier"] == "persistent")


def _wait_persisted(root: Path, tag: str) -> None:
    deadline = time.monotonic() + 30
    while not (root / tag / "manifest.json").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (root / tag / "manifest.json").exists()


def _assert_bit_identical(root: Path, tag: str, step: int) -> None:
    found = nm.get_checkpoint(tag, str(root))
    assert found is not None
    loaded = found.load("model")
    on_disk = torch.load(root / tag / "model", weights_only=True)
    for state in (loaded, on_disk):
        assert state.keys() == _state(step).keys()
        for key, want in _state(step).items():
            assert torch.equal(state[key], want), key
            assert state[key].numpy().tobytes() == want.numpy().tobytes()


def _save(step: int, labels: tuple[str, ...] = ()) -> None:
    nm.Checkpoint(f"global_step{step}", labels=labels).save("model", _state(step))


@pytest.mark.parametrize(("retention", "kept"), [(None, [100, 200, 300]), (1, [200, 300])])
def test_best_saved_between_two_others_within_the_interval_is_persisted(
    root: Path, retention: int | None, kept: list[int]
) -> None:
    # The script: with the defaults (a persist every 100 s) it saves 100, 200
    # (labelled best) and 300 within seconds and ends. 100 is persisted at once (the
    # first persist is never held back), best right after it (a labelled checkpoint does
    # not wait for the interval), 300 at exit: nothing was superseded, nothing skipped.
    # Old code: best was superseded by 300 and evicted: the persistent tier held 100, 300.
    nm.init(str(root), **({} if retention is None else {"num_of_version_in_retention": retention}))
    _save(100)
    _wait_persisted(root, "global_step100")  # a script's seconds between saves
    _save(200, ("best",))
    _save(300)
    nm.shutdown()
    assert _tags(root) == [f"global_step{s}" for s in kept]
    _assert_bit_identical(root, "global_step200", 200)
    (best,) = [c for c in nm.list_checkpoints(str(root)) if c["tag"] == "global_step200"]
    assert best["labels"] == ["best"] and best["tiers"] == ["persistent"]
    assert [(tag, status) for tag, status, _ in _persists(root)] == [
        ("global_step100", "ok"),
        ("global_step200", "ok"),
        ("global_step300", "ok"),
    ]


@pytest.mark.parametrize(("retention", "kept"), [(None, [100, 200, 400]), (1, [200, 400])])
def test_an_unlabelled_checkpoint_superseded_before_its_persist_gets_a_skipped_row(
    root: Path, retention: int | None, kept: list[int]
) -> None:
    # 300 waits for the interval (the persist of best started it again) and 400 supersedes
    # it: 300 is skipped, and the history says so and names 400. Best, persisted, outlives
    # retention (num_of_version_in_retention=1 keeps only the newest unlabelled one).
    # Old code: best and 300 were both superseded, without a row; 100 and 400 persisted.
    nm.init(str(root), **({} if retention is None else {"num_of_version_in_retention": retention}))
    _save(100)
    _wait_persisted(root, "global_step100")
    _save(200, ("best",))
    _save(300)
    _save(400)
    nm.shutdown()
    assert _tags(root) == [f"global_step{s}" for s in kept]
    _assert_bit_identical(root, "global_step200", 200)
    _assert_bit_identical(root, "global_step400", 400)
    assert _persists(root) == [
        ("global_step100", "ok", ""),
        ("global_step200", "ok", ""),
        ("global_step300", "skipped", "superseded by global_step400"),
        ("global_step400", "ok", ""),
    ]
    df = nm.read_history(str(root), tag="global_step300")
    skipped = nm.history_records(df[df["tier"] == "persistent"])
    assert len(skipped) == 1
    row = skipped[0]
    assert (row["step"], row["rank"], row["size_bytes"]) == (300, 0, 0)
    assert (row["duration_s"], row["blocking_s"], row["throughput_mb_s"]) == (0.0, 0.0, 0.0)
    summary = nm.summarize_history(nm.read_history(str(root)))
    assert (summary["saves"], summary["persists"], summary["skipped"]) == (4, 3, 1)
    assert summary["failures"] == 0


def test_a_labelled_commit_supersedes_an_older_pending_one(root: Path) -> None:
    # 150 waits for the interval; best (200) comes before its turn and is persisted at
    # once: 150 is skipped, superseded by best. Old code: 150 skipped without a row, and
    # best waited for the interval (persisted only at exit).
    nm.init(str(root), persistent_time_interval=3600)
    _save(100)
    _wait_persisted(root, "global_step100")
    _save(150)
    _save(200, ("best",))
    _wait_persisted(root, "global_step200")  # not held back by the interval
    nm.shutdown()
    assert _persists(root) == [
        ("global_step100", "ok", ""),
        ("global_step150", "skipped", "superseded by global_step200"),
        ("global_step200", "ok", ""),
    ]


def test_a_queued_labelled_checkpoint_stays_in_the_memory_tier(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # While the persist of 100 is held up, best and two newer checkpoints are saved: best
    # waits in the queue, protected, and the memory tier keeps it; 300, superseded, goes.
    # Old code: best was superseded by 300 and evicted from memory before any persist.
    started, gate = threading.Event(), threading.Event()
    persist = Persisting.persist

    def held_up(self: Persisting, tag: str) -> object:
        if tag == "global_step100":
            started.set()
            assert gate.wait(60)
        return persist(self, tag)

    monkeypatch.setattr(Persisting, "persist", held_up)
    nm.init(str(root), num_of_version_in_retention=1)
    _save(100)
    assert started.wait(30)
    _save(200, ("best",))
    _save(300)
    _save(400)
    persister = current("test").persister
    assert "global_step200" in persister.protected()
    assert "global_step300" not in persister.protected()
    persister.settle_eviction()  # 400's eviction runs on its own thread
    assert _memory_tags() == ["global_step100", "global_step200", "global_step400"]
    gate.set()
    nm.shutdown()
    assert _tags(root) == ["global_step200", "global_step400"]
    _assert_bit_identical(root, "global_step200", 200)
    assert _persists(root) == [
        ("global_step100", "ok", ""),
        ("global_step200", "ok", ""),
        ("global_step300", "skipped", "superseded by global_step400"),
        ("global_step400", "ok", ""),
    ]
