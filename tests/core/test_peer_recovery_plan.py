"""Recovery from peer replicas without a process group: the agreement every rank computes
(protocol/peer_plan.py's `agree`, as a table of offers in, plan out), what a memory
tier offers, and a part restored into a memory tier from the bytes a partner sends
(protocol/part_restore.py). The collective over real ranks: tests/dist/test_peer_recovery.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from nebulaml.format.checksum import checksum_of
from nebulaml.format.manifest import ItemEntry, RankMarker
from nebulaml.format.names import REPLICA_DONE, marker_name, writer_marker_name
from nebulaml.protocol.part_restore import (
    Damaged,
    HeldPart,
    PartInbox,
    Restored,
    own_parts_held,
    replica_files,
    replicas_held,
)
from nebulaml.protocol.peer_plan import (
    PARTS,
    PERSISTENT,
    Incomplete,
    Offer,
    Transfer,
    agree,
    why_incomplete,
)
from nebulaml.protocol.replica_inbox import ReplicaInbox
from nebulaml.protocol.replicas import FileClaim, part_files, replica_root
from nebulaml.storage.store import Store

T0 = "2026-01-01T00:00:00Z"
PERSISTED = ("global_step1", "2025-12-31T00:00:00Z")


def held(tag: str, rank: int, *, replica: bool = False, gen: str = "g1",
         writers: tuple[int, ...] = (0, 1)) -> HeldPart:  # fmt: skip
    return HeldPart(tag, rank, gen, writers, T0, replica)


def own(tag: str, rank: int, *, gen: str = "g1", writers: tuple[int, ...] = (0, 1)) -> HeldPart:
    return held(tag, rank, gen=gen, writers=writers)


def rep(tag: str, rank: int, *, writers: tuple[int, ...] = (0, 1)) -> HeldPart:
    return held(tag, rank, replica=True, writers=writers)


Case = tuple[
    list[list[HeldPart]], set[tuple[str, int, int]], tuple[str, str, list[tuple[int, int]]]
]


# Each row: the offers of ranks 0, 1 (one node each; rank 0 looked at the persistent
# tier), the replicas refused, then the plan: (tag, source, transfers as (rank, holder)).
CASES: dict[str, Case] = {
    "nothing lost: the newest both hold, nothing moves": (
        [[own("global_step3", 0), rep("global_step3", 1)],
         [own("global_step3", 1), rep("global_step3", 0)]],
        set(),
        ("global_step3", PARTS, []),
    ),
    "node 1 lost: its part comes from node 0": (
        [[own("global_step3", 0), rep("global_step3", 1)], []],
        set(),
        ("global_step3", PARTS, [(1, 0)]),
    ),
    "node 1 lost, its replica refused: the persistent tier's": (
        [[own("global_step3", 0), rep("global_step3", 1)], []],
        {("global_step3", 1, 0)},
        ("global_step1", PERSISTENT, []),
    ),
    "refused, but an older tag whole on the nodes is newer than the persistent tier's": (
        [[own("global_step3", 0), rep("global_step3", 1), own("global_step2", 0),
          rep("global_step2", 1)], []],
        {("global_step3", 1, 0)},
        ("global_step2", PARTS, [(1, 0)]),
    ),
    "both nodes lost: the persistent tier's": (
        [[], []],
        set(),
        ("global_step1", PERSISTENT, []),
    ),
    "a part of another generation completes nothing": (
        [[own("global_step3", 0, gen="g2")], [own("global_step3", 1)]],
        set(),
        ("global_step1", PERSISTENT, []),
    ),
    "a checkpoint rank 0 writes alone needs rank 0 only": (
        [[own("global_step4", 0, writers=(0,))], []],
        set(),
        ("global_step4", PARTS, []),
    ),
    "the persistent tier holds the newest: nothing moves": (
        [[own("global_step1", 0), rep("global_step1", 1)], []],
        set(),
        ("global_step1", PERSISTENT, []),
    ),
    "a rank's replica of its own part is no replica": (
        [[own("global_step3", 0)], [rep("global_step3", 1)]],
        set(),
        ("global_step1", PERSISTENT, []),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_the_agreement_table(case: str) -> None:
    """catches: an agreement older than the newest complete one, or newer than one every
    rank can have (a rank would wait for a part nobody sends), a part sent to a rank that
    holds it, a refused replica used again, parts of two generations taken for one
    checkpoint, the persistent tier's copy moved over the wire"""
    parts, excluded, (tag, source, transfers) = CASES[case]
    offers = [
        Offer(r, r, tuple(p), persistent=PERSISTED if r == 0 else None) for r, p in enumerate(parts)
    ]
    plan = agree(offers, excluded)
    assert (plan.tag, plan.source) == (tag, source)
    assert [(t.rank, t.holder) for t in plan.transfers] == transfers
    assert all(t.tag == tag for t in plan.transfers)


