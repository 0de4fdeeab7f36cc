"""`nebula --help` and every command's help, against golden files, and usage errors as one
line, `nebula: error: ...`, exit 2.

The golden files are tests/cli/golden/<command>.txt (`nebula.txt` for the program): what
`nebula [COMMAND] --help` prints at 80 columns. Regenerate them after a deliberate change
with `.venv/bin/python tests/cli/test_help.py` and review the diff.

On main before this change: flags read `--dry-run <bool>`, usage `nebula prune [OPTIONS]
{ROOT}`, hard-wrapped docstrings were reflowed raggedly in boxes, and usage errors came in
boxed panels over four lines.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

GOLDEN = Path(__file__).resolve().parent / "golden"
COMMANDS = ["", "ls", "inspect", "latest", "verify", "diff", "export", "copy", "flush",
            "prune", "history", "advise", "memory", "gc", "unlock"]  # fmt: skip


def help_text(command: str, option: str = "--help") -> str:
    from nebula_cli.app import app

    args = [command, option] if command else [option]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return result.stdout


def golden_path(command: str) -> Path:
    return GOLDEN / f"{command or 'nebula'}.txt"


@pytest.mark.parametrize("command", COMMANDS, ids=[c or "nebula" for c in COMMANDS])
def test_help_matches_its_golden_file(command: str) -> None:
    # Catches: any change to what --help prints (options, wording, layout); regenerate
    # deliberately (see the module) and review.
    text = help_text(command)
    assert text == golden_path(command).read_text(encoding="utf-8"), (
        f"{golden_path(command)} differs: run `.venv/bin/python tests/cli/test_help.py`"
    )


@pytest.mark.parametrize("command", COMMANDS, ids=[c or "nebula" for c in COMMANDS])
def test_help_is_plain_and_fits_80_columns(command: str) -> None:
    # Catches: typer's type tags (`<bool>`, `<str>`), braces in the usage line, rich boxes,
    # lines wider than 80 columns, a command without an example.
    text = help_text(command)
    assert "<bool>" not in text and "<str>" not in text and "<int>" not in text
    usage = text.splitlines()[0]
    assert usage.startswith("Usage: nebula") and "{" not in usage
    assert not set("╭╰│─") & set(text)
    assert max(len(line) for line in text.splitlines()) <= 80
    if command:
        assert "Example: " in text


@pytest.mark.parametrize("command", COMMANDS, ids=[c or "nebula" for c in COMMANDS])
def test_h_is_help_everywhere(command: str) -> None:
    # Catches: `nebula -h` refused as "no such option" (gh, kubectl and git take it), or
    # taken by the program but not by a command.
    assert help_text(command, "-h") == help_text(command)


def test_h_after_arguments_is_help_too() -> None:
    from nebula_cli.app import app

    result = CliRunner().invoke(app, ["ls", "/no/such/root", "-h"], env={"COLUMNS": "80"})
    assert result.exit_code == 0 and result.stdout == help_text("ls")


def test_usage_line_names_arguments_plainly() -> None:
    assert help_text("prune").splitlines()[0] == "Usage: nebula prune [OPTIONS] ROOT"
    assert help_text("copy").splitlines()[0] == "Usage: nebula copy [OPTIONS] ROOT [TAG] [DEST]"
    assert help_text("diff").splitlines()[0] == "Usage: nebula diff [OPTIONS] ROOT TAG_A TAG_B"
    prune = help_text("prune")
    assert "  --dry-run " in prune and "  --keep N " in prune and "-y, --yes" in prune


USAGE_ERRORS = [
    (
        ["prune"],
        "missing argument 'ROOT': give it, or set NEBULA_PERSISTENT_STORAGE_PATH (see "
        "'nebula prune --help')",
    ),
    (["prune", "/x"], "missing option '--keep' (see 'nebula prune --help')"),
    (["prune", "/x", "--keep", "0"], "invalid value for '--keep': must be at least 1"),
    (["ls", "/x", "--colour"], "no such option: --colour"),
    (["frobnicate"], "no such command 'frobnicate'"),
    (["ls", "/x", "extra"], "got unexpected extra argument(s) (extra)"),
    (["history", "/x", "--since", "yesterday"], "is neither an ISO-8601 time"),
    (["advise", "/x", "--mtbf", "6"], "invalid value for '--mtbf': '6' is not a duration"),
    (["export", "/x", "t", "/d", "--format", "zip"], "invalid value for '--format'"),
    (["--show-completion", "tcsh"], "unsupported shell 'tcsh'"),
]


@pytest.mark.parametrize(
    ("args", "message"), USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS]
)
def test_usage_errors_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    # Catches: typer's boxed error panels, the usage block before the error, exit 1.
    from nebula_cli.app import app

    result = CliRunner().invoke(app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("nebula: error: ") and message in lines[0], lines[0]


def test_no_arguments_prints_the_help_on_stderr_exit_2() -> None:
    from nebula_cli.app import app

    result = CliRunner().invoke(app, [], env={"COLUMNS": "80"})
    assert result.exit_code == 2
    assert result.stderr.startswith("Usage: nebula [OPTIONS] COMMAND [ARGS]...")


def regenerate() -> None:
    GOLDEN.mkdir(exist_ok=True)
    for command in COMMANDS:
        golden_path(command).write_text(help_text(command), encoding="utf-8")
        sys.stderr.write(f"wrote {golden_path(command)}\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    regenerate()
