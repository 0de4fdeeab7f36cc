"""A root of many checkpoints: prune and verify print a screen and a summary, not a line
per tag (--verbose: every one; --json: always every one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import in_a_pipe

import nebulaml as nm

N = 30


@pytest.fixture
def many(root: Path) -> Path:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=100)
    for step in range(1, N + 1):
        nm.Checkpoint(f"global_step{step}").save("m", {"v": step})
        nm.flush_persistence()
    nm.shutdown()
    return root


def test_prune_of_many_prints_a_screen_and_a_count_not_every_tag(many: Path) -> None:
    """Bug caught (#29): prune of 1,817 checkpoints printed a table of 1,817 rows and one
    "Deleted ..." line of 30 KB."""
    plan = in_a_pipe("prune", str(many), "--keep", "2", "--dry-run", columns=200)
    assert plan.code == 0, plan.stderr
    assert "... and 8 more to delete (--verbose: all)" in plan.stdout, plan.stdout
    assert "global_step28" not in plan.stdout  # kept, but past the first rows shown
    full = in_a_pipe("prune", str(many), "--keep", "2", "--dry-run", "--verbose", columns=200)
    assert all(f"global_step{s} " in full.stdout for s in range(1, N + 1)), full.stdout
    done = in_a_pipe("prune", str(many), "--keep", "2", "--yes", columns=200)
    assert done.code == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("Deleted"))
    assert line.startswith(f"Deleted {N - 2} of {N - 2}: ") and line.endswith(
        "and 8 more (--verbose: all)"
    ), line
    assert sorted(p.name for p in many.iterdir() if (p / "manifest.json").exists()) == [
        "global_step29",
        "global_step30",
    ]


def test_verify_of_many_shows_every_failure_and_a_summary(many: Path) -> None:
    (many / "global_step3" / "m").write_bytes(b"flipped")  # one corrupt item
    run = in_a_pipe("verify", str(many), columns=200)
    assert run.code == 1
    assert "global_step3" in run.stdout and "corrupt" in run.stdout
    assert "more ok (--verbose: all)" in run.stdout, run.stdout
    assert f"verified {N} checkpoint(s), {N} result(s): 1 failed" in run.stderr, run.stderr
    every = in_a_pipe("verify", str(many), "--verbose", columns=200)
    assert all(f"global_step{s} " in every.stdout for s in range(1, N + 1))
    doc = json.loads(in_a_pipe("verify", str(many), "--json").stdout)
    assert len(doc["results"]) == N and doc["ok"] is False
