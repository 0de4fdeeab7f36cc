"""What `pip install` gives a user (issue #23): the sdist and the wheel built from this
checkout, and the wheel installed into a new, clean virtual environment outside it.

The sdist and the wheel hold every module of every package (found, not listed), the shell
completions, LICENSE and the py.typed markers, and no tests. In a fresh venv in a temporary
folder (torch==2.13.0 first, then the wheel with its dependencies, as the README says), run
from outside the checkout with PYTHONPATH unset: `nebula --help` and `--version`, a save and
a load through the library, `import torch_nebula`, one command of each kind against the root
that library wrote, and the shipped bash completion script.

About 1 minute on 2 cores (2 minutes when others keep them busy): the build ~8 s; the venv,
torch (the local wheel pip's config finds) and the wheel's dependencies ~30 s; the commands
~15 s; deleting it all ~2 s.
Built and installed once for the whole run, by whichever worker needs it first, in the
run's shared folder (tests/shared_setup.py; TMPDIR too; never in the checkout: the build
runs in a copy of it), deleted at the run's end: the venv alone is ~900 MB.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path
from typing import Any

import pytest
from shared_setup import once

from nebula_cli.completions import SCRIPT_FILES

pytestmark = pytest.mark.timeout(600)  # the first test builds and installs (~1 min)

CHECKOUT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # what the README and the Makefile install first
# Each package and its folder in the checkout.
PACKAGE_DIRS = {
    "nebulaml": "core/nebulaml",
    "torch_nebula": "core/torch_nebula",
    "nebula_cli": "nebula_cli",
}
NOT_SHIPPED = ("tests", "benchmarks", "examples", "conftest.py")
# What a copy of the checkout leaves out when git cannot list the files (no .git).
_UNTRACKED = shutil.ignore_patterns(
    ".git", ".venv", ".azurite", "build", "dist", "*.egg-info", "__pycache__", "*.pyc",
    ".pytest_cache", ".ruff_cache", "demo-checkpoints", "bench-results",
)  # fmt: skip


@dataclass(frozen=True)
class Built:
    src: Path  # the copy of the checkout the sdist was built from
    sdist: Path
    wheel: Path
    version: str


@dataclass(frozen=True)
class Installed:
    venv: Path
    work: Path  # the cwd of every command: outside the checkout
    env: dict[str, str]
    version: str

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def nebula(self) -> Path:
        return self.venv / "bin" / "nebula"

    def run(self, *args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return _run(args, env=self.env, cwd=self.work, timeout=timeout)


def _run(
    cmd: tuple[object, ...] | list[object], *, env: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run `cmd`; a non-zero exit fails the test with the command and its output."""
    args = [str(part) for part in cmd]
    out = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True,
                         timeout=timeout, check=False)  # fmt: skip
    if out.returncode != 0:
        pytest.fail(
            f"`{' '.join(args)}` exited {out.returncode}\n"
            f"--- stdout\n{out.stdout[-4000:]}\n--- stderr\n{out.stderr[-4000:]}",
            pytrace=False,
        )
    return out


class _Started:
    """A command `_started` runs in the background: `result()` waits for it, and a non-zero
    exit fails the test as `_run` does."""

    def __init__(self, args: list[str], proc: subprocess.Popen[str], timeout: float) -> None:
        self.args, self.proc, self.timeout = args, proc, timeout

    def result(self) -> None:
        out, err = self.proc.communicate(timeout=self.timeout)
        if self.proc.returncode != 0:
            pytest.fail(
                f"`{' '.join(self.args)}` exited {self.proc.returncode}\n"
                f"--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}",
                pytrace=False,
            )


@contextlib.contextmanager
def _started(
    cmd: list[object], *, env: dict[str, str], cwd: Path, timeout: float
) -> Iterator[_Started]:
    """`cmd` started in the background for the block (`_Started.result()` waits for it);
    killed if the block leaves without having waited."""
    args = [str(part) for part in cmd]
    with subprocess.Popen(args, env=env, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:  # fmt: skip
        try:
            yield _Started(args, proc, timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def _clean_env(work: Path, venv: Path | None = None) -> dict[str, str]:
    """The caller's environment less PYTHON*, VIRTUAL_ENV, NEBULA_* and this venv's bin/;
    temporary files and the memory tier under `work`."""
    dev_bin = str(Path(sys.executable).parent)
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != dev_bin]
    if venv is not None:
        path.insert(0, str(venv / "bin"))
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTHON", "NEBULA_")) and key != "VIRTUAL_ENV"
    }
    env.update(
        PATH=os.pathsep.join(path),
        TMPDIR=str(work / "tmp"),
        NEBULA_MEMORY_TIER_PATH=str(work / "memory-tier"),
        COLUMNS="200",  # tables not cut at 80 columns
    )
    return env


