"""Shell completion scripts for `nebula` (bash, zsh, fish), shipped in the package.

Each script is what the app itself prints for `_NEBULA_COMPLETE=source_<shell> nebula`
(Typer's completion protocol; `nebula --install-completion` installs the same text). The
scripts name no commands: on TAB they run `nebula` again with `_NEBULA_COMPLETE=complete_...`
and the app answers from its own commands and options, so a new command needs no new
scripts. They are kept in two places, the same bytes in each: completions/ at the top of
the repository (and of the sdist: what users browse and packagers install) and
nebula_cli/completions_data/ (package data: every installed wheel has them).
tests/cli/test_completions.py regenerates them and fails when either copy differs (a new
Typer, a renamed program).

Usage: python -m nebula_cli.completions --path bash  (where the installed bash script is)
       python -m nebula_cli.completions [DIR]  (regenerate; default: both folders)

Not for: completing anything itself (the app does that at TAB time).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

PROG_NAME = "nebula"
COMPLETE_VAR = "_NEBULA_COMPLETE"
# The file each shell loads: bash-completion and fish look for <prog>[.bash|.fish]; zsh's
# compinit autoloads functions named _<prog> from $fpath.
SCRIPT_FILES = {"bash": "nebula.bash", "zsh": "_nebula", "fish": "nebula.fish"}
# Package data (see [tool.setuptools.package-data] in pyproject.toml): in a checkout and in
# every installed copy alike.
DEFAULT_DIR = Path(__file__).resolve().parent / "completions_data"
# The top-level copy, in a checkout or an unpacked sdist only: beside pyproject.toml.
CHECKOUT = Path(__file__).resolve().parents[1]
SOURCE_DIR = CHECKOUT / "completions"

_PRINT_SOURCE = f"from nebula_cli.app import app; app(prog_name={PROG_NAME!r})"


def completion_script(shell: str) -> str:
    """The completion script of `shell` ("bash", "zsh" or "fish"), as the app prints it.

    It runs the app in a child process with the completion variable set, so nothing in
    this process (environment, stdout) is touched.

    Example:
        >>> "_NEBULA_COMPLETE=complete_bash" in completion_script("bash")
        True
    """
    if shell not in SCRIPT_FILES:
        raise ValueError(f"unsupported shell {shell!r}; one of {', '.join(SCRIPT_FILES)}")
    env = dict(os.environ, **{COMPLETE_VAR: f"source_{shell}"})
    out = subprocess.run(
        [sys.executable, "-c", _PRINT_SOURCE],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if out.returncode != 0 or not out.stdout.strip():
        raise RuntimeError(
            f"generating the {shell} completion failed (exit {out.returncode}): "
            f"{out.stderr.strip()}"
        )
    # Typer prints the script with a blank first line; zsh needs `#compdef` on line 1.
    return out.stdout.strip() + "\n"


def script_path(shell: str) -> Path:
    """The shipped completion script of `shell` ("bash", "zsh" or "fish").

    Example:
        >>> script_path("bash").name
        'nebula.bash'
    """
    if shell not in SCRIPT_FILES:
        raise ValueError(f"unsupported shell {shell!r}; one of {', '.join(SCRIPT_FILES)}")
    return DEFAULT_DIR / SCRIPT_FILES[shell]


def detect_shell() -> str | None:
    """The shell this program runs under (bash, zsh or fish), or None when it is none of
    them or cannot be told: the parent process's name, else $SHELL."""
    names = []
    try:
        with open(f"/proc/{os.getppid()}/comm", encoding="utf-8") as comm:
            names.append(comm.read().strip())
    except OSError:
        pass
    names.append(Path(os.environ.get("SHELL", "")).name)
    for name in names:
        name = name.lstrip("-")
        if name in SCRIPT_FILES:
            return name
    return None


def install(shell: str, home: Path | None = None) -> list[Path]:
    """Install the shipped script of `shell` for this user; return the files written.

    bash: ~/.bash_completions/nebula.sh, sourced from ~/.bashrc; zsh: ~/.zfunc/_nebula,
    with ~/.zfunc on fpath and compinit run from ~/.zshrc; fish:
    ~/.config/fish/completions/nebula.fish (fish loads it by itself). A line already in an
    rc file is not added again.
    """
    home = Path.home() if home is None else home
    script = script_path(shell).read_text(encoding="utf-8")
    if shell == "bash":
        target = home / ".bash_completions" / "nebula.sh"
        rc, lines = home / ".bashrc", [f"source '{target}'"]
    elif shell == "zsh":
        target = home / ".zfunc" / "_nebula"
        rc, lines = home / ".zshrc", ["fpath+=~/.zfunc; autoload -Uz compinit; compinit"]
    elif shell == "fish":
        target = home / ".config" / "fish" / "completions" / "nebula.fish"
        rc, lines = None, []
    else:
        raise ValueError(f"unsupported shell {shell!r}; one of {', '.join(SCRIPT_FILES)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(script, encoding="utf-8", newline="\n")
    written = [target]
    if rc is not None:
        text = rc.read_text(encoding="utf-8") if rc.is_file() else ""
        missing = [line for line in lines if line not in text.splitlines()]
        if missing:
            text += ("" if not text or text.endswith("\n") else "\n") + "\n".join(missing) + "\n"
            rc.write_text(text, encoding="utf-8")
            written.append(rc)
    return written


def write_scripts(folder: Path) -> list[Path]:
    """Write every shell's script into `folder` (created if missing); return the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for shell, name in SCRIPT_FILES.items():
        path = folder / name
        path.write_text(completion_script(shell), encoding="utf-8", newline="\n")
        written.append(path)
    return written


def default_folders() -> list[Path]:
    """Where `python -m nebula_cli.completions` writes the scripts without a DIR: the
    package's folder, and the top-level completions/ where this runs from a checkout (never
    a folder of that name in site-packages).

    Example:
        >>> default_folders()[0] == DEFAULT_DIR
        True
    """
    checkout = (CHECKOUT / "pyproject.toml").is_file() and SOURCE_DIR.is_dir()
    return [DEFAULT_DIR, *([SOURCE_DIR] if checkout else [])]


def main(argv: list[str] | None = None) -> int:
    """Print a shipped script's path (`--path SHELL`), or regenerate the scripts into DIR
    (default: `default_folders()`)."""
    parser = argparse.ArgumentParser(
        prog="python -m nebula_cli.completions",
        description=(
            "Regenerate nebula's shell completion scripts (bash, zsh, fish), "
            "or print where the shipped one of a shell is."
        ),
    )
    parser.add_argument(
        "--path",
        choices=sorted(SCRIPT_FILES),
        metavar="SHELL",
        help="print where the shipped script of SHELL (bash, fish, zsh) is, and write nothing",
    )
    parser.add_argument(
        "folder",
        nargs="?",
        type=Path,
        help=f"where to write them (default: {DEFAULT_DIR} and, in a checkout, {SOURCE_DIR})",
    )
    args = parser.parse_args(argv)
    if args.path:
        print(script_path(args.path))
        return 0
    for folder in [args.folder] if args.folder is not None else default_folders():
        for path in write_scripts(folder):
            sys.stderr.write(f"wrote {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
