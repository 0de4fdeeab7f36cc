"""`nebula unlock`: a job hold that still counts though its job is gone is broken by hand,
after the operator is shown whose it is; a live job on this host is never unlocked by
mistake."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import warm
from cli_helpers import in_a_pipe

import nebulaml as nm
from nebulaml.format.manifest import utc_now
from nebulaml.format.names import JOB_PREFIX


def _forge_hold(root: Path, host: str = "node-gone-7", pid: int = 4242) -> Path:
    """A hold of another host, renewed just now: it counts for its 90 s."""
    root.mkdir(parents=True, exist_ok=True)
    now = utc_now()
    doc = {"job": "torchelastic:run-9", "host": host, "pid": pid, "pid_start": None,
           "started_at": now, "renewed_at": now}  # fmt: skip
    path = root / f"{JOB_PREFIX}00000003.json"
    path.write_text(json.dumps(doc))
    return path


def _holds(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(JOB_PREFIX))


def test_unlock_breaks_a_gone_jobs_hold_naming_whose_it_was(root: Path) -> None:
    """Bug caught: a hold of a node that was powered off kept every init out (there was
    no command to break it)."""
    _forge_hold(root)
    with pytest.raises(nm.RootInUseError, match="node-gone-7"):
        nm.init(str(root))
    run = in_a_pipe("unlock", str(root), "--yes")
    assert run.code == 0, run.stdout + run.stderr
    assert "torchelastic:run-9 (pid 4242 on node-gone-7" in run.stderr, run.stderr
    assert "Unlocked" in run.stdout and "node-gone-7" in run.stdout, run.stdout
    assert _holds(root) == []
    nm.init(str(root))  # the root is free
    nm.Checkpoint("global_step1").save("m", {"v": 1})
    nm.flush_persistence()
    nm.shutdown()


def test_unlock_without_yes_off_a_terminal_removes_nothing(root: Path) -> None:
    _forge_hold(root)
    run = in_a_pipe("unlock", str(root))
    assert run.code == 1 and "--yes" in run.stderr, run.stderr
    assert _holds(root) == [f"{JOB_PREFIX}00000003.json"]


def test_unlock_of_a_free_root_says_so(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    run = in_a_pipe("unlock", str(root), "--yes", "--json")
    assert run.code == 0, run.stderr
    assert json.loads(run.stdout) == {"root": str(root), "hold": None, "removed": []}
    missing = in_a_pipe("unlock", str(root / "nowhere"), "--yes")
    assert missing.code != 0 and "nowhere" in missing.stderr


def test_unlock_json_names_the_hold_and_what_it_removed(root: Path) -> None:
    _forge_hold(root)
    run = in_a_pipe("unlock", str(root), "--yes", "--json")
    assert run.code == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["hold"]["host"] == "node-gone-7" and doc["hold"]["live"] is True
    assert doc["hold"]["running_here"] is False
    assert doc["removed"] == [f"{JOB_PREFIX}00000003.json"]


def test_a_job_running_on_this_host_is_not_unlocked_without_force(
    root: Path, tmp_path: Path
) -> None:
    script = (
        "import sys, time, nebulaml as nm\n"
        f"nm.init({str(root)!r})\n"
        "print('READY', flush=True)\n"
        "time.sleep(120)\n"
    )
    child = warm.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "READY"
        before = _holds(root)
        assert len(before) == 1
        run = in_a_pipe("unlock", str(root), "--yes")
        assert run.code == 1, run.stdout + run.stderr
        assert f"pid {child.pid}" in run.stderr and "--force" in run.stderr, run.stderr
        assert _holds(root) == before
        forced = in_a_pipe("unlock", str(root), "--yes", "--force", "--json")
        assert forced.code == 0, forced.stderr
        doc = json.loads(forced.stdout)
        assert doc["hold"]["running_here"] is True and doc["hold"]["pid"] == child.pid
        assert doc["removed"] == before  # (the job puts its hold back at its next renewal)
    finally:
        child.kill()
        child.wait()


def test_a_name_that_is_not_utf8_is_escaped_never_printed_raw() -> None:
    """Found by the junk campaign: verify printed a folder name's 0xff byte raw."""
    from nebula_cli.console import printable

    assert printable("global_step\udcff83\x1b[2J") == "global_step\\xff83\\x1b[2J"
    with pytest.raises(nm.InvalidNameError, match="valid UTF-8"):
        nm.Checkpoint("global_step\udcff")
