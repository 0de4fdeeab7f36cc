"""The fsspec backend: a root on any fsspec store that no other backend is registered for
(memory://, ...), and the base of the S3, GCS and Azure backends (s3.py, gcs.py, azure.py).

`RemoteBackend` implements the `Backend` primitives (backend.py) with fsspec calls. What
object stores lack, it builds:

- a create-only publish: an exclusive create (`xb`);
- appends that concurrent writers cannot lose: where an object can only be written whole
  (`Capabilities.object_appends`, declared by every fsspec store nebula opens: it does not
  guess from the protocol's name which stores have appends), each append is an object of
  its own, `.<file>.d/<append id>.part` (`segments_folder`), created create-only and read
  back in the order of their names; a backend that declares otherwise reads, then
  rewrites the file (safe for one writer at a time only).

`open_fsspec` is the factory of a root whose protocol no backend is registered for
(registry.py): it declares an atomic create (fsspec's `xb`), which the probe at init
checks on a persistent root (atomic_probe.py), and object appends.

Each method is one backend request or a few; `Store` retries and translates them.

Not for: local disks (local.py: `Store` never reads a local root through fsspec), S3's or
Azure's requests (s3.py, azure.py). May import: `nebulaml.errors`, `nebulaml.format` and
storage/'s backend.py.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import threading
import weakref
from datetime import datetime, timezone
from typing import Any

import fsspec

from nebulaml.format.names import segments_folder
from nebulaml.storage.backend import Capabilities, OpenRequest, Parts

# What a store reached through fsspec alone declares: `xb` as its create-only publish (the
# probe at init checks it), each append an object of its own (safe on any store).
FSSPEC_CAPABILITIES = Capabilities(atomic_create=True, object_appends=True)

# The options that name where a store's data is (never a secret): part of its location.
_WHERE_OPTIONS = ("endpoint_url", "host", "port", "project", "account_name", "bucket")


class ObjectUpload:
    """An object being written through an fsspec object store's buffered writer (s3fs,
    gcsfs): whole when closed (one upload, or a multipart or resumable upload finished),
    and never committed when abandoned (`abort` drops what was buffered and gives up the
    upload begun).

    Example (not run here: it needs an object store's buffered writer, an
    `fsspec.spec.AbstractBufferedFile`):
        upload = ObjectUpload(s3fs.S3FileSystem(...).open("bucket/run1/x", "wb"))
    """

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def write(self, data: Any) -> int:
        return int(self._raw.write(data))

    def close(self) -> None:
        self._raw.close()

    def abort(self) -> None:
        self._raw.discard()
        self._raw.closed = True  # nothing left for a close (or the collector) to commit


class RemoteBackend:
    """A root at `root` (no protocol, no trailing slash) on the fsspec filesystem `fs`,
    doing what `capabilities` declare; `url` and `location` as `Backend`'s (by default
    the filesystem's URL of the root, and that URL)."""

    writer_retries = False
    # fsspec's writers have no abort: an abandoned one is closed, which may leave a file.
    aborted_write_may_leave_file = True

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        root: str,
        *,
        capabilities: Capabilities = FSSPEC_CAPABILITIES,
        url: str | None = None,
        location: str | None = None,
    ) -> None:
        self.fs = fs
        self.root = root
        self.capabilities = capabilities
        self.url = url if url is not None else fs.unstrip_protocol(root)
        self.location = location if location is not None else self.url
        quiet_async_exit(fs)
        self.appends_as_objects = capabilities.object_appends

    def path(self, parts: Parts) -> str:
        return "/".join([self.root, *parts]) if parts else self.root

    # reading -----------------------------------------------------------------------
    def exists(self, parts: Parts) -> bool:
        return bool(self.fs.exists(self.path(parts)))

    def _ls(self, parts: Parts) -> list[dict[str, Any]]:
        """fsspec `ls(detail=True)` entries of the folder `parts`; empty if missing."""
        try:
            return list(self.fs.ls(self.path(parts), detail=True))
        except FileNotFoundError:
            return []

    def list_folders(self, parts: Parts) -> list[str]:
        out = []
        for entry in self._ls(parts):
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if name and not name.startswith(".") and entry.get("type", "file") == "directory":
                out.append(name)
        return out

    def list_files(self, parts: Parts) -> dict[str, int]:
        return {name: size for name, (size, _) in self.list_versions(parts).items()}

    def list_prefixed(self, parts: Parts, prefix: str) -> dict[str, int]:
        """The files of folder `parts` whose names begin with `prefix`, with their sizes
        (`PrefixListingBackend`): fsspec has no listing by prefix, so the folder's whole
        listing, filtered (correct, not fast; S3, GCS and Azure list by prefix)."""
        return {name: size for name, size in self.list_files(parts).items()
                if name.startswith(prefix)}  # fmt: skip

    def list_versions(self, parts: Parts) -> dict[str, tuple[int, str | None]]:
        """The files of folder `parts`: {name: (size, version)}, where the version is what
        the store says changes whenever the object is written (Azure's ETag, else its
        modification time), or None where it says neither."""
        out: dict[str, tuple[int, str | None]] = {}
        for entry in self._ls(parts):
            if entry.get("type") == "file":
                out[entry["name"].rstrip("/").rsplit("/", 1)[-1]] = _sized_version(entry)
        return out

    def list_tree(self) -> dict[str, dict[str, tuple[int, str | None]]]:
        """Every file one folder below the root, by folder: {folder: {name: (size,
        version)}} as `list_versions` gives them, from one listing of the whole root (an
        object store pages it: a request per few thousand files, where listing a folder
        at a time costs a request per folder). Deeper files are left out."""
        prefix = self.root.strip("/") + "/"
        try:
            found = self.fs.find(self.root, detail=True, withdirs=False)
        except FileNotFoundError:
            return {}
        out: dict[str, dict[str, tuple[int, str | None]]] = {}
        for path, entry in found.items():
            rel = str(path).lstrip("/")
            if entry.get("type") != "file" or not rel.startswith(prefix):
                continue
            parts = rel[len(prefix) :].split("/")
            if len(parts) == 2 and all(parts):
                out.setdefault(parts[0], {})[parts[1]] = _sized_version(entry)
        return out

    def modified_at(self, parts: Parts) -> datetime | None:
        try:
            value = self.fs.modified(self.path(parts))
        except (NotImplementedError, FileNotFoundError):
            return None
        if not isinstance(value, datetime):
            return None
        return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)

    def read_bytes(self, parts: Parts) -> bytes:
        return bytes(self.fs.cat_file(self.path(parts)))

    def open_read(self, parts: Parts) -> Any:
        return self.fs.open(self.path(parts), "rb")

    def read_appended(self, parts: Parts) -> bytes | None:
        """The file itself, then (on object stores) the appends under `.<file>.d/`, each
        ending in a newline, in the order of their names (the time each was written); the
        file at the name (written whole, or by an older nebula) comes first."""
        try:
            head: bytes | None = self.read_bytes(parts)
        except FileNotFoundError:
            head = None
        if not self.appends_as_objects:
            return head
        folder = (*parts[:-1], segments_folder(parts[-1]))
        names = sorted(self.list_files(folder))
        if not names:
            return head
        paths = [self.path((*folder, name)) for name in names]
        found = self.fs.cat(paths, on_error="return")
        if len(found) != len(paths):
            raise OSError(errno.EIO, f"{len(paths)} appends listed, {len(found)} read")
        for value in found.values():
            # One removed since the listing is among the oldest (`rotate_appended`).
            if isinstance(value, BaseException) and not isinstance(value, FileNotFoundError):
                raise value
        pieces = [head] if head else []
        pieces += [bytes(found[key]) for key in sorted(found)  # one folder: by name
                   if not isinstance(found[key], BaseException)]  # fmt: skip
        return b"".join(p if p.endswith(b"\n") else p + b"\n" for p in pieces if p)

    # writing -----------------------------------------------------------------------
    def make_dir(self, parts: Parts) -> None:
        self.fs.makedirs(self.path(parts), exist_ok=True)

    def open_write(self, parts: Parts) -> Any:
        return self.fs.open(self.path(parts), "wb")

    def publish(self, parts: Parts, data: bytes, *, create_only: bool) -> None:
        """An exclusive create (`xb`), or a plain write unless `create_only`."""
        with self.fs.open(self.path(parts), "xb" if create_only else "wb") as f:
            f.write(data)

    def append(self, parts: Parts, data: bytes, *, append_id: str) -> None:
        if self.appends_as_objects:
            folder = (*parts[:-1], segments_folder(parts[-1]))
            name = f"{append_id}.part"
            try:
                self.publish((*folder, name), data, create_only=True)
            except FileNotFoundError:  # a store with real folders: the appends' folder is new
                self.make_dir(folder)
                self.publish((*folder, name), data, create_only=True)
            return
        path = self.path(parts)
        old = self.fs.cat_file(path) if self.fs.exists(path) else b""
        with self.fs.open(path, "wb") as f:
            f.write(bytes(old) + data)

    def rotate_appended(self, parts: Parts, max_bytes: int, head: bytes) -> bool:
        """On object stores, remove the oldest appended objects beyond `2 * max_bytes`
        (several writers may do it at once: each removes what the others may, the oldest,
        and a removed one is no error); elsewhere (one writer) a file of `max_bytes` or
        more is copied to `<name>.1` and started again with `head`."""
        if self.appends_as_objects:
            folder = (*parts[:-1], segments_folder(parts[-1]))
            sizes = self.list_files(folder)
            kept, old = 0, []
            for name in sorted(sizes, reverse=True):  # the newest first: names are times
                kept += sizes[name]
                if kept > 2 * max_bytes:
                    old.append(name)
            for name in old:
                self.remove((*folder, name))
            return bool(old)
        path = self.path(parts)
        try:
            if self.fs.size(path) < max_bytes:
                return False
        except FileNotFoundError:
            return False
        self.publish((*parts[:-1], f"{parts[-1]}.1"), self.read_bytes(parts), create_only=False)
        self.publish(parts, head, create_only=False)
        return True

    def remove(self, parts: Parts) -> None:
        try:
            self.fs.rm_file(self.path(parts))
        except FileNotFoundError:
            return

    def remove_dir(self, parts: Parts) -> None:
        # A store with real folders (memory://, ADLS with a hierarchical namespace) keeps
        # the empty folder; a flat blob store has nothing left to remove.
        path = self.path(parts)
        try:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            return


