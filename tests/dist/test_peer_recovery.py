"""Recovery after a restart from the replicas partner nodes keep (runtime/peer_recovery.py):
real gloo ranks (tests/dist/recovery_child.py), each on a simulated node of its own (its
own memory-tier folder, LOCAL_WORLD_SIZE=1). A first launch saves global_step1..3 with
persistent_time_interval=3600 (only global_step1 persisted), each part replicated to
the next node, and dies (SIGKILL); the test then takes from the nodes what a loss takes;
a second launch recovers.

The agreement as a table, and a part restored without a process group:
tests/core/test_peer_recovery_plan.py.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
from dist_launch import assert_every_rank_ok, run_ranks

from nebulaml.format.names import REPLICAS_DIR

CHILD = Path(__file__).with_name("recovery_child.py")


def launch(phase: str, tmp_path: Path, memory: Path, nodes: int) -> list[tuple[int, str]]:
    results = run_ranks(CHILD, phase, tmp_path / "persistent", memory, nodes, nodes=nodes)
    for _code, out in results:  # a thread left in a gloo wait at exit aborts the process
        assert "terminate called" not in out, out
    return results


def saved_and_killed(tmp_path: Path, memory: Path, nodes: int) -> None:
    """The first launch: global_step1..3 saved and replicated, then every rank killed."""
    results = launch("save", tmp_path, memory, nodes)
    for rank, (code, out) in enumerate(results):
        assert code == -9 and f"SAVED rank {rank}" in out, out


def restarted(tmp_path: Path, memory: Path, nodes: int) -> list[str]:
    results = launch("restart", tmp_path, memory, nodes)
    assert_every_rank_ok(results)
    return [out for _code, out in results]


def lose_node(memory: Path, node: int) -> None:
    """The node is gone, and a fresh one takes its place: its memory tier with it."""
    shutil.rmtree(memory / f"node{node}")


def replica_folder(memory: Path, node: int, rank: int, tag: str) -> Path:
    (found,) = (memory / f"node{node}").rglob(f"{REPLICAS_DIR}/rank-{rank}/{tag}")
    return found


def result_of(out: str) -> dict[str, str]:
    found = re.search(r"RESULT (.*)", out)
    assert found is not None, out
    return dict(re.findall(r"(\w+)=(\[.*?\]|\S+)", found.group(1)))


def saved_part(tmp_path: Path, kind: str, rank: int, tag: str) -> dict[str, str]:
    return json.loads((tmp_path / "out" / f"{kind}-{rank}-{tag}.json").read_text())


def warnings_in(outs: list[str]) -> list[str]:
    return [line for out in outs for line in out.splitlines()
            if line.startswith("WARNING nebulaml: peer recovery:")]  # fmt: skip


def resumed(outs: list[str], tag: str) -> None:
    """Every rank's `get_latest_checkpoint()` is `tag`, and loads what was saved then."""
    for rank, out in enumerate(outs):
        assert f"LATEST rank {rank} {tag}" in out, out
        assert f"LOADED rank {rank} {tag} equal=True" in out, out


