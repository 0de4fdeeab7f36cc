"""Checkpoints that some ranks write (`Checkpoint(tag, ranks=[0])`), and two ranks saving
an item of one name: real gloo processes, on one node (one memory tier) and on two
simulated nodes (a memory tier each)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from dist_launch import assert_every_rank_ok, run_ranks

import nebulaml as nm

CHILD = Path(__file__).with_name("writers_child.py")


def _run(scenario: str, root: Path, memory: Path, *, nodes: int = 1) -> list[tuple[int, str]]:
    """Two ranks of `scenario`; `nodes=2` gives each rank a memory tier of its own."""
    return run_ranks(CHILD, scenario, root, memory, 2, nodes=nodes)


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [1, 2])
def test_a_checkpoint_that_rank_0_alone_writes_commits_and_loads_everywhere(
    tmp_path: Path, memory_tier: Path, nodes: int
) -> None:
    """`if rank == 0: nm.Checkpoint(tag, ranks=[0]).save(...)` in plain DDP; rank 1 calls
    nothing. Bug caught (main): rank 0's commit waited for rank 1's part, then
    RankTimeoutError, the checkpoint never committed (main has no `ranks=`)."""
    root = tmp_path / "persistent"
    results = _run("rank0", root, memory_tier, nodes=nodes)
    assert_every_rank_ok(results)
    assert "REFUSED" in results[1][1] and "rank(s) 0 write" in results[1][1]
    manifest = json.loads((root / "global_step2" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["ranks"] == [0]
    assert {(i["name"], i["rank"]) for i in manifest["items"]} == {("model", 0), ("optimizer", 0)}
    names = {p.name for p in (root / "global_step2").iterdir()}
    assert ".rank-0.json" in names and ".rank-1.json" not in names
    assert not [n for n in names if n.startswith(".writer-")]
    assert next(c["tag"] for c in nm.list_checkpoints(str(root))) == "global_step2"
    assert nm.list_incomplete(str(root)) == []
    # Rank 1 wrote nothing into any memory tier.
    assert not list(memory_tier.rglob(".rank-1.json"))


@pytest.mark.slow
def test_a_second_rank_saving_an_item_name_gets_a_clear_error_from_save(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Both ranks save "model" into one tag on one node. Bug caught (main): rank 1's
    save() returned, its file overwrote rank 0's, a manifest listed "model" twice and
    every reader ignored the checkpoint (rank 1 got CommitConflictError, rank 0 OK)."""
    root = tmp_path / "persistent"
    results = _run("collide", root, memory_tier)
    assert_every_rank_ok(results)
    rank1 = results[1][1]
    assert "COLLISION" in rank1, rank1
    assert "item 'model'" in rank1 and "rank 0 and by rank 1" in rank1, rank1
    assert "TIMEOUT" in results[0][1], results[0][1]  # rank 1's part never came
    assert not list(root.rglob("manifest.json")) and not list(memory_tier.rglob("manifest.json"))


@pytest.mark.slow
def test_ranks_on_two_nodes_saving_one_item_name_never_commit_it_twice(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Two nodes: each memory tier holds its rank's "model"; they meet on the persistent
    tier. Bug caught (main): the persistent manifest listed "model" twice (the second
    copy overwrote the first) and readers ignored the checkpoint."""
    root = tmp_path / "persistent"
    results = _run("collide_nodes", root, memory_tier, nodes=2)
    assert_every_rank_ok(results)
    outs = results[0][1] + results[1][1]
    assert "PERSIST ItemCollisionError" in outs, outs
    # Whichever rank's part reaches the persistent tier second is refused.
    assert re.search(r"item 'model' .* saved by rank (0 and by rank 1|1 and by rank 0)", outs)
    assert not (root / "global_step1" / "manifest.json").exists()
    assert nm.list_checkpoints(str(root)) == []