def test_every_rank_computes_the_same_plan_whatever_the_order_of_the_offers() -> None:
    """Three nodes of two ranks; node 2 lost, node 0 keeps its replicas (both of its local
    ranks offer them). catches: a plan that depends on the order offers arrive in, a part
    sent twice, or by a holder other than the lowest"""
    offers = [
        Offer(0, 0, (own("s5", 0, writers=tuple(range(6))), rep("s5", 4, writers=tuple(range(6))),
                     rep("s5", 5, writers=tuple(range(6))))),
        Offer(1, 0, (own("s5", 1, writers=tuple(range(6))), rep("s5", 4, writers=tuple(range(6))),
                     rep("s5", 5, writers=tuple(range(6))))),
        Offer(2, 1, (own("s5", 2, writers=tuple(range(6))),)),
        Offer(3, 1, (own("s5", 3, writers=tuple(range(6))),)),
        Offer(4, 2), Offer(5, 2),
    ]  # fmt: skip
    plans = {agree(random.Random(seed).sample(offers, len(offers))) for seed in range(8)}
    (plan,) = plans
    assert plan.tag == "s5" and plan.transfers == (Transfer("s5", 4, 0), Transfer("s5", 5, 0))
    # Node 0's replica of rank 4 refused: both of node 0's ranks hold the same files.
    plan = agree(offers, {("s5", 4, 0)})
    assert plan.tag is None and plan.newer == (Incomplete("s5", (4,)),)


W3 = ("global_step1", "global_step3", "rank 1's node was lost, and node 0 keeps its replica "
      "of 'global_step2', not of it")  # fmt: skip


@pytest.mark.parametrize(
    ("offers", "said"),
    [
        pytest.param(
            [Offer(0, 0, (own("global_step3", 0), rep("global_step2", 1)), PERSISTED),
             Offer(1, 1)],
            (*W3[:2], W3[2] + "; 'global_step2' cannot be completed either: rank(s) 0 no "
             "longer hold their own part of it"),
            id="the campaign's: the replica a step behind the survivor's own part",
        ),
        pytest.param(
            [Offer(0, 0, (own("global_step3", 0), own("global_step2", 0),
                          rep("global_step2", 1)), PERSISTED), Offer(1, 1)],
            ("global_step2", "global_step3", W3[2]),
            id="its own part kept: the replica's tag resumes, the newer was not replicated",
        ),
        pytest.param(
            [Offer(0, 0, (own("global_step3", 0, writers=(0, 1, 2)),
                          rep("global_step3", 2, writers=(0, 1, 2))), PERSISTED),
             Offer(1, 1), Offer(2, 2)],
            ("global_step1", "global_step3", "the part of rank(s) 1 is on no node (its node and "
             "the partner keeping its replica were both lost)"),
            id="both nodes of a pair lost (three nodes)",
        ),
    ],
)  # fmt: skip
def test_why_a_newer_checkpoint_cannot_be_completed(
    offers: list[Offer], said: tuple[str, str, str]
) -> None:
    """The warning's words, from the offers. catches: a node whose own part of the
    replica's tag was evicted said to have lost both nodes of the pair (the node-loss
    campaign's restarts behind the replicated step)"""
    plan = agree(offers)
    assert (plan.tag, plan.newer[0].tag) == said[:2]
    assert why_incomplete(plan.newer[0], plan.newer, offers) == said[2]


