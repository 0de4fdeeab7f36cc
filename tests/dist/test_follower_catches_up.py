"""A leader and a follower that save checkpoints back to back: real gloo ranks
(tests/dist/follower_child.py), each on a simulated node of its own (its own memory-tier
folder, LOCAL_WORLD_SIZE=1), sharing one persistent root; rank_timeout_s=30.

The job's first persist is never held back, so the leader takes global_step1 up at once,
while both ranks go on saving. The follower persists its part of what the leader does,
or has moved on: saved the tag again (overwrite=True), its part of the earlier save is
gone, and the leader gives that save up at once instead of waiting rank_timeout_s for it
(its own save of the tag again waited as long).

The decisions as tables: tests/core/test_persist_schedule.py; the commit's wait:
tests/core/test_ranks_commit.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from dist_launch import assert_every_rank_ok, run_ranks

from nebulaml.runtime.evict_plan import FOLLOW_KEEP

CHILD = Path(__file__).with_name("follower_child.py")


def run(scenario: str, tmp_path: Path, memory: Path) -> list[str]:
    results = run_ranks(CHILD, scenario, tmp_path / "persistent", memory, 2, nodes=2)
    assert_every_rank_ok(results)
    outs = [out for _code, out in results]
    for out in outs:
        assert "did not commit their part within" not in out, out
        assert "persisted none of them within" not in out and "could not persist" not in out, out
        assert seconds(r"SHUTDOWN in (\S+) s", out) < 10, out
    return outs


def seconds(pattern: str, out: str) -> float:
    found = re.search(pattern, out)
    assert found is not None, out
    return float(found.group(1))


def committed(root: Path) -> list[str]:
    """The tags committed on the persistent root, oldest first: each of both ranks' parts
    of one generation (never a part missing, never parts of two saves)."""
    tags = []
    for manifest in root.glob("global_step*/manifest.json"):
        folder = manifest.parent
        ranks = {item["rank"] for item in json.loads(manifest.read_text())["items"]}
        assert ranks == {0, 1}, manifest
        parts = [json.loads((folder / f".rank-{r}.json").read_text()) for r in (0, 1)]
        assert parts[0]["generation"] == parts[1]["generation"], parts
        tags.append(folder.name)
    return sorted(tags, key=lambda t: int(t.removeprefix("global_step")))


@pytest.mark.parametrize("scenario", ["flush", "exit"])
def test_the_follower_persists_the_older_tag_its_leader_took_first(
    tmp_path: Path, memory_tier: Path, scenario: str
) -> None:
    """Rank 1 has saved global_step1..4 when rank 0's first persist takes global_step1
    up: rank 1 persists its part of it too, then both global_step4 at the flush or the
    exit. catches: a follower that takes global_step1 for skipped once newer commits
    came (the leader waits rank_timeout_s for its part, the flush or the exit stalls, and
    the follower warns "persisted none of them within 30 s")"""
    for out in run(scenario, tmp_path, memory_tier):
        if scenario == "flush":
            assert re.search(r"FLUSHED True in \S+ s, durable global_step4", out), out
            assert seconds(r"FLUSHED \S+ in (\S+) s", out) < 10, out
    assert committed(tmp_path / "persistent") == ["global_step1", "global_step4"]


def test_a_leader_gives_up_at_once_a_save_its_follower_saved_again(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Rank 1 saves global_step1 twice (overwrite=True); rank 0 then saves it, its persist
    begins at once (the job's first), and it saves it again. catches: a leader that waits
    rank_timeout_s (30 s) for rank 1's part of the first save, gone since rank 1 saved it
    again (rank 0's save of it again waited as long, and rank 1's flush failed); a
    checkpoint committed from parts of two saves"""
    leader, follower = run("again", tmp_path, memory_tier)
    assert seconds(r"AGAIN in (\S+) s", leader) < 10, leader
    for out in (leader, follower):
        assert re.search(r"FLUSHED True in \S+ s, durable global_step4", out), out
        assert seconds(r"FLUSHED \S+ in (\S+) s", out) < 10, out
    assert committed(tmp_path / "persistent")[-1] == "global_step4"


def test_a_follower_keeps_a_few_parts_not_every_one_of_the_interval(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Both ranks save global_step1..12 in step, the persist interval an hour. catches: a
    follower that kept its part of every tag until its leader's next persist (12 parts:
    11.5x the state in the peer benchmark, and each save copied whole, its spare buffers
    taken), while the leader keeps its newest; and one that gave up a tag its leader
    persists (the flush waits rank_timeout_s)."""
    leader, follower = run("steady", tmp_path, memory_tier)
    parts = {out: re.search(r"PARTS (.*)", out) for out in (leader, follower)}
    held = [found.group(1).split() if found else None for found in parts.values()]
    assert held[0] is not None and held[1] is not None, (leader, follower)
    assert len(held[1]) <= FOLLOW_KEEP + 2, held  # the newest few, and what the next
    assert "global_step12" in held[1], held  # commit's eviction takes
    for out in (leader, follower):
        assert re.search(r"FLUSHED True in \S+ s, durable global_step12", out), out
    assert committed(tmp_path / "persistent") == ["global_step1", "global_step12"]
