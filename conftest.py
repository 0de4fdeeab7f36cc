"""Isolation for every test and doctest: a private memory tier, a temporary folder of
the worker's (`tempfile`, and TMPDIR for children), no inherited NEBULA_* settings, and
no nebula session left behind; the leak guard: the run leaves nothing of its own in
/dev/shm or the temporary folder, and says which test left what it finds (pytest-xdist
runs the suite in several workers: the controller judges once every worker is done).
What the run makes there carries its mark (`run_mark`), so that another process's files,
another run's included, never fail it."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import tempfile
import uuid
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
collect_ignore_glob = []
if any(importlib.util.find_spec(name) is None for name in ("transformers", "accelerate")):
    collect_ignore += [
        f"core/nebulaml/{where}{name}.py"
        for name in ("transformers", "accelerate")
        for where in ("", "integrations/")
    ]
    collect_ignore_glob.append("core/nebulaml/integrations/trainer_*.py")  # the Trainer's


TMP = tempfile.gettempdir()
# The run's mark, drawn by the controller (pytest-xdist's workers and every child inherit
# RUN_VAR): the name of everything the run makes in /dev/shm or the temporary folder begins
# with nebula-tests-<run>-: its scratch folders (`scratch_folder`, where its children's
# TMPDIR points: torchrun's torchelastic_*, tempfile's nebula-export-*) and the memory tier
# base outside a test (NEBULA_MEMORY_TIER_PATH; each test has its own under tmp_path).
# Only names with this mark fail the run: another process's (another job's memory tier
# base /dev/shm/nebula-<user>, another run's scratch folders) never do.
RUN_VAR = "NEBULA_TESTS_RUN"
_ANY_RUN = re.compile(r"nebula-tests-[0-9a-f]{12}-")  # some run's mark, this one's or not
# What else a run could leave there, without the mark (a process of the suite's that
# ignored TMPDIR and NEBULA_MEMORY_TIER_PATH): memory tiers (the default base is
# nebula-<user>), torchrun's torchelastic_* folders, torch's and DeepSpeed's shared memory,
# Azurite's data. Said when new at the end of the run, never failing it: another process
# of this user's makes them too. Other names (an editor's, a shell's) are not looked at.
SUITE_PREFIXES = ("nebula-", "torchelastic_", "torch_", "deepspeed", "azurite", "__azurite")
_SEEN = "nebula_leaks_seen"  # xdist: each worker's first sightings, sent to the controller
# path -> the tests during which it appeared: one per worker that saw it appear (several
# workers' tests run at once, and each of them saw it; the one that left it is among them).
_seen_key = pytest.StashKey[dict[str, list[str]]]()
_before_key = pytest.StashKey[set[str]]()


def _entries(folder: str) -> set[str]:
    """The names in `folder` with a suite prefix that this user owns (another user's are
    not this suite's)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return set()
    mine = set()
    for name in names:
        if not name.startswith(SUITE_PREFIXES):
            continue
        with contextlib.suppress(OSError):
            if os.lstat(os.path.join(folder, name)).st_uid == os.getuid():
                mine.add(os.path.join(folder, name))
    return mine


def _snapshot() -> set[str]:
    return _entries(SHM) | _entries(TMP)


def run_mark() -> str:
    """The beginning of the name of everything this run makes in /dev/shm or the
    temporary folder: nebula-tests-<run>-."""
    return f"nebula-tests-{os.environ[RUN_VAR]}-"


def leftovers(before: set[str], after: set[str], mark: str) -> tuple[list[str], list[str]]:
    """What is in `after` and not in `before` (paths in the guarded folders): the run's
    own (their names begin with its `mark`: they fail the run), and those that carry no
    run's mark (said, never failing: another process's, or one of the run's that ignored
    its settings). Another run's (its mark) are neither: that run judges them.

    Example:
        >>> mark = "nebula-tests-0123456789ab-"
        >>> leftovers({"/tmp/x"}, {"/tmp/x", f"/tmp/{mark}gw0-q1", "/dev/shm/nebula-xyz",
        ...     "/tmp/nebula-tests-ba9876543210-gw0-q2"}, mark)
        (['/tmp/nebula-tests-0123456789ab-gw0-q1'], ['/dev/shm/nebula-xyz'])
    """
    ours, unmarked = [], []
    for path in sorted(after - before):
        name = os.path.basename(path)
        if name.startswith(mark):
            ours.append(path)
        elif not _ANY_RUN.match(name):
            unmarked.append(path)
    return ours, unmarked


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_seen_key] = {}
    if _is_worker(config):
        return
    # A fresh mark for each run, a run started by a test of this one's included; the
    # workers pytest-xdist starts after this inherit it, and so does every child.
    os.environ[RUN_VAR] = uuid.uuid4().hex[:12]
    # A memory tier made outside a test (each test has its own: `memory_tier`) carries it.
    parent = SHM if os.path.isdir(SHM) and os.access(SHM, os.W_OK) else TMP
    os.environ["NEBULA_MEMORY_TIER_PATH"] = os.path.join(parent, f"{run_mark()}memory")
    config.stash[_before_key] = _snapshot()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown without it
