"""Interpreter exit (DESIGN.md §5): the newest unpersisted checkpoint is persisted at normal
exit, within a bounded wait after which the process names the checkpoint it left behind; a
background failure that no call raised is reported at exit, never swallowed.

Each test runs a scenario of tests/core/children/nebula_child.py that exits on its own
(without calling flush_persistence or shutdown) and checks what exit left on disk and on
stderr.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from children import crashkit
from children.crashkit import assert_files_hold_known, committed_tags, history_rows

from nebulaml.catalog import read_committed
from nebulaml.storage import Store
from nebulaml.tiers import open_tiers

TIMEOUT_S = 60  # generous bound on any wait for a child; a healthy run needs a few seconds


@pytest.mark.parametrize(("how", "exit_code"), [("return", 0), ("raise", 1)])
def test_exit_persists_the_checkpoint_the_interval_held_back(
    start_child: Callable[..., crashkit.Child], root: Path, how: str, exit_code: int
) -> None:
    child = start_child("exit_with_pending", root, how)
    assert child.wait(TIMEOUT_S) == exit_code, child.stderr
    # Before exit only global_step1 was persisted: global_step2 waited for the interval.
    assert "PERSISTED " + json.dumps(["global_step1"]) in child.stdout.splitlines()
    persistent = Store(root)
    assert committed_tags(persistent) == ["global_step1", "global_step2"]
    assert_files_hold_known(root, 2)
    persists = [(r["tag"], r["status"]) for r in history_rows(root) if r["tier"] == "persistent"]
    assert persists == [("global_step1", "ok"), ("global_step2", "ok")]
    assert "was not persisted" not in child.stderr


def test_exit_waits_at_most_exit_timeout_then_names_the_unpersisted_checkpoint(
    start_child: Callable[..., crashkit.Child], tmp_path: Path
) -> None:
    protocol = crashkit.unique_protocol()
    folder = tmp_path / "persistent"
    url = f"{protocol}://{folder}"
    child = start_child("exit_while_blocked", protocol, folder)  # exit_timeout_s=1
    child.wait_for("EXITING", TIMEOUT_S)  # the persist of global_step1 is stuck mid-item
    t0 = time.monotonic()
    assert child.wait(TIMEOUT_S) == 1, child.stderr  # says so, and exits non-zero
    waited_s = time.monotonic() - t0
    # It waited for the persist (about exit_timeout_s), then gave up: the default would be
    # 600 s. The upper bound leaves room for interpreter teardown on a busy machine.
    assert 0.5 <= waited_s < 8, waited_s
    named = [line for line in child.stderr.splitlines() if "'global_step1'" in line]
    assert len(named) == 1, child.stderr
    assert "not persisted" in named[0]

    # It is where the message says: committed in the memory tier, not in the persistent one.
    crashkit.register(protocol)  # this process reads the same URL, without faults
    assert read_committed(open_tiers(url).memory, "global_step1") is not None
    assert read_committed(Store(folder), "global_step1") is None


def test_exit_reports_a_background_failure_that_no_call_raised(
    start_child: Callable[..., crashkit.Child], tmp_path: Path
) -> None:
    protocol = crashkit.unique_protocol()
    folder = tmp_path / "persistent"
    child = start_child("exit_after_failure", protocol, folder)  # the disk is full
    child.wait(TIMEOUT_S)
    assert child.stdout.splitlines() == ["EXITING"]
    errors = [line for line in child.stderr.splitlines() if line.startswith("nebula: error: ")]
    assert len(errors) == 1, child.stderr
    assert "persisting checkpoint 'global_step1'" in errors[0]
    assert "storage is full" in errors[0]
    assert read_committed(Store(folder), "global_step1") is None
    rows = [r for r in history_rows(folder) if r["tier"] == "persistent"]
    assert [(r["tag"], r["status"]) for r in rows] == [("global_step1", "failed")]
