"""An S3 object written range by range: the ranges equal to an earlier object of the same
root are copied by the server (UploadPartCopy), the others uploaded, in one multipart
upload that appears whole when completed.

    lay_out_parts  the parts of the new object, from its ranges, under S3's rules
    write_parts    upload them (UploadPartCopy for a part taken from the earlier object,
                   UploadPart for the others), several in flight, then complete the upload

Which ranges equal the earlier object is the caller's knowledge (protocol/reuse.py compares
digests). S3's rules shape the parts: every part but the last is at least 5 MiB, a copy
part at most 5 GiB, an upload at most 10,000 parts. So an unchanged run too short to be a
part of its own is uploaded with its changed neighbours, and a changed run too short to be
a part takes bytes from an unchanged neighbour (which are sent, not copied) until it is 5
MiB: a changed tensor alone among unchanged ones costs 5 MiB on the wire, whatever its
size; changed tensors that sit together share their parts (an item file lays out its
small records after its large ones, format/torchzip.py, so that a LoRA adapter's records
are one run at the file's end, where the last part may be as short as it is).

Every copy names the earlier object's ETag (`CopySourceIfMatch`), so a server that honours
the condition (S3, MinIO) never copies from an object rewritten since its version was
recorded; before the first copy the object's ETag is also asked (`HeadObject` with
`If-Match`), for servers that ignore the copy's condition (moto's). Anything that goes
wrong with the earlier object (gone, changed, a server without UploadPartCopy) is said in
a debug line, and its ranges are uploaded instead: the write is whole either way. Each
request is retried as the root's retry policy says; a write that fails aborts its
multipart upload, so no part of it is ever an object.

Not for: which ranges are equal (protocol/reuse.py), objects written as a stream (s3.py's
`Upload`, through s3fs). May import: `nebulaml.errors` and storage/'s backend.py, retry.py
(s3.py imports this module, never the other way).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from nebulaml.storage.backend import Written
from nebulaml.storage.retry import RetryPolicy, all_or_cancel, call_async

log = logging.getLogger("nebulaml")

MiB = 1 << 20
# S3's limits of a multipart upload.
MIN_PART_BYTES = 5 * MiB  # every part but the last
MAX_PART_BYTES = 5 << 30  # a part, uploaded or copied
MAX_PARTS = 10_000
# The parts nebula asks for: uploads of 8 to 16 MiB (several in flight, each retried
# alone), copies of at most 64 MiB (the server copies them; each request stays short).
UPLOAD_PART_BYTES = 8 * MiB
COPY_PART_BYTES = 64 * MiB
# Parts in flight at once.
CONCURRENCY = 8


@dataclass(frozen=True, slots=True)
class Part:
    """One part of a new object: bytes [offset, offset + length), copied from the earlier
    object (`copy`) or uploaded."""

    offset: int
    length: int
    copy: bool


def lay_out_parts(
    ranges: Iterable[tuple[int, int, bool]],
    *,
    min_bytes: int = MIN_PART_BYTES,
    upload_bytes: int = UPLOAD_PART_BYTES,
    copy_bytes: int = COPY_PART_BYTES,
    max_parts: int = MAX_PARTS,
) -> list[Part]:
    """The parts of an object written from `ranges` ((offset, length, equal to the earlier
    object), in file order, covering it): each part but the last at least `min_bytes`,
    copy parts at most `copy_bytes`, at most `max_parts` parts, a copy part only where
    every byte is equal. An unchanged run shorter than `min_bytes` is uploaded (the last
    run of the file excepted: the last part may be short); a changed run shorter than
    `min_bytes` is widened into its unchanged neighbours (the previous one first, or the
    file's last run where that costs less: the part is then the last), taking a whole
    neighbour where what it would keep is too short. Changed runs are uploaded in
    parts of `upload_bytes` to twice that. Over `max_parts`, the shortest unchanged runs
    are uploaded instead and the parts grow.

    Example:
        >>> M = 1 << 20
        >>> def show(ranges, **kw):
        ...     return [(p.offset // M, p.length // M, p.copy) for p in lay_out_parts(ranges, **kw)]
        >>> show([(0, 20 * M, True), (20 * M, 1 * M, False), (21 * M, 20 * M, True)])
        [(0, 16, True), (16, 5, False), (21, 20, True)]
        >>> show([(0, 3 * M, True), (3 * M, 10 * M, False)])   # too short to be copied
        [(0, 13, False)]
        >>> show([(0, 20 * M, True), (20 * M, 2 * M, False)])  # the last part may be short
        [(0, 20, True), (20, 2, False)]
    """
    if not (min_bytes <= upload_bytes and 2 * min_bytes <= copy_bytes <= MAX_PART_BYTES):
        raise ValueError(f"part sizes out of order: {min_bytes}, {upload_bytes}, {copy_bytes}")
    runs = _joined([(o, n, c) for o, n, c in ranges if n > 0])
    shortest = min_bytes  # unchanged runs shorter than this (but the last) are uploaded
    while True:
        spans = _widened(_joined(_short_copies_uploaded(runs, shortest)), min_bytes)
        parts = [p for span in spans for p in _split(span, upload_bytes, copy_bytes)]
        if len(parts) <= max_parts:
            return parts
        shortest *= 2
        upload_bytes *= 2
        copy_bytes = min(2 * copy_bytes, MAX_PART_BYTES)


def _joined(runs: Sequence[tuple[int, int, bool]]) -> list[tuple[int, int, bool]]:
    """`runs` with neighbours of one kind joined."""
    out: list[tuple[int, int, bool]] = []
    for offset, length, copy in runs:
        if out and out[-1][2] == copy and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + length, copy)
        else:
            out.append((offset, length, copy))
    return out


def _short_copies_uploaded(
    runs: list[tuple[int, int, bool]], shortest: int
) -> list[tuple[int, int, bool]]:
    """Unchanged runs shorter than `shortest` made uploads, but the last run of all."""
    last = len(runs) - 1
    return [(o, n, c and (n >= shortest or i == last)) for i, (o, n, c) in enumerate(runs)]


def _widened(spans: list[tuple[int, int, bool]], min_bytes: int) -> list[tuple[int, int, bool]]:
    """`spans` (joined: kinds alternate) with every upload but the last at least
    `min_bytes`, the bytes taken from the unchanged spans beside it: the whole of the
    next one when it is the last span of all and shorter than what is missing (the upload
    is then the last part, which may be short), else from the previous
    one while it keeps `min_bytes`, else from the next one while it keeps `min_bytes` (or
    anything, the last span of all), else the next one is uploaded whole."""
    todo = [list(s) for s in spans]
    out: list[list[Any]] = []
    i = 0
    while i < len(todo):
        offset, length, copy = todo[i]
        if copy:
            if length:
                out.append([offset, length, True])
            i += 1
            continue
        while length < min_bytes and i + 1 < len(todo):
            need = min_bytes - length
            prev = out[-1] if out and out[-1][2] else None
            spare = prev[1] - min_bytes if prev is not None else 0
            after = todo[i + 1]  # an unchanged span
            last = i + 2 == len(todo)
            if last and after[1] < need:
                length += after[1]  # the file's last span uploaded: this is the last part
                i += 1
                break
            if prev is not None and spare >= need:
                prev[1] -= need
                offset, length = offset - need, length + need
                break
            if (after[1] if last else after[1] - min_bytes) >= need:
                after[0], after[1] = after[0] + need, after[1] - need
                length += need
                break
            if prev is not None and spare > 0:
                prev[1] -= spare
                offset, length = offset - spare, length + spare
            length += after[1]  # the next unchanged span is uploaded, and what follows it
            i += 1
            if i + 1 < len(todo):
                length += todo[i + 1][1]
                i += 1
        out.append([offset, length, False])
        i += 1
    return [(o, n, c) for o, n, c in out]


def _split(span: tuple[int, int, bool], upload_bytes: int, copy_bytes: int) -> list[Part]:
    """One span in parts: copies of at most `copy_bytes` (at least half of it when there
    are several), uploads of `upload_bytes` to twice that (one part when shorter)."""
    offset, length, copy = span
    count = -(-length // copy_bytes) if copy else max(1, length // upload_bytes)
    base, extra = divmod(length, count)
    parts, at = [], offset
    for k in range(count):
        n = base + (1 if k < extra else 0)
        parts.append(Part(at, n, copy))
        at += n
    return parts


class _Copying:
    """One object's parts being written: counts, and whether the earlier object still
    serves (the first failure of a copy stops them, said once in a debug line)."""

    def __init__(self, source: dict[str, str] | None, stamp: str | None, what: str) -> None:
        self.source = source
        self.stamp = stamp
        self.what = what
        self.written = 0
        self.reused = 0

    def give_up(self, why: str) -> None:
        if self.source is not None:
            log.debug(
                "%s: unchanged ranges could not be copied from the previous version (%s); "
                "uploading them instead",
                self.what,
                why,
            )
            self.source = None


def write_parts(
    fs: Any,
    path: str,
    view: memoryview,
    ranges: Iterable[tuple[int, int, bool]],
    base: str | None,
    base_stamp: str | None,
    *,
    policy: RetryPolicy,
    what: str,
    describe: Callable[[BaseException], str],
    sent: Callable[[int], None] | None = None,
    concurrency: int = CONCURRENCY,
) -> Written:
    """Write `view` as the object `path` (`bucket/key`) of the s3fs filesystem `fs`: the
    ranges (offset, length, equal) marked equal copied from the object `base` (same
    offsets) while it is still the version `base_stamp` (its ETag), the others, and any
    the server will not copy, uploaded from `view`. The object appears (or changes) whole
    when its multipart upload completes, at the end; nothing is committed if this raises
    (the upload is aborted). An object under 5 MiB, or one with nothing to copy that fits
    one part, is one PutObject. Returns (bytes uploaded, bytes copied from `base`, the
    new object's ETag); `sent(n)` is called on fsspec's event loop as each part of `n`
    bytes is written. Without `base_stamp` nothing is copied: an object whose version is
    not known may have been rewritten since its digests were recorded."""
    from fsspec.asyn import sync

    bucket, key = path.split("/", 1)
    plan = list(ranges)
    take = (
        base is not None
        and base_stamp is not None
        and len(view) >= MIN_PART_BYTES
        and any(equal for *_, equal in plan)
    )

    async def write() -> Written:
        await fs.set_session()
        client = await fs.get_s3(bucket)
        copying = _Copying(None, base_stamp, what)
        if take and base is not None:
            source_bucket, source_key = base.split("/", 1)
            copying.source = {"Bucket": source_bucket, "Key": source_key}

            async def head() -> Any:
                return await client.head_object(
                    Bucket=source_bucket, Key=source_key, IfMatch=base_stamp
                )

            try:  # a server that ignores the copies' condition still finds a rewrite here
                await call_async(head, policy, what, describe=describe)
            except Exception as exc:  # noqa: BLE001 (gone, changed, refused: upload)
                copying.give_up(describe(exc))
        parts = lay_out_parts(plan if copying.source is not None else [(0, len(view), False)])
        if len(parts) <= 1 and not any(p.copy for p in parts):
            etag = await _put_whole(client, bucket, key, view, policy, what, describe)
            if sent is not None and len(view):
                sent(len(view))
            return Written(len(view), 0, etag)

        async def create() -> Any:
            return await client.create_multipart_upload(Bucket=bucket, Key=key)

        upload_id = (await call_async(create, policy, what, describe=describe))["UploadId"]
        target = {"Bucket": bucket, "Key": key, "UploadId": upload_id}
        try:
            done: list[dict[str, Any]] = [{} for _ in parts]
            gate = asyncio.Semaphore(concurrency)

            async def one(number: int, part: Part) -> None:
                async with gate:
                    etag = await _write_part(
                        client, target, number, part, view, copying, policy, describe
                    )
                done[number - 1] = {"PartNumber": number, "ETag": etag}
                if sent is not None:
                    sent(part.length)

            await all_or_cancel([one(n, p) for n, p in enumerate(parts, start=1)])

            async def complete() -> Any:
                return await client.complete_multipart_upload(
                    **target, MultipartUpload={"Parts": done}
                )

            answer = await call_async(complete, policy, what, describe=describe)
        except BaseException:
            await _abort(client, target, policy, what, describe)
            raise
        return Written(copying.written, copying.reused, _etag(answer))

    async def wrapper() -> Written:
        return await write()

    result: Written = sync(fs.loop, wrapper)
    return result


async def _write_part(
    client: Any,
    target: dict[str, str],
    number: int,
    part: Part,
    view: memoryview,
    copying: _Copying,
    policy: RetryPolicy,
    describe: Callable[[BaseException], str],
) -> str:
    """Write one part: copied from the earlier object while it serves, else uploaded; its
    ETag."""
    start, end = part.offset, part.offset + part.length
    source = copying.source
    if part.copy and source is not None and copying.stamp is not None:
        stamp = copying.stamp

        async def copy() -> Any:
            return await client.upload_part_copy(
                **target,
                PartNumber=number,
                CopySource=source,
                CopySourceRange=f"bytes={start}-{end - 1}",
                CopySourceIfMatch=stamp,
            )

        try:
            answer = await call_async(copy, policy, copying.what, describe=describe)
        except Exception as exc:  # noqa: BLE001 (anything: the part is uploaded instead)
            copying.give_up(describe(exc))
        else:
            copying.reused += part.length
            return str(answer["CopyPartResult"]["ETag"])

    async def upload() -> Any:
        return await client.upload_part(**target, PartNumber=number, Body=bytes(view[start:end]))

    answer = await call_async(upload, policy, copying.what, describe=describe)
    copying.written += part.length
    return str(answer["ETag"])


async def _put_whole(
    client: Any,
    bucket: str,
    key: str,
    view: memoryview,
    policy: RetryPolicy,
    what: str,
    describe: Callable[[BaseException], str],
) -> str | None:
    """An object of one part, in one PutObject; its ETag."""
    data = bytes(view)

    async def once() -> Any:
        return await client.put_object(Bucket=bucket, Key=key, Body=data)

    return _etag(await call_async(once, policy, what, describe=describe))


async def _abort(
    client: Any,
    target: dict[str, str],
    policy: RetryPolicy,
    what: str,
    describe: Callable[[BaseException], str],
) -> None:
    """Abort a multipart upload (its parts are dropped, no object appears); a failure to
    abort is logged, never raised over the write's own error (S3 drops an upload left
    behind by a bucket's lifecycle rule only)."""

    async def once() -> Any:
        return await client.abort_multipart_upload(**target)

    try:
        await asyncio.shield(call_async(once, policy, what, describe=describe))
    except Exception as exc:  # noqa: BLE001 (the write's error is what the caller hears)
        log.warning("%s: the failed upload could not be aborted (%s)", what, describe(exc))


def _etag(answer: Any) -> str | None:
    etag = answer.get("ETag") if isinstance(answer, dict) else None
    return etag if isinstance(etag, str) and etag else None
