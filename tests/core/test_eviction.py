"""The eviction a commit asks for: off the save, and settled before the next save begins."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import nebulaml as nm
from nebulaml.protocol.catalog import list_committed
from nebulaml.runtime import persist_actions
from nebulaml.runtime.session import current

WAIT_S = 30


def _save(step: int) -> None:
    ckpt = nm.Checkpoint(f"global_step{step}", 2)
    ckpt.save("model", {"w": torch.full((256, 256), float(step))})
    ckpt.save("optimizer", {"lr": 0.1 * step})


def _save_in_thread(step: int) -> tuple[threading.Event, threading.Event]:
    """Save `step` on a thread of its own: (set when it begins, set when it returned)."""
    begun, done = threading.Event(), threading.Event()

    def save() -> None:
        begun.set()
        _save(step)
        done.set()

    threading.Thread(target=save, daemon=True).start()
    return begun, done


def _memory_tags() -> list[str]:
    return [info.tag for info in list_committed(current("test").tiers.memory)]


@pytest.fixture
def held_deletes(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Evictions' deletes wait for `release` (set `entered` when one starts)."""
    entered, release = threading.Event(), threading.Event()
    delete = persist_actions.delete_checkpoint

    def held(*args: Any, **kwargs: Any) -> bool:
        entered.set()
        assert release.wait(WAIT_S)
        return delete(*args, **kwargs)

    monkeypatch.setattr(persist_actions, "delete_checkpoint", held)
    return entered, release


@pytest.fixture
def first_persisted(
    root: Path, held_deletes: tuple[threading.Event, threading.Event]
) -> Iterator[tuple[threading.Event, threading.Event]]:
    """A session on `root` whose global_step1 is saved and persisted; evictions' deletes
    held (`held_deletes`), released and the session shut down at the end."""
    release = held_deletes[1]
    nm.init(str(root), persistent_time_interval=0)
    try:
        _save(1)
        assert nm.flush_persistence()
        yield held_deletes
    finally:
        release.set()
        nm.shutdown()


def test_a_save_returns_while_the_copy_it_supersedes_is_being_deleted(
    first_persisted: tuple[threading.Event, threading.Event],
) -> None:
    # Catches: the eviction run inside the save again (the save would wait for the delete,
    # and `done` would not be set while the delete is held).
    entered, release = first_persisted
    _begun, done = _save_in_thread(2)
    assert entered.wait(WAIT_S)  # global_step1's eviction has started
    assert done.wait(WAIT_S)  # and the save returned while it is held
    assert "global_step2" in _memory_tags()
    release.set()
    current("test").persister.settle_eviction()
    assert _memory_tags() == ["global_step2"]


def test_the_next_save_waits_for_an_eviction_in_flight(
    first_persisted: tuple[threading.Event, threading.Event],
) -> None:
    # Catches: a save that begins while the last commit's eviction runs on its thread and
    # goes on without it (settle_eviction returning because the eviction was no longer
    # "due"): it would size its room, and take its buffers, with the old copy still there.
    entered, release = first_persisted
    _save(2)
    assert entered.wait(WAIT_S)  # global_step1's eviction runs, held
    begun, done = _save_in_thread(3)
    assert begun.wait(WAIT_S)
    assert not done.wait(0.5)  # waits for the eviction in flight
    assert not current("test").tiers.memory.exists("global_step3")
    release.set()
    assert done.wait(WAIT_S)
    # global_step2's persist paused while that save ran (crew.SaveYield): let it land.
    nm.flush_persistence()
    current("test").persister.settle_eviction()
    assert _memory_tags() == ["global_step3"]
