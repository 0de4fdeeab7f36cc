"""A node's replicas of another node's parts (protocol/replicas.py), the frames that carry
them (runtime/peer_wire.py) and the ring that pairs the nodes (runtime/peers.py), without
a process group: the receiving side is fed bytes as the wire would give them."""

from __future__ import annotations

import os
import random
import shutil
import threading
from pathlib import Path

import pytest

from nebulaml.errors import StorageError
from nebulaml.format.checksum import BLOCK_BYTES, checksum_of
from nebulaml.format.manifest import ItemEntry, Manifest, Producer, RankMarker, utc_now
from nebulaml.format.names import MANIFEST_NAME, REPLICA_DONE, REPLICAS_DIR, marker_name
from nebulaml.protocol.delete import delete_part
from nebulaml.protocol.leases import hold_tag
from nebulaml.protocol.replica_inbox import Outcome, ReplicaInbox
from nebulaml.protocol.replicas import (
    FileClaim,
    OwnParts,
    keep_only,
    part_files,
    read_replica,
    replica_ranks,
    replica_root,
    replica_tags,
    whole_replicas,
)
from nebulaml.runtime.crew import Quiet
from nebulaml.runtime.peer_wire import (
    HEAD_BYTES,
    Head,
    Kind,
    Status,
    WireError,
    decode_begin,
    decode_head,
    encode_begin,
    encode_head,
)
from nebulaml.runtime.peers import node_of, plan_ring
from nebulaml.runtime.replica_delta import (
    ChangedError,
    FileDigests,
    PartnerCopy,
    new_ranges,
    plan_file,
)
from nebulaml.storage.store import Store


def write_part(
    memory: Store, tag: str, rank: int, items: dict[str, bytes], *, manifest: bool = False
) -> None:
    """Rank `rank`'s committed part of `tag` in a memory tier, as a save leaves it."""
    memory.make_dir(tag)
    entries = []
    for name, data in items.items():
        memory.write_bytes((tag, name), data)
        entries.append(ItemEntry.written(name, rank=rank, size_bytes=len(data),
                                         checksum=checksum_of(data), tensor_bytes=0))  # fmt: skip
    marker = RankMarker(tag, rank, world_size=2, created_at=utc_now(), items=tuple(entries))
    memory.publish((tag, marker_name(rank)), marker.to_bytes())
    if manifest:
        doc = Manifest(tag, None, utc_now(), utc_now(), 1, tuple(entries), Producer("", "", ""))
        memory.publish((tag, MANIFEST_NAME), doc.to_bytes())


def receive(
    source: Store,
    receiver: Store,
    tag: str,
    rank: int = 0,
    *,
    claims: list[FileClaim] | None = None,
    flip: int | None = None,
    cut: int = 0,
    sender_ok: bool = True,
    own: OwnParts | None = None,
) -> tuple[bool, str | None]:
    """`rank`'s part of `tag` from `source`'s memory tier into `receiver`'s replicas, fed
    in pieces of random sizes; `flip`: the byte of the stream flipped on the way; `cut`:
    bytes left out at the end. (committed, reason)."""
    announced, small = part_files(source, tag, rank)
    claims = announced if claims is None else claims
    stream = bytearray()
    for claim in announced:
        stream += small.get(claim.name) or source.read_bytes(tag, claim.name)
    if flip is not None:
        stream[flip] ^= 0x01
    del stream[len(stream) - cut :]
    root = replica_root(receiver, rank)
    inbox = ReplicaInbox(root, tag=tag, rank=rank, node=1, files=claims, own=own)
    rng, at = random.Random(7), 0
    while at < len(stream):
        n = rng.randint(1, 5000)
        inbox.feed(memoryview(stream)[at : at + n])
        at += n
    outcome = inbox.finish(sender_ok=sender_ok)
    return outcome.committed, outcome.reason


@pytest.fixture
def tiers(tmp_path: Path) -> tuple[Store, Store]:
    """Two nodes' memory tiers: the sender's and the receiver's."""
    return (
        Store(tmp_path / "node0", durable=False, private=True),
        Store(tmp_path / "node1", durable=False, private=True),
    )


