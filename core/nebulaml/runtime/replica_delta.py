"""What of a replica crosses the wire: only the bytes of each item that differ from the
replica the partner holds already, found by digest, without reading the partner's bytes.

    FileDigests   an item file as the sender last sent it: its size, checksum, the digest
                  of each 1 MiB piece and the 16 KiB blocks' digests of each piece
    PartnerCopy   what the partner holds of this rank: the tag of its newest whole
                  replica, and the digests of its item files
    FilePlan      one item file's plan: the runs the partner takes from its replica,
                  the file's digests for the next plan
    plan_file     compare an item's bytes with what the partner holds
    new_ranges    the ranges of a file that are not taken from the partner's replica

**The evidence.** An item's checksum (`CHECKSUM_ALGO`) is the xxh3 of the digests of its
1 MiB pieces (its leaves), and a save hashes each piece as it copies it into its buffer;
a storage that buffer still holds unchanged is not hashed again, its leaves kept
(runtime/unchanged.py). So the sender takes the leaves of the save (slots'
`leaves_of`), checks them against the checksum the part's marker records (they are the
item's, or they are not used), and reads no piece whose leaf equals the one it sent last
time: a frozen base model is neither read nor sent. A piece whose leaf differs is read,
checked against its leaf, and compared in 16 KiB blocks (xxh3-128, as a persist compares
with the previous version: protocol/reuse.py), so that a small tensor that changed
(a LoRA adapter among frozen weights) costs its blocks, not its piece. Without the save's
leaves (none given, or not matching), the file is hashed here first (two threads).

**What the partner holds.** The sender remembers the digests of the replica the partner
last committed (`PartnerCopy`, kept by replication.py); the partner keeps its newest whole
replica until a newer one is whole (protocol/replicas.py). The partner builds the new
replica's files from that replica's bytes (the runs) and the bytes sent, and checks every
file whole against the checksum announced, so a base that is not what the sender thinks
(a flipped byte in the partner's memory, another replica) never commits: the replica is
refused, and the sender sends the next one whole.

May import: `nebulaml.errors`, `nebulaml.format`, protocol/replicas.py (`FileClaim`) and
protocol/replica_inbox.py (`MAX_RUNS`). Not for: sending (replication.py), the frames
(peer_wire.py), or building and checking the replica (protocol/replica_inbox.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from nebulaml.errors import NebulaError
from nebulaml.format.checksum import (
    CHECKSUM_ALGO,
    LEAF_BYTES,
    compare_pieces,
    leaf_digest,
    tree_hexdigest,
    tree_leaves,
)
from nebulaml.protocol.replica_inbox import MAX_RUNS
from nebulaml.protocol.replicas import FileClaim

Run = tuple[int, int]  # (offset, length): bytes taken from the partner's replica


class ChangedError(NebulaError):
    """An item's bytes in the memory tier are not those its marker records (changed since
    its save: the tag saved again, its buffer reused): nothing of it is sent."""


@dataclass(frozen=True, slots=True)
class FileDigests:
    """An item file as the sender sent it: `leaves`, each 1 MiB piece's digest; `blocks`,
    each piece's 16 KiB blocks' digests (concatenated), None where not hashed."""

    size: int
    checksum: str
    leaves: tuple[bytes, ...]
    blocks: tuple[bytes | None, ...]


@dataclass(frozen=True, slots=True)
class PartnerCopy:
    """The newest whole replica of this rank's part the partner holds, as sent: its tag
    and (created_at) order, and its item files' digests by name."""

    tag: str
    created_at: str
    files: dict[str, FileDigests]


@dataclass(frozen=True, slots=True)
class FilePlan:
    """One item file: `runs` taken from the partner's replica, in order; the rest is sent.
    `digests`: the file's, for the next plan (None: a checksum without pieces)."""

    runs: tuple[Run, ...]
    digests: FileDigests | None

    def sent_bytes(self, size: int) -> int:
        return size - sum(length for _, length in self.runs)


def plan_file(
    view: memoryview | None,
    claim: FileClaim,
    base: FileDigests | None,
    leaves: Sequence[bytes] | None = None,
    *,
    max_runs: int = MAX_RUNS,
) -> FilePlan:
    """What of the item `claim` (its bytes: `view`, None when empty) crosses the wire,
    given what the partner holds of that file (`base`) and the save's leaves (`leaves`,
    used only if they make the checksum of `claim`). `ChangedError` when the bytes read
    are not those of `claim`. More than `max_runs` runs: the file is sent whole.

    Example:
        >>> from nebulaml.format.checksum import BLOCK_BYTES
        >>> old = bytes(3 << 20)
        >>> new = bytearray(old); new[(1 << 20) + 5] = 1              # one byte of piece 1
        >>> first = plan_file(memoryview(old), _claim(old), None)
        >>> first.runs, len(first.digests.blocks)
        ((), 3)
        >>> second = plan_file(memoryview(new), _claim(bytes(new)), first.digests)
        >>> second.sent_bytes(len(new)) == BLOCK_BYTES              # one block of piece 1
        True
    """
    size = claim.size
    if claim.algo != CHECKSUM_ALGO:
        return FilePlan((), None)  # a legacy checksum has no pieces to compare
    data = memoryview(b"") if view is None else view
    if len(data) != size:
        raise ChangedError(f"{claim.name}: {len(data)} bytes, not {size} as its marker says")
    count = -(-size // LEAF_BYTES)
    checked = leaves is not None and len(leaves) == count
    if checked and tree_hexdigest(list(leaves or ())) != claim.checksum:
        checked = False  # not this item's: hashed here instead
    found = list(leaves) if checked and leaves is not None else tree_leaves(data)
    if not checked and tree_hexdigest(found) != claim.checksum:
        raise ChangedError(f"{claim.name}: its bytes are not what its marker records")
    if base is not None and (base.size != size or len(base.leaves) != count):
        base = None

    def check(i: int, piece: memoryview, leaf: bytes) -> None:
        if checked and leaf_digest(piece) != leaf:
            raise ChangedError(f"{claim.name}: changed since its save (piece {i})")

    older = None if base is None else (base.leaves, base.blocks)
    ranges, blocks = compare_pieces(data, found, older, check)
    runs = [(offset, length) for offset, length, same in ranges if same]
    if len(runs) > max_runs:
        runs = []
    return FilePlan(tuple(runs), FileDigests(size, claim.checksum, tuple(found), tuple(blocks)))


def new_ranges(size: int, runs: Sequence[Run]) -> Iterator[Run]:
    """The (offset, length) ranges of a file of `size` bytes outside `runs`, in order.

    Example:
        >>> list(new_ranges(10, [(2, 3), (7, 3)]))
        [(0, 2), (5, 2)]
    """
    at = 0
    for offset, length in runs:
        if offset > at:
            yield at, offset - at
        at = offset + length
    if at < size:
        yield at, size - at


def _claim(data: bytes) -> FileClaim:
    """A claim of item "model" for `data` (the doctests')."""
    from nebulaml.format.checksum import checksum_of

    return FileClaim("model", len(data), CHECKSUM_ALGO, checksum_of(data))
