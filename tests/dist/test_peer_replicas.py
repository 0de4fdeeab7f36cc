"""Each node's memory tier replicated to its partner node over nebula's own gloo group:
real ranks (tests/dist/peer_child.py), each on a simulated node of its own (its own
memory-tier folder, LOCAL_WORLD_SIZE=1), meeting at a store this process serves.

The ring's mapping as a table, the replicas' checks and the frames without a process
group: tests/core/test_replicas.py.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from dist_launch import assert_every_rank_ok, run_ranks

from nebulaml.format.names import REPLICA_DONE, REPLICAS_DIR

CHILD = Path(__file__).with_name("peer_child.py")


def run(
    scenario: str, tmp_path: Path, memory: Path, nodes: int, *, all_ok: bool = True
) -> list[tuple[int, str]]:
    results = run_ranks(CHILD, scenario, tmp_path / "persistent", memory, nodes, nodes=nodes)
    if all_ok:
        assert_every_rank_ok(results)
    for _code, out in results:  # a thread left in a gloo wait at exit aborts the process
        assert "terminate called" not in out, out
    return results


def replicas_of(memory: Path, node: int, rank: int) -> Path:
    """The folder of `rank`'s replicas in node `node`'s memory tier."""
    (found,) = (memory / f"node{node}").rglob(f"{REPLICAS_DIR}/rank-{rank}")
    return found


def sha256s(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.iterdir()
        if p.name != REPLICA_DONE
    }


def part(tmp_path: Path, rank: int, tag: str) -> dict[str, str]:
    return json.loads((tmp_path / "out" / f"part-{rank}-{tag}.json").read_text())


@pytest.mark.parametrize("nodes", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_each_nodes_part_is_replicated_bit_for_bit_to_the_next_node(
    tmp_path: Path, memory_tier: Path, nodes: int
) -> None:
    """Each rank saves global_step1 and global_step2 and replicates each; its partner
    keeps the newest alone (its own part of that tag committed first), byte for byte what
    the rank's memory tier holds, private. catches: a ring that sends to the wrong node
    or to itself, a replica not bit-exact (a chunk lost or written twice at a message
    boundary: 16 KiB messages here), the older replica kept beside the newer once the
    receiver's own part of the newer is there, files other users can read, a process that
    aborts at exit (a receiver left waiting in gloo)"""
    results = run("replicate", tmp_path, memory_tier, nodes)
    for rank, (_code, out) in enumerate(results):
        receive_from = (rank - 1) % nodes
        assert (
            f"RING rank {rank} node {rank} partner {(rank + 1) % nodes} "
            f"send_to {(rank + 1) % nodes} receive_from [{receive_from}]"
        ) in out, out
        assert "STATUS global_step2 replicated=global_step2 refused=None" in out, out
        folder = replicas_of(memory_tier, (rank + 1) % nodes, rank)
        assert sorted(p.name for p in folder.iterdir()) == ["global_step2"]
        replica = folder / "global_step2"
        assert sha256s(replica) == part(tmp_path, rank, "global_step2")
        assert (replica / REPLICA_DONE).is_file()
        for path in [folder.parent, *folder.parent.rglob("*")]:
            assert path.lstat().st_mode & 0o777 == (0o700 if path.is_dir() else 0o600), path
        status = json.loads((tmp_path / "out" / f"status-{rank}.json").read_text())
        assert status == {"kept": {str(receive_from): "global_step2"}, "replicated": "global_step2"}


def test_a_byte_flipped_in_transit_is_refused_and_the_older_replica_stays(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Rank 0's sender flips one byte of global_step2's first message (a test hook, on a
    copy: its own memory tier is intact). catches: a replica committed without checking
    its bytes against the marker's checksums, a refused replica that takes the older
    whole one with it, a refusal the sender never hears of"""
    results = run("corrupt", tmp_path, memory_tier, 2)
    sender, receiver = results[0][1], results[1][1]
    assert "FLIPPED a byte of global_step2" in sender
    assert "STATUS global_step1 replicated=global_step1 refused=None" in sender
    status = re.search(r"STATUS global_step2 replicated=(\S+) refused=(\S+) error=(.*)", sender)
    assert status is not None, sender
    assert status.group(1, 2) == ("global_step1", "global_step2"), sender
    assert "not" in status.group(3) and "announced" in status.group(3), sender
    assert "replica of rank 0's part of 'global_step2' (from node 0) refused" in receiver
    folder = replicas_of(memory_tier, 1, 0)
    assert sorted(p.name for p in folder.iterdir()) == ["global_step1"]
    assert sha256s(folder / "global_step1") == part(tmp_path, 0, "global_step1")
    # The other direction is untouched.
    assert "STATUS global_step2 replicated=global_step2 refused=None" in receiver


