"""The suite runs everything the repository holds: every test file is collected by a plain
`pytest` (pytest's default `norecursedirs` skips any folder named `dist`, and so hid
tests/dist from every run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIPPED_FOLDERS = {".venv", ".azurite", ".git", "node_modules", "__pycache__"}


def _test_files() -> set[str]:
    """Every file pytest would take for tests (test_*.py, *_test.py) in the repository."""
    found = set()
    for pattern in ("test_*.py", "*_test.py"):
        for path in REPO.rglob(pattern):
            rel = path.relative_to(REPO)
            if not SKIPPED_FOLDERS & set(rel.parts) and not rel.parts[0].startswith("."):
                found.add(rel.as_posix())
    return found


def _collected(*args: str) -> list[str]:
    """The test ids a plain `pytest --collect-only` prints (without doctests: files only)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
         "-o", "addopts=-p no:cacheprovider", *args],
        cwd=REPO, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def _plain_session(config: pytest.Config) -> bool:
    """Whether this very run is a plain `pytest` (its paths from `testpaths`, nothing
    deselected): what it collected is then what a plain pytest collects."""
    return (
        config.args_source == pytest.Config.ArgsSource.TESTPATHS
        and not config.option.keyword
        and not config.option.markexpr
    )


@pytest.mark.slow
def test_every_test_file_is_collected_by_a_plain_pytest(request: pytest.FixtureRequest) -> None:
    if _plain_session(request.config):
        # The whole suite is running (make test, CI): it collected every test already (a
        # worker of pytest-xdist too), so a second collection would only cost its time.
        items = request.session.items
        files = {Path(str(item.path)).relative_to(REPO).as_posix() for item in items}
    else:
        files = {test_id.split("::")[0] for test_id in _collected()}
    assert "tests/dist/test_multirank.py" in files  # the folder pytest's default skips
    assert _test_files() - files == set()
