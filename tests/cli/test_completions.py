"""Shell completions: the committed scripts are what the app generates now, and they
complete for real (bash: sourced into a real bash; every shell: the program's protocol)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import TAGS, populate

from nebula_cli.completions import SCRIPT_FILES, default_folders, main

CHECKOUT = Path(__file__).resolve().parents[2]
COMMITTED = CHECKOUT / "nebula_cli" / "completions_data"
TOP_LEVEL = CHECKOUT / "completions"  # what users browse and packagers install
BIN = Path(sys.executable).parent
NEBULA = BIN / "nebula"


@pytest.mark.parametrize("folder", [COMMITTED, TOP_LEVEL], ids=["package", "top-level"])
def test_committed_scripts_are_what_the_app_generates(tmp_path: Path, folder: Path) -> None:
    # Catches: scripts left stale after a Typer upgrade or a change to the program's name
    # or completion variable; the top-level completions/ gone or out of step with the
    # package's copy; a stray or missing script in either.
    assert main([str(tmp_path)]) == 0
    scripts = sorted(p.name for p in folder.iterdir() if p.name != "README.md")
    assert scripts == sorted(SCRIPT_FILES.values())
    for name in SCRIPT_FILES.values():
        assert (tmp_path / name).read_bytes() == (folder / name).read_bytes(), (
            f"{folder.relative_to(CHECKOUT)}/{name} is stale: run "
            "`python -m nebula_cli.completions`"
        )
    assert (folder / "_nebula").read_text().startswith("#compdef nebula\n")  # for compinit


def test_regenerating_writes_both_copies_in_a_checkout() -> None:
    # Catches: `python -m nebula_cli.completions` refreshing the package's copy alone, so
    # that the top-level one goes stale unnoticed until the test above fails.
    assert default_folders() == [COMMITTED, TOP_LEVEL]
    assert {"nebula.bash", "_nebula", "nebula.fish"} <= {p.name for p in TOP_LEVEL.iterdir()}
    readme = (TOP_LEVEL / "README.md").read_text()
    assert all(name in readme for name in SCRIPT_FILES.values())


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


# Per shell: --show-completion / --install-completion honour the shell named --------------
@pytest.mark.parametrize("shell", sorted(SCRIPT_FILES))
def test_show_completion_prints_the_named_shells_script(shell: str) -> None:
    # main: `--show-completion zsh` printed the bash script (the shell was detected, and
    # the word "zsh" ignored).
    out = subprocess.run([NEBULA, "--show-completion", shell], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "SHELL": "/bin/bash"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout == (COMMITTED / SCRIPT_FILES[shell]).read_text()


def test_show_completion_without_a_shell_uses_this_one() -> None:
    env = {**os.environ, "SHELL": "/usr/bin/fish"}  # the parent (python) is not a shell
    out = subprocess.run([NEBULA, "--show-completion"], capture_output=True, text=True,
                         timeout=60, env=env)  # fmt: skip
    assert out.returncode == 0 and out.stdout == (COMMITTED / "nebula.fish").read_text()
    bad = subprocess.run([NEBULA, "--show-completion", "tcsh"], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.startswith("nebula: error: ")


INSTALLED = {
    "bash": (
        ".bash_completions/nebula.sh",
        ".bashrc",
        "source '{home}/.bash_completions/nebula.sh'",
    ),
    "zsh": (".zfunc/_nebula", ".zshrc", "fpath+=~/.zfunc; autoload -Uz compinit; compinit"),
    "fish": (".config/fish/completions/nebula.fish", None, None),
}


@pytest.mark.parametrize("shell", sorted(SCRIPT_FILES))
def test_install_completion_installs_the_named_shells_script(shell: str, tmp_path: Path) -> None:
    # main: `--install-completion fish` installed the bash script (for the detected shell).
    env = {**os.environ, "HOME": str(tmp_path), "SHELL": "/bin/bash"}
    for _ in range(2):  # a second install changes nothing
        out = subprocess.run([NEBULA, "--install-completion", shell], capture_output=True,
                             text=True, timeout=60, env=env)  # fmt: skip
        assert out.returncode == 0, out.stderr
    script, rc, line = INSTALLED[shell]
    assert (tmp_path / script).read_text() == (COMMITTED / SCRIPT_FILES[shell]).read_text()
    assert f"Installed the {shell} completion in {tmp_path / script}" in out.stdout
    if rc is not None:
        lines = (tmp_path / rc).read_text().splitlines()
        assert lines.count(line.format(home=tmp_path)) == 1
    others = {s for s in SCRIPT_FILES if s != shell}
    assert not any((tmp_path / INSTALLED[s][0]).exists() for s in others)


# Dynamic completion: the tags and items of the ROOT on the line ---------------------------
@pytest.fixture
def populated(root: Path) -> Path:
    populate(root)
    return root


def _shell_complete(shell: str, words: str) -> list[str]:
    """What the app answers the `shell` script for the line `words` (the last word being
    completed; a trailing space: a new word)."""
    if shell == "bash":
        parts = words.split(" ")
        env = {"_NEBULA_COMPLETE": "complete_bash", "COMP_WORDS": words,
               "COMP_CWORD": str(len(parts) - 1)}  # fmt: skip
    elif shell == "zsh":
        env = {"_NEBULA_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": words}
    else:
        env = {"_NEBULA_COMPLETE": "complete_fish", "_TYPER_COMPLETE_ARGS": words,
               "_TYPER_COMPLETE_FISH_ACTION": "get-args"}  # fmt: skip
    out = subprocess.run([NEBULA], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0 and out.stderr == "", out.stderr
    if shell == "zsh":  # _arguments '*: :(("a":"help"\n"b"))': the values
        return re.findall(r'(?:^|\n|\(\()"((?:[^"\\]|\\.)*)"', out.stdout)
    return [line.split("\t")[0] for line in out.stdout.splitlines() if line]


@pytest.mark.slow
@pytest.mark.parametrize("shell", sorted(SCRIPT_FILES))
def test_tags_and_items_complete_for_a_root(populated: Path, shell: str) -> None:
    # main: neither tags nor item names completed.
    r = str(populated)
    assert _shell_complete(shell, f"nebula inspect {r} epoch") == TAGS[:3][::-1]
    assert _shell_complete(shell, f"nebula verify {r} glob") == ["global_step400"]
    assert _shell_complete(shell, f"nebula diff {r} {TAGS[0]} glob") == ["global_step400"]
    assert _shell_complete(shell, f"nebula inspect {r} {TAGS[0]} --item o") == ["optimizer"]
    assert _shell_complete(shell, f"nebula latest {r} --item ") == ["model", "optimizer"]
    assert _shell_complete(shell, f"nebula history {r} --tag glob") == ["global_step400"]
    assert _shell_complete(shell, f"nebula export {r} glob") == ["global_step400"]


@pytest.mark.parametrize("shell", sorted(SCRIPT_FILES))
def test_completion_is_silent_when_the_root_cannot_be_read(tmp_path: Path, shell: str) -> None:
    assert _shell_complete(shell, f"nebula inspect {tmp_path / 'nope'} glob") == []
    assert _shell_complete(shell, "nebula inspect az://no-such-container/x glob") == []


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_sourced_bash_script_completes_tags(populated: Path) -> None:
    script = f"""
        source {COMMITTED / "nebula.bash"}
        COMP_WORDS=(nebula inspect {populated} glob); COMP_CWORD=3; _nebula_completion nebula
        echo "words: ${{COMPREPLY[*]}}"
    """
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run(["bash", "--norc", "--noprofile", "-c", script], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["words: global_step400"]


@pytest.mark.parametrize("shell", sorted(SCRIPT_FILES))
def test_copy_offers_the_tier_words_as_dest(shell: str, tmp_path: Path) -> None:
    # main: `nebula copy ROOT TAG <TAB>` offered nothing (bash: files only), though DEST
    # may be `memory` or `persistent`.
    r = tmp_path / "run1"
    assert _shell_complete(shell, f"nebula copy {r} global_step5 ") == ["memory", "persistent"]
    assert _shell_complete(shell, f"nebula copy {r} global_step5 m") == ["memory"]
    assert _shell_complete(shell, f"nebula copy {r} --latest p") == ["persistent"]
    assert _shell_complete(shell, f"nebula copy {r} global_step5 /mnt") == []  # the shell's paths


ZSH_HARNESS = """
compdef() {{ : }}  # compinit's, not needed to run the completion function
# What _arguments does with a '((...))' action: evaluates its words, then lists them.
_arguments() {{
  local action=${{1#'*: :'}}; local -a ws
  eval ws\\=\\( "${{action[3,-3]}}" \\)
  print -rl -- $ws
}}
source {script}
words=({words}); CURRENT=${{#words}}
_nebula_completion
"""


@pytest.mark.skipif(shutil.which("zsh") is None, reason="needs zsh (make venv installs it)")
def test_zsh_menu_keeps_apostrophes_and_colons() -> None:
    # main: the zsh menu read "Show a checkpoints manifest": Typer writes ' as '' inside
    # the single quotes the script evaluates, which zsh reads as two strings joined.
    def menu(words: str) -> list[str]:
        script = ZSH_HARNESS.format(script=COMMITTED / "_nebula", words=words)
        env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        out = subprocess.run(["zsh", "-f", "-c", script], env=env, capture_output=True,
                             text=True, timeout=60)  # fmt: skip
        assert out.returncode == 0 and out.stderr == "", out.stderr
        return out.stdout.splitlines()

    commands = menu("nebula ''")
    assert "inspect:Show a checkpoint's manifest, its items,..." in commands
    assert "diff:Compare two checkpoints of ROOT\\: per..." in commands  # \: is a colon
    assert menu("nebula copy /x global_step5 ''") == [
        "memory:this node's memory tier of ROOT",
        "persistent:ROOT itself",
    ]


# A new interactive zsh whose ~/.zshrc is what `--install-completion zsh` writes: the
# script in $fpath, compinit, then `nebula hi` and one TAB on a pseudo-terminal (zpty).
ZSH_FIRST_TAB = r"""
zmodload zsh/zpty || exit 3
typeset -F SECONDS
print -r -- "PS1='ready> '; fpath=($FOLDER \$fpath); autoload -Uz compinit; compinit -D" \
  > $ZDOTDIR/.zshrc
zpty shell "zsh -i"
wait_for() {
  local chunk end=$(( SECONDS + 20 ))
  while (( SECONDS < end )); do
    while zpty -r -t shell chunk; do out+=$chunk; done
    [[ $out == $~1 ]] && return 0
    sleep 0.05
  done
  return 1
}
wait_for '*ready> *' || { print -r -- "no prompt: $out"; exit 4 }
out=
zpty -w -n shell $'nebula hi\t'
wait_for $'*(history|\a)*'
print -r -- "$out"
zpty -d shell
"""


@pytest.mark.skipif(shutil.which("zsh") is None, reason="needs zsh (make venv installs it)")
def test_zsh_completes_on_the_first_tab_of_a_new_shell(tmp_path: Path) -> None:
    # main: compinit autoloads _nebula from $fpath on the first TAB and runs it; the
    # script only defined _nebula_completion and compdef'd it, so the first TAB of every
    # new shell did nothing (a bell) and only the second completed.
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "ZDOTDIR": str(tmp_path), "FOLDER": str(COMMITTED)}  # fmt: skip
    out = subprocess.run(["zsh", "-f", "-c", ZSH_FIRST_TAB], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "nebula history" in out.stdout and "\a" not in out.stdout, repr(out.stdout)
