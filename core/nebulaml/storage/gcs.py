"""The GCS backend: a root on Google Cloud Storage (or a server that speaks its JSON API,
such as an emulator), `gs://bucket/path` (or `gcs://`), through gcsfs.

`GCSBackend` is the fsspec backend (remote.py) with the requests nebula needs done its own
way, each one JSON API request (or one paged listing):

- `publish(create_only=True)`: one media upload with `ifGenerationMatch=0`, whatever
  gcsfs makes of `xb`: the server creates the object only if no live generation of the
  name exists, and refuses a second create with 412, which is `FileExistsError`. A retried
  create that finds exactly its own bytes there is a success (its first answer was lost),
  as on S3 and Azure.
- `open_write`: gcsfs's writer (one upload, or a resumable upload for a large object),
  whose abandonment commits nothing (`remote.ObjectUpload.abort`);
- listings: `objects.list`, never cached (a tag committed a moment ago by another process
  shows at once): a folder with `delimiter=/`, the whole root (`list_tree`) in one paged
  listing without a delimiter (a request per 1,000 objects, not one per folder). An
  object's version is its generation, which every write of the name changes.

Each request is tried once by gcsfs (its own retries, up to six with a backoff of up to
32 s, would outlast nebula's deadline on a call): `Store` retries what may pass under the
root's policy (retry.py), as on every other store.

Credentials come from the storage options (`token`: a service account's JSON file or its
contents, `google_default`, `anon`, a `google.auth` credential; `project`, ...) or else
Google's default chain (`GOOGLE_APPLICATION_CREDENTIALS`, gcloud's, the metadata server);
the secrets among them are masked in every message. `endpoint_url` points the root at
another server (an emulator: `STORAGE_EMULATOR_HOST` does too); it is part of the root's
location, so two servers with one bucket name are two roots.

`open_gcs` is its factory, registered for `gs://` and `gcs://` (builtins.py): an atomic
create and object appends; no server-side range copy (compose is not used yet).

Not for: what every fsspec store shares (remote.py), or retries and error translation
(store.py, retry.py, failures.py). May import: `nebulaml.errors` and storage/'s
backend.py, remote.py.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

from nebulaml.storage.backend import Capabilities, OpenRequest, Parts
from nebulaml.storage.remote import ObjectUpload, RemoteBackend, remote_location

GCS_CAPABILITIES = Capabilities(atomic_create=True, object_appends=True)

# `token` values that name a way to find credentials, not a credential.
_TOKEN_METHODS = frozenset({"anon", "google_default", "cache", "cloud", "browser"})
# The secret fields of a service account's or a user's credential (a `token` dict).
_SECRET_FIELDS = ("private_key", "private_key_id", "client_secret", "refresh_token",
                  "access_token", "token")  # fmt: skip
_PAGE = 1000  # objects per listing request (GCS's most)


class GCSBackend(RemoteBackend):
    """A root at `root` (`bucket/path`) on the gcsfs filesystem `fs`.

    Example (not run here: it needs a server):
        GCSBackend(gcs_filesystem({"endpoint_url": "http://127.0.0.1:9023",
                                   "token": "anon"}), "ckpt/run1")
    """

    aborted_write_may_leave_file = False  # an abandoned ObjectUpload commits nothing

    def __init__(self, fs: Any, root: str, *, location: str | None = None) -> None:
        super().__init__(fs, root, capabilities=GCS_CAPABILITIES, url=f"gs://{root}",
                         location=location)  # fmt: skip
        self._bucket_ready = False

    @property
    def bucket(self) -> str:
        return self.root.split("/", 1)[0]

    def make_dir(self, parts: Parts) -> None:
        """GCS has no empty folders (one appears with its first object): only the root's
        bucket is made sure of, once (created if missing and the credential may)."""
        if self._bucket_ready:
            return
        try:
            if not self.fs.exists(self.bucket):
                self.fs.makedirs(self.bucket, exist_ok=True)
        except OSError as exc:
            if not _forbidden(exc):
                raise
            # A credential scoped to objects: the bucket must exist, the first write says.
        self._bucket_ready = True

    def open_write(self, parts: Parts) -> ObjectUpload:
        return ObjectUpload(self.fs.open(self.path(parts), "wb"))

    # listings ----------------------------------------------------------------------
    def _key_prefix(self, parts: Parts) -> str:
        """The name prefix of the folder `parts`: `path/in/bucket/` ("" at a bucket's top)."""
        path = self.path(parts)
        key = path.split("/", 1)[1] if "/" in path else ""
        return f"{key.strip('/')}/" if key.strip("/") else ""

    def _pages(self, prefix: str, delimiter: str | None) -> Iterator[dict[str, Any]]:
        """The pages of one `objects.list` of `prefix` in the root's bucket (a missing
        bucket raises `FileNotFoundError`)."""
        token: str | None = None
        while True:
            page = self.fs.call("GET", "b/{}/o", self.bucket, json_out=True,
                                prefix=prefix or None, delimiter=delimiter,
                                maxResults=_PAGE, pageToken=token)  # fmt: skip
            yield page
            token = page.get("nextPageToken")
            if not token:
                return

    def _ls(self, parts: Parts) -> list[dict[str, Any]]:
        """The folder `parts` as fsspec listing entries, from one (paged) listing with a
        delimiter: its files, and its folders (prefixes with an object under them)."""
        out: list[dict[str, Any]] = []
        try:
            for page in self._pages(self._key_prefix(parts), "/"):
                for prefix in page.get("prefixes", []):
                    name = f"{self.bucket}/{prefix.rstrip('/')}"
                    out.append({"name": name, "type": "directory", "size": 0})
                for obj in page.get("items", []):
                    if not obj["name"].endswith("/"):  # not a folder marker another tool made
                        out.append(_entry(self.bucket, obj))
        except FileNotFoundError:  # no bucket: nothing in it
            return []
        return out

    def list_prefixed(self, parts: Parts, prefix: str) -> dict[str, int]:
        """The files of folder `parts` whose names begin with `prefix`, with their sizes:
        one `objects.list` with `prefix=<folder>/<prefix>` and `delimiter=/` (a request
        per 1,000 matches, whatever else the folder holds; folders left out)."""
        folder = self._key_prefix(parts)
        out: dict[str, int] = {}
        try:
            for page in self._pages(folder + prefix, "/"):
                for obj in page.get("items", []):
                    name = obj["name"][len(folder) :]
                    if name and "/" not in name:
                        out[name] = int(obj.get("size") or 0)
        except FileNotFoundError:  # no bucket: nothing in it
            return {}
        return out

    def list_tree(self) -> dict[str, dict[str, tuple[int, str | None]]]:
        """Every file one folder below the root, by folder, from one listing of the whole
        root without a delimiter (paged: a request per 1,000 objects)."""
        prefix = self._key_prefix(())
        out: dict[str, dict[str, tuple[int, str | None]]] = {}
        try:
            for page in self._pages(prefix, None):
                for obj in page.get("items", []):
                    rel = obj["name"][len(prefix) :].split("/")
                    if len(rel) == 2 and all(rel):
                        entry = _entry("", obj)
                        out.setdefault(rel[0], {})[rel[1]] = (entry["size"], entry["etag"])
        except FileNotFoundError:
            return {}
        return out

    # publishing --------------------------------------------------------------------
    def upload(self, parts: Parts, data: bytes, *, create_only: bool) -> dict[str, Any]:
        """One media upload of `data` as `parts`; with `ifGenerationMatch=0` if
        `create_only` (the server refuses a name taken: gcsfs raises `FileExistsError`).
        The object's resource, as the server answers it."""
        key = self.path(parts).split("/", 1)[1]
        condition = {"ifGenerationMatch": "0"} if create_only else {}
        url = f"{self.fs._location}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o"
        answer: dict[str, Any] = self.fs.call(
            "POST", url, json_out=True, uploadType="media", name=key, data=bytes(data),
            headers={"Content-Type": "application/octet-stream"}, **condition,
        )  # fmt: skip
        return answer

    def publish(self, parts: Parts, data: bytes, *, create_only: bool) -> None:
        """One upload; create-only (`ifGenerationMatch=0`) if `create_only`: a name taken
        raises `FileExistsError`, unless it holds exactly `data` (a retry finding its
        own)."""
        try:
            self.upload(parts, data, create_only=create_only)
        except FileExistsError:
            if not create_only:
                raise
            try:
                if bytes(self.fs.cat_file(self.path(parts))) == bytes(data):
                    return
            except FileNotFoundError:
                pass  # removed since: still taken when we asked
            raise


def _forbidden(exc: BaseException) -> bool:
    """Whether gcsfs's error is a 403 (it raises `OSError("Forbidden: ...")`)."""
    return isinstance(exc, PermissionError) or str(exc).startswith("Forbidden")


def _entry(bucket: str, obj: dict[str, Any]) -> dict[str, Any]:
    """An fsspec listing entry of one `objects.list` item: its generation is its version
    (every write of the name makes a new one).

    Example:
        >>> _entry("b", {"name": "t/a", "size": "3", "generation": "17"})["etag"]
        '17'
    """
    generation = obj.get("generation")
    return {
        "name": f"{bucket}/{obj['name']}" if bucket else obj["name"],
        "type": "file",
        "size": int(obj.get("size") or 0),
        "etag": str(generation) if generation is not None else obj.get("etag"),
        "updated": obj.get("updated"),
    }


def token_secrets(token: Any) -> list[str]:
    """The secrets in a `token` storage option: a credential's fields (a dict, or a
    `google.auth` credential's `token` and `refresh_token`), a string that is not the name
    of a method (`anon`, `google_default`, ...), which may be an access token.

    Example:
        >>> token_secrets({"type": "service_account", "private_key": "k"}), token_secrets("anon")
        (['k'], [])
    """
    if token is None:
        return []
    if isinstance(token, str):
        return [] if token in _TOKEN_METHODS else [token]
    if isinstance(token, dict):
        return [str(token[k]) for k in _SECRET_FIELDS if token.get(k)]
    found = (getattr(token, name, None) for name in ("token", "refresh_token", "client_secret"))
    return [value for value in found if isinstance(value, str) and value]


def gcs_filesystem(options: dict[str, Any]) -> Any:
    """A gcsfs filesystem given the storage options, whose requests are each tried once
    (nebula retries: see the module's docstring) and whose listings are never cached.

    gcsfs's plain JSON API filesystem (`gcsfs.core.GCSFileSystem`), not the one `import
    gcsfs` names: that one asks each bucket's type over gRPC first (zonal buckets), a
    request more, and on an emulator a minute's wait.

    Example (not run here: it needs gcsfs):
        gcs_filesystem({"endpoint_url": "http://127.0.0.1:9023", "token": "anon"})
    """
    options = dict(options)
    options.setdefault("use_listings_cache", False)
    return _one_try_class()(**options)


@functools.cache
def _one_try_class() -> Any:
    """gcsfs's `GCSFileSystem` with `_request` undecorated: gcsfs wraps it in its retries,
    and `__wrapped__` is the request itself (where it is missing, gcsfs's retries stay)."""
    from gcsfs.core import GCSFileSystem  # the gcs extra

    request = GCSFileSystem._request
    return type("OneTryGCSFileSystem", (GCSFileSystem,),
                {"_request": getattr(request, "__wrapped__", request)})  # fmt: skip


def open_gcs(request: OpenRequest) -> GCSBackend:
    """The backend of a `gs://bucket/path` (or `gcs://`) root: gcsfs's filesystem given
    the storage options (`token`, `project`, `endpoint_url`, ...), else Google's default
    chain; listings never cached.

    Example (not run here: it needs a server):
        open_gcs(OpenRequest("gs://ckpt/run1", "gs", {"endpoint_url": "http://127.0.0.1:9023",
                                                       "token": "anon"}))
    """
    options = dict(request.options)
    request.add_secrets(token_secrets(options.get("token")))
    fs = gcs_filesystem(options)
    root = str(fs._strip_protocol(request.url)).rstrip("/")
    if not root:
        raise ValueError(f"{request.url}: a GCS root names a bucket (gs://bucket/path)")
    endpoint = options.get("endpoint_url") or os.environ.get("STORAGE_EMULATOR_HOST")
    where = {"endpoint_url": endpoint} if endpoint else {}
    return GCSBackend(fs, root, location=remote_location(f"gs://{root}", where))
