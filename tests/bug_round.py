"""`make bug-round`: inject realistic bugs one at a time and see which test catches each.

Each bug is a small textual patch of today's code (a file, the lines as they are, the
lines with the bug). The repository's files (tracked, and untracked ones git does not
ignore) are copied to a temporary folder once; for each bug the patch is applied there,
never to the working tree, and the test files named for it are run with pytest
(`-x -q -p no:xdist`, PYTHONPATH at the copy's core/), then the file is restored. The
table says, for each bug, where it went and the first test that failed, or MISSED. A
bug whose lines are no longer in the code stops the round before anything runs (update
its patch). The copy is removed at the end.

First the named test files run once on the unchanged copy (`--skip-baseline` skips it):
a file that already fails would make every bug look caught.

Usage: python tests/bug_round.py [--only N ...] [--skip-baseline] [--keep]
Exits 1 if a bug was missed (or a run did not end in pass or fail).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 900  # one bug's test files; each test has pytest-timeout's own limit


@dataclass(frozen=True, slots=True)
class Bug:
    """One injected bug: `original` (exactly once in `file`) replaced by `bugged`; the
    test files in `tests` must catch it."""

    name: str
    file: str
    original: str
    bugged: str
    tests: tuple[str, ...]


BUGS = (
    Bug(
        "a persisted data file is not fsynced",
        "core/nebulaml/storage/local_files.py",
        "        if self._durable:\n            os.fsync(self._fd)\n        fd, self._fd = ",
        "        fd, self._fd = ",
        ("tests/core/test_durability.py",),
    ),
    Bug(
        "a corrupt memory copy is persisted to an fsspec root (no check after writing)",
        "core/nebulaml/protocol/transfer.py",
        "            dst.write_view((tag, item.file), mapped, hashed, sent)\n"
        "            try:\n"
        "                check()\n"
        "            except CorruptCheckpointError:\n"
        "                with contextlib.suppress(NebulaError):\n"
        "                    dst.remove(tag, item.file)  # a bad copy is not left behind\n"
        "                raise\n",
        "            dst.write_view((tag, item.file), mapped, hashed, sent)\n",
        ("tests/core/test_persister.py",),
    ),
    Bug(
        "a reserved sequence is taken when it ties the floor",
        "core/nebulaml/protocol/sequence.py",
        "if sequence > floor and self.store.file_identity(SEQUENCE_FILE) == identity:",
        "if sequence >= floor and self.store.file_identity(SEQUENCE_FILE) == identity:",
        ("tests/core/test_commit.py",),
    ),
    Bug(
        "a lease's age is taken without abs(): a future-dated lease is fresh for ever",
        "core/nebulaml/protocol/leases.py",
        "age_s = abs(((now or datetime.now(timezone.utc)) - lease.taken_at).total_seconds())",
        "age_s = ((now or datetime.now(timezone.utc)) - lease.taken_at).total_seconds()",
        ("tests/core/test_leases.py",),
    ),
    Bug(
        "retention takes the oldest for the newest (and deletes the newest)",
        "core/nebulaml/protocol/retention.py",
        "    newest = ordered[0].tag\n",
        "    newest = ordered[-1].tag\n",
        ("tests/core/test_retention.py",),
    ),
    Bug(
        "retention keeps one checkpoint too many",
        "core/nebulaml/protocol/retention.py",
        "        if kept < keep:\n",
        "        if kept <= keep:\n",
        ("tests/core/test_retention.py",),
    ),
    Bug(
        "a published file's folder is not fsynced (the tag folder before the manifest)",
        "core/nebulaml/storage/local.py",
        "            if self.durable:\n                fsync_dir(folder)\n        finally:\n",
        "        finally:\n",
        ("tests/core/test_durability.py",),
    ),
    Bug(
        "a memory-tier file is made 0644, not 0600",
        "core/nebulaml/storage/local_files.py",
        "PRIVATE_FILE_MODE = 0o600",
        "PRIVATE_FILE_MODE = 0o644",
        ("tests/core/test_memory_tier.py",),
    ),
    Bug(
        "a load from the memory tier skips the checksum",
        "core/nebulaml/runtime/load.py",
        "                verify_bytes(where, entry, local.view, checksum=local.checksum)\n",
        "",
        ("tests/core/test_load.py",),
    ),
    Bug(
        "a rank publishes the manifest before the other ranks' items are there",
        "core/nebulaml/protocol/commit.py",
        "    if marker.writers == (rank,):\n",
        "    if rank in marker.writers:\n",
        ("tests/core/test_ranks_commit.py",),
    ),
    Bug(
        "eviction takes a checkpoint whose persist is in flight",
        "core/nebulaml/runtime/persist_schedule.py",
        "queued = (self.pending, self.inflight, *self.forced, *self.candidates)",
        "queued = (self.pending, *self.forced, *self.candidates)",
        ("tests/core/test_persist_schedule.py", "tests/core/test_labels.py"),
    ),
    Bug(
        "a lease's TTL compared the wrong way",
        "core/nebulaml/protocol/leases.py",
        "    if age_s >= ttl_s:\n",
        "    if age_s < ttl_s:\n",
        ("tests/core/test_leases.py",),
    ),
)


@dataclass(frozen=True, slots=True)
class Outcome:
    bug: Bug
    where: str  # file:line of the patch in today's code
    caught_by: str | None  # the first failing test; None: missed
    note: str = ""  # a run that neither passed nor failed: what it said


def where_of(bug: Bug) -> str:
    """`file:line` of the bug's original lines in the working tree; raises SystemExit if
    they are not there exactly once (the code moved on: update the patch)."""
    text = (REPO / bug.file).read_text()
    count = text.count(bug.original)
    if count != 1:
        raise SystemExit(
            f"bug {bug.name!r}: its original lines occur {count} times in {bug.file}, "
            f"not once; update its patch in {Path(__file__).name}"
        )
    line = text[: text.index(bug.original)].count("\n") + 1
    return f"{bug.file.removeprefix('core/nebulaml/')}:{line}"


def copy_repository(into: Path) -> None:
    """The working tree's files as git sees them (tracked, and untracked ones it does not
    ignore), without the virtual environment and build outputs."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode()  # fmt: skip
    for rel in filter(None, listed.split("\0")):
        source = REPO / rel
        if not source.is_file() or source.is_symlink():
            continue  # deleted in the working tree, or a link
        target = into / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    # Compiled once here, so that the runs' child processes do not compile it each.
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "0", "core", "nebula_cli", "tests",
         "benchmarks", "conftest.py"],
        cwd=into, capture_output=True, check=False,
    )  # fmt: skip


