"""Crashes and background failures.

A writer SIGKILLed before its manifest or in the middle of a persist never leaves a half
checkpoint visible, and the previous checkpoint still loads; the next `init()` on the node
removes what the dead writer left in the memory tier and persists what the memory tier still
holds that is newer than the persistent tier. A failed background persist is raised once, on
the next call into the library, and recorded in the history.

The crashes happen in child processes (tests/core/children/nebula_child.py); the checks run
here, in a process that plays the restarted job. Faults come from a real fsspec filesystem
(children/crashkit.py: FaultFS) registered under a protocol unique to each test.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from children import crashkit
from children.crashkit import (
    ITEMS,
    assert_files_hold_known,
    assert_same_state,
    committed_tags,
    history_rows,
    known_state,
    save_step,
    unique_protocol,
)

import nebulaml as nm
from nebulaml.protocol.catalog import read_committed
from nebulaml.protocol.history import HISTORY_FILE
from nebulaml.protocol.recovery import list_incomplete
from nebulaml.protocol.tiers import open_tiers
from nebulaml.runtime.persister import Persister
from nebulaml.storage.store import Store

TIMEOUT_S = 60  # generous bound on any wait for a child; a healthy run needs a few seconds


def assert_loads_known(ckpt: nm.Checkpoint | None, step: int) -> None:
    assert ckpt is not None
    for item in ITEMS:
        assert_same_state(ckpt.load(item), known_state(step, item))


# a crash before the manifest ---------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("n_items", [1, 2], ids=["between-items", "before-manifest"])
def test_sigkill_before_the_manifest_leaves_the_previous_checkpoint_latest(
    start_child: Callable[..., crashkit.Child], root: Path, n_items: int
) -> None:
    child = start_child("crash_before_commit", root, n_items)
    child.wait_for("READY", TIMEOUT_S)
    assert child.kill() == -signal.SIGKILL
    memory = open_tiers(str(root)).memory
    left = memory.list_files("global_step2")
    # The crash came where it was meant to: items written, no manifest.
    assert set(ITEMS[:n_items]) <= set(left)
    assert "manifest.json" not in left

    latest = nm.get_latest_checkpoint(persist_path=root)
    assert latest is not None
    assert latest.tag == "global_step1"
    assert_loads_known(latest, 1)
    assert [c["tag"] for c in nm.list_checkpoints(root)] == ["global_step1"]
    assert nm.get_checkpoint("global_step2", root) is None
    assert_files_hold_known(root, 1)

    nm.init(root)  # the restarted job on this node; global_step2's writer is dead
    assert not memory.exists("global_step2")
    persistent = Store(root)
    assert committed_tags(persistent) == ["global_step1"]
    assert list_incomplete(persistent) == []
    assert not persistent.exists("global_step2")
    assert nm.get_latest_checkpoint().tag == "global_step1"


# a crash in the middle of the persist -------------------------------------------------------
@pytest.mark.slow
def test_sigkill_during_the_persist_leaves_it_uncommitted_and_the_next_init_finishes_it(
    start_child: Callable[..., crashkit.Child], tmp_path: Path
) -> None:
    protocol = unique_protocol()
    folder = tmp_path / "persistent"
    url = f"{protocol}://{folder}"
    child = start_child("crash_in_persist", protocol, folder)
    line = child.wait_for("PERSISTING", TIMEOUT_S)
    assert child.kill() == -signal.SIGKILL
    assert line.endswith("/global_step2/model")

    persistent = Store(folder)  # the same folder, read as a plain local path
    half = persistent.list_files("global_step2")
    assert half.get("model") == crashkit.FaultFS.fault_after_bytes  # cut off mid-item
    assert "manifest.json" not in half
    assert read_committed(persistent, "global_step2") is None
    assert committed_tags(persistent) == ["global_step1"]

    # The memory tier is namespaced by the persistent root's URL, so the restarted job must
    # name the same URL; this process reads it through FaultFS without faults.
    crashkit.register(protocol)
    assert read_committed(open_tiers(url).memory, "global_step2") is not None
    tiers_of = {c["tag"]: c["tiers"] for c in nm.list_checkpoints(url)}
    assert tiers_of["global_step2"] == ["memory"]
    assert "persistent" in tiers_of["global_step1"]
    assert_loads_known(nm.get_checkpoint("global_step1", url), 1)

    nm.init(url)  # the restarted job: recovery queues global_step2 for the persistent tier
    # shutdown() waits for what is queued, as exit does.
    nm.shutdown(timeout_s=TIMEOUT_S)
    assert committed_tags(persistent) == ["global_step1", "global_step2"]
    assert_files_hold_known(folder, 2)
    assert list_incomplete(persistent) == []


# recovery after a crash ----------------------------------------------------------------------
@pytest.mark.slow
def test_after_a_crash_the_next_init_persists_the_newest_memory_checkpoint(
    start_child: Callable[..., crashkit.Child], root: Path
) -> None:
    crashed = start_child("crash_after_commits", root)
    assert crashed.wait(TIMEOUT_S) == -signal.SIGKILL
    persistent = Store(root)
    assert committed_tags(persistent) == ["global_step1"]
    assert committed_tags(open_tiers(str(root)).memory) == ["global_step3"]

    restarted = start_child("init_and_exit", root)
    assert restarted.wait(TIMEOUT_S) == 0, restarted.stderr
    # The newest one, and not global_step2: the interval skipped it, so it is never persisted.
    assert committed_tags(persistent) == ["global_step1", "global_step3"]
    assert not persistent.exists("global_step2")
    assert_files_hold_known(root, 3)
    # (The crashed process may have lost its last rows: the history is a report.)
    persists = [(r["tag"], r["status"]) for r in history_rows(root) if r["tier"] == "persistent"]
    assert ("global_step3", "ok") in persists
    # At most a `skipped` row (the crashed process may have lost it): never a persist.
    assert "global_step2" not in {tag for tag, status in persists if status != "skipped"}


@pytest.mark.slow
def test_flush_waits_for_the_checkpoint_that_init_recovered(
    start_child: Callable[..., crashkit.Child], root: Path
) -> None:
    crashed = start_child("crash_after_commits", root)
    assert crashed.wait(TIMEOUT_S) == -signal.SIGKILL
    persister = Persister(open_tiers(str(root)), interval_s=3600, retention=2)
    try:
        # Hold the persister thread off while queueing, as a busy scheduler can: this makes
        # deterministic the order that nm.init(root); nm.flush_persistence() almost always
        # takes on its own (init's recovery calls request(); the thread has not yet run).
        with persister._cond:
            persister.request("global_step3")
            flushed = persister.flush(timeout_s=TIMEOUT_S)
        assert flushed == "global_step3"
        assert committed_tags(Store(root)) == ["global_step1", "global_step3"]
    finally:
        persister.close(timeout_s=TIMEOUT_S)


# a background failure ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fail_errno", "cause_type"),
    [(errno.EIO, nm.StorageError), (errno.ENOSPC, nm.StorageFullError)],
    ids=["EIO", "ENOSPC"],
)
def test_a_failed_persist_is_raised_once_by_the_next_flush(
    tmp_path: Path, fail_errno: int, cause_type: type[Exception]
) -> None:
    protocol = unique_protocol()
    folder = tmp_path / "persistent"
    crashkit.register(
        protocol, mode="fail", fail_errno=fail_errno, fault_tags=frozenset({"global_step1"})
    )
    # The opt-in contract: a job that must stop when a persist fails.
    nm.init(f"{protocol}://{folder}", persistent_time_interval=0, on_persist_error="raise")
    save_step(1)

    with pytest.raises(nm.PersistError) as caught:
        nm.flush_persistence(timeout_s=TIMEOUT_S)
    assert caught.value.tag == "global_step1"
    assert "'global_step1'" in str(caught.value)
    assert isinstance(caught.value.__cause__, cause_type)
    assert nm.flush_persistence(timeout_s=TIMEOUT_S) is True  # raised once; then it goes on
    assert read_committed(Store(folder), "global_step1") is None
    assert not Store(folder).exists("global_step1", "model")  # the partial item was removed

    nm.shutdown(timeout_s=TIMEOUT_S)  # the history rows are written by now
    rows = [r for r in history_rows(folder) if r["tier"] == "persistent"]
    assert [(r["tag"], r["status"]) for r in rows] == [("global_step1", "failed")]
    assert "global_step1" in rows[0]["error"]
    assert os.strerror(fail_errno) in rows[0]["error"]


def test_a_failed_persist_is_raised_by_the_next_save_and_training_goes_on(tmp_path: Path) -> None:
    protocol = unique_protocol()
    folder = tmp_path / "persistent"
    fs = crashkit.register(
        protocol, mode="fail", fail_errno=errno.EIO, fault_tags=frozenset({"global_step1"})
    )
    # The opt-in contract: a job that must stop when a persist fails.
    nm.init(f"{protocol}://{folder}", persistent_time_interval=0, on_persist_error="raise")
    save_step(1)
    # The persister writes the failed row only after it has kept the error for the next call.
    crashkit.wait_for_history(fs, str(folder / HISTORY_FILE), lambda t: ",failed," in t, TIMEOUT_S)

    ckpt = nm.Checkpoint("global_step2", len(ITEMS))
    with pytest.raises(nm.PersistError, match="'global_step1'") as caught:
        ckpt.save(ITEMS[0], known_state(2, ITEMS[0]))
    assert caught.value.tag == "global_step1"
    for item in ITEMS:  # the same call again: the error was raised once, the handle is intact
        ckpt.save(item, known_state(2, item))
    assert nm.flush_persistence(timeout_s=TIMEOUT_S) is True
    assert committed_tags(Store(folder)) == ["global_step2"]
    assert_files_hold_known(folder, 2)


@pytest.mark.slow
def test_a_labelled_checkpoint_a_crash_left_unpersisted_is_persisted_on_restart(
    start_child: Callable[..., crashkit.Child], tmp_path: Path
) -> None:
    # catches: recovery queueing only the newest memory checkpoint, so that a `best`
    # behind a newer one is dropped after a crash although a label means "always persist"
    protocol = unique_protocol()
    folder = tmp_path / "persistent"
    url = f"{protocol}://{folder}"
    child = start_child("crash_with_best_unpersisted", protocol, folder)
    child.wait_for("SAVED", TIMEOUT_S)
    assert child.kill() == -signal.SIGKILL
    persistent = Store(folder)
    assert committed_tags(persistent) == ["global_step1"]

    crashkit.register(protocol)  # no faults here
    nm.init(url)
    nm.shutdown(timeout_s=TIMEOUT_S)
    assert committed_tags(persistent) == ["global_step1", "global_step2", "global_step3"]
    assert read_committed(persistent, "global_step2").manifest.labels == ("best",)
    assert_files_hold_known(folder, 2)


@pytest.mark.slow
def test_a_labelled_tag_saved_again_is_persisted_on_restart_over_its_old_version(
    start_child: Callable[..., crashkit.Child], tmp_path: Path
) -> None:
    # catches: recovery taking a labelled tag for durable because the persistent tier holds
    # the tag, in its older version (Lightning's `last`, saved again each epoch): the new
    # version was evicted from the memory tier and the job resumed from the old one
    protocol = unique_protocol()
    folder = tmp_path / "persistent"
    url = f"{protocol}://{folder}"
    child = start_child("crash_with_a_resaved_label_unpersisted", protocol, folder)
    child.wait_for("SAVED", TIMEOUT_S)
    assert child.kill() == -signal.SIGKILL
    # The blocked persist replaced step 1's version: none is committed there now, or
    # step 1's still; the memory tier holds step 2's.
    assert committed_tags(Store(folder)) in ([], ["last"])

    crashkit.register(protocol)  # no faults here
    nm.init(url)
    nm.shutdown(timeout_s=TIMEOUT_S)
    for item in crashkit.ITEMS:
        loaded = torch.load(folder / "last" / item, weights_only=True)
        crashkit.assert_same_state(loaded, crashkit.known_state(2, item))


def test_a_removal_the_framework_asked_for_survives_a_kill(
    start_child: Callable[..., crashkit.Child], tmp_path: Path
) -> None:
    # catches: the removal of a checkpoint the framework dropped (Lightning's top k) queued
    # only in the killed process: the next session kept the checkpoint on the persistent
    # tier for good (a Lightning DDP job killed mid-epoch and resumed, 1 run in 9)
    protocol = unique_protocol()
    folder = tmp_path / "persistent"
    url = f"{protocol}://{folder}"
    child = start_child("crash_with_a_removal_pending", protocol, folder)
    child.wait_for("REMOVED", TIMEOUT_S)  # the thread persists global_step2 first: stuck
    assert child.kill() == -signal.SIGKILL
    persistent = Store(folder)
    assert committed_tags(persistent) == ["global_step1"]

    crashkit.register(protocol)  # no faults here
    nm.init(url, num_of_version_in_retention=5)
    nm.shutdown(timeout_s=TIMEOUT_S)
    assert committed_tags(persistent) == ["global_step2"]
    assert_files_hold_known(folder, 2)
