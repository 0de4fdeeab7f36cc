"""A tag folder this user cannot read (issue #43): another user's, mode 000. Listings skip
it with one warning naming it, `latest` and the resume answer from the others, `verify`
fails it and checks the rest, `prune` keeps it, says why, and prunes the rest.

Root reads every folder whatever its mode, so the reading side runs in a child process as
user nobody (uid 65534), on a root nobody owns that holds two tag folders of root's, mode
000. The child's interpreter must be one nobody can run: this one, or, where it lies in a
folder nobody cannot enter (pyenv's under /root), the system's python of the same version,
given this environment's packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import nebulaml as nm

NOBODY = 65534
UNREADABLE = ("global_step2", "global_step4")  # the newest among them
CLI = "from nebula_cli.app import main; sys.argv[0] = 'nebula'; sys.exit(main())"


def _nobody_python() -> list[str] | None:
    """The start of a command that runs `-c` code as nobody with nebulaml importable
    (the code is appended to its last element), or None where no interpreter serves."""
    boot = f"import site, sys; site.addsitedir({sysconfig.get_paths()['purelib']!r}); "
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for exe in (sys.executable, f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        # -S: no site-packages but this environment's (addsitedir also runs its .pth files,
        # which make the checkout importable).
        command = [exe, "-S", "-c", boot]
        try:
            probe = _as_nobody(command, "import nebulaml, nebula_cli.app", env={}, cwd="/")
        except OSError:
            continue  # nobody may not run it
        if probe.returncode == 0:
            return command
    return None


def _as_nobody(
    command: list[str], code: str, *args: str, env: dict[str, str], cwd: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*command[:-1], command[-1] + code, *args],
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def shared_folder(scratch_folder: str) -> Iterator[Path]:
    """A folder nobody can enter (pytest's and the worker's are root's alone, 0700), in
    the system's temporary folder, removed at the end (its name has the run's mark: the
    leak guard watches it)."""
    mark = f"nebula-tests-{os.environ['NEBULA_TESTS_RUN']}-"
    folder = Path(tempfile.mkdtemp(prefix=f"{mark}nobody-", dir=Path(scratch_folder).parent))
    try:
        folder.chmod(0o755)
        yield folder
    finally:
        shutil.rmtree(folder)


def _give_to_nobody(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        os.lchown(p, NOBODY, NOBODY)


def test_an_unreadable_tag_folder_is_skipped_reported_and_kept(shared_folder: Path) -> None:
    """Bug caught: two of four tag folders mode 000 (another user's): `nebula ls`,
    `ls --all`, `latest`, `verify` and `prune` exited 1 listing nothing, and
    nm.list_checkpoints() and nm.get_latest_checkpoint() raised: no resume."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the listing runs as user nobody, who must not read the folders")
    python = _nobody_python()
    if python is None:
        pytest.skip("no python that user nobody can run imports nebulaml here")
    root = shared_folder / "root"
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10)
    for step in (1, 2, 3, 4):
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.full((2,), float(step))})
        assert nm.flush_persistence() is True
    nm.shutdown()
    leftover = root / "global_step9"  # a crashed save's, readable: `ls --all` lists it
    leftover.mkdir()
    doc = {"host": "another-node", "pid": 1, "rank": 0, "started_at": "2026-01-01T00:00:00Z"}
    (leftover / ".writer-0.json").write_text(json.dumps(doc))
    _give_to_nobody(root)  # the operator's root, but for the two folders below
    for tag in UNREADABLE:
        for p in [root / tag, *(root / tag).iterdir()]:
            os.lchown(p, 0, 0)
        (root / tag).chmod(0)
    home = shared_folder / "home"
    home.mkdir()
    _give_to_nobody(home)
    env = {
        "HOME": str(home),
        "TMPDIR": str(home),
        "NEBULA_MEMORY_TIER_PATH": str(home / "memory-tier"),
        "COLUMNS": "250",
        "PYTHONDONTWRITEBYTECODE": "1",
    }

    def nebula(*args: str) -> subprocess.CompletedProcess[str]:
        return _as_nobody(python, CLI, *args, str(root), env=env, cwd=str(home))

    def said_once(stderr: str) -> None:
        """One warning per unreadable folder, naming it and saying it was skipped."""
        for tag in UNREADABLE:
            lines = [line for line in stderr.splitlines() if f"{root}/{tag}" in line]
            assert len(lines) == 1, stderr
            assert "skipped" in lines[0] and "could not be read" in lines[0], lines

    listed = nebula("ls", "--all", "--json")
    assert listed.returncode == 0, listed.stderr
    doc = json.loads(listed.stdout)
    assert [c["tag"] for c in doc["checkpoints"]] == ["global_step3", "global_step1"]
    assert [c["tag"] for c in doc["incomplete"]] == ["global_step9"]
    said_once(listed.stderr)
    table = nebula("ls")
    assert table.returncode == 0, table.stderr
    assert "global_step3" in table.stdout and "global_step1" in table.stdout
    assert "global_step2" not in table.stdout and "global_step4" not in table.stdout
    said_once(table.stderr)
    latest = nebula("latest")
    assert (latest.returncode, latest.stdout) == (0, "global_step3\n"), latest.stderr

    verified = nebula("verify", "--json")
    assert verified.returncode == 1, verified.stderr
    rows = {r["tag"]: r for r in json.loads(verified.stdout)["results"]}
    assert {tag: r["status"] for tag, r in rows.items()} == {
        "global_step1": "ok",
        "global_step2": "unreadable",
        "global_step3": "ok",
        "global_step4": "unreadable",
    }
    for tag in UNREADABLE:
        assert rows[tag]["file"] == f"{root}/{tag}"
        assert f"nebula: error: {root}/{tag}: " in verified.stderr

    resume = _as_nobody(
        python,
        "import json, nebulaml as nm; root = sys.argv[1];"
        "tags = [c['tag'] for c in nm.list_checkpoints(root, hold=False)];"
        "latest = nm.get_latest_checkpoint(root);"
        "print(json.dumps([tags, latest.tag, latest.load('model')['w'].tolist()]))",
        str(root),
        env=env,
        cwd=str(home),
    )
    assert resume.returncode == 0, resume.stderr
    assert json.loads(resume.stdout) == [["global_step3", "global_step1"], "global_step3", [3, 3]]
    said_once(resume.stderr)

    pruned = nebula("prune", "--keep", "1", "--yes", "--json")
    assert pruned.returncode == 0, pruned.stderr
    doc = json.loads(pruned.stdout)
    assert doc["deleted"] == ["global_step1"] and doc["skipped"] == []
    kept = {row["tag"]: row["reason"] for row in doc["protected"]}
    for tag in UNREADABLE:
        assert "not deleted" in kept[tag] and "could not be read" in kept[tag], kept
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("global")) == [
        "global_step2",
        "global_step3",
        "global_step4",
        "global_step9",
    ]
    for tag in UNREADABLE:
        (root / tag).chmod(0o755)
        assert (root / tag / "manifest.json").is_file()