def test_a_rank_whose_memory_tier_cannot_take_a_part_is_not_sent_one() -> None:
    """catches: a transfer to a rank whose memory tier is stale or unsafe (it would refuse
    it, after every rank waited for it)"""
    tag = "global_step3"
    offers = [Offer(0, 0, (own(tag, 0), rep(tag, 1)), PERSISTED), Offer(1, 1, can_receive=False)]
    plan = agree(offers)
    assert plan.tag == "global_step1" and plan.newer == (Incomplete(tag, (1,)),)


# a part restored into a memory tier ------------------------------------------------------
def write_part(memory: Store, tag: str, rank: int, items: dict[str, bytes]) -> None:
    """Rank `rank`'s committed part of `tag` in a memory tier, as a save leaves it."""
    memory.make_dir(tag)
    entries = []
    for name, data in items.items():
        memory.write_bytes((tag, name), data)
        entries.append(ItemEntry.written(name, rank=rank, size_bytes=len(data),
                                         checksum=checksum_of(data), tensor_bytes=0))  # fmt: skip
    marker = RankMarker(tag, rank, 2, T0, tuple(entries), generation="g1")
    memory.publish((tag, marker_name(rank)), marker.to_bytes())


def memory_tier(path: Path) -> Store:
    return Store(path, durable=False, private=True)


@pytest.fixture
def nodes(tmp_path: Path) -> tuple[Store, Store]:
    """Node 0 keeps a replica of rank 1's part of s3 (as replication leaves it); node 1's
    memory tier is fresh (its node was lost)."""
    source, node0 = memory_tier(tmp_path / "lost"), memory_tier(tmp_path / "node0")
    rng = random.Random(3)
    items = {"model": rng.randbytes(3 << 20 | 77), "optim": rng.randbytes(1000), "empty": b""}
    write_part(source, "s3", 1, items)
    claims, small = part_files(source, "s3", 1)
    inbox = ReplicaInbox(replica_root(node0, 1), tag="s3", rank=1, node=1, files=claims)
    for claim in claims:
        inbox.feed(small.get(claim.name) or source.read_bytes("s3", claim.name))
    assert inbox.finish().committed
    return node0, memory_tier(tmp_path / "node1")


def send_back(node0: Store, node1: Store, *, flip: int | None = None, cut: int = 0) -> Restored:
    """What node 0 sends of its replica of rank 1's part of s3, fed to node 1's inbox in
    pieces of random sizes; `flip`: a byte of the stream flipped; `cut`: bytes left out."""
    found = replica_files(node0, "s3", 1)
    assert found is not None
    root, _node, claims = found
    stream = bytearray(b"".join(root.read_bytes("s3", c.name) for c in claims))
    if flip is not None:
        stream[flip] ^= 0x01
    stream = stream[: len(stream) - cut]
    inbox = PartInbox(node1, tag="s3", rank=1, files=claims, world_size=2)
    rng, at = random.Random(5), 0
    while at < len(stream):
        n = rng.randrange(1, 1 << 20)
        inbox.feed(memoryview(stream)[at : at + n])
        at += n
    return inbox.finish()


