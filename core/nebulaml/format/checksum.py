"""Checksums of item bytes, computed while the bytes are copied, written or read.

An item's checksum (`CHECKSUM_ALGO`, "xxh3_64_tree_1m") is the xxh3-64 of the
concatenated xxh3-64 digests (8 bytes each, big-endian, as `digest()` gives them) of the
file's 1 MiB pieces, in order; the last piece may be shorter, and an empty file has no
piece. Each piece hashes on its own, so every thread of a fill hashes the pieces it has
just copied while they are still in its cache, and a load verifies with several threads:
1.5 GB on 2 cores fills in 0.12 s instead of 0.145 s with plain xxh3 (whose single stream
one thread must hash in order) and verifies in 0.04 s instead of 0.07 s. Items written
before it carry plain xxh3-64 (`LEGACY_CHECKSUM_ALGO`) and still verify.

xxh3 runs at memory speed and releases the GIL on large inputs. This module names the
algorithms (`CHECKSUM_ALGO`, `KNOWN_CHECKSUM_ALGOS`: the manifest records them) and
computes them over bytes, streams and pieces.

May import: `nebulaml.errors` only (the manifest imports from here, never the other way).
Not for: checking bytes against a manifest entry (`verify_bytes`, manifest.py), or
cryptographic integrity (a checksum detects accidents, not attackers; the loader's
weights_only rule is what keeps hostile pickles inert).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

import xxhash

from nebulaml._threads import start as start_thread
from nebulaml.errors import InvalidArgumentError

# Item files: xxh3-64 over the xxh3-64 digests of their 1 MiB pieces, so that several
# threads hash one file. Items written before it carry LEGACY_CHECKSUM_ALGO, plain xxh3-64
# over the file, and still verify. (A manifest seals itself with plain xxh3: manifest.py.)
CHECKSUM_ALGO = "xxh3_64_tree_1m"
LEGACY_CHECKSUM_ALGO = "xxh3_64"
KNOWN_CHECKSUM_ALGOS = (CHECKSUM_ALGO, LEGACY_CHECKSUM_ALGO)

LEAF_BYTES = 1 << 20  # the "1m" of CHECKSUM_ALGO: never change it, define a new algo
HASH_WORKERS = 2  # threads that verify one buffer
_PARALLEL_FROM_BYTES = 16 << 20  # below this, a thread costs more than it saves
PAUSE_PIECES = 8  # tree_leaves' `pause` comes before every 8 pieces (8 MiB)
_LEGACY_CHUNK_BYTES = 16 << 20  # xxhash releases the GIL per call: keep calls long
# What a persist compares with the version before it, inside a piece whose leaf changed
# (protocol/reuse.py): blocks this small, so that a small tensor that changed costs its
# own bytes and little more; xxh3-128, so that equal digests stand for equal bytes.
BLOCK_BYTES = 16 << 10
BLOCK_DIGEST_BYTES = 16


class TreeHasher:
    """A streaming hasher for `CHECKSUM_ALGO`: feed it the file's bytes in any pieces.

    Example:
        >>> data = bytes(range(256)) * 10_000
        >>> h = TreeHasher()
        >>> h.update(data[:1000]); h.update(data[1000:])
        >>> h.hexdigest() == checksum_of(data)
        True
    """

    def __init__(self) -> None:
        self._top = xxhash.xxh3_64()
        self._leaf = xxhash.xxh3_64()
        self._filled = 0  # bytes of the current piece in `_leaf`

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        pos = 0
        while pos < len(view):
            n = min(LEAF_BYTES - self._filled, len(view) - pos)
            if n == LEAF_BYTES:  # a whole piece: hashed at once, no copy into the stream
                self._top.update(xxhash.xxh3_64_digest(view[pos : pos + n]))
            else:
                self._leaf.update(view[pos : pos + n])
                self._filled += n
                if self._filled == LEAF_BYTES:
                    self._top.update(self._leaf.digest())
                    self._leaf.reset()
                    self._filled = 0
            pos += n

    def hexdigest(self) -> str:
        top = self._top.copy()
        if self._filled:
            top.update(self._leaf.digest())
        return top.hexdigest()


def unknown_algo(algo: str) -> str:
    """How an error names a checksum algorithm this nebula does not know."""
    return f"a checksum algorithm this nebula does not know ({algo!r})"


def new_hasher(algo: str = CHECKSUM_ALGO) -> Any:
    """A fresh streaming hasher (`update`, `hexdigest`) for `algo`, one of
    `KNOWN_CHECKSUM_ALGOS`; `InvalidArgumentError` (a ValueError) for any other, such as
    one a newer nebula wrote."""
    if algo == CHECKSUM_ALGO:
        return TreeHasher()
    if algo == LEGACY_CHECKSUM_ALGO:
        return xxhash.xxh3_64()
    raise InvalidArgumentError(unknown_algo(algo))


def leaf_digest(piece: bytes | bytearray | memoryview) -> bytes:
    """The digest of one piece of at most `LEAF_BYTES` (see `tree_hexdigest`)."""
    return xxhash.xxh3_64_digest(piece)


def leaf_hasher(head: bytes | bytearray | memoryview) -> Any:
    """A streaming hasher of one piece fed its first bytes `head`: `update` it with the
    rest, and its `digest()` is the piece's `leaf_digest`; `copy()` keeps the state over
    `head` (a fill hashes a piece whose head it did not write from there: snapshot.py).

    Example:
        >>> piece = bytes(range(256)) * 100
        >>> hasher = leaf_hasher(piece[:1000])
        >>> hasher.update(piece[1000:])
        >>> hasher.digest() == leaf_digest(piece)
        True
    """
    return xxhash.xxh3_64(head)


def tree_hexdigest(leaves: Sequence[bytes]) -> str:
    """`CHECKSUM_ALGO` of a file from the `leaf_digest` of each of its pieces, in order."""
    return xxhash.xxh3_64_hexdigest(b"".join(leaves))


def checksum_of(
    data: bytes | bytearray | memoryview, algo: str = CHECKSUM_ALGO, workers: int = HASH_WORKERS
) -> str:
    """The checksum of `data` under `algo`, the pieces of `CHECKSUM_ALGO` hashed by
    `workers` threads (this one included) when `data` is large.

    Example:
        >>> checksum_of(b"") == TreeHasher().hexdigest()
        True
    """
    view = memoryview(data).cast("B")
    if algo != CHECKSUM_ALGO:
        hasher = new_hasher(algo)
        for offset in range(0, len(view), _LEGACY_CHUNK_BYTES):
            hasher.update(view[offset : offset + _LEGACY_CHUNK_BYTES])
        return str(hasher.hexdigest())
    return tree_hexdigest(tree_leaves(view, workers))


def tree_leaves(
    data: bytes | bytearray | memoryview,
    workers: int = HASH_WORKERS,
    pause: Callable[[], None] | None = None,
) -> list[bytes]:
    """The `leaf_digest` of each `LEAF_BYTES` piece of `data` (which starts on a piece
    boundary of its file), hashed by `workers` threads (this one included) when `data` is
    large; `pause()`, if given, is called by each before every `PAUSE_PIECES` pieces (a
    persist's hash waits there while a save runs)."""
    view = memoryview(data).cast("B")
    count = -(-len(view) // LEAF_BYTES)
    leaves = [b""] * count
    workers = max(1, min(workers, len(view) // _PARALLEL_FROM_BYTES))

    def hash_range(first: int, last: int) -> None:
        for i in range(first, last):
            if pause is not None and (i - first) % PAUSE_PIECES == 0:
                pause()
            leaves[i] = xxhash.xxh3_64_digest(view[i * LEAF_BYTES : (i + 1) * LEAF_BYTES])

    bounds = [count * k // workers for k in range(workers + 1)]
    helpers = [
        threading.Thread(target=hash_range, args=(bounds[k], bounds[k + 1]), daemon=True)
        for k in range(1, workers)
    ]
    for helper in helpers:
        start_thread(helper)
    try:
        hash_range(bounds[0], bounds[1])
    finally:
        for helper in helpers:
            helper.join()
    return leaves


def block_digests(piece: bytes | bytearray | memoryview) -> bytes:
    """The xxh3-128 digests of each `BLOCK_BYTES` block of `piece` (the last may be
    shorter), concatenated: `BLOCK_DIGEST_BYTES` per block.

    Example:
        >>> digests = block_digests(bytes(BLOCK_BYTES) + b"x")
        >>> len(digests) == 2 * BLOCK_DIGEST_BYTES, digests[:16] == digests[16:]
        (True, False)
    """
    view = memoryview(piece).cast("B")
    digest = xxhash.xxh3_128_digest
    return b"".join(digest(view[at : at + BLOCK_BYTES]) for at in range(0, len(view), BLOCK_BYTES))


Range = tuple[int, int, bool]  # (offset, length, the same bytes as in the older version)


def compare_pieces(
    data: memoryview,
    leaves: Sequence[bytes],
    base: tuple[Sequence[bytes], Sequence[bytes | None]] | None,
    check: Callable[[int, memoryview, bytes], None] | None = None,
    pause: Callable[[], None] | None = None,
) -> tuple[list[Range], list[bytes | None]]:
    """Which bytes of `data` (its pieces' `leaves`) are those of an older version of the
    same size (`base`: its leaves and each piece's `block_digests`, None where not
    hashed): a piece whose leaf is the older one's is the same whole, without reading it;
    another is compared in `BLOCK_BYTES` blocks. Returns the ranges, each of one kind,
    merged, and the blocks' digests of each piece (the older version's where the piece
    is the same). `check(i, piece, leaf)` runs on each piece read, first (it may raise);
    `pause()`, if given, before every `PAUSE_PIECES` pieces (as `tree_leaves`').

    Example:
        >>> old = bytes(2 << 20)
        >>> new = bytearray(old); new[5] = 1                      # one byte of piece 0
        >>> base = (tree_leaves(old), [block_digests(old[:LEAF_BYTES]), None])
        >>> ranges, blocks = compare_pieces(memoryview(new), tree_leaves(new), base)
        >>> ranges == [(0, BLOCK_BYTES, False), (BLOCK_BYTES, (2 << 20) - BLOCK_BYTES, True)]
        True
    """
    ranges: list[Range] = []
    blocks: list[bytes | None] = []

    def add(offset: int, length: int, same: bool) -> None:
        if ranges and ranges[-1][2] == same and ranges[-1][0] + ranges[-1][1] == offset:
            last = ranges.pop()
            ranges.append((last[0], last[1] + length, same))
        else:
            ranges.append((offset, length, same))

    for i, leaf in enumerate(leaves):
        if pause is not None and i % PAUSE_PIECES == 0:
            pause()
        start = i * LEAF_BYTES
        piece = data[start : start + LEAF_BYTES]
        if base is not None and base[0][i] == leaf:
            add(start, len(piece), True)
            blocks.append(base[1][i])
            continue
        if check is not None:
            check(i, piece, leaf)
        digests = block_digests(piece)
        blocks.append(digests)
        older = base[1][i] if base is not None else None
        if older is None or len(older) != len(digests):
            add(start, len(piece), False)
            continue
        for k in range(0, len(digests), BLOCK_DIGEST_BYTES):
            at = k // BLOCK_DIGEST_BYTES * BLOCK_BYTES
            same = digests[k : k + BLOCK_DIGEST_BYTES] == older[k : k + BLOCK_DIGEST_BYTES]
            add(start + at, min(BLOCK_BYTES, len(piece) - at), same)
    return ranges, blocks


class HashingWriter:
    """A write-only file wrapper that counts and hashes every byte on its way through.

    Example:
        >>> import io
        >>> w = HashingWriter(io.BytesIO())
        >>> w.write(b"abc")
        3
        >>> w.size_bytes, len(w.hexdigest())
        (3, 16)
    """

    algo = CHECKSUM_ALGO

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._hasher = new_hasher()
        self.size_bytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self._hasher.update(data)
        self._raw.write(data)
        n = memoryview(data).nbytes
        self.size_bytes += n
        return n

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


def hash_stream(
    stream: BinaryIO,
    chunk_bytes: int = 8 << 20,
    algo: str = CHECKSUM_ALGO,
    advance: Callable[[int], None] | None = None,
) -> tuple[int, str]:
    """Read `stream` to its end; return (size in bytes, hex checksum under `algo`).
    `advance(n)` is called with the size of each chunk read (progress)."""
    hasher = new_hasher(algo)
    size = 0
    while chunk := stream.read(chunk_bytes):
        hasher.update(chunk)
        size += len(chunk)
        if advance is not None:
            advance(len(chunk))
    return size, hasher.hexdigest()
