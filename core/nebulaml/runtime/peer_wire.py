"""The messages of replication between nodes (replication.py), as bytes: pure functions,
no I/O.

Every message is one point-to-point send on nebula's process group (peers.py). A frame
starts with a head of `HEAD_BYTES` bytes (`Head`, checked by its own xxh3); the frames a
sender sends to one receiver, in order:

    BEGIN      a replica follows: `body` bytes of announcement (JSON: the tag, the rank
               and node whose part it is, each file's name, size and checksum, in the
               order their bytes follow, and, for a replica built on one the receiver
               holds, that one's tag, `base`, and the runs (offset, length) of each item
               to take from it, `reuse`; `body_check`, its xxh3), then `payload` bytes:
               the files' bytes not taken from the base, one file after the other, both
               cut into messages of at most `chunk` bytes (`pieces`)
    END        the files are all sent; `status` OK, FAILED: the sender could not read
               one whole (zeros were sent in its place, to keep the stream's length), or
               ABANDONED: the sender gave the replica up (its part was saved again
               meanwhile: the bytes sent are not that part's)
    KEEPALIVE  nothing to send for a while: the link is alive (gloo closes a connection
               whose operation waits longer than the group's timeout)
    BYE        the sender closes: the receiver ends

and back, on another tag, after each replica: ACK, `status` OK (committed), FAILED
(refused) or ABANDONED (dropped, as its sender asked), with a `body` of at most
`MAX_REASON_BYTES` saying why it was refused.

    encode_head, decode_head      a head to bytes and back (`WireError`: not one)
    encode_begin, decode_begin    a BEGIN's announcement
    pieces                        the sizes of the messages of `total` bytes

May import: `nebulaml.format` and protocol/replicas.py (`FileClaim`). Not for: sending
(replication.py), or checking the files received (protocol/replica_inbox.py).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Any

import xxhash

from nebulaml.format.jsonbounds import MAX_MANIFEST_BYTES, JsonBoundsError, load_json
from nebulaml.protocol.replicas import FileClaim

HEAD_BYTES = 64
MAGIC = b"NBRP"
VERSION = 2  # 2: replicas built on the one the receiver holds (`base`, `reuse`)
MAX_CHUNK_BYTES = 64 << 20  # what a receiver accepts as a sender's message size
MAX_REASON_BYTES = 4096
# magic, version, kind, status, transfer, chunk, body, payload, body_check; then padding,
# and the head's own xxh3 in its last 8 bytes.
_HEAD = struct.Struct("<4sBBHQQQQQ")
_CHECKED = HEAD_BYTES - 8


class Kind(IntEnum):
    BEGIN = 1
    END = 2
    KEEPALIVE = 3
    BYE = 4
    ACK = 5


class Status(IntEnum):
    OK = 0  # END: every file was read whole; ACK: the replica is committed
    FAILED = 1  # END: a file could not be read; ACK: the replica was refused
    ABANDONED = 2  # END: the sender gave the replica up; ACK: it was dropped, as asked


class WireError(ValueError):
    """Bytes that are not what the protocol sends: the stream cannot be trusted after them."""


@dataclass(frozen=True, slots=True)
class Head:
    """The head of a frame (see the module's docstring).

    Example:
        >>> head = Head(Kind.BEGIN, transfer=3, chunk=4096, body=10, payload=99)
        >>> decode_head(encode_head(head)) == head
        True
    """

    kind: Kind
    transfer: int = 0
    status: Status = Status.OK
    chunk: int = 0
    body: int = 0
    payload: int = 0
    body_check: int = 0


@dataclass(frozen=True, slots=True)
class Begin:
    """A BEGIN's announcement: rank `rank` (of node `node`) sends its part of `tag`; with
    `base`, built on the receiver's replica of that tag: `reuse[name]`, the runs (offset,
    length) of item `name` taken from it."""

    tag: str
    rank: int
    node: int
    files: tuple[FileClaim, ...]
    base: str | None = None
    reuse: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)

    def replica(self) -> dict[str, Any]:
        """What it announces, as protocol/replica_inbox.py's `ReplicaInbox` takes it
        (its keyword arguments: tag, rank, node, files, base, reuse).

        Example:
            >>> sorted(Begin("global_step2", 1, 1, (), "global_step1").replica())
            ['base', 'files', 'node', 'rank', 'reuse', 'tag']
        """
        return {f.name: getattr(self, f.name) for f in fields(self)}


def body_check(body: bytes | bytearray | memoryview) -> int:
    """The xxh3-64 of a frame's body, as its head carries it."""
    return xxhash.xxh3_64_intdigest(body)


