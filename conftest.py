"""Isolation for every test and doctest: a private memory tier, a temporary folder of
the session's (`tempfile`, and TMPDIR for children), no inherited NEBULA_* settings, and
no nebula session left behind; the suite leaves nothing new in /dev/shm or the temporary
folder (pytest's own `pytest-of-<user>` aside)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# The library's modules for an optional framework are not collected for doctests where
# that framework is not installed (tests/integrations skips, or fails under CI).
SHM = "/dev/shm"

collect_ignore = [
    f"core/nebulaml/{name}.py"
    for name in ("lightning", "pytorch_lightning")
    if importlib.util.find_spec(name) is None
]
# The Trainer needs Accelerate too: the Hugging Face modules go together.
if any(importlib.util.find_spec(name) is None for name in ("transformers", "accelerate")):
    collect_ignore += [
        f"core/nebulaml/{where}{name}.py"
        for name in ("transformers", "accelerate")
        for where in ("", "integrations/")
    ]


TMP = tempfile.gettempdir()


def _entries(folder: str) -> set[str]:
    """The names in `folder` this user owns (another user's are not this suite's)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return set()
    mine = set()
    for name in names:
        with contextlib.suppress(OSError):
            if os.lstat(os.path.join(folder, name)).st_uid == os.getuid():
                mine.add(name)
    return mine


@pytest.fixture(scope="session", autouse=True)
def leaves_nothing_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The suite's temporary folder, and its teardown: nothing new left in /dev/shm (a
    memory tier is RAM) or in the temporary folder.

    Doctests' `tempfile.mkdtemp()` and children's temporary files (TMPDIR: torchrun's
    `torchelastic_*`, say) go to one folder for the session, removed at its end; one per
    test would pull the folder from under what a library made once per process
    (multiprocessing's, a compiler's cache). pytest keeps its own under `pytest-of-<user>`.
    """
    before = {SHM: _entries(SHM), TMP: _entries(TMP)}
    tmp_path_factory.getbasetemp()  # pytest's own, where it always is
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Started in the background by a shell (`make test &`, nohup): children would
        # inherit the ignored SIGINT, and the tests of Ctrl-C could not send one. A handler
        # of Python's is not inherited: they start with the default, as from a terminal.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    scratch = tempfile.mkdtemp(prefix="nebula-tests-")
    was = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = os.environ["TMPDIR"] = scratch
    try:
        yield
    finally:
        tempfile.tempdir = was[0]
        if was[1] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = was[1]
        shutil.rmtree(scratch, ignore_errors=True)
    for folder, names in before.items():
        left = sorted(n for n in _entries(folder) - names if not n.startswith("pytest-of-"))
        if left:
            pytest.fail(f"the test suite (or another process of this user, meanwhile) left "
                        f"{left} in {folder}", pytrace=False)  # fmt: skip


@pytest.fixture(autouse=True)
def memory_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private memory-tier base folder (never the user's real /dev/shm tiers)."""
    import nebulaml as nm
    from nebulaml.runtime import session as _session

    base = tmp_path / "memory-tier"
    monkeypatch.setenv("NEBULA_MEMORY_TIER_PATH", str(base))
    for var in (
        "NEBULA_PERSISTENT_STORAGE_PATH",
        "NEBULA_PERSISTENT_TIME_INTERVAL",
        "NEBULA_NUM_OF_VERSION_IN_RETENTION",
        "NEBULA_MEMORY_BUFFER_SIZE",
        "NEBULA_EXIT_TIMEOUT_S",
        "NEBULA_LAZY_SNAPSHOT",
        "NEBULA_KEEP_MEMORY_TIER",
        "NEBULA_RANK_TIMEOUT_S",
        "NEBULA_STORAGE_RETRIES",
        "NEBULA_STORAGE_RETRY_BASE_S",
        "NEBULA_STORAGE_RETRY_MAX_S",
        "NEBULA_JOB_ID",
    ):
        monkeypatch.delenv(var, raising=False)
    yield base
    # A test that provoked a background failure has already asserted on it.
    with contextlib.suppress(nm.NebulaError):
        _session.stop(timeout_s=30)
