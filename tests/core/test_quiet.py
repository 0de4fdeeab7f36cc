"""The low-priority threads (audits, evictions) work between saves, not beside them
(runtime/crew.py's QUIET), and a caller that needs a paused job's result still gets it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import nebulaml as nm
from nebulaml.runtime import unchanged
from nebulaml.runtime.crew import AUDIT_CREW, QUIET, Crew
from nebulaml.runtime.session import current

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