def remote_location(url: str, options: dict[str, Any]) -> str:
    """A remote root's location: its URL and the options that name where its data is
    (an endpoint, a project), never a secret; two servers with one bucket and path are two
    roots.

    Example:
        >>> remote_location("s3://b/run1", {"endpoint_url": "http://127.0.0.1:9000", "secret": "x"})
        "s3://b/run1|[('endpoint_url', 'http://127.0.0.1:9000')]"
    """
    where = sorted((k, str(v)) for k, v in options.items() if k in _WHERE_OPTIONS)
    return f"{url}|{where}" if where else url


def open_fsspec(request: OpenRequest) -> RemoteBackend:
    """The backend of a root on an fsspec store that no backend is registered for
    (memory://, ...): fsspec's filesystem for the URL, given the storage options.

    Example:
        >>> backend = open_fsspec(OpenRequest("memory://example-run", "memory", {}))
        >>> backend.url, backend.capabilities.object_appends
        ('memory:///example-run', True)
    """
    fs, root = fsspec.core.url_to_fs(request.url, **request.options)
    backend = RemoteBackend(fs, str(root).rstrip("/"))
    backend.location = remote_location(backend.url, request.options)
    return backend


# interpreter exit ------------------------------------------------------------------------
_loops: weakref.WeakSet[Any] = weakref.WeakSet()  # the event loops of the stores opened
_quieting = False


