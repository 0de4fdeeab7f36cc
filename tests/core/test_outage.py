"""The persistent tier fails and the training loop never notices (issue #27): a full
persistent disk (a real tmpfs, filled, then grown with `mount -o remount`). Every save
returns, none raises; `flush_persistence()` never reports success while the newest
acknowledged checkpoint is only in memory; once the disk has room the newest lands by
itself (no other call), bit for bit, and the history says `failed`, then `ok`.
(The same against a real Azurite stopped and restarted: tests/azure/test_azure_outage.py.)
"""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from outage_kit import MB, assert_memory_only, state, timed_save, wait_durable

import nebulaml as nm


def _cannot(what: str, stderr: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"cannot {what} for the outage tests: {stderr}")
    pytest.skip(f"cannot {what} here: {stderr.strip()}")


def _mount(args: list[str]) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        _cannot(f"mount {' '.join(args)}", done.stderr)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    disk.mkdir()
    _mount(["-t", "tmpfs", "-o", f"size={6 * MB}", "tmpfs", str(disk)])
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _history(root: Path) -> list[dict[str, str]]:
    with open(root / "checkpointHistories.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r["tier"] == "persistent"]


def test_a_full_disk_never_stops_training_and_the_newest_lands_once_it_grows(
    small_disk: Path,
) -> None:
    """Bugs caught (main): saves raising the deferred PersistError; a second flush
    reporting success with the newest only in RAM; after the disk grew, flush raising
    the old error instead of trying again, and the acknowledged newest never persisted."""
    root = small_disk / "root"
    nm.init(
        str(root),
        persistent_time_interval=0,
        num_of_version_in_retention=2,
        on_persist_error="retry",
    )
    healthy = [timed_save(step) for step in (1, 2)]
    assert nm.flush_persistence() is True
    filler = small_disk / "filler"
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    filler.write_bytes(b"\0" * max(0, free - MB // 2))  # room for no checkpoint
    during = [timed_save(step) for step in range(3, 9)]  # none raises
    assert max(during) < max(3 * max(healthy), 2.0), (healthy, during)
    assert nm.flush_persistence(timeout_s=1, raise_on_error=False) is False
    with pytest.raises(nm.PersistError, match="global_step8"):
        nm.flush_persistence(timeout_s=0.5)
    status = nm.persistence_status()
    assert status.pending[-1] == "global_step8" and status.durable == "global_step2", status
    assert status.last_error and status.failing_since and not status.ok
    assert not (root / "global_step8" / "manifest.json").exists()
    _mount(["-o", f"remount,size={40 * MB}", str(small_disk)])  # grown, nothing else said
    wait_durable("global_step8")
    loaded = torch.load(root / "global_step8" / "model", weights_only=True)
    assert torch.equal(loaded["w"], state(8)["w"]) and int(loaded["step"]) == 8
    assert nm.persistence_status().ok
    assert nm.flush_persistence(timeout_s=30) is True
    nm.shutdown(timeout_s=30)
    rows = [(r["tag"], r["status"]) for r in _history(root)]
    assert any(status == "failed" for _tag, status in rows), rows
    assert rows[-1] == ("global_step8", "ok"), rows
    assert len([r for r in rows if r[1] == "failed"]) <= 6  # one per tag, not per try


def test_a_disk_full_at_init_starts_memory_only_and_persists_once_it_grows(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug caught (main): init raised StorageFullError (the root's identity could not be
    written): the job could not start, not even to checkpoint into RAM. The default mode,
    no option given."""
    root = small_disk / "root"
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    (small_disk / "filler").write_bytes(b"\0" * free)  # not a byte left
    nm.init(str(root), persistent_time_interval=0)
    during = [timed_save(step) for step in (1, 2, 3)]
    assert max(during) < 2.0, during
    assert_memory_only("global_step3", caplog)
    _mount(["-o", f"remount,size={40 * MB}", str(small_disk)])
    wait_durable("global_step3")
    nm.shutdown(timeout_s=30)
    loaded = torch.load(root / "global_step3" / "model", weights_only=True)
    assert torch.equal(loaded["w"], state(3)["w"]) and int(loaded["step"]) == 3
    assert (root / ".nebula-root-id.json").exists()


def test_on_persist_error_raise_stops_the_loop_as_asked(small_disk: Path) -> None:
    """The other mode: the next call into nebula raises the failure (for a job that
    must stop rather than train on unpersisted checkpoints)."""
    root = small_disk / "root"
    nm.init(str(root), persistent_time_interval=0, on_persist_error="raise")
    timed_save(1)
    assert nm.flush_persistence() is True
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    (small_disk / "filler").write_bytes(b"\0" * max(0, free - MB // 2))
    with pytest.raises(nm.PersistError, match="global_step2"):
        timed_save(2)
        nm.flush_persistence(timeout_s=30)


def test_a_bad_on_persist_error_is_refused(tmp_path: Path) -> None:
    with pytest.raises(nm.InvalidArgumentError, match="on_persist_error"):
        nm.init(str(tmp_path / "root"), on_persist_error="ignore")


def test_a_root_identity_deleted_mid_run_is_given_back_and_the_jobs_copies_stay_its_own(
    tmp_path: Path,
) -> None:
    """Bug caught (main): with the root's identity file gone (an emulator reset, an
    operator), `nebula ls` called the job's own memory copies stale (their root "is
    gone") and left them out; nothing gave the identity back."""
    root = tmp_path / "root"
    nm.init(str(root), persistent_time_interval=0)
    timed_save(1)
    assert nm.flush_persistence() is True
    identity = root / ".nebula-root-id.json"
    before = json.loads(identity.read_text())["id"]
    identity.unlink()
    timed_save(2)
    assert nm.flush_persistence() is True
    assert json.loads(identity.read_text())["id"] == before  # the same, not a new root
    listed = nm.list_checkpoints(str(root), hold=False)
    assert listed[0]["tag"] == "global_step2", listed
    assert "memory" in listed[0]["tiers"], listed  # the job's own copy: not stale
    nm.shutdown(timeout_s=30)
    latest = nm.get_latest_checkpoint(str(root))
    assert latest is not None and latest.tag == "global_step2"
    assert torch.equal(latest.load("model")["w"], state(2)["w"])


def test_a_long_outage_keeps_the_newest_and_the_labelled_within_the_budget(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Memory pressure during an outage: the budget holds about three checkpoints; older
    unlabelled ones that never became durable are dropped (named in a warning and a
    `skipped` history row), never the newest acknowledged or a labelled one, and no save
    waits for the persistent tier. Bug caught (main): the budget waited for a flush of
    the failing tier (up to exit_timeout_s) on the training thread, then raised."""
    monkeypatch.setenv("NEBULA_MEMORY_BUFFER_SIZE", str(7 * MB))  # half: 3.5 MiB
    root = small_disk / "root"
    nm.init(str(root), persistent_time_interval=0, exit_timeout_s=600)
    timed_save(1)
    assert nm.flush_persistence() is True
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    (small_disk / "filler").write_bytes(b"\0" * max(0, free - MB // 2))
    during = []
    for step in range(2, 12):
        t0 = time.perf_counter()
        labels = ["best"] if step == 4 else []
        nm.Checkpoint(f"global_step{step}", labels=labels).save("model", state(step))
        during.append(time.perf_counter() - t0)
        time.sleep(0.05)
    assert max(during) < 2.0, during
    status = nm.persistence_status()
    assert "global_step4" in status.pending and status.pending[-1] == "global_step11", status
    dropped = [r.getMessage() for r in caplog.records if "was never persisted" in r.getMessage()]
    assert dropped and all("global_step4'" not in m.split(" was")[0] for m in dropped), dropped
    (small_disk / "filler").unlink()
    wait_durable("global_step11")
    assert nm.flush_persistence("global_step4", timeout_s=30) is True
    nm.shutdown(timeout_s=30)
    for step in (4, 11):
        loaded = torch.load(root / f"global_step{step}" / "model", weights_only=True)
        assert torch.equal(loaded["w"], state(step)["w"])
    rows = _history(root)
    skipped = {r["tag"] for r in rows if r["status"] == "skipped"}
    failed = {r["tag"] for r in rows if r["status"] == "failed"}
    assert failed & skipped, rows  # a dropped one: its failed try, then its skip


def test_checkpoints_dropped_during_one_outage_are_warned_about_once_then_counted(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug caught: a full disk logged one "never persisted ... dropped" warning for each
    checkpoint a newer one superseded, for as long as the outage lasted. Said once, and
    the count when the tier works again."""
    root = small_disk / "root"
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=2)
    timed_save(1)
    assert nm.flush_persistence() is True
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    (small_disk / "filler").write_bytes(b"\0" * max(0, free - MB // 2))
    for step in range(2, 6):
        timed_save(step)  # supersedes the one before, whose persist failed
        _wait_failed(f"global_step{step}")  # its own try failed: one more to drop
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    dropped = [m for m in warned if "was never persisted" in m]
    assert len(dropped) == 1 and "'global_step2'" in dropped[0], dropped
    (small_disk / "filler").unlink()
    wait_durable("global_step5")
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    ended = [m for m in warned if "works again" in m]
    assert len(ended) == 1, ended
    assert "3 checkpoint(s) superseded during it were never persisted" in ended[0], ended
    assert "'global_step2'" in ended[0] and "'global_step4'" in ended[0], ended
    nm.shutdown(timeout_s=30)
    skipped = [r["tag"] for r in _history(root) if r["status"] == "skipped"]
    assert skipped == ["global_step2", "global_step3", "global_step4"], skipped


def _wait_failed(tag: str, timeout_s: float = 60) -> None:
    """Until the persister's own try of `tag` has failed (`nm.persistence_status()`)."""
    deadline = time.monotonic() + timeout_s
    while f"'{tag}'" not in (nm.persistence_status().last_error or ""):
        assert time.monotonic() < deadline, nm.persistence_status()
        time.sleep(0.05)