def _copy_checkout(dest: Path) -> None:
    """Copy the files a fresh clone has (plus new, not ignored ones): never build in place,
    where setuptools would leave build/ and *.egg-info behind."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=CHECKOUT, capture_output=True, check=True, timeout=60,
        ).stdout.decode().split("\0")  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        shutil.copytree(CHECKOUT, dest, ignore=_UNTRACKED)
        return
    for name in filter(None, listed):
        source = CHECKOUT / name
        if source.is_file():  # deleted in the work tree but not yet in git: skipped
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def _package_files(src: Path) -> dict[str, str]:
    """Every file of every package in the source tree: {path in the wheel: path in src}."""
    files = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted((src / folder).rglob("*")):
            rel = path.relative_to(src / folder)
            if path.is_file() and "__pycache__" not in rel.parts and path.suffix != ".pyc":
                files[f"{package}/{rel.as_posix()}"] = f"{folder}/{rel.as_posix()}"
    return files


def _build_and_install(base: Path) -> dict[str, str]:
    """The sdist, the wheel built from that sdist (what `python -m build` does), and a new
    venv (no system site-packages) with torch==2.13.0, then the wheel and its
    dependencies, as a user installs them: the paths, as JSON for tests/shared_setup.py."""
    (base / "tmp").mkdir()
    src = base / "src"
    _copy_checkout(src)
    out = base / "dist"
    # The build and the venv with torch need nothing of each other: the build runs while
    # the venv is made and torch installed (the install is mostly I/O), ~5 s less.
    with _started([sys.executable, "-m", "build", "--outdir", out, src],
                  env=_clean_env(base), cwd=base, timeout=300) as building:  # fmt: skip
        venv = base / "venv"
        env = _clean_env(base, venv)
        _run([sys.executable, "-m", "venv", venv], env=env, cwd=base, timeout=120)
        # --no-compile: Python compiles what it imports anyway; compiling all of torch,
        # pandas and numpy at install time would double the time this takes (~40 s more on
        # 2 cores).
        pip = [venv / "bin" / "python", "-m", "pip", "install", "--no-compile"]
        _run([*pip, TORCH], env=env, cwd=base, timeout=300)
        building.result()
    [sdist] = out.glob("*.tar.gz")
    [wheel] = out.glob("*.whl")
    _run([*pip, wheel], env=env, cwd=base, timeout=300)
    (base / "user").mkdir()
    return {"base": str(base), "src": str(src), "sdist": str(sdist), "wheel": str(wheel),
            "venv": str(venv), "version": wheel.name.split("-")[1]}  # fmt: skip


@pytest.fixture(scope="module")
def packaged(shared_root: Path) -> dict[str, str]:
    """Built and installed once for the whole run, whichever worker comes first (about
    a minute of two cores); the run's end deletes it (the venv alone is ~900 MB)."""
    assert not shared_root.is_relative_to(CHECKOUT)
    return once(shared_root, "packaging", _build_and_install)


@pytest.fixture(scope="module")
def built(packaged: dict[str, str]) -> Built:
    return Built(
        src=Path(packaged["src"]),
        sdist=Path(packaged["sdist"]),
        wheel=Path(packaged["wheel"]),
        version=packaged["version"],
    )


@pytest.fixture(scope="module")
def installed(packaged: dict[str, str]) -> Installed:
    base, venv = Path(packaged["base"]), Path(packaged["venv"])
    return Installed(
        venv=venv, work=base / "user", env=_clean_env(base, venv), version=packaged["version"]
    )


# The build ------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_wheel_holds_every_module_the_completions_license_and_markers(built: Built) -> None:
    # Catches: a subpackage (nebula_cli/commands, a new nebulaml/storage/) missing from the
    # wheel, completions or py.typed not shipped, tests or examples leaking in.
    with zipfile.ZipFile(built.wheel) as whl:
        names = set(whl.namelist())
    dist_info = f"nebula_checkpoint-{built.version}.dist-info"
    shipped = {name for name in names if not name.startswith(f"{dist_info}/")}
    expected = set(_package_files(built.src))
    assert sorted(expected - shipped) == [], "package files missing from the wheel"
    assert sorted(shipped - expected) == [], "files in the wheel that are no package's"
    must = {
        "nebula_cli/commands/__init__.py",
        "nebula_cli/commands/ls.py",
        *(f"nebula_cli/completions_data/{name}" for name in SCRIPT_FILES.values()),
        *(f"{package}/py.typed" for package in PACKAGE_DIRS),
        f"{dist_info}/licenses/LICENSE",
        f"{dist_info}/METADATA",
        f"{dist_info}/entry_points.txt",
    }
    assert sorted(must - names) == []
    assert {name.split("/")[0] for name in names} == {*PACKAGE_DIRS, dist_info}


