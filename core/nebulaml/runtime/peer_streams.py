"""A stream of bytes between two ranks on nebula's group: cut into messages of at most
one buffer's size (peer_wire.pieces), two buffers, one message in flight while the next
is filled (sending) or taken (receiving). Replication (replication.py) and the restart's
recovery (peer_recovery.py) send their parts so.

    MessageBuffers  two buffers of one size, each with a tensor on its memory
    as_tensor       a tensor on a bytearray's memory (a head, an answer)
    send_stream     send `total` bytes taken from an iterator of views
    receive_stream  receive `total` bytes, each message handed to `take`
    send_head       one frame's head; `receive_head`: the next one, decoded
    send_begin      a BEGIN head and its announcement (the files and their claims);
                    `receive_begin`: the announcement after a BEGIN head, checked;
                    `begin_chunk`: the message size a BEGIN head announces, checked

May import: torch, `nebulaml.format`, and runtime.peer_wire. Not for: the frames' bytes
(peer_wire.py), or what the bytes are and where they come from or go (replication.py,
peer_recovery.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from nebulaml.format.jsonbounds import MAX_MANIFEST_BYTES
from nebulaml.runtime.peer_wire import (
    HEAD_BYTES,
    MAX_CHUNK_BYTES,
    Begin,
    Head,
    Kind,
    WireError,
    body_check,
    decode_begin,
    decode_head,
    encode_head,
    pieces,
)


class MessageBuffers:
    """Two message buffers of `size` bytes, each with a tensor on its memory.

    Example:
        >>> buffers = MessageBuffers(4)
        >>> buffers.size, len(buffers.raw), buffers.tensors[0].numel()
        (4, 2, 4)
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.raw = [bytearray(size), bytearray(size)]
        self.tensors = [as_tensor(raw) for raw in self.raw]


def as_tensor(data: bytearray) -> torch.Tensor:
    """A uint8 tensor on `data`'s memory: what the group sends from, or receives into.

    Example:
        >>> raw = bytearray(3)
        >>> as_tensor(raw).fill_(7) is not None, bytes(raw)
        (True, b'\\x07\\x07\\x07')
    """
    return torch.frombuffer(data, dtype=torch.uint8)


def send_stream(
    group: Any,
    to: int,
    tag: int,
    data: Iterator[memoryview],
    total: int,
    buffers: MessageBuffers,
    *,
    before: Callable[[], None] | None = None,
    edit: Callable[[int, memoryview], None] | None = None,
) -> None:
    """Send `total` bytes taken from `data` to rank `to` on `group` (point-to-point `tag`),
    in messages of `buffers.size` bytes, one buffer in flight while the other fills.
    `before` runs before each message is filled (a hold renewed); `edit(index, message)`
    may change a message before it goes (a test's damage in transit)."""
    works: list[Any] = [None, None]
    which = 0
    piece = memoryview(b"")
    for index, size in enumerate(pieces(total, buffers.size)):
        if works[which] is not None:
            works[which].wait()
        if before is not None:
            before()
        raw = memoryview(buffers.raw[which])
        filled = 0
        while filled < size:
            if not piece:
                piece = next(data)
            n = min(len(piece), size - filled)
            raw[filled : filled + n] = piece[:n]
            piece = piece[n:]
            filled += n
        if edit is not None:
            edit(index, raw[:size])
        works[which] = group.send([buffers.tensors[which][:size]], to, tag)
        which = 1 - which
    for work in works:
        if work is not None:
            work.wait()


def receive_stream(
    group: Any,
    source: int,
    tag: int,
    total: int,
    buffers: MessageBuffers,
    take: Callable[[memoryview], None],
) -> None:
    """Receive `total` bytes from rank `source` on `group` (point-to-point `tag`) in
    messages of `buffers.size` bytes, one landing while the one before it is taken
    (`take`, given a view of it, valid until it returns)."""
    sizes = list(pieces(total, buffers.size))
    works: list[Any] = [None, None]

    def post(i: int) -> None:
        if i < len(sizes):
            which = i % 2
            works[which] = group.recv([buffers.tensors[which][: sizes[i]]], source, tag)

    post(0)
    for i, size in enumerate(sizes):
        post(i + 1)
        which = i % 2
        works[which].wait()
        take(memoryview(buffers.raw[which])[:size])
        works[which] = None


def send_head(group: Any, to: int, tag: int, head: Head) -> None:
    """Send one frame's head to rank `to` (point-to-point `tag`) and wait until it left."""
    data = bytearray(encode_head(head))
    group.send([as_tensor(data)], to, tag).wait()


def receive_head(group: Any, source: int, tag: int) -> Head:
    """The next frame's head from rank `source` (point-to-point `tag`); `WireError` when
    it is not one."""
    raw = bytearray(HEAD_BYTES)
    group.recv([as_tensor(raw)], source, tag).wait()
    return decode_head(raw)


def send_begin(
    group: Any,
    to: int,
    tag: int,
    transfer: int,
    body: bytes,
    payload: int,
    buffers: MessageBuffers,
) -> None:
    """Begin transfer `transfer` to rank `to`: its BEGIN head (the announcement's length
    and check, the `payload` bytes that follow it), then the announcement `body`
    (peer_wire.encode_begin's)."""
    send_head(
        group, to, tag, Head(Kind.BEGIN, transfer, chunk=buffers.size, body=len(body),
                             payload=payload, body_check=body_check(body))
    )  # fmt: skip
    send_stream(group, to, tag, iter([memoryview(body)]), len(body), buffers)


def begin_chunk(head: Head) -> int:
    """The message size a BEGIN `head` announces, the size of the buffers to take its
    transfer in; `WireError` when it is no BEGIN, or announces a size no receiver takes
    (the stream cannot go on).

    Example:
        >>> begin_chunk(Head(Kind.BEGIN, 1, chunk=4 << 20))
        4194304
    """
    if head.kind != Kind.BEGIN or not 0 < head.chunk <= MAX_CHUNK_BYTES:
        raise WireError(f"a {head.kind.name} frame where a transfer begins")
    return head.chunk


def receive_begin(
    group: Any, source: int, tag: int, head: Head, buffers: MessageBuffers
) -> Begin | WireError:
    """The announcement that follows the BEGIN `head` from rank `source`, decoded; a
    `WireError` (returned, not raised: the payload still follows, and is taken) when it
    arrived damaged, too long, or is none. A head that is no BEGIN, or announces a
    message size no receiver takes, raises `WireError` (`begin_chunk`): the stream cannot
    go on."""
    begin_chunk(head)
    if head.body > MAX_MANIFEST_BYTES:
        receive_stream(group, source, tag, head.body, buffers, lambda _piece: None)
        return WireError(f"an announcement of {head.body} bytes")
    body = bytearray()
    receive_stream(group, source, tag, head.body, buffers, body.extend)
    if body_check(body) != head.body_check:
        return WireError("its announcement arrived damaged")
    try:
        return decode_begin(body)
    except WireError as exc:
        return exc