def replica_dir(receiver: Store, rank: int, tag: str) -> Path:
    return Path(receiver.root) / REPLICAS_DIR / f"rank-{rank}" / tag


ITEMS = {"model": os.urandom(300_000), "optimizer": os.urandom(70_000), "empty": b""}


def test_a_part_is_replicated_bit_for_bit_with_private_modes(tiers) -> None:
    sender, receiver = tiers
    write_part(sender, "global_step1", 0, ITEMS, manifest=True)
    assert receive(sender, receiver, "global_step1") == (True, None)
    folder = replica_dir(receiver, 0, "global_step1")
    for name in [*ITEMS, marker_name(0), MANIFEST_NAME]:
        assert (folder / name).read_bytes() == sender.read_bytes("global_step1", name), name
    assert (folder / REPLICA_DONE).exists()
    for path in [folder.parent.parent, *folder.parent.parent.rglob("*")]:
        assert path.lstat().st_mode & 0o777 == (0o700 if path.is_dir() else 0o600), path
    replica = read_replica(replica_root(receiver, 0), "global_step1")
    assert replica is not None and replica.size_bytes == sum(map(len, ITEMS.values())) + sum(
        len(sender.read_bytes("global_step1", n)) for n in (marker_name(0), MANIFEST_NAME)
    )
    assert replica_ranks(receiver) == [0]


@pytest.mark.parametrize("where", ["marker", "first item", "last byte"])
def test_a_flipped_byte_is_refused_and_the_older_replica_stays(tiers, where: str) -> None:
    """catches: a replica committed without checking each file against its claim"""
    sender, receiver = tiers
    write_part(sender, "global_step1", 0, ITEMS)
    write_part(sender, "global_step2", 0, ITEMS)
    assert receive(sender, receiver, "global_step1")[0]
    marker_size = len(sender.read_bytes("global_step2", marker_name(0)))
    flip = {"marker": 5, "first item": marker_size + 1000, "last byte": -1}[where]
    committed, reason = receive(sender, receiver, "global_step2", flip=flip)
    assert not committed and reason is not None and "not" in reason
    assert not replica_dir(receiver, 0, "global_step2").exists()
    assert [r.tag for r in whole_replicas(replica_root(receiver, 0))] == ["global_step1"]


def test_a_short_stream_or_a_sender_that_could_not_read_is_refused(tiers) -> None:
    sender, receiver = tiers
    write_part(sender, "global_step1", 0, ITEMS)
    committed, reason = receive(sender, receiver, "global_step1", cut=10)
    assert not committed and "of" in str(reason)
    committed, reason = receive(sender, receiver, "global_step1", sender_ok=False)
    assert not committed and "sender" in str(reason)
    assert whole_replicas(replica_root(receiver, 0)) == []


def test_claims_that_the_marker_does_not_vouch_for_are_refused(tiers) -> None:
    """A sender that announces an item's checksum consistently with the bytes it sends,
    but not with its marker: the bytes match the claim, and still no replica.
    catches: items verified against the sender's claims alone"""
    sender, receiver = tiers
    write_part(sender, "global_step1", 0, ITEMS)
    claims, _ = part_files(sender, "global_step1", 0)
    data = bytearray(sender.read_bytes("global_step1", "model"))
    data[0] ^= 1
    sender.write_bytes(("global_step1", "model"), bytes(data))  # changed after the marker
    lying = [
        FileClaim(c.name, c.size, c.algo, checksum_of(bytes(data))) if c.name == "model" else c
        for c in claims
    ]
    committed, reason = receive(sender, receiver, "global_step1", claims=lying)
    assert not committed and "marker" in str(reason)