def _forget_bytecode(path: Path) -> None:
    """Remove `path`'s compiled module: a patch of the same size in the same second would
    otherwise be read from a stale .pyc (its check is the source's size and mtime)."""
    for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        pyc.unlink()


# The test's id, parameters with spaces too, up to the " - " that starts the reason.
_FIRST_FAILURE = re.compile(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", re.MULTILINE)


def run_tests(copy: Path, tests: tuple[str, ...]) -> tuple[int, str, str]:
    """(pytest's exit status, the first failing test or "", the output's tail). The run's
    temporary folder is the copy's own (TMPDIR): the suite's leak guard then sees only
    what this run leaves there, not what other runs on the machine come and go with."""
    env = dict(os.environ)
    env["TMPDIR"] = str(copy.parent / "tmp")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(copy / "core"), str(copy), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.pop("PYTEST_ADDOPTS", None)
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:xdist", "-rfE",
               "-o", "addopts=-p no:cacheprovider --strict-markers", *tests]  # fmt: skip
    try:
        done = subprocess.run(
            command, cwd=copy, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return -1, "", f"timed out after {RUN_TIMEOUT_S} s"
    out = done.stdout + done.stderr
    first = _FIRST_FAILURE.search(done.stdout)
    return done.returncode, first.group(1) if first else "", out[-3000:]


def inject(copy: Path, bug: Bug) -> Outcome:
    where = where_of(bug)
    path = copy / bug.file
    original = path.read_text()
    path.write_text(original.replace(bug.original, bug.bugged, 1))
    _forget_bytecode(path)
    try:
        rc, first, tail = run_tests(copy, bug.tests)
    finally:
        path.write_text(original)
        _forget_bytecode(path)
    if rc == 1 and first:
        return Outcome(bug, where, first)
    if rc == 0:
        return Outcome(bug, where, None)
    return Outcome(bug, where, None, f"pytest exited {rc}:\n{tail}")


def table(outcomes: list[Outcome]) -> str:
    rows = ["| # | bug | where | caught by |", "| --- | --- | --- | --- |"]
    for outcome in outcomes:
        number = BUGS.index(outcome.bug) + 1
        caught = f"`{outcome.caught_by}`" if outcome.caught_by else "MISSED"
        rows.append(f"| {number} | {outcome.bug.name} | `{outcome.where}` | {caught} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", type=int, nargs="+", metavar="N",
                        help="run these bugs alone (their numbers, from 1)")  # fmt: skip
    parser.add_argument("--skip-baseline", action="store_true",
                        help="do not run the test files on the unchanged copy first")  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = parser.parse_args()
    bugs = [BUGS[n - 1] for n in args.only] if args.only else list(BUGS)
    for bug in bugs:
        where_of(bug)  # every patch applies to today's code, before anything runs
    if shutil.which("strace") is None:
        print("warning: strace is not installed: the fsync bugs' test is skipped "
              "(make venv installs it as root)", file=sys.stderr)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="nebula-bug-round-"))
    copy = work / "repo"
    (work / "tmp").mkdir()
    started = time.monotonic()
    try:
        print(f"copying the repository to {copy}", file=sys.stderr)
        copy_repository(copy)
        if not args.skip_baseline:
            files = tuple(dict.fromkeys(t for bug in bugs for t in bug.tests))
            print(f"baseline: {len(files)} test files on today's code", file=sys.stderr)
            rc, first, tail = run_tests(copy, files)
            if rc != 0:
                print(f"the baseline fails (pytest exited {rc}, {first or 'no test named'}): "
                      f"no bug can be judged\n{tail}", file=sys.stderr)  # fmt: skip
                return 1
        outcomes = []
        for bug in bugs:
            t0 = time.monotonic()
            outcome = inject(copy, bug)
            said = outcome.caught_by or "MISSED"
            print(f"[{BUGS.index(bug) + 1}/{len(BUGS)}] {bug.name}: {said} "
                  f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)  # fmt: skip
            if outcome.note:
                print(outcome.note, file=sys.stderr)
            outcomes.append(outcome)
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(table(outcomes))
    missed = sum(1 for o in outcomes if o.caught_by is None)
    print(f"\n{len(outcomes) - missed} of {len(outcomes)} caught, {missed} missed "
          f"({time.monotonic() - started:.0f} s)")  # fmt: skip
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