def test_the_wheel_metadata_tells_the_truth(built: Built) -> None:
    # Catches: no license, untrue classifiers, an invented URL, a lost README, a lost script.
    with zipfile.ZipFile(built.wheel) as whl:
        dist_info = f"nebula_checkpoint-{built.version}.dist-info"
        meta = Parser().parsestr(whl.read(f"{dist_info}/METADATA").decode())
        entry_points = whl.read(f"{dist_info}/entry_points.txt").decode()
        license_text = whl.read(f"{dist_info}/licenses/LICENSE").decode()
    assert meta["Name"] == "nebula-checkpoint"
    assert meta["License-Expression"] == "MIT"
    assert meta["License-File"] == "LICENSE"
    assert license_text.startswith("MIT License\n\nCopyright (c) 2026 the nebula authors\n")
    assert meta["Requires-Python"] == ">=3.10"
    assert set(meta.get_all("Classifier")) >= {
        "Development Status :: 4 - Beta",
        "Operating System :: POSIX :: Linux",
        *(f"Programming Language :: Python :: 3.{minor}" for minor in (10, 11, 12, 13)),
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Typing :: Typed",
    }
    assert meta["Home-page"] is None and meta.get_all("Project-URL") is None  # none is public
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta.get_payload() == (CHECKOUT / "README.md").read_text(encoding="utf-8")
    assert "nebula = nebula_cli.app:main" in entry_points
    assert any(req.startswith("torch") for req in meta.get_all("Requires-Dist"))


def test_the_sdist_holds_the_source_and_no_tests(built: Built) -> None:
    # Catches: a subpackage missing from the sdist (the wheel is built from the sdist, so it
    # would be missing there too); tests/ shipped by setuptools' defaults; the top-level
    # completions/ (what packagers install) left out.
    top = f"nebula_checkpoint-{built.version}"
    with tarfile.open(built.sdist) as sdist:
        names = {m.name for m in sdist.getmembers() if m.isfile()}
    expected = {f"{top}/{path}" for path in _package_files(built.src).values()}
    expected |= {f"{top}/{name}" for name in ("pyproject.toml", "README.md", "LICENSE")}
    expected |= {f"{top}/completions/{name}" for name in (*SCRIPT_FILES.values(), "README.md")}
    assert sorted(expected - names) == []
    assert sorted(n for n in names if n.split("/")[1] in NOT_SHIPPED) == []
    generated = {f"{top}/{name}" for name in ("PKG-INFO", "setup.cfg", "MANIFEST.in")}
    strays = names - expected - generated
    assert sorted(n for n in strays if not n.startswith(f"{top}/nebula_checkpoint.egg-info/")) == []


# The installed wheel, in a clean venv outside the checkout --------------------------------

SEED = """
import json, sys, torch
import nebulaml as nm
import torch_nebula

root = sys.argv[1]
nm.init(root, persistent_time_interval=0)
for step in (1, 2):
    ckpt = nm.Checkpoint(f"global_step{step}")
    ckpt.save("model", {"weight": torch.arange(6.0).reshape(2, 3) * step, "step": step})
    nm.flush_persistence()  # both persisted (else the persister may take the newer alone)
state = nm.get_latest_checkpoint(root).load("model")
assert torch.equal(state["weight"], torch.arange(6.0).reshape(2, 3) * 2), state
assert state["step"] == 2, state
assert issubclass(torch_nebula.Checkpoint, nm.Checkpoint)
import importlib.util
print(json.dumps({
    "nebulaml": nm.__file__,
    "torch_nebula": torch_nebula.__file__,
    "nebula_cli": importlib.util.find_spec("nebula_cli").origin,
    "pytest": importlib.util.find_spec("pytest") is not None,
    "isolated": sys.prefix != sys.base_prefix,
    "tags": [c["tag"] for c in nm.list_checkpoints(hold=False)],  # prune may take one
}))
"""


def _seed(installed: Installed, folder: Path) -> dict[str, Any]:
    root = installed.work / "run1"
    script = folder / "seed.py"
    script.write_text(SEED, encoding="utf-8")
    out = installed.run(installed.python, script, root, timeout=180)
    return {"root": str(root), "report": json.loads(out.stdout.strip().splitlines()[-1])}


@pytest.fixture(scope="module")
def seeded(installed: Installed, shared_root: Path) -> dict[str, Any]:
    """The installed library's save, flush and load into a root outside the checkout
    (once for the run, as the install)."""
    done = once(shared_root, "packaging-seed", lambda folder: _seed(installed, folder))
    return {"root": Path(done["root"]), "report": done["report"]}