def test_the_replica_committed_last_is_kept_and_the_others_go(tiers) -> None:
    sender, receiver = tiers
    for step in (1, 2, 3):
        write_part(sender, f"global_step{step}", 0, {"model": os.urandom(1000 * step)})
    root = replica_root(receiver, 0)
    assert receive(sender, receiver, "global_step2")[0]
    (Path(root.root) / "global_step9").mkdir()  # a transfer cut short left a folder
    assert receive(sender, receiver, "global_step3")[0]
    assert sorted(os.listdir(root.root)) == ["global_step3"]
    # A part of an older tag sent after it is the sender's newest (its job resumed an
    # older checkpoint): it stays, the one before goes.
    assert receive(sender, receiver, "global_step1")[0]
    assert sorted(os.listdir(root.root)) == ["global_step1"]
    assert keep_only(root, "global_step1") == []


def test_the_replica_before_stays_until_the_own_part_of_the_newer_tag_is_committed(tiers) -> None:
    """Rank 0 (node 0) is a step ahead of rank 1 (node 1), which keeps rank 0's replicas:
    replica global_step2 arrives before rank 1's own part of global_step2 is committed.
    Node 0 lost then, node 1 must still complete a checkpoint: global_step1 (replica +
    own part). catches: the older replica removed as soon as the newer one is whole
    (nothing complete on node 1: 3 of 30 restarts of the node-loss campaign resumed the
    persistent tier, 6-30 steps behind)"""
    sender, receiver = tiers
    own = OwnParts(receiver, 1)
    root = replica_root(receiver, 0)
    for step in (1, 2, 3):
        write_part(sender, f"global_step{step}", 0, {"model": os.urandom(1000 * step)})
    write_part(receiver, "global_step1", 1, {"model": os.urandom(100)})
    assert receive(sender, receiver, "global_step1", own=own)[0]
    assert receive(sender, receiver, "global_step2", own=own)[0]  # own global_step2: not yet
    assert [r.tag for r in whole_replicas(root)] == ["global_step2", "global_step1"]
    write_part(receiver, "global_step2", 1, {"model": os.urandom(100)})
    assert receive(sender, receiver, "global_step3", own=own)[0]  # ahead again
    assert [r.tag for r in whole_replicas(root)] == ["global_step3", "global_step2"]
    write_part(receiver, "global_step3", 1, {"model": os.urandom(100)})
    assert receive(sender, receiver, "global_step3", own=own)[0]  # the same part again
    assert [r.tag for r in whole_replicas(root)] == ["global_step3"]
    assert replica_tags(receiver) == {"global_step3"}


def test_the_replica_kept_beside_the_newest_is_the_one_received_last(tiers) -> None:
    """After a restart from an older checkpoint the replica of the run before (a newer
    tag) is not the one kept beside the sender's newest: the one received last is.
    catches: the older replica chosen by its tag"""
    sender, receiver = tiers
    own = OwnParts(receiver, 1)
    root = replica_root(receiver, 0)
    for step in (5, 3, 4):
        write_part(sender, f"global_step{step}", 0, {"model": os.urandom(100 * step)})
    write_part(receiver, "global_step5", 1, {"model": os.urandom(100)})  # the run before
    assert receive(sender, receiver, "global_step5", own=own)[0]
    assert receive(sender, receiver, "global_step3", own=own)[0]  # this run resumed 2
    assert [r.tag for r in whole_replicas(root)] == ["global_step5", "global_step3"]
    write_part(receiver, "global_step3", 1, {"model": os.urandom(100)})
    assert receive(sender, receiver, "global_step4", own=own)[0]
    assert [r.tag for r in whole_replicas(root)] == ["global_step4", "global_step3"]


def test_the_same_part_again_keeps_the_replica_and_a_changed_one_replaces_it(tiers) -> None:
    sender, receiver = tiers
    write_part(sender, "global_step1", 0, ITEMS)
    assert receive(sender, receiver, "global_step1")[0]
    done = replica_dir(receiver, 0, "global_step1") / REPLICA_DONE
    first = done.stat().st_ino
    assert receive(sender, receiver, "global_step1")[0]
    assert done.stat().st_ino == first  # not written again
    shutil.rmtree(Path(sender.root) / "global_step1")  # saved again (overwrite=True)
    write_part(sender, "global_step1", 0, {"model": b"saved again"})
    assert receive(sender, receiver, "global_step1")[0]
    model = replica_dir(receiver, 0, "global_step1") / "model"
    assert model.read_bytes() == b"saved again"
    assert not (replica_dir(receiver, 0, "global_step1") / "optimizer").exists()


