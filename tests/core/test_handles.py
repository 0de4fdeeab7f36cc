"""A handle holds (issue #18, case 4): a checkpoint handle from `get_checkpoint` or
`get_latest_checkpoint` keeps its checkpoint from retention, eviction and prune (this
process's, or another's) until it is released or its hold expires, so that a checkpoint
the library just named is there when the caller loads it. Before, a loop of save, flush,
`get_latest_checkpoint()` then `load` after the next saves failed with
`CheckpointNotFoundError`: retention had deleted it between.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from children.crashkit import assert_same_state, known_state, save_step
from jobkit import JobChild, job_env

import nebulaml as nm
from nebulaml.ops.pruning import execute_prune, list_prune_candidates, plan_prune
from nebulaml.protocol import leases
from nebulaml.protocol.catalog import list_committed
from nebulaml.protocol.tiers import open_tiers
from nebulaml.storage.store import Store


def tags(store: Store) -> list[str]:
    return [c.tag for c in list_committed(store)]


def hold_leases(root: Path, tag: str, kind: str = "hold") -> list[str]:
    return sorted(p.name for p in (root / tag).iterdir() if p.name.startswith(f".lease-{kind}-"))


def prune(root: Path, keep: int) -> tuple[str, ...]:
    plan = plan_prune(list_prune_candidates(str(root)), keep)
    return execute_prune(str(root), plan).deleted


@pytest.mark.parametrize("how", ["latest", "by tag"])
def test_a_handle_keeps_its_checkpoint_from_its_own_jobs_retention(root: Path, how: str) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=1)
    save_step(1)
    nm.flush_persistence()
    handle = nm.get_latest_checkpoint() if how == "latest" else nm.get_checkpoint("global_step1")
    assert handle is not None and handle.tag == "global_step1"
    for step in (2, 3, 4):  # retention 1: global_step1 is the oldest of four, twice over
        save_step(step)
        nm.flush_persistence()
    # Held on both tiers: neither retention nor the memory tier's eviction took it.
    assert "global_step1" in tags(Store(str(root)))
    assert_same_state(handle.load("model"), known_state(1, "model"))
    handle.release()
    save_step(5)
    nm.flush_persistence()
    assert tags(Store(str(root))) == ["global_step5"]  # released: retention deletes it
    assert "global_step1" not in tags(open_tiers(str(root)).memory)


def persist_steps(root: Path, *steps: int) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=5)
    for step in steps:
        save_step(step)
        nm.flush_persistence()
    nm.shutdown()


def test_a_handle_keeps_its_checkpoint_from_prune_until_released(root: Path) -> None:
    persist_steps(root, 1, 2, 3)
    with nm.get_checkpoint("global_step2", str(root)) as handle:
        assert handle is not None
        assert prune(root, keep=1) == ("global_step1",)  # global_step2 kept: being read
        assert_same_state(handle.load("optimizer"), known_state(2, "optimizer"))
    assert hold_leases(root, "global_step3") == []
    assert prune(root, keep=1) == ("global_step2",)  # released by the with block


def test_another_processs_handle_holds_until_that_process_is_gone(
    root: Path, memory_tier: Path, tmp_path: Path
) -> None:
    persist_steps(root, 1, 2)
    reader = JobChild("handle", root, env=job_env(memory_tier), stderr_path=tmp_path / "r.err")
    try:
        assert reader.wait_for("HOLDING", 60) == "HOLDING global_step2"
        persist_steps(root, 3)
        assert prune(root, keep=1) == ("global_step1",)  # global_step2: the reader holds it
    finally:
        reader.kill()
    assert prune(root, keep=1) == ("global_step2",)  # a dead process holds nothing


def test_a_hold_expires_and_a_load_renews_it(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    persist_steps(root, 1, 2, 3)
    monkeypatch.setattr(leases, "HOLD_TTL_S", 1.0)
    handle = nm.get_checkpoint("global_step1", str(root))
    assert handle is not None
    first = hold_leases(root, "global_step1")
    assert len(first) == 1
    time.sleep(0.3)  # over a quarter of the hold's time: the next load renews it
    handle.load("model")
    renewed = hold_leases(root, "global_step1")
    assert len(renewed) == 1 and renewed != first
    assert prune(root, keep=1) == ("global_step2",)  # global_step1 held still
    time.sleep(1.1)  # no load since: expired
    assert prune(root, keep=1) == ("global_step1",)


def test_a_handle_does_not_keep_its_own_writer_from_replacing_the_tag(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0)
    save_step(1)
    nm.flush_persistence()
    handle = nm.get_latest_checkpoint()
    assert handle is not None
    ckpt = nm.Checkpoint("global_step1", 2, overwrite=True)
    ckpt.save("model", known_state(7, "model"))
    ckpt.save("optimizer", known_state(7, "optimizer"))
    nm.flush_persistence()  # the persist replaces the persistent copy: no CheckpointBusyError
    assert_same_state(handle.load("model"), known_state(7, "model"))
    handle.release()


def test_get_latest_checkpoint_is_held_at_once_after_init(root: Path) -> None:
    # A restarted job: init queues the memory tier's newest for persisting, retention runs
    # right after; the handle the job takes next must survive that and the next saves.
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=1)
    for step in (1, 2):
        save_step(step)
    nm.flush_persistence()
    nm.shutdown()
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=1)
    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == "global_step2"
    save_step(3)
    save_step(4)
    nm.flush_persistence()
    assert_same_state(latest.load("optimizer"), known_state(2, "optimizer"))


def test_a_listing_writes_nothing_and_retention_keeps_exactly_n(root: Path) -> None:
    """Bug caught (#29): every listing wrote (and fsynced) a hold file in every tag folder
    (5.9 s of a 1,817-tag listing), and the seed's "list, save, flush" then kept 3
    versions with num_of_version_in_retention=2."""
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=2)
    for step in (1, 2):
        save_step(step)
        nm.flush_persistence()
    before = sorted(str(p) for p in root.rglob("*"))
    assert [c["tag"] for c in nm.list_checkpoints()] == ["global_step2", "global_step1"]
    assert sorted(str(p) for p in root.rglob("*")) == before
    save_step(3)
    nm.flush_persistence()
    assert tags(Store(str(root))) == ["global_step2", "global_step3"]


def test_a_listed_checkpoint_is_there_when_the_caller_opens_it(root: Path) -> None:
    # With hold=True. Before: list_checkpoints() took no hold, and retention deleted the
    # listed tag before the caller's get_checkpoint: None for a checkpoint it had named.
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=1)
    save_step(1)
    nm.flush_persistence()
    listed = [c["tag"] for c in nm.list_checkpoints(hold=True)]
    assert listed == ["global_step1"]
    for step in (2, 3):
        save_step(step)
        nm.flush_persistence()
    handle = nm.get_checkpoint(listed[0])
    assert handle is not None
    assert_same_state(handle.load("model"), known_state(1, "model"))
    handle.release()


def test_get_latest_checkpoint_path_holds_what_it_names(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=1)
    save_step(1)
    nm.flush_persistence()
    path = nm.get_latest_checkpoint_path("model")
    assert path is not None
    for step in (2, 3):
        save_step(step)
        nm.flush_persistence()
    assert_same_state(torch.load(path, weights_only=True), known_state(1, "model"))


def test_a_listing_holds_each_tag_once_so_a_loop_of_listings_keeps_retention_working(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(leases, "LIST_TTL_S", 0.5)
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=1)
    for step in (1, 2, 3, 4):
        save_step(step)
        nm.flush_persistence()
        nm.list_checkpoints(hold=True)  # a training loop that lists after each save
        time.sleep(0.6)  # every hold expires; listing again does not take it again
    save_step(5)
    nm.flush_persistence()
    assert tags(Store(str(root))) == ["global_step5"]
    assert hold_leases(root, "global_step5", "list") == []  # listed by nobody yet


def test_a_listing_without_hold_writes_nothing(root: Path) -> None:
    persist_steps(root, 1, 2)
    before = sorted(p.name for p in root.rglob("*"))
    assert [c["tag"] for c in nm.list_checkpoints(str(root))] == [
        "global_step2",
        "global_step1",
    ]
    assert sorted(p.name for p in root.rglob("*")) == before
    nm.list_checkpoints(str(root), hold=True)
    assert len(hold_leases(root, "global_step1", "list")) == 1
    with nm.get_checkpoint("global_step1", str(root)) as handle:  # opened: the handle holds
        assert handle is not None
        assert hold_leases(root, "global_step1", "list") == []
        assert len(hold_leases(root, "global_step1")) == 1


def test_a_listing_holds_against_another_threads_prune_not_its_own(root: Path) -> None:
    # The operators campaign: a reader thread listed, a pruning thread of the same process
    # deleted the listed tag before the reader opened it.
    persist_steps(root, 1, 2, 3)
    assert [c["tag"] for c in nm.list_checkpoints(str(root), hold=True)][-1] == "global_step1"
    deleted: list[str] = []
    other = threading.Thread(target=lambda: deleted.extend(prune(root, keep=1)))
    other.start()
    other.join()
    assert deleted == []  # held by this thread's listing
    assert prune(root, keep=1) == ("global_step1", "global_step2")  # its own: deleted
