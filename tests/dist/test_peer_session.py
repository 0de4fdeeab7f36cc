"""`nm.init(..., peer_replicas=1)` wired into the session: real gloo ranks
(tests/dist/peer_session_child.py), each on a simulated node of its own (its own
memory-tier folder, LOCAL_WORLD_SIZE=1), meeting at a store this process serves.

The ring and the replication threads themselves: test_peer_replicas.py; the option's
values, the release rule and the CLI's view without a process group:
tests/core/test_replicas_held.py.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from dist_launch import assert_every_rank_ok, run_ranks
from typer.testing import CliRunner

from nebula_cli.app import app
from nebulaml.format.names import REPLICA_DONE, REPLICAS_DIR

CHILD = Path(__file__).with_name("peer_session_child.py")


def run(
    scenario: str, tmp_path: Path, memory: Path, nodes: int, ranks: int = 2, *, all_ok: bool = True
) -> list[tuple[int, str]]:
    results = run_ranks(CHILD, scenario, tmp_path / "persistent", memory, ranks, nodes=nodes)
    if all_ok:
        assert_every_rank_ok(results)
    for _code, out in results:  # a thread left in a gloo wait at exit aborts the process
        assert "terminate called" not in out, out
    return results


def status_of(out: str, tag: str) -> tuple[str, str, str]:
    found = re.search(rf"STATUS {tag} replicated=(\S+) replication=(\S+) error=(.*)", out)
    assert found is not None, out
    return found.group(1), found.group(2), found.group(3)


def test_each_commit_is_replicated_and_persistence_status_says_so(
    tmp_path: Path, memory_tier: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two nodes save global_step1..3 with peer_replicas=1 and nothing else: each rank's
    persistence_status().replicated reaches global_step3, and the partner's memory tier
    holds that part bit for bit; `nebula memory` and `nebula ls` show it as a replica.
    catches: a commit that never hands its tag to replication (replicated stays None),
    a session that opens no ring, replicas that the CLI does not show"""
    results = run("wired", tmp_path, memory_tier, 2)
    for rank, (_code, out) in enumerate(results):
        assert status_of(out, "global_step3") == ("global_step3", "ok", "None"), out
        partner = memory_tier / f"node{1 - rank}"
        (folder,) = partner.rglob(f"{REPLICAS_DIR}/rank-{rank}")
        assert sorted(p.name for p in folder.iterdir()) == ["global_step3"]
        replica = folder / "global_step3"
        assert (replica / REPLICA_DONE).is_file()
        sent = json.loads((tmp_path / "out" / f"part-{rank}-global_step3.json").read_text())
        held = {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in replica.iterdir()
            if p.name in sent
        }
        assert held == sent
    # What node 1 holds, as its operator sees it (its memory tier was kept).
    monkeypatch.setenv("NEBULA_MEMORY_TIER_PATH", str(memory_tier / "node1"))
    shown = CliRunner().invoke(app, ["memory", "--json"])
    assert shown.exit_code == 0, shown.output
    (tier,) = json.loads(shown.stdout)["tiers"]
    assert [(r["rank"], r["tag"]) for r in tier["replicas"]] == [(0, "global_step3")]
    listed = CliRunner().invoke(app, ["ls", str(tmp_path / "persistent"), "--json"])
    assert listed.exit_code == 0, listed.output
    replicas = json.loads(listed.stdout)["replicas"]
    assert [(r["rank"], r["tag"], r["tier"]) for r in replicas] == [(0, "global_step3", "replica")]
    table = CliRunner().invoke(app, ["ls", str(tmp_path / "persistent")], env={"COLUMNS": "200"})
    assert re.search(r"global_step3 .*replica \(rank 0\)", table.stdout), table.stdout


def test_a_save_never_waits_for_a_slow_partner(tmp_path: Path, memory_tier: Path) -> None:
    """Rank 1's receivers start 3 s late. catches: a commit that waits for the partner's
    answer (or sends on the training thread): rank 0's save and commit would take 3 s"""
    results = run("slow", tmp_path, memory_tier, 2)
    out = results[0][1]
    found = re.search(
        r"SAVED global_step1 in (\S+) s, replicated then (\S+), answered after (\S+) s", out
    )
    assert found is not None, out
    took, then, answered = found.groups()
    assert float(took) < 1.5 and then == "None", out
    assert float(answered) > 2.5, out  # the part went once rank 1 was there
    assert status_of(out, "global_step1") == ("global_step1", "ok", "None"), out


def test_a_job_on_one_node_gets_one_warning_and_no_group(tmp_path: Path, memory_tier: Path) -> None:
    """Two ranks on one node (LOCAL_WORLD_SIZE=2) ask for peer replicas. catches: a group
    made (and a collective run) for nothing, the warning said more than once (init is
    called twice), a status that reports replication it does not do"""
    results = run("one", tmp_path, memory_tier, nodes=1)
    for _code, out in results:
        assert "ONE NODE groups made 0, peers None, replication None" in out, out
        assert status_of(out, "global_step1") == ("None", "None", "None"), out
        warnings = re.findall(r"WARNING (.*)", out)
        assert warnings == ["peer_replicas: the job runs on one node: replication is off"], out


def test_a_partner_killed_is_reported_and_saves_go_on_and_persist(
    tmp_path: Path, memory_tier: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NEBULA_PEER_REPLICAS=1 (init without the argument); rank 1 is SIGKILLed once rank
    0's global_step1 is replicated. catches: the environment variable ignored (replicated
    stays None), a status that never says replication fails (or without its error), a
    save that waits for the dead partner, a checkpoint that no longer commits or persists,
    a shutdown that hangs on the dead link"""
    monkeypatch.setenv("NEBULA_PEER_REPLICAS", "1")
    results = run("kill", tmp_path, memory_tier, 2, all_ok=False)
    assert results[1][0] == -9, results[1][1]
    code, out = results[0]
    assert code == 0 and "OK rank 0" in out, out
    assert status_of(out, "global_step1") == ("global_step1", "ok", "None"), out
    replicated, state, error = status_of(out, "global_step2")
    assert (replicated, state) == ("global_step1", "failing") and error != "None", out
    for step in (2, 3):
        took = re.search(rf"SAVED global_step{step} in (\S+) s", out)
        assert took is not None and float(took.group(1)) < 1.5, out
    assert "FLUSHED True durable=global_step3" in out, out
    assert (tmp_path / "persistent" / "global_step3" / "manifest.json").is_file()
    shut = re.search(r"SHUT DOWN in (\S+) s", out)
    assert shut is not None and float(shut.group(1)) < 10, out