def test_a_replica_missing_a_file_is_not_whole(tiers) -> None:
    sender, receiver = tiers
    write_part(sender, "global_step1", 0, ITEMS)
    assert receive(sender, receiver, "global_step1")[0]
    (replica_dir(receiver, 0, "global_step1") / "optimizer").unlink()
    assert read_replica(replica_root(receiver, 0), "global_step1") is None


def test_replicas_are_never_written_through_a_symbolic_link(tiers, tmp_path: Path) -> None:
    _sender, receiver = tiers
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    receiver.make_dir()
    os.symlink(elsewhere, Path(receiver.root) / REPLICAS_DIR)
    with pytest.raises(StorageError, match="symbolic link"):
        replica_root(receiver, 0)
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize(
    ("tag", "names", "why"),
    [
        ("../x", [".rank-0.json"], "unsafe tag"),
        ("t", ["model"], "no marker of rank 0"),
        ("t", [".rank-0.json", "../etc"], "unsafe item"),
        ("t", [".rank-0.json", ".rank-0.json"], "twice"),
    ],
)
def test_announcements_that_cannot_be_a_replica(
    tiers, tag: str, names: list[str], why: str
) -> None:
    _sender, receiver = tiers
    claims = [FileClaim(n, 0, "xxh3_64_tree_1m", checksum_of(b"")) for n in names]
    inbox = ReplicaInbox(replica_root(receiver, 0), tag=tag, rank=0, node=1, files=claims)
    outcome = inbox.finish()
    assert not outcome.committed and why in str(outcome.reason)
    assert os.listdir(replica_root(receiver, 0).root) == []


def test_a_refused_announcement_never_removes_outside_its_folder(tiers) -> None:
    """catches: the cleanup of a refused replica run on a tag that leaves the folder"""
    _sender, receiver = tiers
    root = replica_root(receiver, 0)
    outside = Path(root.root).parent / "x"
    outside.mkdir()
    (outside / REPLICA_DONE).write_text("{}")
    claims = [FileClaim(".rank-0.json", 0, "xxh3_64_tree_1m", checksum_of(b""))]
    inbox = ReplicaInbox(root, tag="../x", rank=0, node=1, files=claims)
    inbox.abandon()
    assert not inbox.finish().committed
    assert (outside / REPLICA_DONE).exists()


# replicas built on the one held (only the changed blocks arrive) -----------------------------
def receive_delta(
    source: Store,
    receiver: Store,
    tag: str,
    held: PartnerCopy | None,
    *,
    rank: int = 0,
) -> tuple[Outcome, PartnerCopy, int]:
    """`rank`'s part of `tag` as the sender sends it against `held` (what it sent last):
    the inbox's outcome, what the partner holds if it committed, and the bytes fed."""
    claims, small = part_files(source, tag, rank)
    stream, runs = bytearray(), {}
    digests: dict[str, FileDigests] = {}
    for claim in claims:
        if claim.name in small:
            stream += small[claim.name]
            continue
        data = source.read_bytes(tag, claim.name)
        base = held.files.get(claim.name) if held is not None else None
        plan = plan_file(memoryview(data), claim, base)
        assert plan.digests is not None
        digests[claim.name] = plan.digests
        if plan.runs:
            runs[claim.name] = plan.runs
        for offset, length in new_ranges(claim.size, plan.runs):
            stream += data[offset : offset + length]
    base_tag = held.tag if runs and held is not None else None
    inbox = ReplicaInbox(replica_root(receiver, rank), tag=tag, rank=rank, node=1,
                         files=claims, base=base_tag, reuse=runs)  # fmt: skip
    rng, at = random.Random(3), 0
    while at < len(stream):
        n = rng.randint(1, 300_000)
        inbox.feed(memoryview(stream)[at : at + n])
        at += n
    return inbox.finish(), PartnerCopy(tag, "", digests), len(stream)


BIG = 3 << 20  # three pieces


