"""The user's documentation stays true: the README's quickstart runs as written (a job
killed after a checkpoint and run again resumes where it was, to the losses of a run never
killed), every relative link in the README and docs/ reaches a file and a heading, the
README names every command and every `NEBULA_*` setting, and no page cites a commit or an
issue, or narrates its own history."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import warm

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^```[^\n]*\n.*?^```[ \t]*$", re.M | re.S)
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.M | re.S)
LINK = re.compile(r"\]\(([^()\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
# What a page about the product does not say: where a figure came from in the project's
# history (a commit, an issue, "the code before"), or what someone did one day.
DIARY = [
    re.compile(r"\bcommits? [0-9a-f]{7,40}\b"),
    re.compile(r"\bissues? #\d+"),
    re.compile(r"\bthis session\b", re.I),
    re.compile(r"\bwe (tried|dropped|found|fixed|measured|changed)\b", re.I),
    re.compile(r"\btried [a-z ]{0,40}and dropped\b", re.I),
    re.compile(r"\b(on|in) the (old|previous) (code|version)\b", re.I),
    re.compile(r"\bthe code before\b", re.I),
]


def section(text: str, title: str) -> str:
    """The body of the `## title` section of a Markdown text (up to the next `## `)."""
    match = re.search(rf"^## {re.escape(title)}[ \t]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no section '## {title}'"
    return match.group(1)


def prose(text: str) -> str:
    """`text` without its fenced code blocks (whose `#` lines are no headings)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'.

    Example:
        >>> slug("How often to checkpoint: `nebula advise`")
        'how-often-to-checkpoint-nebula-advise'
    """
    kept = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for heading in HEADING.findall(prose(page.read_text(encoding="utf-8"))):
        base = slug(heading)
        name, n = base, 0
        while name in found:  # GitHub numbers repeated headings: name, name-1, ...
            n += 1
            name = f"{base}-{n}"
        found.add(name)
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of `page` whose file, or whose heading, is not there."""
    broken = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{page.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{page.name}: {target} (no such heading)")
    return broken


def test_every_relative_link_reaches_a_file_and_a_heading() -> None:
    # Catches: a section moved or renamed (README#how-it-works, after the README's long
    # explanations moved to docs/) while another page still links to it.
    assert len(PAGES) > 3
    broken = [b for page in PAGES for b in broken_links(page)]
    assert not broken, "\n".join(broken)


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    # The check above must be able to fail. (Page names the repository has, and a missing
    # one spelled apart: tests/test_repository.py reads this file too.)
    gone = "gone" + ".md"
    (tmp_path / "guide.md").write_text("# A\n\n## Two words\n\n```\n# not a heading\n```\n")
    page = tmp_path / "cli.md"
    page.write_text(
        f"[ok](guide.md#two-words) [ok](#b) [x]({gone}) [no heading](guide.md#not-a-heading) "
        "[web](https://example.com/x#y)\n\n# B\n"
    )
    assert broken_links(page) == [
        f"cli.md: {gone} (no such file)",
        "cli.md: guide.md#not-a-heading (no such heading)",
    ]


def test_the_readme_names_every_command() -> None:
    # Catches: a command added to the CLI without its line in the README's table.
    import typer

    from nebula_cli.app import app

    commands = set(typer.main.get_command(app).commands)
    assert {"ls", "verify", "prune", "advise"} <= commands
    table = section(README.read_text(encoding="utf-8"), "The `nebula` command line")
    missing = sorted(c for c in commands if f"`nebula {c}" not in table)
    assert not missing, f"commands the README's table does not name: {missing}"
    for option in ("--install-completion", "--show-completion", "--version"):
        assert option in table


def test_the_readme_names_every_setting() -> None:
    # Catches: a NEBULA_* variable read by the library but not in the README's
    # Configuration table (NEBULA_PRIVATE was only mentioned in passing).
    from nebulaml import config

    settings = {
        value
        for name, value in vars(config).items()
        if name.startswith("ENV_") and isinstance(value, str) and value.startswith("NEBULA_")
    }
    assert {"NEBULA_PERSISTENT_STORAGE_PATH", "NEBULA_PRIVATE", "NEBULA_JOB_ID"} <= settings
    table = section(README.read_text(encoding="utf-8"), "Configuration")
    rows = [line for line in table.splitlines() if line.startswith("|")]
    missing = sorted(s for s in settings if not any(f"`{s}`" in row for row in rows))
    assert not missing, f"settings the README's Configuration table does not name: {missing}"


def test_no_page_is_a_diary() -> None:
    # Catches: a page that cites a commit hash or an issue for a figure, or narrates what
    # was tried ("tried this session and dropped"): docs describe the product as it is.
    found = []
    for page in PAGES:
        text = re.sub(r"\s+", " ", page.read_text(encoding="utf-8"))
        for pattern in DIARY:
            found += [f"{page.name}: {m.group(0)!r}" for m in pattern.finditer(text)]
    assert not found, "\n".join(found)


def test_the_diary_check_finds_each_kind(tmp_path: Path) -> None:
    planted = (
        "Measured on commit 1a2b3c4d (issue #22), tried this\nsession and dropped; "
        "on the old code it failed."
    )
    text = re.sub(r"\s+", " ", planted)
    hits = [p.pattern for p in DIARY if p.search(text)]
    assert len(hits) == 5, hits


# The quickstart, run as a user runs it -----------------------------------------------------

# Runs the quickstart and SIGKILLs it right after the checkpoint `argv[2]` commits: a crash
# at the worst moment for a memory tier (acknowledged, not yet persisted).
KILL_AFTER_COMMIT = """
import os, runpy, signal, sys
import nebulaml as nm

script, tag = sys.argv[1], sys.argv[2]
commit = nm.Checkpoint.commit

def commit_then_die(self):
    done = commit(self)
    if self.tag == tag:
        nm.wait_for_snapshot()  # its lazy copy and commit done (the default)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return done

nm.Checkpoint.commit = commit_then_die
sys.argv = [script]
runpy.run_path(script, run_name="__main__")
"""


def quickstart() -> str:
    blocks = PYTHON_BLOCK.findall(section(README.read_text(encoding="utf-8"), "Quickstart"))
    assert len(blocks) == 1, "the Quickstart has one Python block: the script it runs"
    return blocks[0]


def run(folder: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return warm.run(
        [sys.executable, *args], cwd=folder, env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.slow
def test_the_quickstart_runs_crashes_and_resumes(tmp_path: Path, memory_tier: Path) -> None:
    # Catches: a quickstart that does not run as written (a name it never defines, an API
    # it misnames: the handle's `.step`), one whose resume raises on a job's first run, or
    # one that resumes wrong (the optimizer not restored: the losses after the resume
    # differ from those of a run never killed).
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier), PYTHONUNBUFFERED="1")
    env.pop("NEBULA_PERSISTENT_STORAGE_PATH", None)
    code = quickstart()
    whole, job = tmp_path / "whole", tmp_path / "job"
    for folder in (whole, job):
        folder.mkdir()
        (folder / "train.py").write_text(code, encoding="utf-8")

    never_killed = run(whole, "train.py", env=env)
    assert never_killed.returncode == 0, never_killed.stderr[-3000:]
    lines = never_killed.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"step {s}" for s in range(20, 201, 20)]

    killed = run(job, "-c", KILL_AFTER_COMMIT, "train.py", "global_step100", env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert killed.stdout.splitlines() == lines[:4]  # steps 20-80; 100 committed, then killed

    resumed = run(job, "train.py", env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.splitlines() == ["resumed from global_step100", *lines[5:]]

    finished = run(job, "train.py", env=env)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.stdout == "resumed from global_step200\n"
    # Persisted at exit, and the memory tiers released by the clean exits.
    assert (job / "checkpoints" / "global_step200" / "manifest.json").is_file()
    assert not [p for p in memory_tier.glob("*/global_step*")], list(memory_tier.rglob("*"))
