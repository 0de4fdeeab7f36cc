"""An Azure blob written range by range: the ranges equal to an earlier blob of the same
root are staged from it by the service, the others uploaded, and the block list committed.

    lay_out       the blocks of the new blob, from its ranges
    write_ranges  stage them (Put Block From URL for a range taken from the earlier blob,
                  Put Block for the others), several in flight, then Put Block List

Which ranges equal the earlier blob is the caller's knowledge (protocol/reuse.py compares
digests); here each range becomes blocks of its own kind, so the blocks of a new version
follow its ranges: a run of unchanged 16 KiB blocks (whole 1 MiB pieces where they are
equal) is staged from the earlier blob in blocks of at most `COPY_BLOCK_BYTES`, each
changed run uploaded in blocks that end at multiples of the root's block size (so a
version with nothing to reuse is laid out as any upload is). A blob has at most 50,000
blocks: past that, the shortest unchanged runs are uploaded instead.

The service reads the earlier blob by URL with this root's own credential: a read-only
SAS for that one blob signed with the account key (a connection string or an account key),
the root's SAS token, or a bearer token of its token credential. A staged block is a copy
of the bytes, not a reference: deleting the earlier blob later never changes the new one.
Every staging from the earlier blob requires it to be the very blob the caller names by
ETag (`If-Match`), so a blob rewritten since its version was recorded is never read.
Anything that goes wrong with the earlier blob (no credential that can sign for it, gone,
changed, the service or emulator without Put Block From URL, a SAS refused) is said in a
debug line, and its ranges are uploaded instead: the write is whole either way.

Not for: which ranges are equal (protocol/reuse.py), or blobs written as a stream
(azure.py's `BlockWriter`). May import: `nebulaml.errors`, `nebulaml.format` and storage/'s
backend.py, redaction.py, retry.py (azure.py imports this module, never the other way).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from nebulaml.errors import NebulaError
from nebulaml.format.checksum import BLOCK_BYTES
from nebulaml.storage.backend import Written
from nebulaml.storage.redaction import redact
from nebulaml.storage.retry import RetryPolicy, all_or_cancel, call_async

log = logging.getLogger("nebulaml")

# Azure allows 50,000 blocks per blob.
MAX_BLOCKS = 50_000
# A block staged from the earlier blob: the service copies it, so one request may be
# large (the service takes up to 4000 MiB; 64 MiB keeps each request short, and several
# in flight).
COPY_BLOCK_BYTES = 64 << 20
# How long the SAS that lets the service read the earlier blob is valid (a write that
# takes longer uploads what is left instead), and how far back it starts (clock skew).
_SAS_VALID = timedelta(hours=1)
_SAS_SKEW = timedelta(minutes=15)
_TOKEN_SCOPE = "https://storage.azure.com/.default"


@dataclass(frozen=True, slots=True)
class Block:
    """One block of a new blob: bytes [offset, offset + length), staged from the earlier
    blob (`copy`) or uploaded."""

    offset: int
    length: int
    copy: bool


def lay_out(
    ranges: Iterable[tuple[int, int, bool]],
    *,
    upload_bytes: int,
    copy_bytes: int = COPY_BLOCK_BYTES,
    max_blocks: int = MAX_BLOCKS,
) -> list[Block]:
    """The blocks of a blob written from `ranges` ((offset, length, equal to the earlier
    blob), in file order): each unchanged run copied in blocks of at most `copy_bytes`,
    each changed run uploaded in blocks cut at multiples of `upload_bytes`. Over
    `max_blocks`, the shortest unchanged runs are uploaded instead (then, if need be, the
    upload blocks grow).

    Example:
        >>> M = 1 << 20
        >>> [(b.offset // M, b.length // M, b.copy)
        ...  for b in lay_out([(0, 3 * M, True), (3 * M, 5 * M, False)], upload_bytes=4 * M)]
        [(0, 3, True), (3, 1, False), (4, 4, False)]
        >>> len(lay_out([(0, 3 * M, True), (3 * M, 5 * M, False)], upload_bytes=4 * M,
        ...             max_blocks=2))
        2
    """
    runs = [(offset, length, copy) for offset, length, copy in ranges if length > 0]
    longest_copy = max((length for _, length, copy in runs if copy), default=0)
    shortest = 0  # unchanged runs shorter than this are uploaded
    while True:
        blocks: list[Block] = []
        for offset, length, copy in _merged(runs, shortest):
            end = offset + length
            if copy:
                blocks.extend(
                    Block(at, min(copy_bytes, end - at), True)
                    for at in range(offset, end, copy_bytes)
                )
                continue
            at = offset
            while at < end:
                cut = min(end, (at // upload_bytes + 1) * upload_bytes)
                blocks.append(Block(at, cut - at, False))
                at = cut
        if len(blocks) <= max_blocks:
            return blocks
        if shortest <= longest_copy:
            shortest = max(2 * shortest, 4 * BLOCK_BYTES)
        else:
            upload_bytes *= 2


def run_on_loop(fs: Any, coro: Awaitable[Any]) -> Any:
    """Run `coro` on the event loop of the adlfs filesystem `fs` and return its result
    (this thread waits)."""
    from fsspec.asyn import sync

    async def wrapper() -> Any:
        return await coro

    return sync(fs.loop, wrapper)


def _merged(runs: Sequence[tuple[int, int, bool]], shortest: int) -> list[tuple[int, int, bool]]:
    """`runs` with unchanged runs shorter than `shortest` made uploads, neighbours of one
    kind joined."""
    out: list[tuple[int, int, bool]] = []
    for offset, length, copy in runs:
        copy = copy and length >= shortest
        if out and out[-1][2] == copy and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + length, copy)
        else:
            out.append((offset, length, copy))
    return out


class _NotStaged(NebulaError):
    """The service answered that it does not stage blocks from a URL (HTTP 501: an
    emulator without Put Block From URL): no retry changes that."""


@dataclass(frozen=True, slots=True)
class _Source:
    """How the service reads the earlier blob: its URL (with a SAS where one is used),
    a bearer token for `x-ms-copy-source-authorization` otherwise, and the secret in
    either (masked in every message)."""

    url: str
    bearer: str | None
    secret: str


async def _source_of(fs: Any, container: str, blob: str) -> _Source | None:
    """The way this root's credential lets the service read `blob`; None if it has none
    (anonymous access)."""
    service = fs.service_client
    async with service.get_blob_client(container, blob) as client:
        url = str(client.url)
    if "?" in url:  # the client's own SAS, in its account URL
        return _Source(url, None, url.split("?", 1)[1])
    credential = service.credential
    name = getattr(credential, "account_name", None)
    key = getattr(credential, "account_key", None)
    if isinstance(name, str) and isinstance(key, str) and key:
        from azure.storage.blob import BlobSasPermissions, generate_blob_sas

        now = datetime.now(timezone.utc)
        sas = generate_blob_sas(
            name,
            container,
            blob,
            account_key=key,
            permission=BlobSasPermissions(read=True),
            start=now - _SAS_SKEW,
            expiry=now + _SAS_VALID,
        )
        return _Source(f"{url}?{sas}", None, sas)
    signature = getattr(credential, "signature", None)  # an AzureSasCredential
    if isinstance(signature, str) and signature.strip("?"):
        sas = signature.lstrip("?")
        return _Source(f"{url}?{sas}", None, sas)
    get_token = getattr(credential, "get_token", None)
    if get_token is not None:
        token = (await get_token(_TOKEN_SCOPE)).token
        return _Source(url, f"Bearer {token}", token)
    return None


class _Staging:
    """One blob's blocks being staged: counts, and whether the earlier blob still serves."""

    def __init__(self, source: _Source | None, stamp: str | None, what: str) -> None:
        self.source = source
        self.stamp = stamp
        self.what = what
        self.written = 0
        self.reused = 0

    def give_up(self, why: str) -> None:
        """Stop taking ranges from the earlier blob (said once, in a debug line)."""
        if self.source is not None:
            log.debug(
                "%s: unchanged ranges could not be staged from the previous version "
                "(%s); uploading them instead",
                self.what,
                redact(why, (self.source.secret,)),
            )
            self.source = None


def write_ranges(
    fs: Any,
    path: str,
    view: memoryview,
    ranges: Iterable[tuple[int, int, bool]],
    base: str | None,
    base_stamp: str | None,
    *,
    block_bytes: int,
    concurrency: int,
    policy: RetryPolicy,
    what: str,
    describe: Callable[[BaseException], str],
    sent: Callable[[int], None] | None = None,
) -> Written:
    """Write `view` as the blob at `path`: each range (offset, length, equal) with
    `equal` set is staged from the blob `base` (same offsets), which must still be the
    version `base_stamp` (its ETag); the others, and any range the service will not stage
    from `base`, are uploaded from `view`. The blob appears (or changes) whole when its
    block list is committed, at the end; nothing is committed if this raises. Returns
    (bytes uploaded, bytes staged from `base`, the new blob's ETag). `sent(n)` is called
    on fsspec's event loop as each block of `n` bytes is staged."""
    container, blob, _ = fs.split_path(path)
    plan = list(ranges)
    take = base is not None and base_stamp is not None and any(equal for *_, equal in plan)
    if not take:
        plan = [(0, len(view), False)] if len(view) else []
    blocks = lay_out(plan, upload_bytes=block_bytes)

    async def write() -> Written:
        staging = _Staging(None, base_stamp, what)
        if take and base is not None:
            source_container, source_blob, _ = fs.split_path(base)
            try:
                staging.source = await _source_of(fs, source_container, source_blob)
            except Exception as exc:  # noqa: BLE001 (any failure: upload instead)
                log.debug("%s: no way to read the previous version (%s)", what, describe(exc))
            if staging.source is None:
                log.debug("%s: nothing signs a read of the previous version; uploading", what)
        async with fs.service_client.get_blob_client(container, blob) as client:
            if len(blocks) <= 1 and not any(b.copy for b in blocks):
                etag = await _upload_whole(client, view, policy, what, describe)
                staging.written = len(view)
                if sent is not None and len(view):
                    sent(len(view))
                return Written(staging.written, 0, etag)
            ids = [uuid.uuid4().hex for _ in blocks]  # every ID of a blob has one length
            gate = asyncio.Semaphore(concurrency)

            async def one(block_id: str, block: Block) -> None:
                async with gate:
                    await _stage(client, block_id, block, view, staging, policy, describe)
                if sent is not None:
                    sent(block.length)

            await all_or_cancel([one(i, b) for i, b in zip(ids, blocks, strict=True)])
            etag = await _commit(client, ids, policy, what, describe)
        return Written(staging.written, staging.reused, etag)

    result: Written = run_on_loop(fs, write())
    return result


async def _stage(
    client: Any,
    block_id: str,
    block: Block,
    view: memoryview,
    staging: _Staging,
    policy: RetryPolicy,
    describe: Callable[[BaseException], str],
) -> None:
    """Stage one block: from the earlier blob while it serves, else uploaded."""
    start, end = block.offset, block.offset + block.length
    source = staging.source
    if block.copy and source is not None:
        from azure.core.exceptions import HttpResponseError

        try:
            from azure.storage.blob._generated.models import SourceModifiedAccessConditions

            condition: Any = SourceModifiedAccessConditions(source_if_match=staging.stamp)
        except ImportError:  # an SDK that moved it: no copy without the condition
            staging.give_up("this azure-storage-blob has no source conditions")
        else:

            async def copy() -> None:
                try:
                    await client.stage_block_from_url(
                        block_id,
                        source.url,
                        source_offset=start,
                        source_length=block.length,
                        source_authorization=source.bearer,
                        source_modified_access_conditions=condition,
                    )
                except HttpResponseError as exc:
                    if exc.status_code == 501:
                        raise _NotStaged(describe(exc)) from None
                    raise

            try:
                await call_async(copy, policy, staging.what, describe=describe)
            except Exception as exc:  # noqa: BLE001 (anything: the block is uploaded instead)
                staging.give_up(str(exc) if isinstance(exc, _NotStaged) else describe(exc))
            else:
                staging.reused += block.length
                return

    async def upload() -> None:
        await client.stage_block(block_id, view[start:end], length=block.length)

    await call_async(upload, policy, staging.what, describe=describe)
    staging.written += block.length


async def _upload_whole(
    client: Any,
    view: memoryview,
    policy: RetryPolicy,
    what: str,
    describe: Callable[[BaseException], str],
) -> str | None:
    """A blob of at most one block, in one request; its ETag."""
    data = bytes(view)

    async def once() -> Any:
        return await client.upload_blob(
            data, overwrite=True, metadata={"is_directory": "false"}, max_concurrency=1
        )

    answer = await call_async(once, policy, what, describe=describe)
    return _etag(answer)


async def _commit(
    client: Any,
    ids: list[str],
    policy: RetryPolicy,
    what: str,
    describe: Callable[[BaseException], str],
) -> str | None:
    """Commit the block list (the moment the blob appears, whole); its ETag. Committing
    the same list again is harmless: a retry after a lost answer is safe."""
    from azure.storage.blob import BlobBlock

    blocks = [BlobBlock(block_id) for block_id in ids]

    async def once() -> Any:
        return await client.commit_block_list(blocks, metadata={"is_directory": "false"})

    answer = await call_async(once, policy, what, describe=describe)
    return _etag(answer)


def _etag(answer: Any) -> str | None:
    etag = answer.get("etag") if isinstance(answer, dict) else None
    return etag if isinstance(etag, str) and etag else None
