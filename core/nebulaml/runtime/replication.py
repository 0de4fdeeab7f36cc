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
one not yet begun, so a slow partner costs two buffers, never a queue. The files are read
as they are when they are sent: a part evicted meanwhile goes short (its END says so) and
one whose buffers were reused for a newer save arrives changed; the partner refuses both.
The messages: peer_wire.py.

**Receiving.** One thread per rank that sends to this one (`Ring.receive_from`) takes
its frames, writes each replica into this node's memory tier as its bytes arrive, and
checks and commits it there (protocol/replicas.py: `<memory tier>/.replicas/rank-<r>/`);
then answers COMMITTED, or REFUSED with the reason (also one warning here, and one on the
sender's side).

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

May import: every layer below, and runtime's peers.py and peer_wire.py. Not for: which
ranks are partners or the process group (peers.py), the bytes of a frame (peer_wire.py),
or what makes a replica whole (protocol/replicas.py).
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
from nebulaml.protocol.replicas import FileClaim, Outcome, ReplicaInbox, part_files, replica_root
from nebulaml.runtime.peer_wire import (
    HEAD_BYTES,
    MAX_CHUNK_BYTES,
    MAX_REASON_BYTES,
    Begin,
    Head,
    Kind,
    Status,
    WireError,
    body_check,
    decode_begin,
    decode_head,
    encode_begin,
    encode_head,
    pieces,
)
from nebulaml.runtime.peers import Peers
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")

CHUNK_BYTES = 4 << 20
KEEPALIVE_S = 60.0
CLOSE_GRACE_S = 5.0
# Point-to-point tags on nebula's group: a sender's frames, the receiver's answers, and
# one nothing is ever sent on (`close` cuts a connection with a receive on it).
DATA_TAG = 1
ACK_TAG = 2
CUT_TAG = 3

# A test's hook: called with (tag, index of the message among the files' messages, its
# bytes) just before each message of a replica's files is sent; it may change the bytes
# (a copy of the files': the memory tier's are never touched).
Tamper = Callable[[str, int, memoryview], None]


@dataclass(frozen=True, slots=True)
class ReplicationStatus:
    """Where this rank's replication stands.

    `replicated`: the newest tag whose part of this rank the partner holds, verified;
    `pending`: a tag waiting to be sent; `sending`: the tag in flight; `refused`: the last
    tag the partner refused, and `last_error` why (or why the link failed); `link_down`:
    nothing more can be sent this run; `kept`: for each rank that sends to this one, the
    newest tag of its part this node holds whole.
    """

    replicated: str | None = None
    pending: str | None = None
    sending: str | None = None
    refused: str | None = None
    last_error: str | None = None
    link_down: bool = False
    kept: dict[int, str] = field(default_factory=dict)


class _Buffers:
    """Two message buffers of `size` bytes, each with a tensor on its memory."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.raw = [bytearray(size), bytearray(size)]
        self.tensors = [torch.frombuffer(raw, dtype=torch.uint8) for raw in self.raw]


class Replication:
    """This rank's side of the ring of `peers` (peers.open_ring), over the memory tier
    `memory` of this node: its parts are sent from there, and the replicas it keeps are
    written there. `start` it, `replicate` each committed tag, `close` it before the
    interpreter exits."""

    def __init__(
        self,
        peers: Peers,
        memory: Store,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        keepalive_s: float = KEEPALIVE_S,
        tamper: Tamper | None = None,
    ) -> None:
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be 1 to {MAX_CHUNK_BYTES}")
        self.ring, self.group, self.memory = peers.ring, peers.group, memory
        self.chunk_bytes = chunk_bytes
        self.keepalive_s = keepalive_s
        self._tamper = tamper
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
        """Until the partner has answered for `tag` (replicated or refused), the link is
        down, or `timeout_s` has passed; the status then."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                state = self._state
                answered = tag in (state.replicated, state.refused)
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
        buffers: _Buffers | None = None
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
                    buffers = _Buffers(self.chunk_bytes)
                self._send_part(tag, buffers)
        except Exception as exc:  # noqa: BLE001 - the link's end, reported
            self._link_failed(f"sending to rank {to}", exc, sending=True)

    def _send_head(self, head: Head) -> None:
        data = bytearray(encode_head(head))
        self.group.send(
            [torch.frombuffer(data, dtype=torch.uint8)], self.ring.send_to, DATA_TAG
        ).wait()

    def _send_part(self, tag: str, buffers: _Buffers) -> None:
        """One replica: announce, send the files, wait for the partner's answer."""
        try:
            claims, small = part_files(self.memory, tag, self.ring.rank)
        except NebulaError as exc:
            log.warning("replication: rank %d's part of %r not sent: %s", self.ring.rank, tag, exc)
            with self._cond:
                self._update(sending=None, refused=tag, last_error=str(exc))
                self._cond.notify_all()
            return
        self._transfers += 1
        transfer, to = self._transfers, self.ring.send_to
        answer = bytearray(HEAD_BYTES)
        answered = self.group.recv([torch.frombuffer(answer, dtype=torch.uint8)], to, ACK_TAG)
        body = encode_begin(tag, self.ring.rank, self.ring.node, claims)
        payload = sum(claim.size for claim in claims)
        self._send_head(
            Head(Kind.BEGIN, transfer, chunk=buffers.size, body=len(body), payload=payload,
                 body_check=body_check(body))
        )  # fmt: skip
        self._send_stream(tag, iter([memoryview(body)]), len(body), buffers, tamper=False)
        whole = [True]
        stream = self._read_files(tag, claims, small, whole)
        self._send_stream(tag, stream, payload, buffers, tamper=True)
        self._send_head(Head(Kind.END, transfer, Status.OK if whole[0] else Status.FAILED))
        answered.wait()
        head = decode_head(answer)
        if head.kind != Kind.ACK or head.transfer != transfer:
            raise WireError(f"an answer of kind {head.kind.name} for transfer {head.transfer}")
        reason = None
        if head.body:
            text = bytearray(min(head.body, MAX_REASON_BYTES))
            self.group.recv([torch.frombuffer(text, dtype=torch.uint8)], to, ACK_TAG).wait()
            reason = text.decode(errors="replace")
        with self._cond:
            if head.status == Status.OK:
                self._update(sending=None, replicated=tag)
            else:
                self._update(sending=None, refused=tag, last_error=reason)
            self._cond.notify_all()
        if head.status != Status.OK:
            log.warning("replication: rank %d refused rank %d's part of %r: %s",
                        to, self.ring.rank, tag, reason)  # fmt: skip

    def _read_files(
        self, tag: str, claims: list[FileClaim], small: dict[str, bytes], whole: list[bool]
    ) -> Iterator[memoryview]:
        """The files' bytes in order, in pieces; a file that cannot be read whole is made
        up with zeros to its announced size, and `whole[0]` set False."""
        zeros = memoryview(bytes(min(CHUNK_BYTES, self.chunk_bytes)))
        for claim in claims:
            left = claim.size
            if claim.name in small:
                yield memoryview(small[claim.name])
                continue
            try:
                with self.memory.open_read(tag, claim.name) as f:
                    while left:
                        data = f.read(min(left, self.chunk_bytes))
                        if not data:
                            break
                        left -= len(data)
                        yield memoryview(data)
            except NebulaError as exc:
                log.warning("replication: %s could not be read: %s", claim.name, exc)
            if left:
                whole[0] = False
            while left:
                piece = zeros[: min(left, len(zeros))]
                left -= len(piece)
                yield piece

    def _send_stream(
        self, tag: str, data: Iterator[memoryview], total: int, buffers: _Buffers, *, tamper: bool
    ) -> None:
        """Send `total` bytes taken from `data` as messages of `buffers.size` bytes, one
        buffer in flight while the other fills."""
        works: list[Any] = [None, None]
        which, index = 0, 0
        piece = memoryview(b"")
        for size in pieces(total, buffers.size):
            if works[which] is not None:
                works[which].wait()
            raw = memoryview(buffers.raw[which])
            filled = 0
            while filled < size:
                if not piece:
                    piece = next(data)
                n = min(len(piece), size - filled)
                raw[filled : filled + n] = piece[:n]
                piece = piece[n:]
                filled += n
            if tamper and self._tamper is not None:
                self._tamper(tag, index, raw[:size])
            message = buffers.tensors[which][:size]
            works[which] = self.group.send([message], self.ring.send_to, DATA_TAG)
            which, index = 1 - which, index + 1
        for work in works:
            if work is not None:
                work.wait()

    # receiving -------------------------------------------------------------------------
    def _receive_loop(self, source: int) -> None:
        head_raw = bytearray(HEAD_BYTES)
        head_tensor = torch.frombuffer(head_raw, dtype=torch.uint8)
        buffers: _Buffers | None = None
        try:
            while True:
                self.group.recv([head_tensor], source, DATA_TAG).wait()
                head = decode_head(head_raw)
                if head.kind == Kind.KEEPALIVE:
                    continue
                if head.kind == Kind.BYE:
                    return
                if head.kind != Kind.BEGIN or not 0 < head.chunk <= MAX_CHUNK_BYTES:
                    raise WireError(f"a {head.kind.name} frame where a replica begins")
                if buffers is None or buffers.size != head.chunk:
                    buffers = _Buffers(head.chunk)
                self._receive_part(source, head, buffers)
        except Exception as exc:  # noqa: BLE001 - the link's end, reported
            self._link_failed(f"receiving from rank {source}", exc, sending=False)

    def _receive_stream(
        self, source: int, total: int, buffers: _Buffers, take: Callable[[memoryview], None]
    ) -> None:
        """Receive `total` bytes from `source` in messages of `buffers.size` bytes, one
        message landing while the one before it is taken."""
        sizes = list(pieces(total, buffers.size))
        works: list[Any] = [None, None]

        def post(i: int) -> None:
            if i < len(sizes):
                which = i % 2
                message = buffers.tensors[which][: sizes[i]]
                works[which] = self.group.recv([message], source, DATA_TAG)

        post(0)
        for i, size in enumerate(sizes):
            post(i + 1)
            which = i % 2
            works[which].wait()
            take(memoryview(buffers.raw[which])[:size])
            works[which] = None

    def _receive_part(self, source: int, head: Head, buffers: _Buffers) -> None:
        body = bytearray()
        self._receive_stream(source, head.body, buffers, lambda piece: body.extend(piece))
        begin: Begin | None = None
        reason: str | None = None
        try:
            if body_check(body) != head.body_check:
                raise WireError("its announcement arrived damaged")
            begin = decode_begin(body)
            if begin.rank != source:
                raise WireError(f"rank {source} announced rank {begin.rank}'s part")
        except WireError as exc:
            begin, reason = None, str(exc)
        inbox = None
        if begin is not None:
            try:
                root = replica_root(self.memory, begin.rank)
            except NebulaError as exc:
                reason = f"no folder for it: {exc}"
            else:
                inbox = ReplicaInbox(
                    root, tag=begin.tag, rank=begin.rank, node=begin.node, files=begin.files
                )
        try:
            drop: Callable[[memoryview], None] = lambda _piece: None  # noqa: E731
            self._receive_stream(source, head.payload, buffers, inbox.feed if inbox else drop)
            end_raw = bytearray(HEAD_BYTES)
            end_tensor = torch.frombuffer(end_raw, dtype=torch.uint8)
            self.group.recv([end_tensor], source, DATA_TAG).wait()
            end = decode_head(end_raw)
            if end.kind != Kind.END or end.transfer != head.transfer:
                raise WireError(f"a {end.kind.name} frame where transfer {head.transfer} ends")
        except BaseException:
            if inbox is not None:
                inbox.abandon()  # the link failed mid-replica: no half replica stays
            raise
        if inbox is not None:
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
        head = bytearray(encode_head(Head(Kind.ACK, transfer, status, body=len(reason))))
        self.group.send([torch.frombuffer(head, dtype=torch.uint8)], source, ACK_TAG).wait()
        if reason:
            text = bytearray(reason)
            self.group.send([torch.frombuffer(text, dtype=torch.uint8)], source, ACK_TAG).wait()