def lora_part(memory: Store, step: int, adapter: bytes) -> None:
    """A part whose item holds a frozen base (the same at every step) and an adapter."""
    frozen = random.Random(0).randbytes(BIG)
    write_part(memory, f"global_step{step}", 0, {"model": frozen + adapter, "empty": b""})


def test_a_replica_built_on_the_one_held_gets_only_the_changed_blocks(tiers) -> None:
    """catches: a frozen base sent again; a run taken from the wrong offset (the replica
    would not be bit-exact, and would be refused); a kept base removed before the new
    replica is whole"""
    sender, receiver = tiers
    lora_part(sender, 1, os.urandom(40_000))
    outcome, held, fed = receive_delta(sender, receiver, "global_step1", None)
    assert outcome.committed and fed > BIG
    lora_part(sender, 2, os.urandom(40_000))
    outcome, held, fed = receive_delta(sender, receiver, "global_step2", held)
    assert outcome.committed, outcome.reason
    marker = len(sender.read_bytes("global_step2", marker_name(0)))
    # The adapter's 40,000 bytes span at most 4 blocks of 16 KiB.
    assert fed - marker <= 4 * BLOCK_BYTES, fed
    folder = replica_dir(receiver, 0, "global_step2")
    assert (folder / "model").read_bytes() == sender.read_bytes("global_step2", "model")
    assert sorted(os.listdir(Path(folder).parent)) == ["global_step2"]  # the base went after


def test_a_replica_arriving_during_a_save_waits_until_the_save_returns(tiers) -> None:
    """catches: the receiver copying a replica's unchanged bytes from the one held (or
    writing what arrives) while the training thread saves: on 2 cores it took the
    follower's CPU during its save (replication.py gives the inbox `QUIET.pause_point`)"""
    sender, receiver = tiers
    lora_part(sender, 1, os.urandom(40_000))
    _outcome, held, _fed = receive_delta(sender, receiver, "global_step1", None)
    lora_part(sender, 2, os.urandom(40_000))
    claims, small = part_files(sender, "global_step2", 0)
    stream, runs = bytearray(), {}
    for claim in claims:
        if claim.name in small:
            stream += small[claim.name]
            continue
        data = sender.read_bytes("global_step2", claim.name)
        plan = plan_file(memoryview(data), claim, held.files.get(claim.name))
        if plan.runs:
            runs[claim.name] = plan.runs
        for offset, length in new_ranges(claim.size, plan.runs):
            stream += data[offset : offset + length]
    quiet = Quiet()
    done = threading.Event()

    def receive() -> None:
        inbox = ReplicaInbox(replica_root(receiver, 0), tag="global_step2", rank=0, node=1,
                             files=claims, base="global_step1", reuse=runs,
                             pause=quiet.pause_point)  # fmt: skip
        inbox.feed(stream)
        assert inbox.finish().committed
        done.set()

    with quiet.saving():
        thread = threading.Thread(target=receive)
        thread.start()
        assert not done.wait(0.5), "the replica was written while a save ran"
        assert not (replica_dir(receiver, 0, "global_step2") / "model").exists()
    assert done.wait(30)
    thread.join()
    folder = replica_dir(receiver, 0, "global_step2")
    assert (folder / "model").read_bytes() == sender.read_bytes("global_step2", "model")


def test_after_a_restart_from_an_older_checkpoint_the_new_replicas_are_kept(tiers) -> None:
    """The job resumed global_step1 (its node 1 was lost at global_step3, whose replica
    the receiver still holds) and saves global_step2 again: that replica is the sender's
    newest, and the next one is built on it. catches: the stale global_step3 of the run
    before kept as "the newest" and each new replica removed as soon as it was committed
    and answered (the sender's `replicated` names a replica the partner no longer holds,
    and every other one is refused: its base is not there; found by the node-loss
    campaign, tests/reliability/node_loss.py)"""
    sender, receiver = tiers
    lora_part(sender, 3, os.urandom(40_000))  # the run before the restart
    outcome, _held, _fed = receive_delta(sender, receiver, "global_step3", None)
    assert outcome.committed
    shutil.rmtree(Path(sender.root) / "global_step3")
    lora_part(sender, 2, os.urandom(40_000))  # the run after it: a new sender, nothing held
    outcome, held, _fed = receive_delta(sender, receiver, "global_step2", None)
    assert outcome.committed, outcome.reason
    root = replica_root(receiver, 0)
    assert [r.tag for r in whole_replicas(root)] == ["global_step2"]
    lora_part(sender, 3, os.urandom(40_000))
    outcome, _held, fed = receive_delta(sender, receiver, "global_step3", held)
    assert outcome.committed, outcome.reason
    assert fed < BIG  # built on global_step2: the frozen base did not go again
    folder = replica_dir(receiver, 0, "global_step3")
    assert (folder / "model").read_bytes() == sender.read_bytes("global_step3", "model")
    assert [r.tag for r in whole_replicas(root)] == ["global_step3"]


