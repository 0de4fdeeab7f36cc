"""The suite's leak guard (../conftest.py), run on a tiny suite of its own: a test that
leaves a file with the run's mark (nebula-tests-<run>-) in the temporary folder fails the
run, which names that test, in parallel workers too; a file of another process's never
fails a run, with a suite prefix (/dev/shm/nebula-xyz, another run's scratch folder) or
without."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def _guard() -> ModuleType:
    """The repository's conftest.py, as a module of its own (tests/conftest.py is the
    `conftest` on sys.path)."""
    spec = importlib.util.spec_from_file_location("root_conftest", REPO / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# LEAK_INTO is the run's temporary folder itself (the suite's own tempfile and children
# use a scratch folder inside it, removed at the end): where a process that ignores TMPDIR,
# or one that outlives its test, leaves a file.
LEAKY = """
import os

def test_clean():
    pass

def test_leaves_a_file_behind():
    name = "{name}".format(run=os.environ["NEBULA_TESTS_RUN"])  # {{run}}: the run's mark
    with open(os.path.join(os.environ["LEAK_INTO"], name), "w") as f:
        f.write("left")
"""


def _run_suite(
    tmp_path: Path, name: str, *args: str, source: str = LEAKY, **env_vars: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(REPO / "conftest.py", suite / "conftest.py")
    (suite / "test_leaky.py").write_text(source.format(name=name), encoding="utf-8")
    tmp = tmp_path / "tmp"  # the guarded temporary folder of the run
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp), LEAK_INTO=str(tmp), **env_vars)
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
    done, tmp = _run_suite(tmp_path, "nebula-tests-{run}-leftover", *workers)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "2 passed" in out, out
    (left,) = tmp.glob("nebula-tests-*-leftover")
    line = next((x for x in out.splitlines() if str(left) in x), "")
    assert "appeared during" in line, out
    # In parallel workers, test_clean may have run at the same time and be named too.
    assert "test_leaky.py::test_leaves_a_file_behind" in line, out


@pytest.mark.slow
def test_another_processs_file_never_fails_the_run(tmp_path: Path) -> None:
    done, tmp = _run_suite(tmp_path, "an-editors-cache", "-n", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp / "an-editors-cache").exists()  # it was there: the guard let it be


# A file of another process's, with the suite's own prefix, made in /dev/shm while the run
# goes on (another job's memory tier base, another pytest run's): not this run's.
FOREIGN = """
import os

def test_another_process_makes_a_file():
    with open(os.environ["FOREIGN_FILE"], "w") as f:
        f.write("not this run's")
"""


@pytest.mark.slow
def test_another_processs_nebula_file_in_dev_shm_never_fails_the_run(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    folder = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path / "tmp"
    foreign = folder / f"nebula-xyz-{os.getpid()}-{tmp_path.name}"
    try:
        done, _tmp = _run_suite(tmp_path, "", source=FOREIGN, FOREIGN_FILE=str(foreign))
        assert foreign.exists()  # it was there at the run's end
    finally:
        foreign.unlink(missing_ok=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_guard_judges_only_names_with_the_runs_mark(tmp_path: Path) -> None:
    # What the guard does at the run's end, on a folder of its own: of what is new, only
    # the names this run made (its mark) are its leftovers; another process's are not.
    guard = _guard()
    mark = guard.run_mark()
    assert mark == f"nebula-tests-{os.environ['NEBULA_TESTS_RUN']}-"
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "nebula-old").mkdir()  # there before the run: never judged
    before = guard._entries(str(shm))
    (shm / "nebula-xyz").mkdir()  # another job's memory tier base, made during the run
    (shm / "nebula-tests-0123456789ab-gw0-abc").mkdir()  # another run's scratch folder
    (shm / "an-editors-cache").touch()  # no suite prefix: not even looked at
    (shm / f"{mark}memory").mkdir()  # this run's
    ours, unmarked = guard.leftovers(before, guard._entries(str(shm)), mark)
    assert ours == [str(shm / f"{mark}memory")]
    assert unmarked == [str(shm / "nebula-xyz")]
