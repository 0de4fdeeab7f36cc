"""Progress and retries on stderr: off a terminal as periodic plain lines (never a bar),
one line per storage retry, and nothing of either with --quiet; stdout stays data only.

On main before this change: `verify` showed nothing in a pipe, `flush` of 200 MB ran 5 s
silently, and an unreachable endpoint waited 14.7 s silently before its error.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import warm
from cli_helpers import EXE, in_a_pipe

import nebulaml as nm
from nebula_cli import progress

CRASHING_JOB = """
import os, sys, torch, nebulaml as nm
nm.init(sys.argv[1], persistent_time_interval=3600)
nm.Checkpoint("global_step1").save("model", {"w": torch.ones(1000)})
nm.flush_persistence()
nm.Checkpoint("global_step2").save("model", {"w": torch.ones(600_000)})  # not due for an hour
nm.wait_for_snapshot()  # its lazy copy taken (the default): a crash keeps it
os._exit(0)  # a crash: nothing runs at exit
"""
UNIT = r"[\d.]+ (?:B|KiB|MiB|GiB)"
LINE = re.compile(rf"^nebula: .+: {UNIT} of {UNIT} \(\d+%\)")


@pytest.fixture
def every_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """A progress line for every report (they are PROGRESS_INTERVAL_S apart otherwise)."""
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.0)


@pytest.fixture
def big(root: Path) -> Path:
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(3_000_000)})  # 11.4 MiB
    nm.flush_persistence()
    return root


def _progress_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if LINE.match(line)]


@pytest.mark.parametrize(
    "command",
    [
        ["verify", "{root}"],
        ["copy", "{root}", "global_step1", "{dest}"],
        ["export", "{root}", "global_step1", "{dest}"],
    ],
    ids=["verify", "copy", "export"],
)
def test_a_pipe_gets_plain_progress_lines(big: Path, tmp_path: Path, every_report: None,
                                          command: list[str]) -> None:  # fmt: skip
    # Catches: no progress off a terminal, a bar's escape codes in a pipe, decimal units.
    args = [a.format(root=big, dest=tmp_path / "dest") for a in command]
    run = in_a_pipe(*args)
    assert run.code == 0, run.stderr
    lines = _progress_lines(run.stderr)
    assert len(lines) >= 2, run.stderr
    assert lines[-1].endswith(" s") and "(100%) in " in lines[-1]
    assert "\x1b" not in run.stderr and "\r" not in run.stderr and " MB" not in run.stderr
    quiet = in_a_pipe(*args, "--quiet", "--overwrite") if command[0] == "export" else None
    quiet = quiet or in_a_pipe(*args, "--quiet")
    assert quiet.code == 0 and _progress_lines(quiet.stderr) == []


def test_a_copy_shows_its_verifying_phase(big: Path, tmp_path: Path, every_report: None) -> None:
    # main: the copy's line reached 100% and then nothing was said while every byte was
    # read back from the destination and checked (about 2 s for 200 MB to Azure).
    run = in_a_pipe("copy", str(big), "global_step1", str(tmp_path / "dest"))
    assert run.code == 0, run.stderr
    lines = _progress_lines(run.stderr)
    copying = [i for i, line in enumerate(lines) if line.startswith("nebula: copying ")]
    verifying = [i for i, line in enumerate(lines) if line.startswith("nebula: verifying ")]
    assert copying and verifying, run.stderr
    assert lines[verifying[-1]].startswith("nebula: verifying global_step1: 11.4 MiB of 11.4 MiB")
    assert "(100%) in " in lines[verifying[-1]]
    assert min(verifying) > min(i for i in copying if "(100%)" in lines[i])  # after the copy
    terminal = {"COLUMNS": "100", "TTY_COMPATIBLE": "1", "TERM": "xterm"}
    again = in_a_pipe("copy", str(big), "global_step1", str(tmp_path / "d2"), **terminal)
    assert again.code == 0 and "verifying global_step1" in again.stderr, again.stderr


def test_a_copy_reports_verification_through_the_library(big: Path, tmp_path: Path) -> None:
    copied: list[tuple[int, int]] = []
    verified: list[tuple[int, int]] = []
    nm.copy_checkpoint(str(big), "global_step1", str(tmp_path / "dest"),
                       progress=lambda *a: copied.append(a),
                       verify_progress=lambda *a: verified.append(a))  # fmt: skip
    size = nm.list_checkpoints(str(big))[0]["size_bytes"]
    assert copied[-1] == (size, size) and verified[-1] == (size, size)
    assert [done for done, _ in verified] == sorted(done for done, _ in verified)


def test_a_quick_operation_in_a_pipe_prints_no_progress(big: Path) -> None:
    run = in_a_pipe("verify", str(big), "--json")
    assert run.code == 0 and run.stderr == ""
    assert json.loads(run.stdout)["ok"] is True


@pytest.mark.slow
def test_flush_reports_progress(root: Path, memory_tier: Path, every_report: None) -> None:
    # main: `flush` said nothing until it was done.
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier))
    warm.run([sys.executable, "-c", CRASHING_JOB, str(root)], env=env, check=True,
                   timeout=60)  # fmt: skip
    run = in_a_pipe("flush", str(root))
    assert run.code == 0, run.stderr
    assert run.stdout == f"Persisted global_step2 to {root}\n"
    lines = _progress_lines(run.stderr)
    assert lines and lines[0].startswith(f"nebula: persisting to {root}: ")
    persisting = [line for line in lines if line.startswith("nebula: persisting to ")]
    assert "2.3 MiB of 2.3 MiB (100%) in" in persisting[-1]
    assert lines[-1].startswith(f"nebula: verifying at {root}: 2.3 MiB of 2.3 MiB (100%) in")


def test_progress_on_a_terminal_is_a_bar_on_stderr(big: Path, tmp_path: Path) -> None:
    # Catches: the bar on stdout (it would end up in `$(...)`).
    env = {"COLUMNS": "80", "TTY_COMPATIBLE": "1", "TERM": "xterm"}
    run = in_a_pipe("copy", str(big), "global_step1", str(tmp_path / "d"), **env)
    assert run.code == 0, run.stderr
    assert "copying global_step1" in run.stderr and "MiB" in run.stderr
    assert run.stdout.startswith("Copied global_step1")


UNREACHABLE = (
    "connection_string=DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
    "AccountKey=Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
    "KBHBeksoGMGw==;BlobEndpoint=http://127.0.0.1:9/devstoreaccount1"
)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["ls", "verify"])
def test_each_retry_is_a_line_and_quiet_hides_them(command: str) -> None:
    # main: an unreachable endpoint waited through every retry without a word.
    pytest.importorskip("adlfs")
    env = dict(os.environ, NEBULA_STORAGE_RETRIES="2", NEBULA_STORAGE_RETRY_BASE_S="0.01",
               NEBULA_STORAGE_RETRY_MAX_S="0.02")  # fmt: skip
    args = [EXE, command, "az://container/run1", "--storage-option", UNREACHABLE]
    out = warm.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.splitlines()
    retries = [line for line in lines if line.startswith("nebula: retrying: az://container/run1")]
    assert len(retries) == 2, out.stderr
    assert retries[0].endswith("retry 1 of 2 in 0.01 s") or "retry 1 of 2" in retries[0]
    assert lines[-1].startswith("nebula: error: ") and "Eby8vdM02" not in out.stderr
    if command == "verify":
        quiet = warm.run([*args, "--quiet"], capture_output=True, text=True, env=env,
                               timeout=120)  # fmt: skip
        assert quiet.returncode == 1
        assert quiet.stderr.splitlines() == [lines[-1]]