def encode_head(head: Head) -> bytes:
    """`head` as `HEAD_BYTES` bytes, sealed with its own checksum."""
    fields = _HEAD.pack(
        MAGIC, VERSION, int(head.kind), int(head.status), head.transfer, head.chunk,
        head.body, head.payload, head.body_check,
    )  # fmt: skip
    data = fields.ljust(_CHECKED, b"\0")
    return data + xxhash.xxh3_64_intdigest(data).to_bytes(8, "little")


def decode_head(data: bytes | bytearray | memoryview) -> Head:
    """The head in `data`; `WireError` when it is not one this nebula sends (another
    version, a damaged head).

    Example:
        >>> damaged = bytearray(encode_head(Head(Kind.BYE)))
        >>> damaged[9] ^= 1
        >>> decode_head(damaged)
        Traceback (most recent call last):
        ...
        nebulaml.runtime.peer_wire.WireError: a damaged frame head
    """
    raw = bytes(data)
    if len(raw) != HEAD_BYTES:
        raise WireError(f"a frame head of {len(raw)} bytes")
    if int.from_bytes(raw[_CHECKED:], "little") != xxhash.xxh3_64_intdigest(raw[:_CHECKED]):
        raise WireError("a damaged frame head")
    magic, version, kind, status, transfer, chunk, body, payload, check = _HEAD.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        raise WireError(f"a frame of another protocol ({magic!r}, version {version})")
    try:
        return Head(Kind(kind), transfer, Status(status), chunk, body, payload, check)
    except ValueError as exc:
        raise WireError(f"a frame of unknown kind or status ({kind}, {status})") from exc


def encode_begin(
    tag: str,
    rank: int,
    node: int,
    files: Sequence[FileClaim],
    base: str | None = None,
    reuse: Mapping[str, Sequence[tuple[int, int]]] | None = None,
) -> bytes:
    """A BEGIN's body.

    Example:
        >>> claim = FileClaim(".rank-0.json", 2, "xxh3_64_tree_1m", "ab")
        >>> decode_begin(encode_begin("global_step1", 0, 1, [claim])).files == (claim,)
        True
        >>> begin = decode_begin(encode_begin("s2", 0, 1, [claim], "s1", {"m": [(0, 9)]}))
        >>> begin.base, begin.reuse
        ('s1', {'m': ((0, 9),)})
    """
    doc: dict[str, object] = {
        "tag": tag, "rank": rank, "node": node, "files": [c.to_json() for c in files]
    }  # fmt: skip
    if base is not None:
        doc["base"] = base
        doc["reuse"] = {name: [list(run) for run in runs] for name, runs in (reuse or {}).items()}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def decode_begin(body: bytes | bytearray | memoryview) -> Begin:
    """A BEGIN's body; `WireError` when it is not one. Whether the files it announces can
    be a replica is protocol/replicas.py's question (`check_claims`)."""
    try:
        doc = load_json(bytes(body), max_bytes=MAX_MANIFEST_BYTES)
    except JsonBoundsError as exc:
        raise WireError(f"an announcement that is {exc}") from exc
    try:
        files = tuple(
            FileClaim(name, size, algo, checksum) for name, size, algo, checksum in doc["files"]
        )
        reuse = {
            name: tuple((offset, length) for offset, length in runs)
            for name, runs in doc.get("reuse", {}).items()
        }
        begin = Begin(doc["tag"], doc["rank"], doc["node"], files, doc.get("base"), reuse)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise WireError(f"a malformed announcement ({exc})") from exc
    texts = [begin.tag] + [f for c in files for f in (c.name, c.algo, c.checksum)]
    texts += ([] if begin.base is None else [begin.base]) + list(reuse)
    numbers = [begin.rank, begin.node] + [c.size for c in files]
    numbers += [n for runs in reuse.values() for run in runs for n in run]
    if not all(isinstance(t, str) for t in texts) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers
    ):
        raise WireError("an announcement with a field of the wrong type")
    return begin


def pieces(total: int, chunk: int) -> Iterator[int]:
    """The sizes of the messages that carry `total` bytes, `chunk` at most each.

    Example:
        >>> list(pieces(10, 4)), list(pieces(0, 4))
        ([4, 4, 2], [])
    """
    if chunk < 1:
        raise WireError(f"a message size of {chunk} bytes")
    for offset in range(0, total, chunk):
        yield min(chunk, total - offset)
