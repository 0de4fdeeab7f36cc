"""The S3 backend: a root on Amazon S3 or an S3-compatible server (MinIO, Ceph, R2,
moto), `s3://bucket/path` (or `s3a://`), through s3fs and aiobotocore.

`S3Backend` is the fsspec backend (remote.py) with the requests nebula needs done its own
way, each one S3 request (or one paged listing) run on s3fs's event loop:

- `publish(create_only=True)`: one `PutObject` with `If-None-Match: *`, whatever the
  installed s3fs makes of `xb`; the server refuses a second create of a name (412, or 409
  for a create racing another), which is `FileExistsError`. A retried create that finds
  exactly its own bytes there is a success (its first answer was lost), as on Azure.
- `open_write`: s3fs's writer (one PutObject, or a multipart upload for a large object),
  whose abandonment commits nothing (`remote.ObjectUpload.abort`);
- `write_ranges`: an item file whose unchanged ranges are copied by the server from its
  previous version (UploadPartCopy, pinned to that version's ETag), the rest uploaded, in
  one multipart upload with several parts in flight (s3_parts.py);
- listings: `ListObjectsV2`, never cached (a tag committed a moment ago by another
  process shows at once): a folder with `Delimiter=/`, the whole root (`list_tree`) in one
  paged listing without a delimiter (a request per 1,000 objects, not one per folder).

Credentials come from the storage options (`key`, `secret`, `token`, `profile`, or
`client_kwargs`) or else the standard AWS chain (environment, shared files, instance
role); they are masked in every message (`open_s3` adds the environment's to the
secrets). `endpoint_url` points the root at a MinIO-style server; it is part of the root's
location, so two servers with one bucket name are two roots.

`open_s3` is its factory, registered for `s3://` and `s3a://` (builtins.py): an atomic
create, object appends and server-side range copies.

Not for: what every fsspec store shares (remote.py), or retries and error translation
(store.py, retry.py, failures.py), or the parts of an object written by ranges
(s3_parts.py). May import: `nebulaml.errors` and storage/'s backend.py, remote.py,
retry.py, s3_parts.py.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from nebulaml.storage import s3_parts
from nebulaml.storage.backend import Capabilities, OpenRequest, Parts, Written
from nebulaml.storage.remote import ObjectUpload, RemoteBackend, remote_location
from nebulaml.storage.retry import RetryPolicy

S3_CAPABILITIES = Capabilities(atomic_create=True, object_appends=True, range_copy=True)

# What the AWS chain may read from the environment that is a secret.
_ENVIRONMENT_SECRETS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
# Secret names inside `client_kwargs` (botocore's own spelling) and s3fs's options.
_SECRET_OPTIONS = ("secret", "token", "password", "aws_secret_access_key", "aws_session_token")
# Answers to a create-only PUT that found the name taken: 412, or 409 when two raced.
_TAKEN_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412", "409"})


class S3Backend(RemoteBackend):
    """A root at `root` (`bucket/path`) on the s3fs filesystem `fs`.

    Example (not run here: it needs a server):
        S3Backend(s3fs.S3FileSystem(endpoint_url="http://127.0.0.1:9000"), "ckpt/run1")
    """

    aborted_write_may_leave_file = False  # an abandoned ObjectUpload commits nothing

    def __init__(
        self,
        fs: Any,
        root: str,
        *,
        location: str | None = None,
        policy: RetryPolicy | None = None,
        name: Callable[[Parts], str] | None = None,
        describe: Callable[[BaseException], str] = str,
    ) -> None:
        super().__init__(fs, root, capabilities=S3_CAPABILITIES, url=f"s3://{root}",
                         location=location)  # fmt: skip
        self._bucket_ready = False
        self._policy = policy if policy is not None else RetryPolicy()
        self._name = name or (lambda parts: "/".join([self.url, *parts]))
        self._describe = describe

    def make_dir(self, parts: Parts) -> None:
        """S3 has no empty folders (one appears with its first object): only the root's
        bucket is made sure of, once (created if missing and the credential may)."""
        if self._bucket_ready:
            return
        bucket = self.root.split("/", 1)[0]
        try:
            if not self.fs.exists(bucket):
                self.fs.makedirs(bucket, exist_ok=True)
        except PermissionError:
            pass  # a credential scoped to objects: the bucket must exist, the first write says
        self._bucket_ready = True

    def open_write(self, parts: Parts) -> ObjectUpload:
        return ObjectUpload(self.fs.open(self.path(parts), "wb"))

    def write_ranges(
        self,
        parts: Parts,
        view: memoryview,
        ranges: list[tuple[int, int, bool]],
        base: Parts | None,
        base_stamp: str | None,
        sent: Callable[[int], None] | None = None,
    ) -> Written:
        """Write `view` as the object `parts`, the ranges marked equal copied by the server
        from the object `base` while it is still the version `base_stamp` (its ETag), the
        rest uploaded; each request retried by the root's policy (s3_parts.write_parts)."""
        return s3_parts.write_parts(
            self.fs,
            self.path(parts),
            view,
            ranges,
            None if base is None else self.path(base),
            base_stamp,
            policy=self._policy,
            what=self._name(parts),
            describe=self._describe,
            sent=sent,
        )

    def _run(self, coro: Any) -> Any:
        from fsspec.asyn import sync

        return sync(self.fs.loop, lambda: coro)

    async def _pages(self, prefix: str, delimiter: str) -> AsyncIterator[dict[str, Any]]:
        """The pages of one `ListObjectsV2` of `prefix` in the root's bucket."""
        from s3fs.errors import translate_boto_error

        bucket = self.root.split("/", 1)[0]
        await self.fs.set_session()
        client = await self.fs.get_s3(bucket)
        paginator = client.get_paginator("list_objects_v2")
        try:
            async for page in paginator.paginate(Bucket=bucket, Prefix=prefix, Delimiter=delimiter):
                yield page
        except Exception as exc:  # the server's answer, as s3fs says it (missing: not found)
            raise translate_boto_error(exc) from exc

    def _key_prefix(self, parts: Parts) -> str:
        """The key prefix of the folder `parts`: `path/in/bucket/` ("" at a bucket's top)."""
        key = self.path(parts).split("/", 1)[1] if "/" in self.path(parts) else ""
        return f"{key.strip('/')}/" if key.strip("/") else ""

    def _ls(self, parts: Parts) -> list[dict[str, Any]]:
        """The folder `parts` as fsspec listing entries, from one (paged) listing with a
        delimiter: its files, and its folders (prefixes with an object under them)."""
        bucket = self.root.split("/", 1)[0]
        prefix = self._key_prefix(parts)

        async def walk() -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            async for page in self._pages(prefix, "/"):
                for common in page.get("CommonPrefixes", []):
                    name = f"{bucket}/{common['Prefix'].rstrip('/')}"
                    out.append({"name": name, "type": "directory", "size": 0})
                for obj in page.get("Contents", []):
                    if obj["Key"].endswith("/"):
                        continue  # a folder marker another tool made
                    out.append(_entry(bucket, obj))
            return out

        try:
            return list(self._run(walk()))
        except FileNotFoundError:  # no bucket: nothing in it
            return []

    def list_prefixed(self, parts: Parts, prefix: str) -> dict[str, int]:
        """The files of folder `parts` whose names begin with `prefix`, with their sizes:
        one `ListObjectsV2` with `Prefix=<folder>/<prefix>` and `Delimiter=/` (a request
        per 1,000 matches, whatever else the folder holds; folders left out)."""
        folder = self._key_prefix(parts)

        async def walk() -> dict[str, int]:
            out: dict[str, int] = {}
            async for page in self._pages(folder + prefix, "/"):
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(folder) :]
                    if name and "/" not in name:
                        out[name] = int(obj.get("Size") or 0)
            return out

        try:
            return dict(self._run(walk()))
        except FileNotFoundError:  # no bucket: nothing in it
            return {}

    def list_tree(self) -> dict[str, dict[str, tuple[int, str | None]]]:
        """Every file one folder below the root, by folder, from one listing of the whole
        root without a delimiter (paged: a request per 1,000 objects)."""
        prefix = self._key_prefix(())

        async def walk() -> dict[str, dict[str, tuple[int, str | None]]]:
            out: dict[str, dict[str, tuple[int, str | None]]] = {}
            async for page in self._pages(prefix, ""):
                for obj in page.get("Contents", []):
                    rel = obj["Key"][len(prefix) :].split("/")
                    if len(rel) == 2 and all(rel):
                        entry = _entry("", obj)
                        out.setdefault(rel[0], {})[rel[1]] = (entry["size"], entry["etag"])
            return out

        try:
            return dict(self._run(walk()))
        except FileNotFoundError:
            return {}

    def publish(self, parts: Parts, data: bytes, *, create_only: bool) -> None:
        """One `PutObject`; with `If-None-Match: *` if `create_only` (a name taken raises
        `FileExistsError`, unless it holds exactly `data`: a retry finding its own)."""
        path = self.path(parts)
        bucket, key = path.split("/", 1)
        extra = {"IfNoneMatch": "*"} if create_only else {}
        try:
            self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **extra)
        except Exception as exc:
            if not create_only or not _taken(exc):
                raise
            if bytes(self.fs.cat_file(path)) == data:
                return
            raise FileExistsError(path) from exc