def pytest_testnodedown(node: object, error: object) -> None:
    """xdist's controller: a worker's first sightings of the suite's files."""
    seen = getattr(node, "workeroutput", {}).get(_SEEN)
    config = getattr(node, "config", None)
    if seen and config is not None:
        for path, tests in json.loads(seen).items():
            config.stash[_seen_key].setdefault(path, []).extend(tests)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The leak guard: nothing with the run's mark is in /dev/shm or the temporary folder
    when every worker is done; what is names the test during which it appeared. What is
    new there with a suite prefix but no run's mark is said, and fails nothing."""
    config = session.config
    seen: dict[str, list[str]] = config.stash[_seen_key]
    if _is_worker(config):
        config.workeroutput[_SEEN] = json.dumps(seen)  # type: ignore[attr-defined]
        return
    # The set-up the workers shared (tests/shared_setup.py: an installed wheel is ~900 MB).
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is not None:
        with contextlib.suppress(ValueError, OSError):
            shutil.rmtree(factory.getbasetemp() / "shared", ignore_errors=True)
    left, unmarked = leftovers(config.stash[_before_key], _snapshot(), run_mark())
    if unmarked:
        lines = [f"  {path}" + (f" ({_culprits(seen[path])})" if seen.get(path) else "")
                 for path in unmarked]  # fmt: skip
        _say(config, "new during the run, without its mark (not judged: another process's?):",
             lines, yellow=True)  # fmt: skip
    if left:
        lines = [f"  {path} ({_culprits(seen.get(path, []))})" for path in left]
        _say(config, "the test suite left these behind:", lines, red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _say(config: pytest.Config, title: str, lines: list[str], **markup: bool) -> None:
    message = title + "\n" + "\n".join(lines)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(message, **markup)
    else:
        print(message)


def _culprits(tests: list[str]) -> str:
    """Which test left a file: the one during which it appeared, or those that ran at
    the same time in parallel workers (it is one of them)."""
    if not tests:
        return "appeared outside any test: a session's set-up or a process that outlived its test"
    if len(tests) == 1:
        return f"appeared during {tests[0]}"
    return f"appeared during one of {', '.join(sorted(tests))}: they ran at the same time"


@pytest.fixture(autouse=True)
def _watch_for_leftovers(request: pytest.FixtureRequest) -> Iterator[None]:
    """Notes what appears in /dev/shm and the temporary folder during each test, so that
    the leak guard can say which test left it (another worker's test may have, too)."""
    before = _snapshot()
    yield
    seen = request.config.stash[_seen_key]
    for path in _snapshot() - before:
        seen.setdefault(path, [request.node.nodeid])


@pytest.fixture(scope="session", autouse=True)
def scratch_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The suite's temporary folder, one per worker: doctests' `tempfile.mkdtemp()` and
    children's temporary files (TMPDIR: torchrun's `torchelastic_*`, say) go there, and it
    is removed at the worker's end. One per test would pull the folder from under what a
    library made once per process (multiprocessing's, a compiler's cache). pytest keeps
    its own under `pytest-of-<user>`."""
    tmp_path_factory.getbasetemp()  # pytest's own, where it always is
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Started in the background by a shell (`make test &`, nohup): children would
        # inherit the ignored SIGINT, and the tests of Ctrl-C could not send one. A handler
        # of Python's is not inherited: they start with the default, as from a terminal.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    scratch = tempfile.mkdtemp(prefix=f"{run_mark()}{worker}-")
    was = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = os.environ["TMPDIR"] = scratch
    try:
        yield scratch
    finally:
        tempfile.tempdir = was[0]
        if was[1] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = was[1]
        shutil.rmtree(scratch, ignore_errors=True)


# The suite's own settings, not nebula's: where Azurite is, children started cold, the run's mark.
_SUITE_SETTINGS = frozenset(
    {"NEBULA_MEMORY_TIER_PATH", "NEBULA_TESTS_COLD", "NEBULA_AZURITE_BIN",
     "NEBULA_AZURITE_STAGING_BIN", RUN_VAR}
)  # fmt: skip


@pytest.fixture(autouse=True)
def memory_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private memory-tier base folder (never the user's real /dev/shm tiers)."""
    import nebulaml as nm
    from nebulaml.runtime import session as _session

    base = tmp_path / "memory-tier"
    monkeypatch.setenv("NEBULA_MEMORY_TIER_PATH", str(base))
    # Every NEBULA_* setting of the caller's environment is cleared, whatever its name (a
    # list of names drifts as settings are added), but the suite's own.
    for var in [name for name in os.environ if name.startswith("NEBULA_")]:
        if var not in _SUITE_SETTINGS:
            monkeypatch.delenv(var, raising=False)
    yield base
    # A test that provoked a background failure has already asserted on it.
    with contextlib.suppress(nm.NebulaError):
        _session.stop(timeout_s=30)