def test_the_caller_never_waits_for_the_partner(tmp_path: Path, memory_tier: Path) -> None:
    """Rank 1 starts receiving 2 s late. catches: a `replicate` that sends on the
    caller's thread (it would return only once rank 1 took the part)"""
    results = run("late", tmp_path, memory_tier, 2)
    out = results[0][1]
    found = re.search(
        r"REPLICATE global_step1 returned in (\S+) s, replicated then (\S+), "
        r"answered after (\S+) s",
        out,
    )
    assert found is not None, out
    returned, replicated_then, answered = found.groups()
    assert float(returned) < 0.1 and replicated_then == "None", out
    assert float(answered) > 1.0, out  # the part went once rank 1 was there
    assert "STATUS global_step1 replicated=global_step1" in out, out


def test_a_slow_partner_never_makes_the_sender_hold_more(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Rank 1 receives nothing until rank 0 saved and replicated global_step1..8. catches:
    a queue of tags to send (each held against eviction until sent: the memory tier grows
    with the partner's delay), or a newer tag that does not replace the one waiting"""
    results = run("slow", tmp_path, memory_tier, 2)
    sender, receiver = results[0][1], results[1][1]
    held = re.search(r"^HELD (.*)$", sender, re.MULTILINE)
    assert held is not None, sender
    # The part in flight when rank 1 was away (the first), and the newest: nothing between.
    assert set(held.group(1).split()) <= {"global_step1", "global_step8"}, sender
    assert "STATUS replicated=global_step8 refused=None" in sender, sender
    kept = re.search(r"^KEPT (.*)$", receiver, re.MULTILINE)
    assert kept is not None and kept.group(1).split() == ["global_step8"], receiver


@pytest.mark.slow
def test_an_idle_link_outlives_the_groups_timeout(tmp_path: Path, memory_tier: Path) -> None:
    """The group's timeout is 3 s and the ranks wait 4 s before replicating. catches: no
    keepalive (gloo closes a connection whose receive waited past the timeout, and the
    next part is never sent)"""
    results = run("idle", tmp_path, memory_tier, 2)
    for _code, out in results:
        assert "STATUS global_step1 replicated=global_step1 refused=None" in out, out


@pytest.mark.slow
def test_a_close_whose_partner_never_says_bye_ends_within_its_grace(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Rank 1 closes 6 s after rank 0: rank 0's receiver gets no BYE. catches: a close
    that waits for the partner without bound, or leaves a thread in a gloo wait (the
    process then aborts at exit: status 134 instead of 0)"""
    results = run("close", tmp_path, memory_tier, 2)
    closed = re.search(r"CLOSED in (\S+) s", results[0][1])
    assert closed is not None and float(closed.group(1)) < 4, results[0][1]


@pytest.mark.slow
def test_a_partner_killed_mid_replica_is_reported_and_never_stalls_a_save(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Rank 1 is SIGKILLed while rank 0's part is on its way to it (rank 0's sends slowed
    by a test hook). catches: a status that never says the link is down (or a `wait`
    that sits out its whole timeout), a next save or `replicate` that waits for the dead
    partner, a close or exit that hangs or aborts on the dead connection"""
    results = run("kill", tmp_path, memory_tier, 2, all_ok=False)
    assert results[1][0] == -9, results[1][1]
    code, out = results[0]
    assert code == 0 and "OK rank 0" in out, out
    status = re.search(r"STATUS global_step1 replicated=(\S+) link_down=(\S+) error=(.+)", out)
    assert status is not None and status.group(1, 2) == ("None", "True"), out
    asked = re.search(r"SAVED global_step2 and asked in (\S+) s", out)
    assert asked is not None and float(asked.group(1)) < 2, out
    closed = re.search(r"CLOSED in (\S+) s", out)
    assert closed is not None and float(closed.group(1)) < 0.5, out


def statuses(out: str, tag: str) -> list[dict[str, str]]:
    """Each STATUS line of `tag` in a rank's output, as its fields."""
    found = re.findall(rf"^STATUS {tag} (.*)$", out, re.M)
    return [dict(re.findall(r"(\w+)=(\S*)", line.split(" error=")[0])) for line in found]


def test_only_the_changed_bytes_cross_the_wire_and_the_replica_is_bit_exact(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Each rank saves a 12 MiB frozen base and a 2 MiB adapter, twice (the adapter
    changed); the second replica is built on the first. catches: a frozen base sent
    again (bytes on the wire > 1.05 x the adapter's), a replica built from the wrong
    bytes of its base (it would not be bit-exact, or not committed)"""
    results = run("delta", tmp_path, memory_tier, 2)
    for rank, (_code, out) in enumerate(results):
        (first,) = statuses(out, "global_step1")
        (second,) = statuses(out, "global_step2")
        assert first["replicated"] == "global_step1" and first["refused"] == "None", out
        assert second["replicated"] == "global_step2" and second["refused"] == "None", out
        sizes = re.search(r"SIZES documents=(\d+) changed=(\d+)", out)
        assert sizes is not None, out
        documents, changed = map(int, sizes.groups())
        total, sent = int(second["bytes_total"]), int(second["bytes_sent"])
        assert int(first["bytes_sent"]) > total > 14 << 20, out  # the first goes whole
        # What the partner did not hold: the adapter (and the part's marker, which is new
        # each time, a few hundred bytes); framing: 2 heads and the announcement.
        assert sent - documents <= 1.05 * changed, (sent, documents, changed)
        ratio = (sent - documents) / changed
        print(f"rank {rank}: {sent} bytes sent of {total}; {changed} changed, "
              f"{documents} of marker: {ratio:.4f} x the changed")  # fmt: skip
        replica = replicas_of(memory_tier, (rank + 1) % 2, rank) / "global_step2"
        assert sha256s(replica) == part(tmp_path, rank, "global_step2")


def test_a_replica_built_on_a_corrupt_base_is_refused_and_the_next_goes_whole(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Rank 1 flips a byte of the frozen base in its replica of rank 0's global_step1;
    rank 0's global_step2 is built on it. catches: a replica committed from a wrong base
    (its copied bytes not checked), the older replica taken with the refusal, a sender
    that builds on the same bad base again (the next send must go whole, and commit)"""
    results = run("base", tmp_path, memory_tier, 2)
    sender, receiver = results[0][1], results[1][1]
    assert "FLIPPED" in receiver
    (refused,) = statuses(sender, "global_step2")
    assert refused["refused"] == "global_step2" and refused["replicated"] == "global_step1"
    assert "base" in sender.split("STATUS global_step2 ")[1].splitlines()[0], sender
    assert "replica of rank 0's part of 'global_step2' (from node 0) refused" in receiver
    (again,) = statuses(sender, "global_step2-again")
    assert again["replicated"] == "global_step2", sender
    assert int(again["bytes_sent"]) > int(again["bytes_total"]) > 14 << 20  # whole
    folder = replicas_of(memory_tier, 1, 0)
    assert sorted(p.name for p in folder.iterdir()) == ["global_step2"]
    assert sha256s(folder / "global_step2") == part(tmp_path, 0, "global_step2")


def test_a_part_half_sent_is_held_against_eviction_and_its_replica_commits(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Each rank persists global_step1, then saves global_step2 and global_step3 while
    global_step1 is half sent: the commits evict what they supersede, and global_step3
    would take global_step1's buffers. catches: a send whose part is evicted or
    overwritten under it (without the hold, the sender finds its part gone and gives the
    replica up), a hold that outlives the send (global_step1 never evicted after, once
    the partner's replica of it gave way to global_step4's)"""
    results = run("hold", tmp_path, memory_tier, 2)
    for rank, (_code, out) in enumerate(results):
        assert "HELD global_step1 kept=True" in out, out
        (state,) = statuses(out, "global_step1")
        assert state["replicated"] == "global_step1" and state["refused"] == "None", out
        ((step4,),) = [[s["replicated"] for s in statuses(out, "global_step4")]]
        assert step4 == "global_step4", out
        assert "AFTER global_step1 kept=False" in out, out
        assert "refused:" not in results[(rank + 1) % 2][1]
        held = json.loads((tmp_path / "out" / f"replica-{rank}-global_step1.json").read_text())
        assert held == part(tmp_path, rank, "global_step1")


def test_a_part_saved_again_mid_send_is_abandoned_quietly_and_the_newer_one_sent(
    tmp_path: Path, memory_tier: Path
) -> None:
    """Each rank saves global_step1 again (overwrite=True) while it is half sent: the
    newer part wins. catches: an overwrite that fails on the send's hold, a replica of
    bytes the part no longer holds committed, a give-up reported as a refusal (a warning
    on either side), the newer part not replicated when asked for"""
    results = run("overwrite", tmp_path, memory_tier, 2)
    for rank, (_code, out) in enumerate(results):
        given_up, sent = statuses(out, "global_step1")
        assert given_up["abandoned"] == "global_step1", out
        assert given_up["refused"] == given_up["replicated"] == "None", out
        assert sent["replicated"] == "global_step1" and sent["refused"] == "None", out
        assert "refused " not in out and "refused:" not in out, out  # no warning of it
        replica = replicas_of(memory_tier, (rank + 1) % 2, rank) / "global_step1"
        assert sha256s(replica) == part(tmp_path, rank, "global_step1-again")