def _taken(exc: BaseException) -> bool:
    """Whether a create-only PUT failed because the name is taken (s3fs translates the
    412 to `FileExistsError`; its cause, botocore's error, names the code)."""
    if isinstance(exc, FileExistsError):
        return True
    current: BaseException | None = exc
    while current is not None:
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return str(error.get("Code")) in _TAKEN_CODES or status in (409, 412)
        current = current.__cause__
    return False


def _entry(bucket: str, obj: dict[str, Any]) -> dict[str, Any]:
    """An fsspec listing entry of one `ListObjectsV2` object: its ETag is its version."""
    etag = obj.get("ETag")
    return {
        "name": f"{bucket}/{obj['Key']}" if bucket else obj["Key"],
        "type": "file",
        "size": int(obj.get("Size") or 0),
        "etag": etag.strip('"') if isinstance(etag, str) else None,
        "LastModified": obj.get("LastModified"),
    }


def open_s3(request: OpenRequest) -> S3Backend:
    """The backend of an `s3://bucket/path` root: s3fs's filesystem given the storage
    options (`endpoint_url`, `key`/`secret`, `profile`, `client_kwargs`, ...), else the AWS
    chain; listings never cached.

    Example (not run here: it needs a server):
        open_s3(OpenRequest("s3://ckpt/run1", "s3", {"endpoint_url": "http://127.0.0.1:9000"}))
    """
    request.add_secrets(os.environ.get(name) for name in _ENVIRONMENT_SECRETS)
    options = dict(request.options)
    nested = options.get("client_kwargs")
    for source in (options, nested if isinstance(nested, dict) else {}):
        request.add_secrets(v for k, v in source.items() if k.lower() in _SECRET_OPTIONS)
    import s3fs  # the s3 extra

    options.setdefault("use_listings_cache", False)
    # No retries of botocore's own (5 tries with backoff) inside each of nebula's, which are
    # bounded (retry.py, deadline.py): a refused connection took 9 s to be said, and init
    # waited out its deadline for a store that was down (tests/s3/test_s3_outage.py).
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    options["config_kwargs"] = config
    fs = s3fs.S3FileSystem(**options)
    root = str(fs._strip_protocol(request.url)).rstrip("/")
    if not root:
        raise ValueError(f"{request.url}: an S3 root names a bucket (s3://bucket/path)")
    endpoint = options.get("endpoint_url") or (nested or {}).get("endpoint_url")
    where = {"endpoint_url": endpoint} if endpoint else {}
    return S3Backend(
        fs,
        root,
        location=remote_location(f"s3://{root}", where),
        policy=request.policy,
        name=request.name,
        describe=request.describe,
    )
