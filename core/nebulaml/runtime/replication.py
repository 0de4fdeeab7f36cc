"""Replicating this rank's checkpoint parts to its partner node, and keeping the parts of
the ranks that replicate to it, over nebula's gloo process group (peers.py), on threads
of their own: the caller never waits on the partner.

    Replication   this rank's side of the ring: `start`, `replicate(tag)` (returns at
                  once), `status`, `wait`, `close`

**Sending.** `replicate(tag)` hands the sender thread the tag whose part this rank has
committed to its memory tier: its marker (`.rank-<r>.json`), the checkpoint's manifest
when the memory tier holds one, and the items the marker lists. The sender announces
each file (name, size, checksum: the marker's for the items), then sends the files in
messages of `chunk_bytes` (4 MiB) from two buffers it reuses (one in flight while the
other fills), and waits for the partner's answer: the part is *replicated* once the
partner says it committed it whole. One tag waits at most: a newer `replicate` replaces
one not yet begun, so a slow partner costs two buffers, never a queue. The messages:
peer_wire.py.

**Only what changed.** The sender remembers the digests of the replica the partner last
committed (its newest whole one), and sends of each item only the 16 KiB blocks whose
digest differs; the partner takes the rest from that replica and checks every file whole
(replica_delta.py says how the blocks are found from the save's own digests, without
reading a frozen base; protocol/replica_inbox.py how the partner builds and checks). A
replica the partner refuses (its base was not what the sender thought, a byte flipped on
the way) makes the next one go whole. The items are read from their mappings (the slot
pool's, which the save filled: `Store.map_read`), copied once, into the message buffers.
`status()` counts the bytes the last replica put on the wire (`bytes_sent`) against the
part's (`bytes_total`).

**A hold on the part sent.** While it reads a part, the sender holds it as a checkpoint
handle holds its tag (protocol/leases.py: a hold file in the tag folder, by the part's
marker on a node that holds no manifest): eviction and retention leave it, and its
buffers go to no newer save, until the send ends (the hold goes whatever happens). The
hold is renewed as the messages go, and lapses on its own `HOLD_TTL_S` (60 s) after a
send stops moving (a stuck partner never pins memory for longer); at most one part is
held, one superseded copy of this rank's part beside the newer ones. A tag saved again
(`overwrite=True`) replaces it all the same: the newer part wins. The sender then finds
the part's marker changed when its bytes are sent, ends the replica ABANDONED, and the
partner drops it quietly; the status says `abandoned`, not `refused`, and the newer part
goes when it is asked for. So does a part evicted or saved again before its turn came
(nothing of it is sent).

**Receiving.** One thread per rank that sends to this one (`Ring.receive_from`) takes
its frames, writes each replica into this node's memory tier as its bytes arrive, and
checks and commits it there (protocol/replica_inbox.py, into
`<memory tier>/.replicas/rank-<r>/`: protocol/replicas.py); then answers COMMITTED, or
REFUSED with the reason (also one warning here, and one on the sender's side). The
replica before stays while this rank's own part of the new one's tag is not committed
yet (`OwnParts`): a lost partner then still finds a checkpoint complete here. The
receiver's work (each message written, each piece copied from the replica held) waits
while a save runs in this process (crew.QUIET, as the audits do): a partner's replica
arriving during a save took the follower's CPU and made its save 1.18x slower. The
threads keep the process's priority: a replica that falls behind is a step a restart
after a lost node goes back.

**Failures.** gloo cannot mend a connection: an error of the group (the partner's
process ended, a damaged frame head, an operation that waited past the group's timeout)
ends that link for this run, says so in one warning, and leaves the other links as they
are. An idle sender sends a keepalive every `keepalive_s` (60 s), well within the group's
timeout (peers.PEER_TIMEOUT).

**Closing.** No thread may be waiting in a gloo operation when the interpreter finalises
(one woken then aborts the process), and a pending receive ends only when its peer sends
or its connection closes. So `close` first asks politely: the sender finishes the part
in flight and sends BYE, which ends the partner's receiver, while this rank's receivers
wait for their senders' BYE; what has not ended within `grace_s` has its connection cut
(a 1 ms receive on `CUT_TAG`, which nothing sends, times out, and gloo closes the
connection to that peer: every operation waiting on it ends with an error). A job whose
ranks close together ends with BYEs only.

May import: every layer below, and runtime's peers.py, peer_wire.py, peer_streams.py,
replica_delta.py and crew.py (`QUIET`). Not for: which ranks are partners or the process
group (peers.py), the bytes of a frame (peer_wire.py), which bytes of a part changed
(replica_delta.py), or what makes a replica whole (protocol/replicas.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from nebulaml._threads import start as start_thread
from nebulaml.errors import NebulaError
from nebulaml.format.manifest import parse_marker
from nebulaml.format.names import marker_name, order_key
from nebulaml.protocol.leases import HandleHolds, hold_tag
from nebulaml.protocol.replica_inbox import Outcome, ReplicaInbox
from nebulaml.protocol.replicas import (
    FileClaim,
    OwnParts,
    part_files,
    replica_root,
)
from nebulaml.runtime.crew import QUIET
from nebulaml.runtime.peer_streams import (
    MessageBuffers,
    as_tensor,
    begin_chunk,
    receive_begin,
    receive_head,
    receive_stream,
    send_begin,
    send_head,
    send_stream,
)
from nebulaml.runtime.peer_wire import (
    HEAD_BYTES,
    MAX_CHUNK_BYTES,
    MAX_REASON_BYTES,
    Begin,
    Head,
    Kind,
    Status,
    WireError,
    decode_head,
    encode_begin,
    encode_head,
)
from nebulaml.runtime.peers import Peers
from nebulaml.runtime.replica_delta import FilePlan, PartnerCopy, new_ranges, plan_file
from nebulaml.storage.store import MissingFileError, Store

log = logging.getLogger("nebulaml")

CHUNK_BYTES = 4 << 20
KEEPALIVE_S = 60.0
CLOSE_GRACE_S = 5.0
HOLD_WAIT_S = 2.0  # how long a sender waits on a deleter's claim on the part it would send
# Point-to-point tags on nebula's group: a sender's frames, the receiver's answers, and
# one nothing is ever sent on (`close` cuts a connection with a receive on it).
DATA_TAG = 1
ACK_TAG = 2
CUT_TAG = 3

# A test's hook: called with (tag, index of the message among the files' messages, its
# bytes) just before each message of a replica's files is sent; it may change the bytes
# (a copy of the files': the memory tier's are never touched).
Tamper = Callable[[str, int, memoryview], None]
# The save's digests of each 1 MiB piece of an item (tag, item file), where it has them.
Leaves = Callable[[str, str], list[bytes] | None]


@dataclass(frozen=True, slots=True)
class ReplicationStatus:
    """Where this rank's replication stands.

    `replicated`: the newest tag whose part of this rank the partner holds, verified;
    `pending`: a tag waiting to be sent; `sending`: the tag in flight; `refused`: the last
    tag the partner refused, and `last_error` why (or why the link failed); `link_down`:
    nothing more can be sent this run; `kept`: for each rank that sends to this one, the
    newest tag of its part this node holds whole; `abandoned`: the last tag whose replica
    this rank gave up because the tag was saved again (or evicted) before or while it was
    sent (no error: the newer part is sent when it is asked for); `bytes_sent`: the
    bytes the last replica put on the wire (its frames' heads, announcement and payload),
    `bytes_total`: the bytes of the part it replicates.
    """

    replicated: str | None = None
    pending: str | None = None
    sending: str | None = None
    refused: str | None = None
    last_error: str | None = None
    link_down: bool = False
    kept: dict[int, str] = field(default_factory=dict)
    abandoned: str | None = None
    bytes_sent: int = 0
    bytes_total: int = 0


class Replication:
    """This rank's side of the ring of `peers` (peers.open_ring), over the memory tier
    `memory` of this node: its parts are sent from there, and the replicas it keeps are
    written there. `start` it, `replicate` each committed tag, `close` it before the
    interpreter exits. `leaves(tag, item)`: the save's digests of the item's 1 MiB pieces
    where it has them (the session's slot pool: `SlotPool.leaves_of`); without them each
    item sent is hashed again before it is compared (replica_delta.py)."""

    def __init__(
        self,
        peers: Peers,
        memory: Store,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        keepalive_s: float = KEEPALIVE_S,
        tamper: Tamper | None = None,
        leaves: Leaves | None = None,
    ) -> None:
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be 1 to {MAX_CHUNK_BYTES}")
        self.ring, self.group, self.memory = peers.ring, peers.group, memory
        self.chunk_bytes = chunk_bytes
        self.keepalive_s = keepalive_s
        self._tamper = tamper
        self._leaves = leaves
        self._partner: PartnerCopy | None = None  # the sender's thread's alone
        self._cond = threading.Condition()
        self._state = ReplicationStatus()
        self._closing = False
        self._transfers = 0
        self._threads: list[threading.Thread] = []

    # the caller's side ---------------------------------------------------------------
    def start(self) -> Replication:
        """Start the sender and the receivers; returns self."""
        sender = threading.Thread(target=self._send_loop, name="nebula-replica-send", daemon=True)
        self._threads.append(start_thread(sender))
        for source in self.ring.receive_from:
            receiver = threading.Thread(
                target=self._receive_loop,
                args=(source,),
                name=f"nebula-replica-receive-{source}",
                daemon=True,
            )
            self._threads.append(start_thread(receiver))
        return self

    def replicate(self, tag: str) -> None:
        """Send this rank's part of `tag` (committed to the memory tier) to the partner, on
        the sender's thread; returns at once. A tag still waiting is replaced."""
        with self._cond:
            if self._closing or self._state.link_down:
                return
            self._update(pending=tag)
            self._cond.notify_all()

    def status(self) -> ReplicationStatus:
        with self._cond:
            return self._state

    def wait(self, tag: str, timeout_s: float) -> ReplicationStatus:
        """Until the partner has answered for `tag` (replicated, refused, or dropped as
        abandoned), the link is down, or `timeout_s` has passed; the status then."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                state = self._state
                answered = tag in (state.replicated, state.refused, state.abandoned)
                if state.link_down or (answered and tag not in (state.pending, state.sending)):
                    return state
                left = deadline - time.monotonic()
                if left <= 0:
                    return state
                self._cond.wait(left)

    def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """End replication: the part in flight finishes and the partner is told (BYE);
        this rank's receivers end at their senders' BYE; whatever has not ended within
        `grace_s` has its connection cut. Returns once no thread of this replication is
        left in a gloo operation."""
        with self._cond:
            self._closing = True
            self._update(pending=None)
            self._cond.notify_all()
        deadline = time.monotonic() + grace_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in self._threads):
            for peer in self.ring.peers:
                self._cut(peer)
            for thread in self._threads:
                thread.join(grace_s)
        left = [thread.name for thread in self._threads if thread.is_alive()]
        if left:
            log.warning("replication: %s did not end", ", ".join(left))

    # the state -------------------------------------------------------------------------
    def _update(self, **changes: Any) -> None:
        """Replace fields of the status (under `_cond`)."""
        self._state = dataclasses.replace(self._state, **changes)

    def _link_failed(self, what: str, exc: BaseException, *, sending: bool) -> None:
        """The link of `what` failed (the sender's, when `sending`: nothing more is sent)."""
        with self._cond:
            closing = self._closing
            if sending:
                self._update(link_down=True, sending=None, pending=None, last_error=str(exc))
            self._cond.notify_all()
        if not closing:
            log.warning("replication: %s stopped for this run: %s", what, exc)

    def _cut(self, peer: int) -> None:
        """Close the connection to `peer` on nebula's group (see the module's docstring)."""
        probe = torch.zeros(1, dtype=torch.uint8)
        with contextlib.suppress(Exception):
            self.group.recv([probe], peer, CUT_TAG).wait(timedelta(milliseconds=1))

    # sending ---------------------------------------------------------------------------
    def _send_loop(self) -> None:
        buffers: MessageBuffers | None = None
        to = self.ring.send_to
        try:
            while True:
                quiet_until = time.monotonic() + self.keepalive_s
                with self._cond:
                    while self._state.pending is None and not self._closing:
                        left = quiet_until - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                    tag, closing = self._state.pending, self._closing
                    if tag is not None:
                        self._update(pending=None, sending=tag)
                if closing:
                    self._send_head(Head(Kind.BYE))
                    return
                if tag is None:  # nothing sent for `keepalive_s`
                    self._send_head(Head(Kind.KEEPALIVE))
                    continue
                if buffers is None:
                    buffers = MessageBuffers(self.chunk_bytes)
                self._send_part(tag, buffers)
        except Exception as exc:  # noqa: BLE001 - the link's end, reported
            self._link_failed(f"sending to rank {to}", exc, sending=True)

    def _send_head(self, head: Head) -> None:
        send_head(self.group, self.ring.send_to, DATA_TAG, head)

    def _send_part(self, tag: str, buffers: MessageBuffers) -> None:
        """One replica: hold the part, plan it against what the partner holds, announce,
        send, wait for the partner's answer; the hold goes whatever happens."""
        rank = self.ring.rank
        try:
            there, name = hold_tag(
                self.memory, tag, wait_s=HOLD_WAIT_S, committed=marker_name(rank)
            )
        except NebulaError as exc:
            there, name = False, None
            log.debug("replication: %s not held: %s", self.memory.display(tag), exc)
        if not there:  # evicted, or saved again, before its turn came: nothing to send
            self._gone(tag, f"{marker_name(rank)} is not in the memory tier")
            return
        holds = HandleHolds(tag)
        holds.add(self.memory, name)  # None: a store that refused it (full): unheld
        try:
            self._send_held(tag, buffers, holds)
        finally:
            holds.release()

    def _not_sent(self, tag: str, reason: str) -> None:
        """The part is there but cannot be sent (its bytes are not what its marker says)."""
        log.warning("replication: rank %d's part of %r not sent: %s", self.ring.rank, tag, reason)
        with self._cond:
            self._update(sending=None, refused=tag, last_error=reason)
            self._cond.notify_all()

    def _gone(self, tag: str, reason: str) -> None:
        """The part went, or was saved again, before it was sent: given up, no error."""
        log.info("replication: rank %d's part of %r given up: %s", self.ring.rank, tag, reason)
        with self._cond:
            self._update(sending=None, abandoned=tag)
            self._cond.notify_all()

    def _damage(self, tag: str) -> Callable[[int, memoryview], None] | None:
        """The test's damage in transit (`tamper`) to the messages of `tag`'s payload."""
        tamper = self._tamper
        if tamper is None:
            return None
        return lambda index, message: tamper(tag, index, message)

    def _send_held(self, tag: str, buffers: MessageBuffers, holds: HandleHolds) -> None:
        rank, to = self.ring.rank, self.ring.send_to
        with contextlib.ExitStack() as views:
            try:
                claims, small = part_files(self.memory, tag, rank)
            except MissingFileError as exc:
                self._gone(tag, str(exc))
                return
            except NebulaError as exc:
                self._not_sent(tag, str(exc))
                return
            try:
                where = self.memory.display(tag, marker_name(rank))
                created_at = parse_marker(small[marker_name(rank)], where).created_at
                plans = self._plan(tag, claims, small, views)
            except NebulaError as exc:
                if self._same_marker(tag, small[marker_name(rank)]):
                    self._not_sent(tag, str(exc))  # its bytes are not its marker's
                else:
                    self._gone(tag, f"saved again while it was read ({exc})")
                return
            partner = self._partner
            reuse = {name: plan.runs for name, (_view, plan) in plans.items() if plan.runs}
            base = partner.tag if reuse and partner is not None else None
            self._transfers += 1
            transfer = self._transfers
            answer = bytearray(HEAD_BYTES)
            answered = self.group.recv([as_tensor(answer)], to, ACK_TAG)
            body = encode_begin(tag, rank, self.ring.node, claims, base, reuse)
            payload = sum(
                claim.size if claim.name in small else plans[claim.name][1].sent_bytes(claim.size)
                for claim in claims
            )
            send_begin(self.group, to, DATA_TAG, transfer, body, payload, buffers)
            stream = self._payload(claims, small, plans)
            send_stream(
                self.group, to, DATA_TAG, stream, payload, buffers,
                before=holds.renew, edit=self._damage(tag),
            )  # fmt: skip
            # The part saved again while it was sent (its marker changed or went): the bytes
            # sent may be the new part's, the old one's or both. The newer part wins: this
            # replica is given up, and the newer one is sent when it is asked for.
            same = self._same_marker(tag, small[marker_name(rank)])
        holds.release()  # the part is read: eviction may take it as soon as it likes
        status = Status.OK if same else Status.ABANDONED
        self._send_head(Head(Kind.END, transfer, status))
        sent = 2 * HEAD_BYTES + len(body) + payload
        total = sum(claim.size for claim in claims)
        answered.wait()
        head = decode_head(answer)
        if head.kind != Kind.ACK or head.transfer != transfer:
            raise WireError(f"an answer of kind {head.kind.name} for transfer {head.transfer}")
        reason = None
        if head.body:
            text = bytearray(min(head.body, MAX_REASON_BYTES))
            self.group.recv([as_tensor(text)], to, ACK_TAG).wait()
            reason = text.decode(errors="replace")
        with self._cond:
            counts = {"bytes_sent": sent, "bytes_total": total}
            if head.status == Status.OK:
                self._update(sending=None, replicated=tag, **counts)
            elif head.status == Status.ABANDONED:
                self._update(sending=None, abandoned=tag, **counts)
            else:
                self._update(sending=None, refused=tag, last_error=reason, **counts)
            self._cond.notify_all()
        if head.status == Status.OK:
            digests = {n: p.digests for n, (_v, p) in plans.items() if p.digests is not None}
            copy = PartnerCopy(tag, created_at, digests)
            held = self._partner
            # The partner keeps its newest whole replica (protocol/replicas.py): an older
            # tag sent late is committed and goes at once.
            if held is None or order_key(tag, created_at) >= order_key(held.tag, held.created_at):
                self._partner = copy
        elif head.status == Status.ABANDONED:
            log.info("replication: rank %d's part of %r was saved again while it was sent: "
                     "given up", rank, tag)  # fmt: skip
        else:
            self._partner = None  # what it holds is not known: the next replica goes whole
            log.warning("replication: rank %d refused rank %d's part of %r: %s",
                        to, rank, tag, reason)  # fmt: skip

    def _plan(
        self,
        tag: str,
        claims: list[FileClaim],
        small: dict[str, bytes],
        views: contextlib.ExitStack,
    ) -> dict[str, tuple[memoryview | None, FilePlan]]:
        """Each item file's bytes (mapped: lent by the slot pool where it filled them, no
        copy) and what of them crosses the wire (replica_delta.plan_file), against the
        partner's replica unless that is of this very tag (saved again: the partner
        replaces it before the new one is built)."""
        partner = self._partner
        if partner is not None and partner.tag == tag:
            partner = None
        plans: dict[str, tuple[memoryview | None, FilePlan]] = {}
        for claim in claims:
            if claim.name in small:
                continue
            view = views.enter_context(self.memory.map_read(tag, claim.name))
            leaves = self._leaves(tag, claim.name) if self._leaves is not None else None
            base = partner.files.get(claim.name) if partner is not None else None
            plans[claim.name] = (view, plan_file(view, claim, base, leaves))
        return plans

    def _payload(
        self,
        claims: list[FileClaim],
        small: dict[str, bytes],
        plans: dict[str, tuple[memoryview | None, FilePlan]],
    ) -> Iterator[memoryview]:
        """The bytes the partner does not take from its replica, file after file."""
        for claim in claims:
            if claim.name in small:
                yield memoryview(small[claim.name])
                continue
            view, plan = plans[claim.name]
            if view is None:
                continue  # an empty file
            for offset, length in new_ranges(claim.size, plan.runs):
                for at in range(offset, offset + length, self.chunk_bytes):
                    yield view[at : min(at + self.chunk_bytes, offset + length)]

    def _same_marker(self, tag: str, sent: bytes) -> bool:
        """Whether the part's marker is still the one sent."""
        try:
            return self.memory.read_bytes(tag, marker_name(self.ring.rank)) == sent
        except NebulaError:
            return False

    # receiving -------------------------------------------------------------------------
    def _receive_loop(self, source: int) -> None:
        head_raw = bytearray(HEAD_BYTES)
        head_tensor = as_tensor(head_raw)
        buffers: MessageBuffers | None = None
        try:
            while True:
                self.group.recv([head_tensor], source, DATA_TAG).wait()
                head = decode_head(head_raw)
                if head.kind == Kind.KEEPALIVE:
                    continue
                if head.kind == Kind.BYE:
                    return
                chunk = begin_chunk(head)
                if buffers is None or buffers.size != chunk:
                    buffers = MessageBuffers(chunk)
                self._receive_part(source, head, buffers)
        except Exception as exc:  # noqa: BLE001 - the link's end, reported
            self._link_failed(f"receiving from rank {source}", exc, sending=False)

    def _receive_part(self, source: int, head: Head, buffers: MessageBuffers) -> None:
        announced = receive_begin(self.group, source, DATA_TAG, head, buffers)
        begin: Begin | None = None
        reason: str | None = None
        if isinstance(announced, WireError):
            reason = str(announced)
        elif announced.rank != source:
            reason = f"rank {source} announced rank {announced.rank}'s part"
        else:
            begin = announced
        inbox = None
        if begin is not None:
            try:
                root = replica_root(self.memory, begin.rank)
            except NebulaError as exc:
                reason = f"no folder for it: {exc}"
            else:
                own = OwnParts(self.memory, self.ring.rank)
                inbox = ReplicaInbox(root, **begin.replica(), own=own, pause=QUIET.pause_point)
        try:
            drop: Callable[[memoryview], None] = lambda _piece: None  # noqa: E731
            receive_stream(
                self.group, source, DATA_TAG, head.payload, buffers, inbox.feed if inbox else drop
            )
            end = receive_head(self.group, source, DATA_TAG)
            if end.kind != Kind.END or end.transfer != head.transfer:
                raise WireError(f"a {end.kind.name} frame where transfer {head.transfer} ends")
        except BaseException:
            if inbox is not None:
                inbox.abandon()  # the link failed mid-replica: no half replica stays
            raise
        if inbox is not None and end.status == Status.ABANDONED:
            outcome = inbox.withdraw()
        elif inbox is not None:
            outcome = inbox.finish(sender_ok=end.status == Status.OK)
        else:
            log.warning("replication: a replica from rank %d refused: %s", source, reason)
            outcome = Outcome("?", source, committed=False, reason=reason)
        if outcome.committed:
            with self._cond:
                self._update(kept={**self._state.kept, outcome.rank: outcome.tag})
                self._cond.notify_all()
        self._answer(source, head.transfer, outcome)

    def _answer(self, source: int, transfer: int, outcome: Outcome) -> None:
        reason = (outcome.reason or "").encode()[:MAX_REASON_BYTES]
        status = Status.OK if outcome.committed else Status.FAILED
        if outcome.withdrawn:
            status, reason = Status.ABANDONED, b""
        head = bytearray(encode_head(Head(Kind.ACK, transfer, status, body=len(reason))))
        self.group.send([as_tensor(head)], source, ACK_TAG).wait()
        if reason:
            text = bytearray(reason)
            self.group.send([as_tensor(text)], source, ACK_TAG).wait()
