"""Operator commands never make a running trainer's save fail (issue #18, case 3).

`nebula copy ROOT --latest persistent` (or `nebula flush ROOT`) copies into the persistent
tier the checkpoint the trainer's persister may be persisting at that moment. Before, the
one that came second found the other's writer marker and failed: the trainer's next call
raised `PersistError` ("being written by pid ..."), although the copy had persisted the
checkpoint, or the operator's copy failed with `CheckpointBusyError`. Now each waits for
the other, and a committed copy of the same items at the destination is the persist's.

The other writer is a child process paused at a known point: an operator's copy whose
writer marker is at the destination (children/jobs_child.py `copy_paused`), or a trainer
whose persist blocks inside an item (nebula_child.py `crash_in_persist`, on FaultFS).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from children import crashkit
from children.crashkit import assert_files_hold_known, committed_tags, save_step
from jobkit import JobChild, job_env

import nebulaml as nm
from nebulaml.errors import CommitConflictError
from nebulaml.ops.pruning import execute_prune, list_prune_candidates, plan_prune
from nebulaml.protocol import cowriters
from nebulaml.protocol.catalog import read_committed
from nebulaml.protocol.cowriters import copy_alongside
from nebulaml.storage.store import Store


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run `fn` in a thread; the list gets its result or the exception it raised."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_the_persister_waits_for_an_operators_copy_of_the_same_tag(
    root: Path, memory_tier: Path, tmp_path: Path
) -> None:
    nm.init(str(root), persistent_time_interval=3600)
    save_step(1)
    nm.flush_persistence()  # also starts the interval: global_step2's persist waits
    save_step(2)
    gate = tmp_path / "gate"
    copier = JobChild("copy_paused", root, "global_step2", "persistent", gate,
                      env=job_env(memory_tier), stderr_path=tmp_path / "copy.err")  # fmt: skip
    try:
        copier.wait_for("COPYING", 60)  # its writer marker is in root/global_step2
        thread, out = in_thread(lambda: nm.flush_persistence("global_step2", timeout_s=120))
        thread.join(1.0)
        assert out == [], out  # waiting for the copy, not failed ("being written by pid")
        gate.touch()
        assert copier.wait(60) == 0, copier.stdout + copier.stderr
        thread.join(60)
        assert out == [True], out
    finally:
        copier.kill()
    save_step(3)  # and the trainer's next call raises nothing either
    nm.flush_persistence()
    assert committed_tags(Store(str(root))) == ["global_step2", "global_step3"]
    assert_files_hold_known(root, 2)


@pytest.mark.slow
def test_an_operators_copy_waits_for_the_trainers_persist_of_the_same_tag(
    start_child: Callable[..., crashkit.Child], tmp_path: Path
) -> None:
    protocol, folder = crashkit.unique_protocol(), tmp_path / "faulty"
    crashkit.register(protocol)  # here the same files, without faults
    url = f"{protocol}://{folder}"
    trainer = start_child("crash_in_persist", protocol, folder)
    trainer.wait_for("PERSISTING", 60)  # its persist of global_step2 is inside an item
    thread, out = in_thread(lambda: nm.copy_checkpoint(url, "global_step2", "persistent"))
    thread.join(1.0)
    assert out == [], out  # waiting for the persister, not CheckpointBusyError
    trainer.kill()  # the trainer dies mid-persist: its leftovers are a dead writer's
    thread.join(60)
    assert len(out) == 1 and isinstance(out[0], dict), out
    assert out[0]["copied_items"] or out[0]["skipped_items"]
    assert_files_hold_known(folder, 2)


def test_a_manifest_the_other_writer_published_first_is_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src_root, dst_root = tmp_path / "src", tmp_path / "dst"
    nm.init(str(src_root), persistent_time_interval=0)
    save_step(1)
    nm.flush_persistence()
    src = read_committed(Store(str(src_root)), "global_step1")
    assert src is not None
    dst = Store(str(dst_root))
    real = cowriters.copy_checkpoint

    def raced(info: object, store: Store, **options: object) -> object:
        real(info, store, **options)  # the other writer's copy, committed first
        raise CommitConflictError(store.url, "global_step1")  # ours lost the race

    monkeypatch.setattr(cowriters, "copy_checkpoint", raced)
    result = copy_alongside(src, dst, overwrite=True)
    assert result.unchanged
    assert committed_tags(dst) == ["global_step1"]


def test_prune_never_fails_the_trainers_retention(root: Path) -> None:
    # Retention and a prune deleting the same old tag at once: retention is tidying
    # after the persist, never the persist's failure.
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=1)
    stop = threading.Event()

    def prunes() -> None:
        while not stop.is_set():
            with contextlib.suppress(nm.NebulaError):  # a prune may fail; the trainer not
                execute_prune(str(root), plan_prune(list_prune_candidates(str(root)), 1))
            time.sleep(0.001)

    thread = threading.Thread(target=prunes, daemon=True)
    thread.start()
    try:
        for step in range(1, 16):
            save_step(step)
            nm.flush_persistence()
    finally:
        stop.set()
        thread.join(30)
    assert committed_tags(Store(str(root)))[-1] == "global_step15"


def test_the_writers_lock_files_go_with_their_writers(memory_tier: Path, tmp_path: Path) -> None:
    """Bug caught: every persist left its `.nebula-writing-<n>.lock` in the memory-tier
    base folder (64 of them after a job and `gc`). And two writers of one tag still take
    turns: the second waits while the first holds the lock, even with the file removed
    and made again in between."""
    root = tmp_path / "root"
    nm.init(str(root), persistent_time_interval=0)
    for step in (1, 2, 3):
        nm.Checkpoint(f"global_step{step}").save("model", {"w": step})
        assert nm.flush_persistence() is True
    nm.shutdown()
    assert not list(memory_tier.glob(".nebula-writing-*")), list(memory_tier.iterdir())

    dst, inside, order = Store(tmp_path / "dst"), threading.Event(), []

    def hold(name: str, seconds: float) -> None:
        with cowriters.writing(dst, "global_step1", time.monotonic() + 30):
            order.append(f"{name} in")
            inside.set()
            time.sleep(seconds)
            order.append(f"{name} out")

    first, _ = in_thread(lambda: hold("first", 0.3))
    assert inside.wait(10)
    second, _ = in_thread(lambda: hold("second", 0))
    third, _ = in_thread(lambda: hold("third", 0))
    for thread in (first, second, third):
        thread.join(30)
    assert order[:2] == ["first in", "first out"], order
    assert order[2::2] == [x.replace("out", "in") for x in order[3::2]], order  # no overlap
    assert not list(memory_tier.glob(".nebula-writing-*"))


def test_writers_of_other_roots_never_wait_for_each_other(
    memory_tier: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug caught (#47): a persist locked one of 64 files chosen by a hash of its root and
    tag, so an unrelated job's persist to another root waited for the whole of a long
    copy that happened to share its file (4.99 s for 1 KiB beside a 189 MB persist), said
    "in use by another process" and, past 300 s, failed. The other writer here holds a
    tag of another root whose hash falls on the very file the old scheme gave this one."""
    import hashlib

    def old_stripe(store: Store) -> int:
        key = hashlib.sha256(f"{store.location}\0global_step1".encode()).digest()
        return int.from_bytes(key[:4], "big") % 64

    root = tmp_path / "root"
    mine = old_stripe(Store(str(root)))
    others = (Store(str(tmp_path / f"other{i}")) for i in range(10_000))
    other = next(store for store in others if old_stripe(store) == mine)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with cowriters.writing(other, "global_step1", time.monotonic() + 30):
            holding.set()
            release.wait(30)

    holder, _ = in_thread(hold)
    try:
        assert holding.wait(10)
        nm.init(str(root), persistent_time_interval=0)
        nm.Checkpoint("global_step1").save("model", {"w": 1})
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="nebulaml"):
            assert nm.flush_persistence() is True
        took = time.monotonic() - started
    finally:
        release.set()
        holder.join(30)
        nm.shutdown()
    assert "in use by" not in caplog.text, caplog.text
    assert took < 2.0, f"the persist waited {took:.2f} s for another root's writer"
