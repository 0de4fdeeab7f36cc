"""A stream of bytes between two ranks on nebula's group: cut into messages of at most
one buffer's size (peer_wire.pieces), two buffers, one message in flight while the next
is filled (sending) or taken (receiving). Replication (replication.py) and the restart's
recovery (peer_recovery.py) send their parts so.

    MessageBuffers  two buffers of one size, each with a tensor on its memory
    as_tensor       a tensor on a bytearray's memory (a head, an answer)
    send_stream     send `total` bytes taken from an iterator of views
    receive_stream  receive `total` bytes, each message handed to `take`

May import: torch, and runtime.peer_wire. Not for: the frames (peer_wire.py), or what the
bytes are and where they come from or go (replication.py, peer_recovery.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from nebulaml.runtime.peer_wire import pieces


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