def test_a_replica_built_on_a_corrupt_base_is_refused_and_the_base_stays(tiers) -> None:
    """A byte of the held replica flipped in the receiver's memory: the frozen run taken
    from it makes a file that does not match its checksum. catches: a replica whose
    copied bytes are not hashed (it would commit wrong bytes); a refusal that takes the
    held replica with it"""
    sender, receiver = tiers
    lora_part(sender, 1, os.urandom(40_000))
    lora_part(sender, 2, os.urandom(40_000))
    outcome, held, _ = receive_delta(sender, receiver, "global_step1", None)
    assert outcome.committed
    model = replica_dir(receiver, 0, "global_step1") / "model"
    data = bytearray(model.read_bytes())
    data[123_456] ^= 0x01
    model.write_bytes(bytes(data))
    outcome, _, _ = receive_delta(sender, receiver, "global_step2", held)
    assert not outcome.committed and "base" in str(outcome.reason), outcome.reason
    assert [r.tag for r in whole_replicas(replica_root(receiver, 0))] == ["global_step1"]
    assert not replica_dir(receiver, 0, "global_step2").exists()
    # Sent whole, it commits.
    outcome, _, fed = receive_delta(sender, receiver, "global_step2", None)
    assert outcome.committed and fed > BIG


def test_a_base_that_is_not_held_whole_is_refused(tiers) -> None:
    sender, receiver = tiers
    lora_part(sender, 1, os.urandom(40_000))
    lora_part(sender, 2, os.urandom(40_000))
    held = receive_delta(sender, receiver, "global_step1", None)[1]
    (replica_dir(receiver, 0, "global_step1") / REPLICA_DONE).unlink()
    outcome, _, _ = receive_delta(sender, receiver, "global_step2", held)
    assert not outcome.committed and "is not a whole replica here" in str(outcome.reason)


@pytest.mark.parametrize(
    ("base", "runs", "why"),
    [
        (None, {"model": [(0, 1)]}, "without a base"),
        ("global_step2", {"model": [(0, 1)]}, "built on itself"),
        ("../x", {"model": [(0, 1)]}, "unsafe base"),
        ("global_step1", {".rank-0.json": [(0, 1)]}, "no item"),
        ("global_step1", {"other": [(0, 1)]}, "no item"),
        ("global_step1", {"model": [(5, 1), (0, 1)]}, "out of order"),
        ("global_step1", {"model": [(0, 0)]}, "out of order"),
        ("global_step1", {"model": [(0, BIG + 1)]}, "past its"),
    ],
)  # fmt: skip
def test_runs_that_cannot_be_taken_from_a_base(
    tiers, base: str | None, runs: dict, why: str
) -> None:
    sender, receiver = tiers
    lora_part(sender, 2, b"")
    claims, _ = part_files(sender, "global_step2", 0)
    inbox = ReplicaInbox(replica_root(receiver, 0), tag="global_step2", rank=0, node=1,
                         files=claims, base=base, reuse=runs)  # fmt: skip
    outcome = inbox.finish()
    assert not outcome.committed and why in str(outcome.reason), outcome.reason


