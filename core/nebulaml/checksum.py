"""Streaming checksums of item bytes, computed while the bytes are written or read.

xxh3-64 runs at memory speed, so hashing during the copy costs little and needs no second
pass over the data. Not for: cryptographic integrity (a checksum detects accidents, not
attackers; the loader's weights_only rule is what keeps hostile pickles inert).
"""

from __future__ import annotations

from typing import BinaryIO

import xxhash

from .errors import CorruptCheckpointError
from .manifest import CHECKSUM_ALGO, ItemEntry


def new_hasher() -> xxhash.xxh3_64:
    """A fresh streaming hasher for `CHECKSUM_ALGO`."""
    return xxhash.xxh3_64()


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


def hash_stream(stream: BinaryIO, chunk_bytes: int = 8 << 20) -> tuple[int, str]:
    """Read `stream` to its end; return (size in bytes, hex checksum)."""
    hasher = new_hasher()
    size = 0
    while chunk := stream.read(chunk_bytes):
        hasher.update(chunk)
        size += len(chunk)
    return size, hasher.hexdigest()


def verify_bytes(where: str, entry: ItemEntry, data: bytes | memoryview) -> None:
    """Check an item's bytes against its manifest entry before anything unpickles them;
    a mismatch raises `CorruptCheckpointError` naming `where`."""
    hasher = new_hasher()
    hasher.update(data)
    actual = hasher.hexdigest()
    if len(data) != entry.size_bytes or actual != entry.checksum:
        raise CorruptCheckpointError(
            where,
            f"{entry.size_bytes} bytes with {entry.checksum_algo} {entry.checksum}",
            f"{len(data)} bytes with {entry.checksum_algo} {actual}",
        )
