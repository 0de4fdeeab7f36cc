"""The low-priority threads (audits, evictions) work between saves, not beside them
(runtime/crew.py's QUIET), and a caller that needs a paused job's result still gets it;
a persist in flight pauses between its chunks while a save runs (crew.SaveYield), never
for longer than `YIELD_MAX_S` at a time, and not at all for a save that waits for it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import nebulaml as nm
from nebulaml.format import checksum
from nebulaml.runtime import unchanged
from nebulaml.runtime.crew import AUDIT_CREW, QUIET, Crew, SaveYield
from nebulaml.runtime.session import current
from nebulaml.storage import local_files

WAIT_S = 30


def test_a_low_priority_job_waits_for_the_save_to_end() -> None:
    # Catches: a nice crew that starts a job while a save runs (the audit beside the copy).
    crew = Crew("test-quiet", 1, nice=True)
    ran = threading.Event()
    with QUIET.saving():
        job = crew.submit(ran.set)
        assert not ran.wait(0.3)
        assert QUIET.busy()
    assert job.wait(WAIT_S) and ran.is_set()
    assert not QUIET.busy()


def test_a_waiter_hurries_a_job_the_save_holds_back() -> None:
    # Catches: a fill waiting for its buffer's last audit while the audit waits for the
    # save to end: the save would never end.
    crew = Crew("test-quiet-hurry", 1, nice=True)
    with QUIET.saving():
        job = crew.submit(lambda: None)
        with QUIET.hurry():
            assert job.wait(WAIT_S)


def test_a_paused_audit_goes_on_where_it_stopped() -> None:
    # Catches: an audit that gives up (or compares nothing) when a save pauses it midway:
    # a difference after the pause must still be found.
    size = 3 * unchanged._AUDIT_CHUNK_BYTES
    live = torch.zeros(size, dtype=torch.uint8)
    buffer = torch.zeros(size, dtype=torch.uint8)
    buffer[-1] = 1  # the copy differs in its last chunk
    storage = live.untyped_storage()
    entered = threading.Event()
    pause_point = QUIET.pause_point

    def noted() -> None:
        entered.set()
        pause_point()

    with QUIET.saving():
        QUIET.pause_point = noted  # type: ignore[method-assign]
        try:
            job = AUDIT_CREW.submit(
                lambda: unchanged._audit(
                    buffer.data_ptr(), [(storage, (0, size), (0,))], "the test's item"
                )
            )
            assert not job.wait(0.3)  # held back while the save runs
        finally:
            QUIET.pause_point = pause_point  # type: ignore[method-assign]
    assert job.wait(WAIT_S)
    with unchanged.WATCH.lock:
        found = unchanged.WATCH.differed.pop(storage, None)
    assert found is not None and found[1] == "the test's item"


def test_no_audit_runs_while_a_save_of_a_frozen_base_runs(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Catches: the audit of the first item's skipped base started in the middle of the
    # save (it ran beside the second item's copy and the commit, a third of the stall).
    audit = unchanged._audit
    seen: list[bool] = []

    def watched(*args: Any) -> None:
        seen.append(QUIET.busy())
        audit(*args)

    monkeypatch.setattr(unchanged, "_audit", watched)
    base = torch.randn(1024, 2048)  # 8 MiB: skipped from the third save on
    nm.init(str(root), persistent_time_interval=0)
    try:
        for step in range(1, 7):
            checkpoint = nm.Checkpoint(f"global_step{step}", 2)
            checkpoint.save("model", {"base": base, "adapter": torch.full((64,), float(step))})
            checkpoint.save("optimizer", {"exp_avg": torch.full((4096,), float(step))})
        current("test").pool.settle_audits()
    finally:
        nm.shutdown()
    assert seen, "no audit ran: nothing was skipped"
    assert not any(seen)


def test_a_persist_in_flight_writes_nothing_while_a_save_runs(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Catches: a persist hashing and writing beside a save (it took the save's memory
    # bandwidth and CPU: a persist in flight doubled a 0.3 GB save's stall, issue #49).
    write_at = local_files.DirectFile.write_at
    writes: list[float] = []

    def recorded(self: Any, view: memoryview, offset: int) -> None:
        writes.append(time.monotonic())
        write_at(self, view, offset)

    monkeypatch.setattr(local_files.DirectFile, "write_at", recorded)
    nm.init(str(root), persistent_time_interval=0)
    try:
        checkpoint = nm.Checkpoint("global_step1")
        checkpoint.save("model", {"w": torch.randn(8 << 20)})  # 32 MiB: 4 chunks
        with QUIET.saving():  # a save runs from before the persist begins
            checkpoint.commit()
            held_from = time.monotonic()
            time.sleep(0.5)
            held_to = time.monotonic()
        assert nm.flush_persistence()
    finally:
        nm.shutdown()
    assert writes, "the persist wrote nothing"
    assert not [t for t in writes if held_from <= t <= held_to], "written beside the save"


def test_a_persist_compares_nothing_while_a_save_runs(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Catches: the persist's comparison with the version before (each changed piece's
    # block digests, the whole item when all of it changed) run beside a save without a
    # pause: 0.1-0.2 s of CPU at 0.5 GB, a save in flight slowed by as much (issue #49).
    real = checksum.block_digests
    calls: list[float] = []
    save: list[threading.Thread] = []
    held: list[float] = []
    saving = threading.Event()

    def hold_quiet() -> None:
        with QUIET.saving():
            held.append(time.monotonic())
            saving.set()
            time.sleep(0.5)
            held.append(time.monotonic())

    def recorded(piece: Any) -> bytes:
        if not save:  # a save begins while the first piece is compared
            save.append(threading.Thread(target=hold_quiet))
            save[0].start()
            assert saving.wait(WAIT_S)
        calls.append(time.monotonic())
        return real(piece)

    monkeypatch.setattr(checksum, "block_digests", recorded)
    nm.init(str(root), persistent_time_interval=0)
    try:
        checkpoint = nm.Checkpoint("global_step1")
        checkpoint.save("model", {"w": torch.randn(16 << 20)})  # 64 MiB: 64 pieces
        checkpoint.commit()
        # (A flush hurries the persist past saves: only once this save has ended.)
        assert saving.wait(WAIT_S), "nothing was compared"
        save[0].join(WAIT_S)
        assert nm.flush_persistence()
    finally:
        nm.shutdown()
    beside = [t for t in calls if held[0] <= t <= held[1]]
    assert len(calls) >= 64
    assert len(beside) <= checksum.PAUSE_PIECES, f"{len(beside)} pieces compared beside the save"


def test_a_persist_pauses_once_for_a_save_that_outlasts_its_wait() -> None:
    # Catches: a persist paused for as long as a save runs, when the save waits for that
    # persist (a tag saved again, the budget's flush): each would wait for the other.
    pause = SaveYield(max_s=0.05)
    with QUIET.saving():
        started = time.monotonic()
        for _ in range(20):
            pause()
        assert time.monotonic() - started < 0.5  # one wait of 0.05 s, then none
    with QUIET.saving(), QUIET.hurry():
        started = time.monotonic()
        pause()
        assert time.monotonic() - started < 0.05