def test_a_part_sent_back_is_committed_as_a_save_leaves_it(nodes: tuple[Store, Store]) -> None:
    """catches: a part restored without its marker, or with a marker other than the rank
    wrote, items not byte for byte the replica's, a writer marker left behind (a later
    session would take the part for a dead writer's leftover), files other users can
    read, a part the next recovery does not offer"""
    node0, node1 = nodes
    assert [(p.tag, p.rank, p.replica) for p in replicas_held(node0)] == [("s3", 1, True)]
    restored = send_back(node0, node1)
    assert restored.committed, restored
    root = replica_root(node0, 1)
    names = {n for n in root.list_files("s3") if n != REPLICA_DONE}
    assert set(node1.list_files("s3")) == names
    for name in names:
        assert node1.read_bytes("s3", name) == root.read_bytes("s3", name), name
    assert writer_marker_name(1) not in node1.list_files("s3")
    folder = Path(node1.root) / "s3"
    for path in [folder, *folder.iterdir()]:
        assert path.stat().st_mode & 0o777 == (0o700 if path.is_dir() else 0o600), path
    (part,) = own_parts_held(node1, 1)
    assert (part.tag, part.rank, part.generation, part.replica) == ("s3", 1, "g1", False)


@pytest.mark.parametrize(
    "damage", ["a byte of the marker", "a byte of an item", "the last byte", "cut short"]
)
def test_a_damaged_part_is_refused_and_leaves_nothing(
    nodes: tuple[Store, Store], damage: str
) -> None:
    """catches: a part committed with a byte that is not what its rank wrote (skipping
    the checks would load it), an item file left with the damaged bytes, a refusal that
    does not say which file"""
    node0, node1 = nodes
    found = replica_files(node0, "s3", 1)
    assert found is not None
    total = sum(c.size for c in found[2])
    flip, cut = {
        "a byte of the marker": (10, 0),
        "a byte of an item": (found[2][0].size + (1 << 20) + 5, 0),
        "the last byte": (total - 1, 0),
        "cut short": (None, 100),
    }[damage]
    restored = send_back(node0, node1, flip=flip, cut=cut)
    assert not restored.committed
    assert restored.reason
    assert not node1.exists("s3"), node1.list_files("s3")
    assert own_parts_held(node1, 1) == []


def test_an_item_of_another_part_is_refused(nodes: tuple[Store, Store]) -> None:
    """The announcement claims an item the marker does not list (its bytes match the
    claim). catches: a part whose items are only checked against what the sender says,
    not against the rank's marker"""
    node0, node1 = nodes
    found = replica_files(node0, "s3", 1)
    assert found is not None
    root, _node, claims = found
    extra = b"not this rank's"
    claims = [*claims, FileClaim("intruder", len(extra), claims[1].algo, checksum_of(extra))]
    inbox = PartInbox(node1, tag="s3", rank=1, files=claims, world_size=2)
    for claim in claims[:-1]:
        inbox.feed(root.read_bytes("s3", claim.name))
    inbox.feed(extra)
    restored = inbox.finish()
    assert not restored.committed and "marker" in (restored.reason or ""), restored
    assert not node1.exists("s3")


def test_a_leftover_at_an_items_name_is_replaced_never_written_through(
    nodes: tuple[Store, Store], tmp_path: Path
) -> None:
    """A file another hand left at an item's name is a hard link to a file elsewhere.
    catches: a restore that truncates and writes the linked file in place"""
    node0, node1 = nodes
    node1.make_dir("s3")
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep me")
    (Path(node1.root) / "s3" / "model").hardlink_to(outside)
    restored = send_back(node0, node1)
    assert restored.committed, restored
    assert outside.read_bytes() == b"keep me"


def test_a_replica_whose_marker_is_damaged_is_not_offered_but_named(
    nodes: tuple[Store, Store],
) -> None:
    """catches: a replica offered on the word of a marker that is not the one its rank
    wrote (its generation and writers would decide the agreement), or dropped silently"""
    node0, _node1 = nodes
    path = Path(replica_root(node0, 1).root) / "s3" / marker_name(1)
    data = bytearray(path.read_bytes())
    data[5] ^= 0x01
    path.write_bytes(bytes(data))
    damaged: list[Damaged] = []
    assert replicas_held(node0, damaged) == []
    (found,) = damaged
    assert (found.tag, found.rank) == ("s3", 1) and marker_name(1) in found.reason
