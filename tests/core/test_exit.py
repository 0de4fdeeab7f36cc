"""Interpreter exit: the newest unpersisted checkpoint is persisted at normal
exit, within a bounded wait after which the process names the checkpoint it left behind; a
background failure that no call raised is reported at exit, never swallowed.

Each test runs a scenario of tests/core/children/nebula_child.py that exits on its own
(without calling flush_persistence or shutdown) and checks what exit left on disk and on
stderr.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from children import crashkit
from children.crashkit import assert_files_hold_known, committed_tags, history_rows

from nebulaml.protocol.catalog import read_committed
from nebulaml.protocol.tiers import open_tiers
from nebulaml.runtime.exit import EXIT_NOT_PERSISTED
from nebulaml.storage.store import Store

TIMEOUT_S = 60  # generous bound on any wait for a child; a healthy run needs a few seconds


@pytest.mark.slow
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


@pytest.mark.slow
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
    # It failed; it did not run out of time (the elastic campaign's survivor said so).
    said = [line for line in child.stderr.splitlines() if "was not persisted" in line]
    assert all("did not finish within" not in line for line in said), child.stderr
    assert read_committed(Store(folder), "global_step1") is None
    rows = [r for r in history_rows(folder) if r["tier"] == "persistent"]
    assert [(r["tag"], r["status"]) for r in rows] == [("global_step1", "failed")]


@pytest.mark.slow
def test_exit_persists_to_a_memory_root(
    start_child: Callable[..., crashkit.Child], tmp_path: Path
) -> None:
    # A memory:// root lives as long as the process: an atexit handler of the script's
    # own (registered after init, so run before anything registered at import) sees it.
    root = f"memory://nebula-exit-{tmp_path.name}/root"
    child = start_child("exit_memory_root", root)
    assert child.wait(TIMEOUT_S) == 0, child.stderr
    committed = [line for line in child.stdout.splitlines() if line.startswith("COMMITTED ")]
    assert committed == ["COMMITTED " + json.dumps(["global_step1", "global_step2"])], (
        child.stdout + child.stderr
    )
    assert "not persisted" not in child.stderr and "error" not in child.stderr


@pytest.mark.slow
def test_exit_waits_for_a_non_daemon_thread_that_still_saves(
    start_child: Callable[..., crashkit.Child], root: Path
) -> None:
    # The exit persist runs before the interpreter joins the non-daemon threads, unless
    # one still runs: then it persists after, what that thread saved last included.
    child = start_child("exit_while_a_thread_saves", root)
    assert child.wait(TIMEOUT_S) == 0, child.stderr
    assert child.stdout.splitlines() == ["EXITING", "SAVED"], child.stderr
    assert committed_tags(Store(root)) == ["global_step1", "global_step2"]
    assert_files_hold_known(root, 2)


# A second signal during the exit persist ---------------------------------------------------
# `exit_slowly` persists global_step2 at exit over a throttled link (about SLOW_S seconds):
# the test ends the child with a first signal, and sends more once the persist is under way.
SLOW_S = 4.0


def _finishing_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "finishing the persist of" in line]


def _wait_for_stderr(child: crashkit.Child, predicate: Callable[[str], bool]) -> str:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate(child.stderr):
        assert child.proc.poll() is None, f"the child exited ({child.proc.returncode}) early"
        assert time.monotonic() < deadline, child.stderr
        time.sleep(0.02)
    return child.stderr


def _signal_status(signum: int) -> int:
    # SIGTERM: nebula's handler exits with 128 + 15; SIGINT: CPython re-raises an
    # uncaught KeyboardInterrupt as SIGINT once the interpreter has finished.
    return -signal.SIGINT if signum == signal.SIGINT else 128 + signum


@pytest.mark.slow
@pytest.mark.parametrize(
    ("first", "second"),
    [
        (signal.SIGTERM, signal.SIGTERM),
        (signal.SIGTERM, signal.SIGINT),
        (signal.SIGINT, signal.SIGINT),
    ],
    ids=["term-term", "term-int", "int-int"],
)
def test_a_second_signal_during_the_exit_persist_lets_it_finish(
    start_child: Callable[..., crashkit.Child], tmp_path: Path, first: int, second: int
) -> None:
    protocol = crashkit.unique_protocol()
    folder = tmp_path / "persistent"
    child = start_child("exit_slowly", protocol, folder, 60, SLOW_S)
    child.wait_for("READY", TIMEOUT_S)
    child.proc.send_signal(first)
    child.wait_for("PERSISTING", TIMEOUT_S)  # the exit persist of global_step2 is under way
    child.proc.send_signal(second)
    assert child.wait(TIMEOUT_S) == _signal_status(first), child.stderr
    # It said, once, what it was finishing, where, and for how long at most.
    finishing = _finishing_lines(child.stderr)
    assert len(finishing) == 1, child.stderr
    assert "'global_step2'" in finishing[0] and str(folder) in finishing[0]
    assert re.search(r"at most \d+ s", finishing[0]), finishing[0]
    assert "not persisted" not in child.stderr
    # And it finished it: committed, and the files hold what was saved.
    assert committed_tags(Store(folder)) == ["global_step1", "global_step2"]
    assert_files_hold_known(folder, 2)


@pytest.mark.slow
def test_a_second_signal_and_a_persist_longer_than_exit_timeout_name_the_checkpoint(
    start_child: Callable[..., crashkit.Child], tmp_path: Path
) -> None:
    protocol = crashkit.unique_protocol()
    folder = tmp_path / "persistent"
    url = f"{protocol}://{folder}"
    child = start_child("exit_slowly", protocol, folder, 2, 60)  # exit_timeout_s=2
    child.wait_for("READY", TIMEOUT_S)
    child.proc.send_signal(signal.SIGTERM)
    child.wait_for("PERSISTING", TIMEOUT_S)
    t0 = time.monotonic()
    child.proc.send_signal(signal.SIGTERM)
    status = child.wait(TIMEOUT_S)
    waited_s = time.monotonic() - t0
    assert status == EXIT_NOT_PERSISTED, child.stderr  # neither 143 nor 0
    assert waited_s < 8, waited_s  # exit_timeout_s, not the 60 s the persist needs
    assert len(_finishing_lines(child.stderr)) == 1, child.stderr
    named = [line for line in child.stderr.splitlines() if "not persisted" in line]
    assert len(named) == 1, child.stderr
    assert "'global_step2'" in named[0] and f"nebula flush {url}" in named[0], named[0]
    # It is where the message says: committed in the memory tier, not in the persistent one.
    crashkit.register(protocol)
    memory = open_tiers(url).memory
    assert memory.url in named[0]
    assert read_committed(memory, "global_step2") is not None
    assert read_committed(Store(folder), "global_step2") is None


@pytest.mark.slow
def test_a_third_signal_abandons_the_exit_persist_and_names_the_checkpoint(
    start_child: Callable[..., crashkit.Child], tmp_path: Path
) -> None:
    protocol = crashkit.unique_protocol()
    folder = tmp_path / "persistent"
    child = start_child("exit_slowly", protocol, folder, 600, 120)
    child.wait_for("READY", TIMEOUT_S)
    child.proc.send_signal(signal.SIGTERM)
    child.wait_for("PERSISTING", TIMEOUT_S)
    child.proc.send_signal(signal.SIGTERM)
    _wait_for_stderr(child, lambda err: bool(_finishing_lines(err)))
    t0 = time.monotonic()
    child.proc.send_signal(signal.SIGINT)
    assert child.wait(TIMEOUT_S) == EXIT_NOT_PERSISTED, child.stderr
    assert time.monotonic() - t0 < 8  # at once, not after the 600 s exit_timeout_s
    named = [line for line in child.stderr.splitlines() if "not persisted" in line]
    assert len(named) == 1, child.stderr
    assert "'global_step2'" in named[0] and "abandoned" in named[0], named[0]
    assert read_committed(Store(folder), "global_step2") is None


def test_sigterm_during_the_interpreters_exit_ends_it_without_a_traceback(
    start_child: Callable[..., crashkit.Child], tmp_path: Path
) -> None:
    """torchrun SIGTERMs a rank whose script has returned, while an exit handler of its
    own still runs. Bug caught: nebula's SIGTERM handler raised SystemExit into that
    handler: "Exception ignored in atexit callback", a traceback, and the exit went on."""
    root = tmp_path / "persistent"
    child = start_child("exit_into_a_slow_atexit", root)
    child.wait_for("SLOW", TIMEOUT_S)
    started = time.monotonic()
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait(TIMEOUT_S) == 128 + signal.SIGTERM, child.stderr
    assert time.monotonic() - started < 10
    said = child.stderr
    assert "Traceback" not in said and "Exception ignored" not in said, said
    assert committed_tags(Store(root)) == ["global_step1"]
