"""The `nebula` entry point: --version and --help, in-process and as a real command."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

from typer.testing import CliRunner

from nebula_cli.app import app
from nebulaml import __version__


def test_version_in_process() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"nebula {__version__}"


def test_help_as_a_real_command_is_fast() -> None:
    exe = shutil.which("nebula") or str(
        __import__("pathlib").Path(sys.executable).parent / "nebula"
    )
    start = time.perf_counter()
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    assert out.returncode == 0, out.stderr
    assert "Usage: nebula" in out.stdout
    assert elapsed < 5  # a generous bound on a shared machine; the import test is the real guard


def test_unknown_command_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["frobnicate"])
    assert result.exit_code == 2