def test_a_withdrawn_replica_goes_quietly_and_the_held_one_stays(tiers, caplog) -> None:
    sender, receiver = tiers
    write_part(sender, "global_step1", 0, ITEMS)
    write_part(sender, "global_step2", 0, ITEMS)
    assert receive(sender, receiver, "global_step1")[0]
    claims, _ = part_files(sender, "global_step2", 0)
    inbox = ReplicaInbox(replica_root(receiver, 0), tag="global_step2", rank=0, node=1,
                         files=claims)  # fmt: skip
    inbox.feed(b"x" * 100)
    with caplog.at_level("WARNING", logger="nebulaml"):
        outcome = inbox.withdraw()
    assert outcome.withdrawn and not outcome.committed and caplog.records == []
    assert [r.tag for r in whole_replicas(replica_root(receiver, 0))] == ["global_step1"]


def test_a_sent_file_whose_bytes_are_not_its_marker_is_not_planned() -> None:
    """The save's leaves that do not make the checksum are not used; bytes that are not
    the item's are never sent. catches: a delta planned from stale evidence"""
    data = os.urandom(2 << 20)
    claim = FileClaim("model", len(data), "xxh3_64_tree_1m", checksum_of(data))
    stale = [bytes(8), bytes(8)]
    assert plan_file(memoryview(data), claim, None, stale).digests is not None
    changed = bytearray(data)
    changed[5] ^= 1
    with pytest.raises(ChangedError):
        plan_file(memoryview(changed), claim, None)
    # The save's leaves, right for the checksum, but a piece changed since: refused too.
    leaves = plan_file(memoryview(data), claim, None).digests.leaves  # type: ignore[union-attr]
    with pytest.raises(ChangedError, match="changed since its save"):
        plan_file(memoryview(changed), claim, None, list(leaves))


# the hold of a part being sent -------------------------------------------------------------
def test_a_held_part_is_not_evicted_but_a_save_of_its_tag_replaces_it(tiers) -> None:
    """A node's memory tier in a job over several nodes holds no manifest: the sender
    holds the part by its marker. catches: a hold that eviction (delete_part) does not
    see; a hold that makes an overwrite fail"""
    memory, _ = tiers
    write_part(memory, "global_step1", 0, ITEMS)
    there, name = hold_tag(memory, "global_step1", committed=marker_name(0))
    assert there and name is not None
    assert not delete_part(memory, "global_step1", 0)
    assert memory.exists("global_step1", "model")
    memory.remove("global_step1", name)
    assert delete_part(memory, "global_step1", 0)
    assert not memory.exists("global_step1", "model")
    write_part(memory, "global_step2", 0, ITEMS)
    there, name = hold_tag(memory, "global_step2", committed=marker_name(0))
    assert there
    assert delete_part(memory, "global_step2", 0, replacing=True, keep_folder=True)
    assert not memory.exists("global_step2", marker_name(0))
    assert hold_tag(memory, "global_step3", committed=marker_name(0)) == (False, None)


# the wire ----------------------------------------------------------------------------------
def test_a_head_round_trips_and_a_damaged_one_is_refused() -> None:
    head = Head(Kind.END, transfer=7, status=Status.FAILED, chunk=1, body=2, payload=3)
    data = encode_head(head)
    assert len(data) == HEAD_BYTES and decode_head(data) == head
    for at in (0, 4, 20, HEAD_BYTES - 1):
        damaged = bytearray(data)
        damaged[at] ^= 0x10
        with pytest.raises(WireError):
            decode_head(damaged)


@pytest.mark.parametrize(
    "body",
    [b"", b"[]", b'{"tag": "t"}', b'{"tag": 1, "rank": 0, "node": 0, "files": []}',
     b'{"tag": "t", "rank": -1, "node": 0, "files": []}',
     b'{"tag": "t", "rank": 0, "node": 0, "files": [["a", "1", "x", "y"]]}',
     b'{"tag": "t", "rank": 0, "node": 0, "files": [], "base": 1, "reuse": {}}',
     b'{"tag": "t", "rank": 0, "node": 0, "files": [], "base": "s", "reuse": {"m": [[0]]}}',
     b'{"tag": "t", "rank": 0, "node": 0, "files": [], "base": "s", "reuse": {"m": [[0, -1]]}}',
     b'{"tag": "t", "rank": 0, "node": 0, "files": [], "base": "s", "reuse": []}'],
)  # fmt: skip
def test_a_malformed_announcement_is_refused(body: bytes) -> None:
    with pytest.raises(WireError):
        decode_begin(body)


