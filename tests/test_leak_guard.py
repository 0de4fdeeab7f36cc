"""The suite's leak guard (../conftest.py), run on a tiny suite of its own: a test that
leaves a file with one of the suite's prefixes in the temporary folder fails the run, which
names that test, in parallel workers too; a file of another process's (no suite prefix)
never fails a run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# LEAK_INTO is the run's temporary folder itself (the suite's own tempfile and children
# use a scratch folder inside it, removed at the end): where a process that ignores TMPDIR,
# or one that outlives its test, leaves a file.
LEAKY = """
import os

def test_clean():
    pass

def test_leaves_a_file_behind():
    with open(os.path.join(os.environ["LEAK_INTO"], "{name}"), "w") as f:
        f.write("left")
"""


def _run_suite(
    tmp_path: Path, name: str, *args: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(REPO / "conftest.py", suite / "conftest.py")
    (suite / "test_leaky.py").write_text(LEAKY.format(name=name), encoding="utf-8")
    tmp = tmp_path / "tmp"  # the guarded temporary folder of the run
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), LEAK_INTO=str(tmp))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(suite),
         "-c", os.devnull, *args, str(suite)],
        cwd=suite, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    return done, tmp


@pytest.mark.slow
@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_leftover_of_the_suites_fails_the_run_and_names_its_test(
    tmp_path: Path, workers: list[str]
) -> None:
    done, tmp = _run_suite(tmp_path, "nebula-leftover", *workers)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "2 passed" in out, out
    line = next((x for x in out.splitlines() if str(tmp / "nebula-leftover") in x), "")
    assert "appeared during" in line, out
    # In parallel workers, test_clean may have run at the same time and be named too.
    assert "test_leaky.py::test_leaves_a_file_behind" in line, out


@pytest.mark.slow
def test_another_processs_file_never_fails_the_run(tmp_path: Path) -> None:
    done, tmp = _run_suite(tmp_path, "an-editors-cache", "-n", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp / "an-editors-cache").exists()  # it was there: the guard let it be
