"""Recovery after a restart from the replicas partner nodes keep (issue #44): the ranks
agree on the newest checkpoint complete somewhere, a rank whose part of it was lost with
its node receives it back from the partner that keeps its replica, and the checkpoint is
made durable, so that `get_latest_checkpoint()` returns it on every rank.

    recover_from_peers   every rank, collectively, at init: agree (protocol/peer_plan.py),
                         send back, persist; a `RecoveryResult`

**Where it is called.** Once per process, on every rank of the job, at the same point of
its program: after `nm.init` (the session: its tiers and persister) and `peers.open_ring`
(nebula's gloo group, which carries everything here), before the replication threads of
runtime/replication.py start (they replace the replicas read here) and before the first
save. Called before the session's own recovery of an earlier process's parts
(session.py: where the generation is known at init, torchrun's, it discards this rank's
parts of an earlier generation that the persistent tier cannot complete), a rank's own
part is used as it is; called after it, that part comes back from the partner's replica.

**1. Agree.** Each rank offers (one `all_gather_object` on nebula's group) what it holds:
its own committed parts in its memory tier (`.rank-<r>.json` and every item it lists),
the whole replicas its node keeps of other ranks' parts (protocol/replicas.py), and, the
lowest rank alone, the persistent tier's newest committed checkpoint (one listing, within
`PERSISTENT_WAIT_S`; not asked while the session knows the tier fails). Every rank then
computes the same answer from the offers (protocol/peer_plan.py's `agree` says how): the
newest checkpoint complete from the ranks' own parts, their partners' replicas or the
persistent tier, and the parts to send back.

**2. Send back.** For each writing rank whose part is not in its own memory tier, the
rank that holds its replica sends it (on a thread, while this rank receives its own):
peer_wire.py's frames on `DATA_TAG` (4; replication's are 1 to 3): a BEGIN head and its
announcement (the part's marker, then its items, with the sizes and checksums the
replica's record claims), the files in messages of `chunk_bytes`, then END (FAILED when
the holder could not read them whole: zeros keep the stream's length). A holder that has
no whole replica any more sends END alone. The receiving rank writes the part into its
own memory tier as a save leaves one (protocol/part_restore.py: each file checked as its
bytes arrive, the items against the checksums the rank's marker records, the marker
published last), so that the persister persists it as any other part.

**3. Fall back.** Then every rank learns (a second `all_gather_object`) which parts were
refused. A replica refused is never loaded and never offered again: the ranks agree
anew, without it, on the newest checkpoint complete elsewhere (an older tag from their
own tiers and replicas, or the persistent tier), and parts received of a tag not agreed
in the end are removed. Each refusal is said in one warning naming the tag, the rank and
the checkpoint resumed instead; a newer checkpoint that no node can complete in one
warning saying why (peer_plan's `why_incomplete`): a rank's node lost and the replica its partner
keeps of an older tag (replication is asynchronous), and when that tag cannot be
completed either, the ranks that no longer hold their own part of it; or a rank's node
and the partner keeping its replica both lost; a resume from the persistent tier with
nothing newer known, in one line at info. The job's
lowest rank says them (once for the job); each rank says what it received at info.

**4. Durable.** A checkpoint agreed from the nodes' parts is persisted now (the session's
persister: each rank that writes it flushes its part, the lowest writer commits it) and
the ranks wait for one another, so that on return `get_latest_checkpoint()` returns it
on every rank: a node's memory tier holds parts, never a manifest, so a job of several
nodes lists and loads what its persistent tier holds. While the persistent tier fails,
init does not wait: the checkpoint is queued to persist once it answers (`durable` False).

May import: every layer below runtime, and runtime's peers.py, peer_streams.py,
peer_wire.py (its frames, not its tags), ranks.py and persister.py (the type). Not for:
replicating parts as they are saved (replication.py), the frames' bytes (peer_wire.py),
writing a part received (protocol/part_restore.py), or the session's recovery of its own
memory tier (session.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nebulaml._threads import start as start_thread
from nebulaml.errors import NebulaError
from nebulaml.protocol.catalog import list_committed
from nebulaml.protocol.delete import delete_part
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
    Plan,
    Transfer,
    agree,
    why_incomplete,
)
from nebulaml.protocol.replicas import FileClaim
from nebulaml.protocol.tiers import TierSet
from nebulaml.runtime import peer_streams as streams
from nebulaml.runtime.peer_wire import (
    MAX_CHUNK_BYTES,
    Head,
    Kind,
    Status,
    WireError,
    encode_begin,
)
from nebulaml.runtime.peers import Peers
from nebulaml.runtime.ranks import RankInfo
from nebulaml.storage.deadline import within
from nebulaml.storage.store import Store

if TYPE_CHECKING:
    from nebulaml.runtime.persister import Persister

log = logging.getLogger("nebulaml")

CHUNK_BYTES = 4 << 20
# The point-to-point tag of a part sent back on nebula's group: replication.py uses 1 to 3
# on the same group.
DATA_TAG = 4
# How long the lowest rank's listing of the persistent tier may take at a restart.
PERSISTENT_WAIT_S = 30.0


# what a rank reports --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Moved:
    """One part sent back: rank `rank`'s part of `tag`, from `holder`; `size` bytes of
    items in `seconds`."""

    tag: str
    rank: int
    holder: int
    size: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Refusal:
    """A replica refused: rank `rank`'s part of `tag` from `holder` (of node `node`), and
    why."""

    tag: str
    rank: int
    holder: int
    node: int
    reason: str


@dataclass(frozen=True, slots=True)
class RecoveryResult:
    """What `recover_from_peers` did.

    `tag`: the checkpoint the ranks agreed on (None: none is complete anywhere), from
    `source` (`PARTS`: the nodes' own parts and partners' replicas; `PERSISTENT`: the
    persistent tier, whole; `NONE`). `received`: the parts this rank received and
    committed into its memory tier; `sent`: those it sent back to their ranks; `refused`:
    every replica refused on the way, the same on every rank; `newer`: the newer
    checkpoints no node could complete. `durable`: the persistent tier holds `tag`
    committed (so `get_latest_checkpoint()` returns it on every rank); `seconds`: the
    whole recovery on this rank.
    """

    tag: str | None
    source: str
    received: tuple[Moved, ...] = ()
    sent: tuple[Moved, ...] = ()
    refused: tuple[Refusal, ...] = ()
    newer: tuple[Incomplete, ...] = ()
    durable: bool = False
    seconds: float = 0.0


# the collective -------------------------------------------------------------------------
def recover_from_peers(
    peers: Peers,
    tiers: TierSet,
    ranks: RankInfo,
    *,
    persister: Persister | None = None,
    look_persistent: bool = True,
    persist_timeout_s: float | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> RecoveryResult:
    """Agree with every other rank on the checkpoint to resume, receive this rank's part
    of it from the partner that keeps its replica if this node lost it, and make it
    durable (the module's docstring: where to call it, and each step).

    Collective over `peers.group` (peers.open_ring): every rank of the job calls it once,
    at the same point of its program. `tiers`: this rank's (the session's `tiers`: its
    memory tier holds its parts and the replicas its node keeps); `ranks`: this process
    in the job (`world_size` ranks, as the group's). `persister`: the session's, which
    persists a checkpoint agreed from the nodes' parts before this returns (None: not
    persisted here; `durable` says so; while the persister knows the persistent tier
    fails, it is asked to persist it once the tier answers, not waited for: init never
    waits out an outage). `look_persistent`: the lowest rank lists the
    persistent tier for its newest checkpoint (within `PERSISTENT_WAIT_S`; not while
    `persister` knows the tier fails). `persist_timeout_s`: how long that persist may take
    (None: the persister's own bounds). `chunk_bytes`: the messages of a part sent back.

    A failure of the group (a rank gone meanwhile) raises what torch.distributed raises:
    the job restarts again. Nothing else raises: a replica refused is fallen back from,
    and a persist that fails leaves `durable` False, said in one warning.
    """
    import torch.distributed as dist

    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be 1 to {MAX_CHUNK_BYTES}")
    started = time.monotonic()
    group, me = peers.group, ranks.rank
    mine = _offer(peers, tiers, ranks, look=look_persistent, persister=persister)
    gathered: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(gathered, mine, group=group)
    offers: list[Offer] = gathered
    nodes = {offer.rank: offer.node for offer in offers}
    excluded: set[tuple[str, int, int]] = set()
    refused: list[Refusal] = []
    moved: list[Moved] = []  # every part committed by its rank, of every round
    plan = agree(offers, excluded)
    for _ in range(1 + sum(len(offer.parts) for offer in offers)):  # each round refuses one
        if not plan.transfers:
            break
        got = _move(peers, tiers, ranks, plan, nodes, chunk_bytes)
        outcomes: list[Any] = [None] * ranks.world_size
        dist.all_gather_object(outcomes, got, group=group)
        done = [m for each in outcomes for m in each if isinstance(m, Moved)]
        failed = [r for each in outcomes for r in each if isinstance(r, Refusal)]
        moved += done
        if not failed:
            break
        offers = _with_received(offers, done)  # not sent again
        for refusal in failed:
            excluded.add((refusal.tag, refusal.rank, nodes[refusal.holder]))
        refused += failed
        plan = agree(offers, excluded)
    # A part received of a tag not agreed in the end (another rank's part of it was
    # refused) completes nothing: it goes.
    for m in moved:
        if m.rank == me and m.tag != plan.tag:
            try:
                delete_part(tiers.memory, m.tag, m.rank)
            except NebulaError as exc:
                log.debug("peer recovery: %r left: %s", m.tag, exc)
    moved = [m for m in moved if m.tag == plan.tag]
    # A replica whose marker was damaged was never offered: said where it was needed.
    for offer in offers:
        for d in offer.damaged:
            needed = any(n.tag == d.tag and d.rank in n.missing for n in plan.newer)
            seen = any((r.tag, r.rank, r.node) == (d.tag, d.rank, offer.node) for r in refused)
            if needed and not seen:
                refused.append(Refusal(d.tag, d.rank, offer.rank, offer.node, d.reason))
    received = [m for m in moved if m.rank == me]
    if me == min(nodes):
        _say(plan, refused, moved, offers)
    for m in received:
        log.info(
            "peer recovery: rank %d's part of %r received from rank %d (%d bytes in %.2f s)",
            m.rank, m.tag, m.holder, m.size, m.seconds,
        )  # fmt: skip
    durable = _make_durable(peers, tiers, ranks, plan, persister, persist_timeout_s)
    return RecoveryResult(
        tag=plan.tag,
        source=plan.source,
        received=tuple(received),
        sent=tuple(m for m in moved if m.holder == me),
        refused=tuple(refused),
        newer=plan.newer,
        durable=durable,
        seconds=time.monotonic() - started,
    )


def _with_received(offers: Sequence[Offer], moved: Sequence[Moved]) -> list[Offer]:
    """`offers` with each part in `moved` its rank's own now (committed in its tier)."""
    out = list(offers)
    for m in moved:
        for part in offers[m.holder].parts:
            if (part.tag, part.rank, part.replica) == (m.tag, m.rank, True):
                mine = out[m.rank]
                own = dataclasses.replace(part, replica=False)
                out[m.rank] = dataclasses.replace(mine, parts=(*mine.parts, own))
                break
    return out


def _offer(
    peers: Peers, tiers: TierSet, ranks: RankInfo, *, look: bool, persister: Persister | None
) -> Offer:
    parts: list[HeldPart] = []
    damaged: list[Damaged] = []
    if tiers.memory_usable:
        parts = own_parts_held(tiers.memory, ranks.rank) + replicas_held(tiers.memory, damaged)
    persistent = None
    failing = persister is not None and persister.failing()
    if look and ranks.rank == 0 and tiers.persistent is not None and not failing:
        persistent = _newest_persistent(tiers.persistent)
    return Offer(
        ranks.rank, peers.ring.node, tuple(parts), persistent, tiers.memory_usable, tuple(damaged)
    )


def _newest_persistent(store: Store) -> tuple[str, str] | None:
    """The persistent tier's newest committed checkpoint as (tag, created_at), or None."""
    try:
        with within(PERSISTENT_WAIT_S):
            listed = list_committed(store)
    except NebulaError as exc:
        log.warning("peer recovery: the persistent tier %s did not answer (%s): the ranks "
                    "agree on what their nodes hold", store.url, exc)  # fmt: skip
        return None
    if not listed:
        return None
    return listed[-1].tag, listed[-1].manifest.created_at


def _where(plan: Plan) -> str:
    if plan.source == PERSISTENT:
        return f"{plan.tag!r} (the persistent tier)"
    if plan.source == PARTS:
        return f"{plan.tag!r} (the nodes' memory tiers)"
    return "no checkpoint (none is complete anywhere)"


def _say(
    plan: Plan, refused: Sequence[Refusal], moved: Sequence[Moved], offers: Sequence[Offer]
) -> None:
    """The job's lines about the agreement (the lowest rank says them)."""
    said: set[tuple[str, int]] = set()
    for refusal in refused:
        if (refusal.tag, refusal.rank) in said:
            continue
        said.add((refusal.tag, refusal.rank))
        then = (
            "another node's replica of it was whole"
            if refusal.tag == plan.tag
            else f"resuming from {_where(plan)} instead"
        )
        log.warning(
            "peer recovery: rank %d's part of %r from its replica on node %d (rank %d) "
            "failed its check and was not loaded (%s); %s",
            refusal.rank, refusal.tag, refusal.node, refusal.holder, refusal.reason, then,
        )  # fmt: skip
    lost = [n for n in plan.newer if not any(r.tag == n.tag for r in refused)]
    if lost:
        newest = lost[0]
        log.warning(
            "peer recovery: %r cannot be completed: %s; resuming from %s",
            newest.tag, why_incomplete(newest, lost, offers), _where(plan),
        )  # fmt: skip
    elif not refused and plan.source == PERSISTENT:
        log.info("peer recovery: no node holds a checkpoint newer than the persistent tier's "
                 "%r: resuming from it", plan.tag)  # fmt: skip
    elif plan.source == PARTS:
        log.info("peer recovery: the ranks resume from %r, %d part(s) sent back to them "
                 "(%d bytes)", plan.tag, len(moved), sum(m.size for m in moved))  # fmt: skip


def _make_durable(
    peers: Peers,
    tiers: TierSet,
    ranks: RankInfo,
    plan: Plan,
    persister: Persister | None,
    timeout_s: float | None,
) -> bool:
    """Persist a checkpoint agreed from the nodes' parts (each writer its part, the lowest
    commits), then wait for every rank: whether the persistent tier holds it."""
    import torch.distributed as dist

    if plan.source != PARTS:
        return plan.source == PERSISTENT
    ok = persister is not None and tiers.persistent is not None
    if ok and ranks.rank in plan.writers:
        assert persister is not None and plan.tag is not None
        if persister.failing():  # init does not wait out an outage: persisted after it
            ok = False
            persister.request(plan.tag)
            log.warning("peer recovery: %r, agreed from the nodes' parts, is persisted once "
                        "the persistent tier answers", plan.tag)  # fmt: skip
        else:
            try:
                persister.flush(plan.tag, timeout_s)
            except NebulaError as exc:
                ok = False
                log.warning("peer recovery: %r, agreed from the nodes' parts, could not be "
                            "persisted: %s", plan.tag, exc)  # fmt: skip
    flags: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(flags, ok, group=peers.group)
    return all(flags)


# the wire -------------------------------------------------------------------------------
def _move(
    peers: Peers,
    tiers: TierSet,
    ranks: RankInfo,
    plan: Plan,
    nodes: dict[int, int],
    chunk_bytes: int,
) -> list[Moved | Refusal]:
    """This rank's part of one round: the parts it holds for others sent on a thread, its
    own received here; what became of its own."""
    me = ranks.rank
    sends = [t for t in plan.transfers if t.holder == me]
    errors: list[BaseException] = []

    def send_all() -> None:
        try:
            for transfer in sends:
                _send(peers, tiers.memory, transfer, chunk_bytes)
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
            errors.append(exc)

    sender = None
    if sends:
        sender = start_thread(
            threading.Thread(target=send_all, name="nebula-recovery-send", daemon=True)
        )
    got: list[Moved | Refusal] = []
    try:
        for transfer in plan.transfers:
            if transfer.rank == me:
                got.append(_receive(peers, tiers, ranks, transfer, nodes))
    finally:
        if sender is not None:
            sender.join()
    if errors:
        raise errors[0]
    return got


def _send(peers: Peers, memory: Store, transfer: Transfer, chunk_bytes: int) -> None:
    """Send rank `transfer.rank`'s part of `transfer.tag` from this node's replica of it
    (or END alone when there is no whole one); its receiver says what became of it."""
    to = transfer.rank
    found = replica_files(memory, transfer.tag, transfer.rank)
    if found is None:
        streams.send_head(peers.group, to, DATA_TAG, Head(Kind.END, 1, Status.FAILED))
        return
    root, node, claims = found
    buffers = streams.MessageBuffers(chunk_bytes)
    body = encode_begin(transfer.tag, transfer.rank, node, claims)
    payload = sum(claim.size for claim in claims)
    streams.send_begin(peers.group, to, DATA_TAG, 1, body, payload, buffers)
    whole = [True]
    files = _read_files(root, transfer.tag, claims, chunk_bytes, whole)
    streams.send_stream(peers.group, to, DATA_TAG, files, payload, buffers)
    streams.send_head(
        peers.group, to, DATA_TAG, Head(Kind.END, 1, Status.OK if whole[0] else Status.FAILED)
    )


def _read_files(
    root: Store, tag: str, claims: Sequence[FileClaim], chunk_bytes: int, whole: list[bool]
) -> Iterator[memoryview]:
    """The files' bytes in order; a file that cannot be read whole is made up with zeros
    to its announced size, and `whole[0]` set False."""
    zeros = memoryview(bytes(chunk_bytes))
    for claim in claims:
        left = claim.size
        try:
            with root.open_read(tag, claim.name) as f:
                while left:
                    data = f.read(min(left, chunk_bytes))
                    if not data:
                        break
                    left -= len(data)
                    yield memoryview(data)
        except NebulaError as exc:
            log.warning("peer recovery: %s could not be read: %s", root.display(tag, claim.name),
                        exc)  # fmt: skip
        if left:
            whole[0] = False
        while left:
            piece = zeros[: min(left, len(zeros))]
            left -= len(piece)
            yield piece


def _receive(
    peers: Peers, tiers: TierSet, ranks: RankInfo, transfer: Transfer, nodes: dict[int, int]
) -> Moved | Refusal:
    """Receive this rank's part of `transfer.tag` from `transfer.holder` into the memory
    tier: committed (`Moved`), or refused and nothing of it left (`Refusal`)."""
    started = time.monotonic()
    holder = transfer.holder
    node = nodes.get(holder, -1)

    def refusal(reason: str) -> Refusal:
        return Refusal(transfer.tag, transfer.rank, holder, node, reason)

    head = streams.receive_head(peers.group, holder, DATA_TAG)
    if head.kind == Kind.END:
        return refusal(f"rank {holder} holds no whole replica of it now")
    buffers = streams.MessageBuffers(streams.begin_chunk(head))
    begin = streams.receive_begin(peers.group, holder, DATA_TAG, head, buffers)
    reason = None
    inbox: PartInbox | None = None
    if isinstance(begin, WireError):
        reason = str(begin)
    elif (begin.tag, begin.rank) != (transfer.tag, transfer.rank):
        reason = f"rank {begin.rank}'s part of {begin.tag!r} announced instead"
    elif begin.base is not None:
        reason = "a part announced as built on a replica (a part comes whole)"
    else:
        inbox = PartInbox(tiers.memory, tag=transfer.tag, rank=transfer.rank,
                          files=begin.files, world_size=ranks.world_size)  # fmt: skip
    try:
        drop: Callable[[memoryview], None] = lambda _piece: None  # noqa: E731
        streams.receive_stream(
            peers.group, holder, DATA_TAG, head.payload, buffers, inbox.feed if inbox else drop
        )
        end = streams.receive_head(peers.group, holder, DATA_TAG)
        if end.kind != Kind.END:
            raise WireError(f"a {end.kind.name} frame where a part ends")
    except BaseException:
        if inbox is not None:
            inbox.abandon()
        raise
    if inbox is None:
        return refusal(reason or "no part announced")
    restored: Restored = inbox.finish(sender_ok=end.status == Status.OK)
    if not restored.committed:
        return refusal(restored.reason or "refused")
    return Moved(transfer.tag, transfer.rank, holder, restored.size, time.monotonic() - started)
