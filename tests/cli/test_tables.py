"""Every command's output at 80 columns, in a pipe and on a terminal: nothing a user must
copy next (a tag, a path, a checksum) is ever cut, and off a terminal a table is plain
aligned text, one line a row, with IEC units.

On main before this change: `history ROOT | cat` printed `global_ste…` and `0.…` in every
cell, `ls` cut `epoch=2-step…`, `inspect` split checksums over two lines, and `verify` and
`copy` mixed MB and MiB.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_helpers import (
    TAGS,
    in_a_pipe,
    on_a_simulated_terminal,
    on_a_terminal,
    populate,
    whole_on_a_line,
)

import nebulaml as nm
from nebula_cli.tables import plain_table


def _commands(root: Path, tmp_path: Path) -> dict[str, list[str]]:
    r = str(root)
    return {
        "ls": ["ls", r, "--all"],
        "inspect": ["inspect", r, TAGS[2], "--item", "model"],
        "verify": ["verify", r],
        "history": ["history", r],
        "prune": ["prune", r, "--keep", "1", "--dry-run"],
        "diff": ["diff", r, TAGS[0], TAGS[1], "--all"],
        "export": ["export", r, TAGS[2], str(tmp_path / "exported-items-folder")],
        "latest": ["latest", r, "--item", "model"],
        "copy": ["copy", r, TAGS[1], str(tmp_path / "a-backup-root-with-a-long-name")],
        "flush": ["flush", r],
        "memory": ["memory"],
        "gc": ["gc", "--dry-run"],
    }


def _must_show(name: str, root: Path, tmp_path: Path) -> list[str]:
    """What the output of command `name` must hold whole, on one line."""
    checksums = []
    for tag in TAGS:
        manifest = json.loads((root / tag / "manifest.json").read_text())
        checksums += [i["checksum"]["value"] for i in manifest["items"]]
    memory = nm.memory_tier_path(str(root))
    newest = json.loads((root / TAGS[2] / "manifest.json").read_text())["items"]
    return {
        "ls": TAGS,
        "inspect": [f"xxh3_64_tree_1m:{i['checksum']['value']}" for i in newest]
        + ["encoder.layer.0.attention.weight", "layers.1"],
        "verify": TAGS + checksums,
        "history": TAGS,
        "prune": TAGS,
        "diff": ["encoder.layer.0.attention.weight", "encoder.layer.0.attention.bias"],
        "export": [str(tmp_path / "exported-items-folder" / "model.pt")],
        "latest": [str(root / TAGS[3] / "model")],
        "copy": [TAGS[1], str(tmp_path / "a-backup-root-with-a-long-name")],
        "flush": [],
        "memory": [str(root), memory],
        "gc": [str(root)],
    }[name]


NAMES = list(_commands(Path("r"), Path("t")))


@pytest.fixture
def populated(root: Path) -> Path:
    populate(root)
    return root


EXIT_CODES = {"diff": 1}  # the two checkpoints differ


@pytest.mark.parametrize("name", NAMES)
def test_in_a_pipe_at_80_columns_nothing_is_cut(populated: Path, tmp_path: Path, name: str) -> None:
    # Catches: "…" in a pipe (rich fitted the table to COLUMNS=80); a tag, path or
    # checksum cut or folded over two lines; a table drawn with box characters.
    run = in_a_pipe(*_commands(populated, tmp_path)[name])
    assert run.code == EXIT_CODES.get(name, 0), run.stderr
    assert "…" not in run.stdout + run.stderr
    assert not set("┏┃┡│└━─") & set(run.stdout), run.stdout
    assert whole_on_a_line(run.stdout, *_must_show(name, populated, tmp_path)) == [], run.stdout
    assert not re.search(r"\d ?(kB|KB|MB|GB|TB)\b", run.stdout)  # sizes: IEC everywhere
    # Rates: the history's is MB/s, the unit of throughput_mb_s in its file and --json.
    assert ("MiB/s" if name == "history" else "MB/s") not in run.stdout


@pytest.mark.parametrize("name", NAMES)
def test_on_a_terminal_80_columns_nothing_is_cut(
    populated: Path, tmp_path: Path, name: str
) -> None:
    # Catches: a narrow terminal cutting a cell with "…", or folding a tag, path or
    # checksum over two lines (the layout changes instead).
    run = on_a_simulated_terminal(*_commands(populated, tmp_path)[name])
    assert run.code == EXIT_CODES.get(name, 0), run.stderr
    assert "…" not in run.stdout + run.stderr
    assert whole_on_a_line(run.stdout, *_must_show(name, populated, tmp_path)) == [], run.stdout


def test_plain_rows_are_one_line_each_and_aligned(populated: Path) -> None:
    # Catches: a row wrapped over two lines in a pipe; columns that do not line up.
    run = in_a_pipe("ls", str(populated))
    title, header, *rows = run.stdout.splitlines()
    assert title == str(populated)
    assert header.split() == ["tag", "step", "tiers", "size", "items", "age", "labels"]
    assert [row.split()[0] for row in rows] == TAGS[::-1]
    column = header.index("tiers")
    assert all(row[column:].startswith(("memory", "persistent")) for row in rows)
    assert all(not line.endswith(" ") for line in run.stdout.splitlines())
    assert "memory,persistent" in rows[0] and "best" in rows[2]


def test_history_in_a_pipe_is_whole(populated: Path) -> None:
    # Catches: main's `history ROOT | cat`: every cell `global_ste…`, `0.…`.
    nm.shutdown()
    run = in_a_pipe("history", str(populated))
    rows = [line for line in run.stdout.splitlines() if line[:4].isdigit()]
    assert len(rows) == 8
    for line in rows:
        assert re.search(r"\d\.\d{3}", line), line  # seconds, not "0.…"
        assert any(tag in line for tag in TAGS)
    assert "MB/s" in run.stdout


@pytest.mark.slow
def test_a_real_terminal_80_columns(populated: Path, memory_tier: Path) -> None:
    # Catches: what only a real terminal shows (rich's own width detection).
    run = on_a_terminal(["ls", str(populated)], memory_tier)
    assert run.code == 0, run.stdout
    assert "…" not in run.stdout and whole_on_a_line(run.stdout, *TAGS) == []
    # The root's path is printed whole on its own line, however long (pytest-xdist's
    # folders make it over 80 columns); every other line fits the terminal.
    lines = run.stdout.splitlines()
    assert str(populated) in lines
    assert max(len(line) for line in lines if line != str(populated)) <= 80
    run = on_a_terminal(["inspect", str(populated), TAGS[3]], memory_tier)
    manifest = json.loads((populated / TAGS[3] / "manifest.json").read_text())
    sums = [f"xxh3_64_tree_1m:{i['checksum']['value']}" for i in manifest["items"]]
    assert run.code == 0 and whole_on_a_line(run.stdout, *sums) == [], run.stdout


def test_a_very_narrow_terminal_lists_records_whole(populated: Path) -> None:
    # Catches: a 40-column terminal cutting tags (one record a row instead).
    run = on_a_simulated_terminal("ls", str(populated), columns=40)
    assert run.code == 0 and "…" not in run.stdout
    assert whole_on_a_line(run.stdout, *TAGS) == []
    assert "tiers: memory,persistent" in run.stdout


def test_plain_table_doctest_shape() -> None:
    from rich.table import Table

    table = Table(title="t")
    table.add_column("a")
    table.add_column("n", justify="right")
    table.add_row("x" * 90, "1")
    assert plain_table(table).splitlines() == ["t", "a" + " " * 89 + "  n", "x" * 90 + "  1"]
