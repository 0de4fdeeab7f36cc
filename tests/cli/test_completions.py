"""Shell completions: the committed scripts are what the app generates now, and they
complete for real (bash: sourced into a real bash; every shell: the program's protocol)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nebula_cli.completions import SCRIPT_FILES, main

COMMITTED = Path(__file__).resolve().parents[2] / "nebula_cli" / "completions_data"
BIN = Path(sys.executable).parent
NEBULA = BIN / "nebula"


def test_committed_scripts_are_what_the_app_generates(tmp_path: Path) -> None:
    # Catches: scripts left stale after a Typer upgrade or a change to the program's name
    # or completion variable; a stray or missing file in completions_data/.
    assert main([str(tmp_path)]) == 0
    assert sorted(p.name for p in COMMITTED.iterdir()) == sorted(SCRIPT_FILES.values())
    for name in SCRIPT_FILES.values():
        assert (tmp_path / name).read_bytes() == (COMMITTED / name).read_bytes(), (
            f"nebula_cli/completions_data/{name} is stale: run `python -m nebula_cli.completions`"
        )
    assert (COMMITTED / "_nebula").read_text().startswith("#compdef nebula\n")  # for compinit


def _complete(env: dict[str, str]) -> list[str]:
    out = subprocess.run([NEBULA], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_the_program_completes_command_names() -> None:
    # Catches: `history` not registered, or completion switched off in the app.
    bash = {"_NEBULA_COMPLETE": "complete_bash", "COMP_CWORD": "1"}
    assert _complete({**bash, "COMP_WORDS": "nebula hi"}) == ["history"]
    assert {"ls", "history"} <= set(_complete({**bash, "COMP_WORDS": "nebula "}))
    fish = {"_NEBULA_COMPLETE": "complete_fish", "_TYPER_COMPLETE_FISH_ACTION": "get-args"}
    assert "history" in _complete({**fish, "_TYPER_COMPLETE_ARGS": "nebula hi"})


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_sourced_bash_script_completes_commands_and_options() -> None:
    # Catches: a committed bash script that defines the wrong function, registers it for
    # the wrong name, or calls the program with the wrong variable.
    script = f"""
        source {COMMITTED / "nebula.bash"}
        complete -p nebula
        COMP_WORDS=(nebula hi); COMP_CWORD=1; _nebula_completion nebula
        echo "words: ${{COMPREPLY[*]}}"
        COMP_WORDS=(nebula history --si); COMP_CWORD=2; _nebula_completion nebula
        echo "words: ${{COMPREPLY[*]}}"
    """
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run(["bash", "--norc", "--noprofile", "-c", script], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "complete -o default -F _nebula_completion nebula"
    assert lines[1:] == ["words: history", "words: --since"]