def test_the_installed_library_saves_and_loads(installed: Installed, seeded: dict) -> None:
    report = seeded["report"]
    site = installed.venv / "lib"
    for module in ("nebulaml", "torch_nebula", "nebula_cli"):
        path = Path(report[module])
        assert path.is_relative_to(site), f"{module} imported from {path}, not the new venv"
    assert report["isolated"] and not report["pytest"]  # nothing of the dev venv is seen
    assert report["tags"][:2] == ["global_step2", "global_step1"]
    assert (seeded["root"] / "global_step2" / "model").is_file()


def test_the_installed_nebula_helps_and_tells_its_version(installed: Installed) -> None:
    # Catches: `ModuleNotFoundError: No module named 'nebula_cli.commands'` (issue #23).
    out = installed.run(installed.nebula, "--help")
    assert "Usage: nebula" in out.stdout
    for command in ("ls", "inspect", "latest", "verify", "history", "copy", "prune", "flush"):
        assert f" {command} " in out.stdout, out.stdout
    out = installed.run(installed.nebula, "--version")
    assert out.stdout.strip() == f"nebula {installed.version}"


def _check_ls(doc: dict, root: Path) -> None:
    assert [c["tag"] for c in doc["checkpoints"]][:2] == ["global_step2", "global_step1"]


def _check_inspect(doc: dict, root: Path) -> None:
    assert doc["tag"] == "global_step2"
    assert [item["name"] for item in doc["manifest"]["items"]] == ["model"]


def _check_latest(doc: dict, root: Path) -> None:
    assert doc["tag"] == "global_step2" and doc["step"] == 2


def _check_verify(doc: dict, root: Path) -> None:
    assert doc["ok"] and {r["status"] for r in doc["results"]} == {"ok"}
    assert {r["tag"] for r in doc["results"]} >= {"global_step1", "global_step2"}


def _check_history(doc: dict, root: Path) -> None:
    assert doc["summary"]["saves"] == 2 and doc["summary"]["failures"] == 0


def _check_copy(doc: dict, root: Path) -> None:
    assert doc["tag"] == "global_step2" and doc["copied_items"] == ["model"]
    assert (root.parent / "backup" / "global_step2" / "model").is_file()


def _check_prune(doc: dict, root: Path) -> None:
    assert doc["dry_run"] and [d["tag"] for d in doc["delete"]] == ["global_step1"]
    assert doc["deleted"] == [] and (root / "global_step1").is_dir()


def _check_flush(doc: dict, root: Path) -> None:
    assert doc["root"] == str(root) and doc["persisted"] == []  # flushed by the library


COMMANDS: dict[str, tuple[tuple[str, ...], Callable[[dict, Path], None]]] = {
    "ls": (("ls", "{root}"), _check_ls),
    "inspect": (("inspect", "{root}", "global_step2"), _check_inspect),
    "latest": (("latest", "{root}"), _check_latest),
    "verify": (("verify", "{root}"), _check_verify),
    "history": (("history", "{root}"), _check_history),
    "copy": (("copy", "{root}", "global_step2", "{backup}"), _check_copy),
    "prune": (("prune", "{root}", "--keep", "1", "--dry-run"), _check_prune),
    "flush": (("flush", "{root}"), _check_flush),
}


@pytest.mark.slow
@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_installed_command_works_on_what_the_library_wrote(
    installed: Installed, seeded: dict, command: str
) -> None:
    args, check = COMMANDS[command]
    root = seeded["root"]
    argv = [arg.format(root=root, backup=root.parent / "backup") for arg in args]
    doc = json.loads(installed.run(installed.nebula, *argv, "--json").stdout)
    check(doc, root)
    table = installed.run(installed.nebula, *argv)  # as a person types it: rich's output
    assert table.stdout.strip(), table.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_installed_bash_completion_is_found_and_completes(installed: Installed) -> None:
    # Catches: completions not shipped, or not findable from the installed package.
    out = installed.run(installed.python, "-m", "nebula_cli.completions", "--path", "bash")
    script = Path(out.stdout.strip())
    assert script.is_file() and script.is_relative_to(installed.venv), script
    for name in SCRIPT_FILES.values():
        assert (script.parent / name).is_file()
    bash = f"""
        source {script}
        COMP_WORDS=(nebula hi); COMP_CWORD=1; _nebula_completion nebula
        echo "words: ${{COMPREPLY[*]}}"
    """
    out = installed.run("bash", "--norc", "--noprofile", "-c", bash)
    assert out.stdout.splitlines() == ["words: history"]