def test_a_lost_nodes_part_comes_back_from_its_partner_bit_for_bit(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Node 1 is lost after global_step3 (only global_step1 persisted). catches: ranks
    that resume the persistent tier's global_step1 (what main did), a part sent back that
    is not byte for byte what the rank saved, a part received that the persister does not
    persist (`get_latest_checkpoint()` would stay global_step1), a rank that disagrees"""
    saved_and_killed(tmp_path, memory_tier, 2)
    lose_node(memory_tier, 1)
    outs = restarted(tmp_path, memory_tier, 2)
    first, second = (result_of(out) for out in outs)
    assert first["tag"] == second["tag"] == "global_step3", outs
    assert first["source"] == second["source"] == "parts", outs
    assert second["received"] == "[('global_step3', 1, 0)]", outs[1]
    assert first["sent"] == "[('global_step3', 1, 0)]" and first["received"] == "[]", outs[0]
    assert first["durable"] == second["durable"] == "True", outs
    restored = saved_part(tmp_path, "restored", 1, "global_step3")
    assert restored == saved_part(tmp_path, "part", 1, "global_step3")
    (folder,) = (memory_tier / "node1").rglob("global_step3")
    for path in [folder, *folder.iterdir()]:
        assert path.lstat().st_mode & 0o777 == (0o700 if path.is_dir() else 0o600), path
    resumed(outs, "global_step3")
    assert warnings_in(outs) == [], outs


def test_a_node_a_step_ahead_of_its_partners_replica_still_completes_it(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Both nodes save and replicate global_step1..2, then save global_step3, which no
    replica reaches (replication is asynchronous: the node-loss campaign lost a node
    there); node 1 is lost. Node 0 holds rank 1's replica of global_step2 and its own
    parts of global_step2 and global_step3: the job resumes global_step2, bit for bit.
    catches: this rank's own part of the replica's tag evicted as soon as a newer one
    was committed (nothing complete on node 0: the job resumed the persistent tier's
    global_step1, 3 of 30 restarts of the campaign 6-30 steps behind), and the warning
    that then blamed both nodes of the pair"""
    results = launch("ahead", tmp_path, memory_tier, 2)
    for rank, (code, out) in enumerate(results):
        assert code == -9 and f"SAVED rank {rank}" in out, out
    held = re.search(r"HELD rank 0 (.*)", results[0][1])
    assert held is not None, results[0][1]
    assert {"global_step2", "global_step3"} <= set(held.group(1).split()), results[0][1]
    lose_node(memory_tier, 1)
    replica = replica_folder(memory_tier, 0, 1, "global_step2")
    assert sorted(p.name for p in replica.parent.iterdir()) == ["global_step2"]
    outs = restarted(tmp_path, memory_tier, 2)
    first, second = (result_of(out) for out in outs)
    assert first["tag"] == second["tag"] == "global_step2", outs
    assert first["source"] == second["source"] == "parts", outs
    assert second["received"] == "[('global_step2', 1, 0)]", outs[1]
    assert first["durable"] == second["durable"] == "True", outs
    restored = saved_part(tmp_path, "restored", 1, "global_step2")
    assert restored == saved_part(tmp_path, "part", 1, "global_step2")
    resumed(outs, "global_step2")
    (line,) = warnings_in(outs)
    assert (
        "'global_step3' cannot be completed: rank 1's node was lost, and node 0 keeps its "
        "replica of 'global_step2', not of it; resuming from 'global_step2'"
    ) in line, line


@pytest.mark.parametrize("damaged", ["shard_rank1", ".rank-1.json"])
def test_a_flipped_byte_in_the_partners_replica_falls_back_and_is_never_loaded(
    tmp_path: Path, memory_tier: Path, damaged: str
) -> None:
    """Node 1 is lost, and one byte of node 0's replica of rank 1's global_step3 is
    flipped: of its shard (found as it is sent back) or of its marker (found when node 0
    offers it). The replica of global_step2 went when global_step3's was whole (a node
    keeps the newest), so the newest complete elsewhere is the persistent tier's
    global_step1. catches: a part received without checking its bytes (global_step3
    would be agreed, persisted and loaded with the flipped byte), a refused part left in
    the memory tier, a fallback not said, said by every rank, or blamed on a lost node"""
    saved_and_killed(tmp_path, memory_tier, 2)
    lose_node(memory_tier, 1)
    replica = replica_folder(memory_tier, 0, 1, "global_step3")
    assert sorted(p.name for p in replica.parent.iterdir()) == ["global_step3"]
    data = bytearray((replica / damaged).read_bytes())
    data[random.Random(7).randrange(len(data))] ^= 0x10
    (replica / damaged).write_bytes(bytes(data))
    outs = restarted(tmp_path, memory_tier, 2)
    first, second = (result_of(out) for out in outs)
    assert first["tag"] == second["tag"] == "global_step1", outs
    assert first["source"] == second["source"] == "persistent", outs
    assert second["received"] == "[]" and second["refused"] == "1", outs[1]
    (line,) = warnings_in(outs)
    assert "rank 1's part of 'global_step3'" in line and "'global_step1'" in line, line
    assert f"{damaged}:" in line and "failed its check" in line, line
    # Nothing of the refused part is left on node 1; global_step3 was never committed.
    assert not any((memory_tier / "node1").rglob(".rank-1.json")), outs[1]
    assert not (tmp_path / "persistent" / "global_step3" / "manifest.json").exists()
    resumed(outs, "global_step1")


def test_nothing_lost_moves_nothing_and_resumes_the_newest(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Both nodes come back with their memory tiers. catches: a part sent although its
    rank holds it, an agreement older than the newest every node holds, a checkpoint
    left in the memory tiers alone (`get_latest_checkpoint()` lists the persistent tier)"""
    saved_and_killed(tmp_path, memory_tier, 2)
    outs = restarted(tmp_path, memory_tier, 2)
    for out in outs:
        result = result_of(out)
        assert result["tag"] == "global_step3" and result["source"] == "parts", out
        assert result["received"] == result["sent"] == "[]", out
        assert result["durable"] == "True", out
    resumed(outs, "global_step3")
    assert warnings_in(outs) == [], outs


def test_both_nodes_lost_resume_the_persistent_tier_said_once(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Both nodes of a two-node job are lost: nothing newer than the persistent tier's
    global_step1 is known anywhere. catches: a rank that waits for a part, a resume
    from nothing, the line said by every rank or not at all"""
    saved_and_killed(tmp_path, memory_tier, 2)
    lose_node(memory_tier, 0)
    lose_node(memory_tier, 1)
    outs = restarted(tmp_path, memory_tier, 2)
    for out in outs:
        result = result_of(out)
        assert result["tag"] == "global_step1" and result["source"] == "persistent", out
    said = [line for out in outs for line in out.splitlines() if "peer recovery:" in line]
    assert said == [
        "INFO nebulaml: peer recovery: no node holds a checkpoint newer than the persistent "
        "tier's 'global_step1': resuming from it"
    ], outs
    resumed(outs, "global_step1")


@pytest.mark.slow
def test_both_nodes_of_a_pair_lost_resume_the_persistent_tier_said_once(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Three nodes; node 1 and node 2, which keeps node 1's replicas, are both lost: rank
    1's part of global_step3 is nowhere, while node 0 still holds its own part and rank
    2's replica. catches: an agreement on a checkpoint a rank cannot have (a hang, or a
    load that fails), rank 2's part sent back for nothing, the loss not said, or said by
    every rank"""
    saved_and_killed(tmp_path, memory_tier, 3)
    lose_node(memory_tier, 1)
    lose_node(memory_tier, 2)
    outs = restarted(tmp_path, memory_tier, 3)
    for out in outs:
        result = result_of(out)
        assert result["tag"] == "global_step1" and result["source"] == "persistent", out
        assert result["received"] == result["sent"] == "[]", out
    (line,) = warnings_in(outs)
    assert "'global_step3' cannot be completed" in line and "rank(s) 1 " in line, line
    assert "'global_step1' (the persistent tier)" in line, line
    resumed(outs, "global_step1")


@pytest.mark.slow
def test_three_nodes_one_lost_comes_back_from_the_next_node(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Three nodes, node 2 lost: its part comes from node 0, the next node in the ring.
    catches: a part asked of the wrong node (the ring's last node replicates to the
    first)"""
    saved_and_killed(tmp_path, memory_tier, 3)
    lose_node(memory_tier, 2)
    outs = restarted(tmp_path, memory_tier, 3)
    results = [result_of(out) for out in outs]
    assert {r["tag"] for r in results} == {"global_step3"}, outs
    assert results[2]["received"] == "[('global_step3', 2, 0)]", outs[2]
    assert results[0]["sent"] == "[('global_step3', 2, 0)]", outs[0]
    assert saved_part(tmp_path, "restored", 2, "global_step3") == saved_part(
        tmp_path, "part", 2, "global_step3"
    )
    resumed(outs, "global_step3")
