"""What the repository's text says about itself: every Markdown document it names is one it
has (a module's docstring citing a design document that is not there tells its reader
nothing)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Folders that are not the repository's own text: tools' caches, environments, builds.
SKIP_DIRS = {
    ".git",
    ".venv",
    ".venv-dlrover",  # DLRover's, for the peer benchmark (make venv-dlrover)
    ".azurite",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    "build",
    "dist",
    "demo-checkpoints",
    "bench-results",
    "node_modules",
}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".in", ".sh", ".yml", ".yaml", ".json"}
MD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.md\b")


def text_files(root: Path = REPO) -> Iterator[Path]:
    """The repository's text files (sources, docs, configuration), tools' folders skipped."""
    for path in root.iterdir():
        if path.is_symlink():
            continue
        if path.is_dir():
            if path.name not in SKIP_DIRS and not path.name.endswith(".egg-info"):
                yield from text_files(path)
        elif path.suffix in TEXT_SUFFIXES or path.name in ("Makefile", "MANIFEST.in"):
            yield path


def test_every_markdown_document_named_exists() -> None:
    # Catches: a docstring or page that cites a document the repository does not have
    # (the design and style notes cited by 14 modules were never part of it).
    have = {p.name for p in text_files() if p.suffix == ".md"}
    assert {"README.md", "CHANGELOG.md", "architecture.md"} <= have
    dangling = []
    for path in text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            for name in MD_NAME.findall(line):
                if name not in have:
                    dangling.append(f"{path.relative_to(REPO)}:{number}: {name}")
    assert not dangling, "documents the repository does not have:\n" + "\n".join(dangling)


def test_the_scan_finds_a_dangling_name(tmp_path: Path) -> None:
    # The check above must be able to fail: a planted reference is found.
    planted = "DESIGN" + "." + "md"  # spelled apart, so that this file names no document
    (tmp_path / "mod.py").write_text(f'"""See {planted} §4."""\n')
    found = [
        name
        for path in text_files(tmp_path)
        for name in MD_NAME.findall(path.read_text(encoding="utf-8"))
    ]
    assert found == [planted]
