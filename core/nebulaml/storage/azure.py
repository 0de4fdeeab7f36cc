"""The Azure backend: a root on Azure Blob Storage or ADLS Gen2 (`az://`, `abfs://`,
`abfss://`), through adlfs and the Azure SDK's async clients.

`AzureBackend` is the fsspec backend (remote.py) with the requests nebula needs beyond
adlfs, each run on fsspec's event loop and raising the SDK's exceptions (`Store` retries
and translates them):

- `BlockWriter`: item files uploaded as blocks, several in flight while the caller keeps
  writing, each block retried on its own, committed (made visible) only when the writer
  is closed whole;
- `write_ranges`: an item file whose unchanged ranges are staged from its previous
  version's blob by the service (azure_ranges.py);
- `create_blob`: a create-only upload (one Put Blob with `If-None-Match: *`), the commit
  point of a checkpoint's manifest;
- `list_folder`: one uncached listing request, no existence probes;
- `ensure_container`: the root's container, created when missing.

`open_azure` is its factory, registered for `az://`, `abfs://` and `abfss://`
(builtins.py): an atomic create, object appends and server-side range copies.

Not for: credentials, the adlfs filesystem and its options (azure_auth.py opens it), or
what every fsspec store shares (remote.py). May import: `nebulaml.errors`,
`nebulaml.format` and storage/'s azure_auth.py, azure_ranges.py, backend.py, remote.py,
retry.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from nebulaml.storage import azure_auth, azure_ranges
from nebulaml.storage.azure_ranges import MAX_BLOCKS
from nebulaml.storage.azure_ranges import run_on_loop as _run
from nebulaml.storage.backend import Capabilities, OpenRequest, Parts, Written
from nebulaml.storage.remote import RemoteBackend
from nebulaml.storage.retry import RetryPolicy, call_async

# One Put Blob with If-None-Match: *; appends as blobs; Put Block From URL for ranges.
AZURE_CAPABILITIES = Capabilities(atomic_create=True, object_appends=True, range_copy=True)


def ensure_container(fs: Any, container: str) -> None:
    """Create `container` unless it exists. A credential that may not create containers
    (a container-scoped SAS) is no error here: the container must exist already, and
    the first write says so if it does not."""
    from azure.core.exceptions import HttpResponseError, ResourceExistsError

    async def create() -> None:
        try:
            await fs.service_client.get_container_client(container).create_container()
        except ResourceExistsError:
            return
        except HttpResponseError as exc:
            if exc.status_code == 403:
                return
            raise

    _run(fs, create())


def create_blob(fs: Any, path: str, data: bytes, *, overwrite: bool) -> None:
    """Upload a small blob in one request; create-only unless `overwrite` (the service
    refuses with 409 if it exists: `FileExistsError`)."""
    from azure.core.exceptions import ResourceExistsError

    container, blob, _ = fs.split_path(path)

    async def upload() -> None:
        async with fs.service_client.get_blob_client(container, blob) as client:
            try:
                await client.upload_blob(
                    data,
                    overwrite=overwrite,
                    metadata={"is_directory": "false"},
                    max_concurrency=1,
                )
            except ResourceExistsError as exc:
                raise FileExistsError(path) from exc

    _run(fs, upload())


def list_folder(fs: Any, path: str, name_prefix: str = "") -> list[dict[str, Any]]:
    """The files and folders directly under `path` (those whose names begin with
    `name_prefix`: the service filters them), as fsspec `ls(detail=True)` entries (name,
    type, size), in one listing request per 5,000 entries; never cached. A missing
    container or an empty prefix is an empty list."""
    from azure.core.exceptions import ResourceNotFoundError
    from azure.storage.blob.aio import BlobPrefix

    container, prefix, _ = fs.split_path(path)
    prefix = (f"{prefix.strip('/')}/" if prefix.strip("/") else "") + name_prefix

    async def walk() -> list[dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        try:
            async with fs.service_client.get_container_client(container) as client:
                async for item in client.walk_blobs(
                    name_starts_with=prefix, delimiter="/", include=["metadata"]
                ):
                    name = f"{container}/{item.name.rstrip('/')}"
                    metadata = {
                        k.lower(): v for k, v in (getattr(item, "metadata", None) or {}).items()
                    }
                    folder = isinstance(item, BlobPrefix) or metadata.get("hdi_isfolder") == "true"
                    if folder:
                        found[name] = {"name": name, "type": "directory", "size": 0}
                    elif name not in found:
                        found[name] = {"name": name, "type": "file", "size": int(item.size or 0)}
        except ResourceNotFoundError:
            return []
        return list(found.values())

    return _run(fs, walk())


def list_file_names(fs: Any, path: str) -> list[str]:
    """The names of the blobs directly under `path`, without their properties: the
    service's names-only listing, a fraction of `list_folder`'s time for a folder of
    many files (0.13-0.24 s against 0.55-0.62 s for 1,000 on Azurite). A missing
    container or an empty prefix is an empty list."""
    from azure.core.exceptions import ResourceNotFoundError

    container, prefix, _ = fs.split_path(path)
    prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""

    async def names() -> list[str]:
        try:
            async with fs.service_client.get_container_client(container) as client:
                found = [name async for name in client.list_blob_names(name_starts_with=prefix)]
        except ResourceNotFoundError:
            return []
        return [rest for name in found if (rest := name[len(prefix) :]) and "/" not in rest]

    return _run(fs, names())


class BlockWriter:
    """A write-only file that uploads an Azure block blob while it is being written.

    Writes fill blocks of `block_bytes`; each full block is staged in the background on
    fsspec's event loop, `concurrency` at most in flight (the writer waits for the oldest
    beyond that, so memory stays at about `block_bytes * concurrency`). Each block is
    retried on its own under `policy`. `close()` stages the rest, waits, and commits the
    block list: only then does the blob exist (or change). `abort()` commits nothing. A
    file that fits in one block goes up in one request instead.

    `bytes` given to `write` are kept without a copy until uploaded (they cannot
    change); other buffers are copied once. `on_sent(n)`, when set, is called as each
    block's upload completes (on the event loop's thread), with its size: progress that
    tracks bytes at the service, not bytes handed to the writer.
    """

    def __init__(
        self,
        fs: Any,
        path: str,
        *,
        block_bytes: int,
        concurrency: int,
        policy: RetryPolicy,
        what: str,
        describe: Any = str,
    ) -> None:
        self._fs = fs
        self._container, self._blob, _ = fs.split_path(path)
        self._block_bytes = block_bytes
        self._grow_at = MAX_BLOCKS // 2  # the block size grows for huge items (>400 GB)
        self._concurrency = concurrency
        self._policy = policy
        self._what = what
        self._describe = describe
        self._pieces: deque[memoryview] = deque()
        self._buffered = 0
        self._ids: list[str] = []
        self._inflight: deque[concurrent.futures.Future[None]] = deque()
        self.on_sent: Callable[[int], None] | None = None
        self.closed = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data if isinstance(data, bytes) else bytes(memoryview(data).cast("B")))
        n = view.nbytes
        if n:
            self._pieces.append(view)
            self._buffered += n
        while self._buffered >= self._block_bytes:
            self._stage(self._take(self._block_bytes))
            if len(self._ids) >= self._grow_at:  # stay under 50,000 blocks per blob
                self._block_bytes *= 2
                self._grow_at += (MAX_BLOCKS - self._grow_at) // 2
        return n

    def flush(self) -> None:
        """Blocks go out as they fill; there is nothing to flush early."""

    def _take(self, n: int) -> bytes | memoryview:
        """The next `n` buffered bytes (a view of one piece when they lie in one)."""
        first = self._pieces[0]
        if first.nbytes >= n:
            block = first[:n]
            if first.nbytes == n:
                self._pieces.popleft()
            else:
                self._pieces[0] = first[n:]
            self._buffered -= n
            return block
        parts, need = [], n
        while need:
            piece = self._pieces[0]
            if piece.nbytes <= need:
                parts.append(self._pieces.popleft())
                need -= piece.nbytes
            else:
                parts.append(piece[:need])
                self._pieces[0] = piece[need:]
                need = 0
        self._buffered -= n
        return b"".join(parts)

    def _stage(self, block: bytes | memoryview) -> None:
        while len(self._inflight) >= self._concurrency:
            self._inflight.popleft().result()  # raises the block's error
        block_id = uuid.uuid4().hex  # every ID of a blob has the same length
        self._ids.append(block_id)
        self._inflight.append(
            asyncio.run_coroutine_threadsafe(self._stage_block(block_id, block), self._fs.loop)
        )

    async def _stage_block(self, block_id: str, block: bytes | memoryview) -> None:
        async def once() -> None:
            async with self._fs.service_client.get_blob_client(
                self._container, self._blob
            ) as client:
                await client.stage_block(block_id, block, length=len(block))

        await call_async(once, self._policy, self._what, describe=self._describe)
        if self.on_sent is not None:
            self.on_sent(len(block))  # before the block's future is done: in order

    def close(self) -> None:
        """Upload what is left and commit the blob (the moment it appears)."""
        if self.closed:
            return
        try:
            if not self._ids:
                self._upload_whole(self._take(self._buffered) if self._buffered else b"")
            else:
                if self._buffered:
                    self._stage(self._take(self._buffered))
                while self._inflight:
                    self._inflight.popleft().result()
                self._commit()
        except BaseException:
            self.abort()
            raise
        self.closed = True

    def _upload_whole(self, data: bytes | memoryview) -> None:
        async def once() -> None:
            async with self._fs.service_client.get_blob_client(
                self._container, self._blob
            ) as client:
                await client.upload_blob(
                    bytes(data),
                    overwrite=True,
                    metadata={"is_directory": "false"},
                    max_concurrency=1,
                )

        async def upload() -> None:
            await call_async(once, self._policy, self._what, describe=self._describe)

        _run(self._fs, upload())
        if self.on_sent is not None:
            self.on_sent(len(data))

    def _commit(self) -> None:
        from azure.storage.blob import BlobBlock

        blocks = [BlobBlock(block_id) for block_id in self._ids]

        async def once() -> None:
            async with self._fs.service_client.get_blob_client(
                self._container, self._blob
            ) as client:
                await client.commit_block_list(blocks, metadata={"is_directory": "false"})

        async def commit() -> None:
            # Committing the same list again is harmless: a retry after a lost answer is safe.
            await call_async(once, self._policy, self._what, describe=self._describe)

        _run(self._fs, commit())

    def abort(self) -> None:
        """Stop uploading and commit nothing (staged blocks expire on the service)."""
        self.closed = True
        self._pieces.clear()
        self._buffered = 0
        pending = list(self._inflight)
        self._inflight.clear()
        for future in pending:
            future.cancel()
        concurrent.futures.wait(pending)


class AzureBackend(RemoteBackend):
    """A root at `root` (`container/path`) on the adlfs filesystem `fs`. Item files go up
    in blocks of `block_bytes`, `concurrency` in flight, each retried under `policy`;
    `name(parts)` is how a file is named in retry logs, `describe(exc)` one line about a
    failure (both without secrets)."""

    writer_retries = True  # each block, and the commit, retried under `policy`
    aborted_write_may_leave_file = False  # an aborted BlockWriter commits nothing

    def __init__(
        self,
        fs: Any,
        root: str,
        *,
        block_bytes: int,
        concurrency: int,
        policy: RetryPolicy,
        name: Callable[[Parts], str],
        describe: Callable[[BaseException], str],
        url: str | None = None,
        location: str | None = None,
    ) -> None:
        super().__init__(fs, root, capabilities=AZURE_CAPABILITIES, url=url, location=location)
        self._block_bytes, self._concurrency = block_bytes, concurrency
        self._policy, self._name, self._describe = policy, name, describe
        self._container_ready = False

    def _ls(self, parts: Parts) -> list[dict[str, Any]]:
        # One uncached request, no existence probes for an empty folder.
        return list_folder(self.fs, self.path(parts))

    def list_file_names(self, parts: Parts) -> list[str]:
        return list_file_names(self.fs, self.path(parts))

    def list_prefixed(self, parts: Parts, prefix: str) -> dict[str, int]:
        """The blobs of folder `parts` whose names begin with `prefix`, with their sizes:
        one listing of `<folder>/<prefix>` with a delimiter (a request per 5,000 matches,
        however many folders the root holds; folders, and ADLS's, left out)."""
        return {entry["name"].rsplit("/", 1)[-1]: entry["size"]
                for entry in list_folder(self.fs, self.path(parts), prefix)
                if entry["type"] == "file"}  # fmt: skip

    def make_dir(self, parts: Parts) -> None:
        """Blob storage has no empty folders (one appears with its first file): only the
        root's container is created, if it is missing."""
        if not self._container_ready:
            ensure_container(self.fs, self.root.split("/", 1)[0])
            self._container_ready = True

    def open_write(self, parts: Parts) -> BlockWriter:
        return BlockWriter(
            self.fs,
            self.path(parts),
            block_bytes=self._block_bytes,
            concurrency=self._concurrency,
            policy=self._policy,
            what=self._name(parts),
            describe=self._describe,
        )

    def write_ranges(
        self,
        parts: Parts,
        view: memoryview,
        ranges: list[tuple[int, int, bool]],
        base: Parts | None,
        base_stamp: str | None,
        sent: Callable[[int], None] | None = None,
    ) -> Written:
        """Write `view` as the blob `parts`, the ranges marked equal staged from the blob
        `base` while it is still the version `base_stamp` (its ETag), the rest uploaded
        (azure_ranges.write_ranges)."""
        return azure_ranges.write_ranges(
            self.fs,
            self.path(parts),
            view,
            ranges,
            None if base is None else self.path(base),
            base_stamp,
            block_bytes=self._block_bytes,
            concurrency=self._concurrency,
            policy=self._policy,
            what=self._name(parts),
            describe=self._describe,
            sent=sent,
        )

    def publish(self, parts: Parts, data: bytes, *, create_only: bool) -> None:
        """One upload with `If-None-Match: *` (unless not `create_only`). A create that
        finds exactly the bytes it was to write is a success, not a conflict: a retried
        upload whose first answer was lost finds its own bytes there (the manifest and
        history names make other writers' differ)."""
        path = self.path(parts)
        try:
            create_blob(self.fs, path, data, overwrite=not create_only)
        except FileExistsError:
            # A retry (ours, or the HTTP client's own for a PUT on a dropped connection)
            # may find what the first try wrote: the same bytes.
            if bytes(self.fs.cat_file(path)) == data:
                return
            raise


def open_azure(request: OpenRequest) -> AzureBackend:
    """The backend of an `az://`, `abfs://` or `abfss://` root: adlfs's filesystem with the
    credentials azure_auth.py resolves (the storage options, else the environment; what
    the Azure SDK may read from the environment is masked in every message too).

    Example (not run here: it needs an account or Azurite):
        open_azure(OpenRequest("az://container/run1", "az", {"account_name": "acct"}))
    """
    request.add_secrets(azure_auth.environment_secrets(os.environ).values())
    fs, root = azure_auth.open_filesystem(request.url, request.options, os.environ)
    block_bytes, concurrency = azure_auth.upload_settings(request.options)
    url = azure_auth.canonical_url(request.url)
    return AzureBackend(
        fs,
        root.rstrip("/"),
        block_bytes=block_bytes,
        concurrency=concurrency,
        policy=request.policy,
        name=request.name,
        describe=request.describe,
        url=url,
        location=f"{azure_auth.endpoint_of(fs)}|{url}",
    )