def _sized_version(entry: dict[str, Any]) -> tuple[int, str | None]:
    """(size, version) of an fsspec listing entry: the version is what the store changes
    whenever the object is written (an ETag, else its modification time), or None."""
    version = entry.get("etag") or entry.get("last_modified") or entry.get("mtime")
    return int(entry.get("size") or 0), None if version is None else str(version)


def quiet_async_exit(fs: Any) -> None:
    """Keep the interpreter's exit quiet about `fs`'s event loop (issue #18: Ctrl-C during
    an az:// copy printed hundreds of lines). A process that ends while requests are in
    flight (an interrupt, an exit during a persist) abandons them on fsspec's loop
    thread; as the interpreter shuts down, asyncio and aiohttp report each one ("Task was
    destroyed but it is pending", "Unclosed connection", "Task exception was never
    retrieved", the SDK's "Unable to stream download"), most once the interpreter has
    shut its thread pools down under them. They are nothing to report then: as the
    interpreter begins to exit (threading's exit hook, before the pools go), that loop's
    exception handler and the loggers of asyncio, aiohttp and the Azure SDK are silenced.
    What nebula could not do itself at exit it says on its own (runtime/exit.py)."""
    global _quieting
    loop = getattr(fs, "_loop", None) if getattr(fs, "async_impl", False) else None
    if loop is not None:
        _loops.add(loop)
    if not _quieting:
        _quieting = True
        # Imported first, so that the pools' own hook is registered before this one (the
        # hooks run newest first) and this one runs before the pools are shut down.
        import concurrent.futures.thread  # noqa: F401

        register = getattr(threading, "_register_atexit", None)
        try:
            if register is None:
                raise RuntimeError("no threading exit hooks")
            register(_silence_abandoned_requests)
        except RuntimeError:  # already shutting down, or an interpreter without them
            atexit.register(_silence_abandoned_requests)


def _quiet_handler(_loop: Any, _context: dict[str, Any]) -> None:
    return None


_SILENCED_LOGGERS = ("asyncio", "aiohttp", "azure", "adlfs")


def _silence_abandoned_requests() -> None:
    for name in _SILENCED_LOGGERS:
        logger = logging.getLogger(name)
        # disabled stops this logger's own records; the level also stops its children's
        # (azure.core...), whose records would reach the root's handlers otherwise.
        logger.disabled = True
        logger.setLevel(logging.CRITICAL + 1)
    try:
        from fsspec import asyn

        default = asyn.loop[0]
    except (ImportError, AttributeError, IndexError):
        default = None
    for loop in {*list(_loops), *([default] if default is not None else [])}:
        # A loop already closed has nothing left to say.
        with contextlib.suppress(Exception):
            loop.set_exception_handler(_quiet_handler)