def test_an_announcement_round_trips() -> None:
    claims = (FileClaim(".rank-3.json", 10, "xxh3_64_tree_1m", "ab"), FileClaim("m", 0, "x", "y"))
    begin = decode_begin(encode_begin("global_step5", 3, 1, claims))
    assert (begin.tag, begin.rank, begin.node, begin.files) == ("global_step5", 3, 1, claims)
    assert (begin.base, begin.reuse) == (None, {})
    runs = {"m": ((0, 5), (9, 1))}
    begin = decode_begin(encode_begin("global_step5", 3, 1, claims, "global_step4", runs))
    assert (begin.base, begin.reuse) == ("global_step4", runs)


# the ring ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("rank", "local_world_size", "group_rank", "node"),
    [(0, 1, None, 0), (3, 1, None, 3), (5, 4, None, 1), (7, 4, None, 1), (8, 4, None, 2),
     (5, 4, 9, 9), (0, 0, None, 0)],
)  # fmt: skip
def test_node_of(rank: int, local_world_size: int, group_rank: int | None, node: int) -> None:
    assert node_of(rank, local_world_size, group_rank) == node


def places(*nodes: int) -> list[tuple[int, int]]:
    """Each rank's (node, local rank), ranks numbered node after node as torchrun does."""
    out: list[tuple[int, int]] = []
    for node in nodes:
        local = sum(1 for n, _ in out if n == node)
        out.append((node, local))
    return out


# (the job's places, rank) -> (node, partner, send_to, receive_from); None: no ring
RINGS = [
    (places(0), 0, None),
    (places(0, 0, 0, 0), 2, None),
    (places(0, 1), 0, (0, 1, 1, (1,))),
    (places(0, 1), 1, (1, 0, 0, (0,))),
    (places(0, 1, 2), 0, (0, 1, 1, (2,))),
    (places(0, 1, 2), 1, (1, 2, 2, (0,))),
    (places(0, 1, 2), 2, (2, 0, 0, (1,))),
    (places(0, 0, 1, 1), 0, (0, 1, 2, (2,))),
    (places(0, 0, 1, 1), 1, (0, 1, 3, (3,))),
    (places(0, 0, 1, 1), 3, (1, 0, 1, (1,))),
    (places(0, 0, 1, 1, 2, 2, 3, 3), 5, (2, 3, 7, (3,))),
    (places(0, 0, 1, 1, 2, 2, 3, 3), 7, (3, 0, 1, (5,))),
    # GROUP_RANK numbers that are not 0..n-1: the ring follows their order
    ([(9, 0), (5, 0), (7, 0)], 0, (9, 5, 1, (2,))),
    ([(9, 0), (5, 0), (7, 0)], 1, (5, 7, 2, (0,))),
    # a node with fewer ranks: its ranks take the sends of the seats it lacks, in turn
    (places(0, 0, 1), 1, (0, 1, 2, ())),
    (places(0, 0, 1), 2, (1, 0, 0, (0, 1))),
    # ranks not numbered node after node (LOCAL_RANK is what pairs them)
    ([(0, 1), (1, 1), (0, 0), (1, 0)], 0, (0, 1, 1, (1,))),
]


@pytest.mark.parametrize(("job", "rank", "expected"), RINGS)
def test_plan_ring(job: list[tuple[int, int]], rank: int, expected: tuple | None) -> None:
    ring = plan_ring(job, rank)
    if expected is None:
        assert ring is None
        return
    assert ring is not None
    assert (ring.node, ring.partner, ring.send_to, ring.receive_from) == expected
    # Every rank that sends has one receiver, and every part goes to another node.
    for r in range(len(job)):
        other = plan_ring(job, r)
        assert other is not None and job[other.send_to][0] != job[r][0]
        assert r in plan_ring(job, other.send_to).receive_from  # type: ignore[union-attr]
