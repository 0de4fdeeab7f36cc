"""A job's other two moments during an outage (issue #43), on a real Azurite of the test's
own, stopped or suspended (SIGSTOP: requests hang): a job restarted while the store is away
resumes from its node's memory tier, within 10 s and bit for bit, and a process that ends
while the store is away ends within `exit_timeout_s` + 5 s, with status 1 naming the
checkpoint that is not durable; and a store that hangs under a running job is reported
as one that is down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import warm
from azurite import Azurite
from outage_kit import store_away, timed_save, wait_durable

import nebulaml as nm

# The outage campaign's training script (make reliability runs it many times over).
CHILD = Path(__file__).resolve().parents[1] / "reliability" / "outage_life_child.py"

CALL_TIMEOUT_S = "3"  # how long one store call may hang (NEBULA_STORAGE_CALL_TIMEOUT_S)
EXIT_TIMEOUT_S = 8.0


def _child(how: str, url: str, journal: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "NEBULA_STORAGE_CALL_TIMEOUT_S": CALL_TIMEOUT_S,
           "NEBULA_EXIT_TIMEOUT_S": str(EXIT_TIMEOUT_S), "PYTHONUNBUFFERED": "1"}  # fmt: skip
    pipe = subprocess.PIPE
    return warm.Popen([sys.executable, str(CHILD), how, url, str(journal), *args], env=env,
                      text=True, stdin=pipe, stdout=pipe, stderr=pipe)  # fmt: skip


def _acknowledged(journal: Path) -> list[dict[str, object]]:
    """The checkpoints the child acknowledged (its journal: one JSON line each)."""
    if not journal.exists():
        return []
    return [json.loads(line) for line in journal.read_text().splitlines() if line]


def _expect(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdout is not None
    got = proc.stdout.readline().strip()
    if got != line:
        proc.kill()
        _out, err = proc.communicate(timeout=30)
        raise AssertionError(f"expected {line!r}, got {got!r}; stderr:\n{err}")


def _tell(proc: subprocess.Popen[str]) -> None:
    """Tell the child the store is away now."""
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["stopped", "suspended"])
def test_a_job_restarted_during_an_outage_resumes_from_its_memory_tier(
    own_azurite: Azurite, how: str, tmp_path: Path
) -> None:
    """Bugs caught (main): the restart's `get_latest_checkpoint()` raising StorageError
    after 12 s (stopped) or blocking for minutes (suspended), the resume script dying
    with rc 1; `nm.init` taking 5.6-7.5 s with the store down."""
    url = f"az://outage/{uuid.uuid4().hex[:12]}"
    journal = tmp_path / "acknowledged.jsonl"
    first = _child("save", url, journal)
    _expect(first, "DURABLE")
    with store_away(own_azurite, how):
        _tell(first)  # it saves global_step4, 5, ... in RAM only, each acknowledged
        deadline = time.monotonic() + 60
        while len(_acknowledged(journal)) < 2:
            assert time.monotonic() < deadline and first.poll() is None, first.poll()
            time.sleep(0.05)
        first.kill()
        first.communicate(timeout=60)
        newest = _acknowledged(journal)[-1]
        started = time.monotonic()
        second = _child("resume", url, journal)
        assert second.stdout is not None
        resumed = json.loads(second.stdout.readline())
        _out, err = second.communicate("\n", timeout=EXIT_TIMEOUT_S + 60)  # ends in the outage
        ended = time.monotonic() - started
        # The newest acknowledged, bit for bit, within 10 s of the restart.
        assert resumed["tag"] == f"global_step{newest['step']}", (resumed, newest, err)
        assert resumed["digest"] == newest["digest"], (resumed, newest)
        assert resumed["took_s"] < 10, (resumed, err)
        # init: at once for a store that refuses, CONNECT_WAIT_S (3 s) for one that hangs.
        assert resumed["init_s"] < (1.5 if how == "stopped" else 4.5), resumed
        said = [line for line in err.splitlines() if "does not answer" in line]
        assert 1 <= len(said) <= 2 and "memory tier" in err, err  # init's, and the listing's
        assert ended < EXIT_TIMEOUT_S + 5 + 10, (ended, err)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["stopped", "suspended"])
def test_a_process_ending_during_an_outage_ends_within_its_exit_timeout(
    own_azurite: Azurite, how: str, tmp_path: Path
) -> None:
    """Bugs caught (main): with the store suspended, a script whose last checkpoint was
    not persisted still running 140 s after its end (exit_timeout_s=20), stuck releasing
    the job's hold on the root, a store call without a deadline; the exit naming the
    superseded checkpoint whose persist was in flight instead of the newest."""
    url = f"az://outage/{uuid.uuid4().hex[:12]}"
    proc = _child("exit", url, tmp_path / "acknowledged.jsonl", "2")
    _expect(proc, "READY")
    with store_away(own_azurite, how):
        _tell(proc)
        _expect(proc, "SAVED global_step3")  # global_step2 and 3, back to back
        started = time.monotonic()
        try:
            _out, err = proc.communicate(timeout=EXIT_TIMEOUT_S + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        ended = time.monotonic() - started
    assert ended < EXIT_TIMEOUT_S + 5, (ended, err)
    assert proc.returncode == 1, (proc.returncode, err)
    # The newest, which the memory tier keeps, not global_step2 (in flight, superseded).
    assert "'global_step3' was not persisted" in err, err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_hung_store_is_reported_as_a_stopped_one_is(
    own_azurite: Azurite, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug caught (main): through a 45 s SIGSTOP outage `persistence_status()` kept
    `failing_since` and `last_error` at None and nothing was logged: the persist hung in a
    store call without a deadline."""
    monkeypatch.setenv("NEBULA_STORAGE_CALL_TIMEOUT_S", "2")
    url = f"az://outage/{uuid.uuid4().hex[:12]}"
    nm.init(url, persistent_time_interval=0, exit_timeout_s=60)
    timed_save(1)
    assert nm.flush_persistence(timeout_s=60) is True
    with store_away(own_azurite, "suspended"):
        started = time.monotonic()
        timed_save(2)
        while nm.persistence_status().failing_since is None:
            assert time.monotonic() - started < 30, nm.persistence_status()
            time.sleep(0.1)
        status = nm.persistence_status()
        assert status.last_error is not None and "no answer" in status.last_error, status
        assert status.pending == ("global_step2",) and not status.ok, status
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any("could not persist 'global_step2'" in m for m in warned), warned
    wait_durable("global_step2")  # the store answers again: the persist lands by itself
    assert nm.persistence_status().ok
    nm.shutdown(timeout_s=60)
