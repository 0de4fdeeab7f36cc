"""One storage abstraction for every tier: a root given as a path or an fsspec URL.

`Store` is the facade through which every other layer touches files. It gives the commit
protocol the primitives it needs on any backend: durable writes (fsync on local disks), a
create-only publish of small files (a hard link on local disks, a conditional create on
object stores), appends that concurrent writers cannot lose, and listing. Each operation
is delegated to the root's backend, opened by the factory registered for the root's
protocol (registry.py); what the backend can do beyond the primitives is what it declares
(`Capabilities`: a local path, clones, server-side range copies), never what its protocol's
name suggests.

It is also the storage boundary: backend exceptions are translated here, once, into
`StorageError` (with secrets redacted from every message), and on network stores each
operation is retried on transient errors (a timeout, a reset connection, a 5xx) under a
bounded `RetryPolicy` (retry.py) before the error reaches the caller. No operation waits
without bound (deadline.py): on a network store each is answered within the policy's
`call_timeout_s` (a long upload: without progress for that long), and on any store
within the deadline of the block it runs in (`deadline.within`), or raises
`StoreTimeoutError`.

One short method per operation, each with the contract its callers rely on; the work is
in the backends.

Not for: knowing what a checkpoint is (protocol/ builds on these primitives), how one
backend does an operation (local.py, remote.py, s3.py, azure.py), or which backend a
protocol has (registry.py). May import: `nebulaml.errors`, `nebulaml.config`,
`nebulaml.format` and the rest of storage/.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any, BinaryIO, TypeVar, cast

import fsspec

from nebulaml._threads import quiet
from nebulaml.config import storage_retry_env
from nebulaml.errors import CommitConflictError, InvalidArgumentError, NebulaError, StorageError
from nebulaml.storage import atomic_probe
from nebulaml.storage.backend import (
    Backend,
    Capabilities,
    LocalPathBackend,
    OpenRequest,
    Parts,
    RangeCopyBackend,
    Written,
    new_append_id,
)
from nebulaml.storage.deadline import Progress, bounded
from nebulaml.storage.failures import MissingFileError, describe, translate_errors
from nebulaml.storage.mapped_reads import Lender, LocalRead
from nebulaml.storage.redaction import redact, secrets_in
from nebulaml.storage.registry import factory_for
from nebulaml.storage.remote_streams import CountedWriter, RemoteReader, RemoteWriter
from nebulaml.storage.retry import OPTION_NAMES as RETRY_OPTIONS
from nebulaml.storage.retry import RetryPolicy
from nebulaml.storage.retry import call as call_with_retries
from nebulaml.storage.view_writes import write_view_chunks

__all__ = ["LocalRead", "MissingFileError", "Store", "using_storage_options"]

T = TypeVar("T")

# nebula's own storage options, which no backend is given.
_NEBULA_OPTIONS = (*RETRY_OPTIONS, atomic_probe.OPTION_SINGLE_WRITER)

_scoped_options: contextvars.ContextVar[tuple[tuple[str, Any], ...]] = contextvars.ContextVar(
    "nebula_storage_options", default=()
)


@contextlib.contextmanager
def using_storage_options(options: Mapping[str, Any]) -> Iterator[None]:
    """Give `options` to every root opened by URL inside the block (not to local paths).

    For the functions that take a root (`list_checkpoints`, `copy_checkpoint`,
    `get_latest_checkpoint`, ...) when its credentials are not in the environment; options
    passed explicitly (`init(storage_options=...)`) win over these. The `nebula` CLI's
    `--storage-option KEY=VALUE` uses it.

    Example:
        >>> import nebulaml as nm
        >>> with nm.using_storage_options({"account_name": "myaccount"}):
        ...     pass  # e.g. nm.list_checkpoints("az://container/run1")
    """
    if not isinstance(options, Mapping):
        raise InvalidArgumentError(f"storage options must be a mapping, not {type(options)}")
    token = _scoped_options.set(tuple({**dict(_scoped_options.get()), **options}.items()))
    try:
        yield
    finally:
        _scoped_options.reset(token)


class Store:
    """A checkpoint root on one backend.

    Paths inside the root are given as parts (`"global_step5", "model"`), never as
    strings with separators, so no caller builds paths by hand. `storage_options` go to
    the backend registered for the root's protocol (for `az://` roots: adlfs, see
    azure_auth.py; `s3://`: s3fs), over any given by `using_storage_options`; nebula's
    own are taken out first: `nebula_retries`, `nebula_retry_base_s` and
    `nebula_retry_max_s` set the retry policy of a network store, `nebula_single_writer`
    lets a root without an atomic create be used (`require_atomic_create`). `durable=False` is for
    a root in RAM (nothing to fsync); `private=True` makes a local root this user's alone
    (folders 0700, files 0600): both for the memory tier.

    Example:
        >>> import tempfile
        >>> store = Store(tempfile.mkdtemp())
        >>> store.make_dir("t")
        >>> store.write_bytes(("t", "a"), b"hello")
        >>> store.read_bytes("t", "a")
        b'hello'
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None = None,
        *,
        durable: bool = True,
        private: bool = False,
    ) -> None:
        url = os.fspath(url)
        protocol = fsspec.core.split_protocol(url)[0]
        # A local root's factory takes no options: those of `using_storage_options` are
        # for the roots opened by URL.
        scoped = dict(_scoped_options.get()) if protocol is not None else {}
        options = {**scoped, **(storage_options or {})}
        self._secrets = secrets_in(options)
        self.policy = RetryPolicy.from_options(options, storage_retry_env())
        # One writer at a time promised: no atomic create needed (atomic_probe.py).
        self.single_writer = atomic_probe.single_writer_mode(options)
        self.durable = durable
        self.url = url  # until the backend says its own (for messages while it opens)
        self._backend = self._open_backend(url, protocol, options, durable=durable,
                                           private=private)  # fmt: skip
        self.capabilities: Capabilities = self._backend.capabilities
        # A private store (the memory tier) is this user's alone: folders 0700, files 0600.
        self.private = private and self.is_local
        self.root: str = self._backend.root
        # A URL that parses back to the same root (for display and for namespacing), and
        # what the root is, whatever name reached it.
        self.url = self._backend.url
        self.location: str = self._backend.location
        # The backend's fsspec filesystem, where it has one (tests and tools look at it).
        self.fs: Any = getattr(self._backend, "fs", None)
        # Mappings this process already holds, by (st_dev, st_ino, size): the slot pool's
        # of the memory tier's files (slots.SlotPool.view_of). None: map afresh.
        self.mapped: Lender | None = None

    def _open_backend(
        self,
        url: str,
        protocol: str | None,
        options: Mapping[str, Any],
        *,
        durable: bool,
        private: bool,
    ) -> Backend:
        """The backend for `url`, from the factory registered for its protocol
        (registry.py); the secrets it names (from the environment) are masked from now on."""
        secrets = list(self._secrets)  # the factory adds what the environment holds
        request = OpenRequest(
            url,
            protocol,
            {k: v for k, v in options.items() if k not in _NEBULA_OPTIONS},
            durable=durable,
            private=private,
            policy=self.policy,
            secrets=secrets,
            name=lambda parts: redact(self.display(*parts), self._secrets),
            describe=self._describe_error,
        )
        # A network filesystem's event loop (fsspec's thread) and the threads it starts
        # take no signal meant for the main thread (nebulaml._threads).
        try:
            with translate_errors(redact(url, self._secrets), cast(tuple[str, ...], secrets),
                                  remote=True), quiet():  # fmt: skip
                try:
                    return factory_for(protocol)(request)
                except ImportError as exc:  # a known protocol whose library is not installed
                    raise StorageError(redact(f"{url}: {exc}", secrets)) from exc
                except ValueError as exc:  # an unknown protocol, or options refused
                    raise StorageError(redact(f"{url}: {exc}", secrets)) from exc
        finally:
            self._secrets = tuple(secrets)

    @property
    def is_local(self) -> bool:
        """Whether the root is a folder of this machine (`Capabilities.local_path`)."""
        return self.capabilities.local_path

    def require_atomic_create(self) -> None:
        """Refuse this root as a persistent tier (`InvalidArgumentError`, one line) unless
        its backend publishes create-only atomically, or its user promised one writer at a
        time (atomic_probe.py's `require_store` says how).

        Example:
            >>> import tempfile
            >>> Store(tempfile.mkdtemp()).require_atomic_create()  # a local disk: atomic
        """
        atomic_probe.require_store(self)

    def _local(self) -> LocalPathBackend:
        """The backend, as the local one it declares it is (`is_local`)."""
        return cast(LocalPathBackend, self._backend)

    def _if_local(self, parts: Parts, fn: Callable[[LocalPathBackend], T], default: T) -> T:
        """`fn(the local backend)` as `_call` runs it on a local root; else `default`."""
        return self._call(parts, lambda: fn(self._local())) if self.is_local else default

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # paths -------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """The backend path of `parts` under the root."""
        return self._backend.path(parts)

    def display(self, *parts: str) -> str:
        """A human-readable location of `parts` (a path, or a URL for remote stores)."""
        return "/".join([self.url, *parts]) if parts else self.url

    def local_path(self, *parts: str) -> str | None:
        """The OS path of `parts` if this store is on a local filesystem, else None."""
        return self.path(*parts) if self.is_local else None

    def file_stamp(self, *parts: str) -> str | None:
        """On a local root, what names the regular file `parts` as it is now (its device,
        inode, size and modification time: local.file_stamp), for `write_ranges`'s
        `base_stamp`; None elsewhere, or where it is no regular file."""
        return self._if_local(parts, lambda local: local.file_stamp(parts), None)

    # the boundary --------------------------------------------------------------------
    def _translated(self, what: str) -> contextlib.AbstractContextManager[None]:
        return translate_errors(what, self._secrets, remote=not self.is_local)

    def _call(self, parts: Parts, fn: Callable[[], T]) -> T:
        """`fn()`, a backend call about the file or folder `parts`: retried on transient
        errors (network stores), and translated to `StorageError` naming `parts`."""
        if self.is_local:
            try:
                return bounded(fn, lambda: self.display(*parts), None, key=self.location)
            except Exception:
                # Named and translated once it failed: a save makes a dozen calls.
                with self._translated(self.display(*parts)):
                    raise
        what = redact(self.display(*parts), self._secrets)
        with translate_errors(what, self._secrets, remote=True, tries=self.policy.retries + 1):
            return self._bounded(lambda: call_with_retries(
                fn, self.policy, what, describe=self._describe_error), what)  # fmt: skip

    def _bounded(self, fn: Callable[[], T], what: str, progress: Progress | None = None) -> T:
        """`fn()`, a network store's call, answered within the policy's `call_timeout_s`
        (with `progress`: without progress for that long) and the block's deadline."""
        return bounded(fn, what, self.policy.call_timeout_s, key=self.location,
                       progress=progress)  # fmt: skip

    def _describe_error(self, exc: BaseException) -> str:
        return redact(describe(exc), self._secrets)

    # reading -----------------------------------------------------------------------
    def exists(self, *parts: str) -> bool:
        """Whether a file or folder is at `parts` (on local disks: the name itself)."""
        return self._call(parts, lambda: self._backend.exists(parts))

    def list_dirs(self, *parts: str) -> list[str]:
        """Names of the folders directly under the root, or under the folder `parts`
        (hidden ones excluded; none if it is missing). On object stores a folder exists
        while it holds a file."""
        return self._call(parts, lambda: self._backend.list_folders(parts))

    def list_files(self, *parts: str) -> dict[str, int]:
        """Files directly inside the folder `parts`, with their sizes in bytes (none if
        the folder is missing)."""
        return self._call(parts, lambda: self._backend.list_files(parts))

    def list_prefixed(self, *parts: str, prefix: str) -> dict[str, int]:
        """`list_files` of the folder `parts` (the root: none) for the names that begin
        with `prefix`, listed the backend's cheap way, not the whole folder's
        (backend.PrefixListingBackend), or else listed whole and filtered.

        Example:
            >>> import tempfile; store = Store(tempfile.mkdtemp()); store.make_dir(".a-dir")
            >>> store.write_bytes((".a-1",), b"ab"); store.list_prefixed(prefix=".a-")
            {'.a-1': 2}
        """
        if "/" in prefix:
            raise InvalidArgumentError(f"a name prefix has no '/': {prefix!r}")
        if (listing := getattr(self._backend, "list_prefixed", None)) is not None:
            return self._call(parts, lambda: listing(parts, prefix))
        return {n: s for n, s in self.list_files(*parts).items() if n.startswith(prefix)}

    def list_file_names(self, *parts: str) -> list[str]:
        """The names of the files directly inside the folder `parts` (none if it is
        missing): `list_files` without the sizes, which a local disk gives only by a
        stat per file, an object store only with each object's properties."""
        names = getattr(self._local() if self.is_local else self._backend, "list_file_names", None)
        if names is None:
            return list(self.list_files(*parts))
        return self._call(parts, lambda: names(parts))

    def list_non_files(self, *parts: str) -> list[str]:
        """On a local root, the names directly inside the folder `parts` that are not
        regular files (a FIFO, a socket, a device, a symbolic link, a folder; none if the
        folder is missing): `list_files` leaves them out, and nebula writes none in a tag
        folder. [] elsewhere: an object store holds only blobs."""
        return self._if_local(parts, lambda local: local.list_non_files(parts), [])

    def list_versions(self, *parts: str) -> dict[str, tuple[int, str | None]] | None:
        """On an object store, the files of folder `parts` as {name: (size, version)}
        from one listing, the version being what changes whenever the object is written
        (an ETag), or None where the store says nothing; None on a local root (whose
        files have a cheaper identity: `file_identity`)."""
        listing = None if self.is_local else getattr(self._backend, "list_versions", None)
        return None if listing is None else self._call(parts, lambda: listing(parts))

    def list_tree(self) -> dict[str, dict[str, tuple[int, str | None]]] | None:
        """On an object store, the files one folder below the root, by folder, as
        `list_versions` gives a folder's, from one listing of the whole root (paged: a
        request per few thousand files, not one per folder); None on a local root."""
        listing = None if self.is_local else getattr(self._backend, "list_tree", None)
        return None if listing is None else self._call((), lambda: listing())

    def file_identity(self, *parts: str) -> tuple[int, int, int] | None:
        """(inode, size, modification time in ns) of the regular file `parts` on a local
        root, without following a link; None when it is missing, not a regular file, or
        the root is not local (an object store has no cheap identity: callers read).
        A file replaced (written again, or removed and created) has another identity."""
        return self._if_local(parts, lambda local: local.file_identity(parts), None)

    def folder_identity(self, *parts: str) -> tuple[int, int] | None:
        """(inode, modification time in ns) of the folder `parts` (the root: none) on a
        local root: it changes when a name is added to it or removed; None when it is
        missing or the root is not local."""
        return self._if_local(parts, lambda local: local.folder_identity(parts), None)

    def modified_at(self, *parts: str) -> datetime | None:
        """A file's modification time (UTC), or None if the backend cannot tell or the
        file is gone."""
        return self._call(parts, lambda: self._backend.modified_at(parts))

    def read_bytes(self, *parts: str) -> bytes:
        return self._call(parts, lambda: self._backend.read_bytes(parts))

    @contextlib.contextmanager
    def open_read(self, *parts: str) -> Iterator[BinaryIO]:
        """A binary stream of a file; backend errors while reading become StorageError."""
        where = self.display(*parts)
        f = self._call(parts, lambda: self._backend.open_read(parts))
        if not self.is_local:  # each read of a network stream is retried and translated
            f = RemoteReader(f, lambda fn: self._call(parts, fn))
        try:
            # The block is the caller's code: only OS errors are the storage's here.
            with translate_errors(where, self._secrets):
                yield f
        finally:
            f.close()

    @contextlib.contextmanager
    def map_read(self, *parts: str) -> Iterator[memoryview | None]:
        """A local file's bytes, mapped read-only (no copy into this process); None for a
        remote store or an empty file.

        Where this process maps the file already (`mapped`: the slot pool, which filled
        it), that mapping is lent instead (see mapped_reads.map_view)."""
        if not self.is_local:
            yield None
            return
        where = self.display(*parts)
        with contextlib.ExitStack() as stack:
            with self._translated(where):
                view = stack.enter_context(self._local().map_read(parts, self.mapped))
            if view is None:
                yield None
                return
            with translate_errors(where, self._secrets):
                yield view

    @contextlib.contextmanager
    def read_local(self, *parts: str, algo: str | None = None) -> Iterator[LocalRead | None]:
        """A local file's bytes in memory that loaded tensors may keep using (`buffer`),
        with `path`, a name of this very open file (not of whatever the name points to by
        the time it is reopened). None where that is not possible (a remote store, an
        empty file, no /proc): read bytes instead. How the file is read in (mapped, or
        read whole; in the memory tier, marked in use for as long as the mapping lives):
        see mapped_reads.read_in. A memory-tier file recycled before the mark raises
        `MissingFileError`, as if it were gone.

        With `algo` (a checksum algorithm), a file mapped from a local disk is hashed
        while it is read, and `checksum` is its checksum under `algo`; elsewhere (and
        without `algo`) `checksum` is None and the caller hashes `view`.
        """
        if not self.is_local:
            yield None
            return
        with contextlib.ExitStack() as stack:
            with self._translated(self.display(*parts)):
                read = stack.enter_context(self._local().read_local(parts, algo=algo))
            yield read  # the caller's code: its errors are its own

    def read_appended(self, *parts: str) -> bytes | None:
        """Everything `append_text` appended to a file, in order (None if never written);
        on object stores a file written whole at that name comes first (see remote.py)."""
        return self._call(parts, lambda: self._backend.read_appended(parts))

    # writing -----------------------------------------------------------------------
    def make_dir(self, *parts: str) -> None:
        """Create the folder `parts` (and the root); on local disks make the entry durable.
        Object stores have no empty folders: there a folder appears with its first file
        (the container of an `az://` root is created if it is missing)."""
        self._call(parts, lambda: self._backend.make_dir(parts))

    def make_new_dir(self, *parts: str) -> bool:
        """`make_dir`, and whether the folder is new: True when this call made it, False
        when something was at that name already (on an object store: a file under it).

        Example:
            >>> import tempfile
            >>> store = Store(tempfile.mkdtemp())
            >>> store.make_new_dir("t1"), store.make_new_dir("t1")
            (True, False)
            >>> Store(tempfile.mkdtemp() + "/not/yet").make_new_dir("t1")  # the root made too
            True
        """
        if self.is_local:
            return self._call(parts, lambda: self._local().make_new_dir(parts))
        existed = self.exists(*parts)
        self.make_dir(*parts)
        return not existed

    def link(self, source: tuple[str, ...], parts: tuple[str, ...]) -> bool:
        """On a local root, give the file `source` the name `parts` too (a hard link: it
        appears whole, as a `publish` does, with one system call); False where it cannot
        (not local, no such file, the name taken, no hard links): write the file instead."""
        return self._if_local(parts, lambda local: local.link(source, parts), False)

    @contextlib.contextmanager
    def open_write(
        self, *parts: str, sent: Callable[[int], None] | None = None
    ) -> Iterator[BinaryIO]:
        """Write a file; it is durable when the block exits, and removed if it raises.

        On Azure the file is uploaded in blocks, several in flight, while the block runs,
        and appears (whole) only when the block exits. `sent(n)` is called as `n` more
        bytes have reached the store: on Azure as each block's upload completes (from
        another thread), elsewhere as each write returns.
        """
        where = self.display(*parts)
        if self.is_local:
            with self._translated(where):
                writer = self._local().open_write(parts)
            try:
                with self._translated(where):
                    yield writer if sent is None else CountedWriter(writer, sent)  # type: ignore[misc]
            except BaseException:
                writer.abort()
                raise
            with self._translated(where):
                writer.close()
            return
        raw = self._call(parts, lambda: self._backend.open_write(parts))
        # A writer that retries each request itself: its error is the last of those tries.
        tries = self.policy.retries + 1 if self._backend.writer_retries else 1

        def translated(fn: Callable[[], Any]) -> Any:
            with translate_errors(where, self._secrets, remote=True, tries=tries):
                return self._bounded(fn, redact(where, self._secrets))

        if sent is not None and hasattr(raw, "on_sent"):
            raw.on_sent, sent = sent, None  # the writer says when its uploads complete
        remote = RemoteWriter(raw, translated, sent)
        try:
            with translate_errors(where, self._secrets):
                yield remote  # type: ignore[misc]
            remote.finish()
        except BaseException:
            remote.abort()
            if self._backend.aborted_write_may_leave_file:
                with contextlib.suppress(NebulaError):
                    self.remove(*parts)
            raise

    def write_view(
        self,
        parts: tuple[str, ...],
        view: memoryview,
        each: Callable[[memoryview], None],
        sent: Callable[[int], None] | None = None,
    ) -> None:
        """Write `view` (page-aligned memory, such as `map_read`'s) as the file `parts`,
        durable on return and removed if this raises; `each(piece)` (a hash update) runs on
        every piece, in order, while the piece before it is written; `sent(n)` as
        `open_write`'s.

        On a local disk the pieces go with O_DIRECT where the filesystem allows it
        (local_files.DirectFile); other stores take them through `open_write`.
        """
        if self.is_local:
            with self._translated(self.display(*parts)):
                self._local().write_view(parts, view, each, sent)
            return
        with self.open_write(*parts, sent=sent) as f:

            def write(piece: memoryview, _offset: int) -> None:
                f.write(piece)

            write_view_chunks(write, view, each)

    @property
    def clones(self) -> bool:
        """Whether `write_ranges` can take ranges from an earlier file of this store
        instead of writing them: where the backend declares clones (a local root:
        `copy_file_range`, reflinks on XFS and btrfs) or server-side range copies (Azure's
        Put Block From URL, S3's UploadPartCopy)."""
        return self.capabilities.clones or self.capabilities.range_copy

    def write_ranges(
        self,
        parts: tuple[str, ...],
        view: memoryview,
        ranges: Iterable[tuple[int, int, bool]],
        base: tuple[str, ...] | None,
        sent: Callable[[int], None] | None = None,
        *,
        base_stamp: str | None = None,
    ) -> Written:
        """Write `view` as the file `parts`, whole on return (durable, or committed) and
        never left half-written if this raises: each range (offset, length, reuse) with
        `reuse` set is taken from the file `base` of this store, which holds the same bytes
        there, where the store can (`clones`); the others, and all of them elsewhere, are
        written from `view`. On Azure and S3 `base` must still be the object of ETag
        `base_stamp` (what an earlier `write_ranges` returned; without one nothing is
        copied), and what it cannot give is uploaded; on a local root nothing is taken
        from `base` unless it is still the file of `base_stamp` when one is given, and an
        item reused whole is linked only then (LocalBackend.write_ranges). Returns (bytes
        written, bytes taken from `base`, the new file's stamp: its ETag on Azure and S3,
        `file_stamp` on a local root, else None); `sent(n)` as `open_write`'s."""
        if self.is_local and self.capabilities.clones:
            with self._translated(self.display(*parts)):
                return self._local().write_ranges(parts, view, ranges, base, sent, base_stamp)
        if self.capabilities.range_copy:
            # Each request is retried by the backend: its error is the last of those tries.
            tries = self.policy.retries + 1
            where = self.display(*parts)
            backend, progress = cast(RangeCopyBackend, self._backend), Progress()

            def write() -> Written:
                def moved(n: int) -> None:
                    progress.touch()
                    if sent is not None:
                        sent(n)

                return backend.write_ranges(parts, view, list(ranges), base, base_stamp, moved)

            with translate_errors(where, self._secrets, remote=True, tries=tries):
                return self._bounded(write, redact(where, self._secrets), progress)
        self.write_view(parts, view, lambda _piece: None, sent)
        return Written(len(view), 0)

    def write_bytes(self, parts: tuple[str, ...], data: bytes, *, durable: bool = True) -> None:
        """Write (or replace) a small file, durably unless `durable=False` (a lease or a
        claim: it speaks to live processes only, and a crash leaves none of them)."""
        if not durable and self.is_local:
            with self._translated(self.display(*parts)):
                writer = self._local().open_write(parts, durable=False)
                try:
                    writer.write(data)
                except BaseException:
                    writer.abort()
                    raise
                writer.close()
            return
        with self.open_write(*parts) as f:
            f.write(data)

    def publish(self, parts: tuple[str, ...], data: bytes, *, create_only: bool = True) -> None:
        """Make a small file appear whole, or not at all (the commit point of a tag).

        Raises `CommitConflictError` if `create_only` and it exists: local disks hard-link
        a temporary file into place, Azure uploads with `If-None-Match: *`, other stores
        create exclusively (each backend's `publish`). On Azure, a retried create that
        finds exactly its own bytes there is a success, not a conflict.
        """

        def create() -> None:
            try:
                self._backend.publish(parts, data, create_only=create_only)
            except FileExistsError as exc:
                raise self._conflict(parts) from exc

        self._call(parts, create)

    def _conflict(self, parts: tuple[str, ...]) -> CommitConflictError:
        # parts is (tag, file): the conflict is about the tag, at the root.
        if len(parts) >= 2:
            return CommitConflictError(self.display(*parts[:-2]), parts[-2])
        return CommitConflictError(self.url, parts[-1])

    def append_text(self, parts: tuple[str, ...], text: str) -> None:
        """Append text to a file (created if missing); read it back with `read_appended`.

        Concurrent writers never lose each other's appends (local disks: one O_APPEND
        write; object stores: a new object `.<file>.d/<UTC time>-<random>.part` each, see
        remote.py), and a retried append is not written twice.
        """
        data, append_id = text.encode("utf-8"), new_append_id()  # one id for every retry
        self._call(parts, lambda: self._backend.append(parts, data, append_id=append_id))

    def rotate_appended(self, parts: tuple[str, ...], max_bytes: int, head: str) -> bool:
        """Keep a file `append_text` writes to about twice `max_bytes`: once it holds
        `max_bytes`, it becomes `<file>.1` (the one before removed) and a new file holding
        `head` starts (local disks; never through a symbolic link); on object stores the
        oldest appended objects beyond `2 * max_bytes` are removed. Whether it did."""
        data = head.encode("utf-8")
        return self._call(parts, lambda: self._backend.rotate_appended(parts, max_bytes, data))

    def remove(self, *parts: str, durable: bool = True) -> None:
        """Remove one file; a missing file is not an error. On a local disk the removal
        is durable on return (the folder fsynced) unless `durable=False`: a file that
        goes after its checkpoint's manifest, which a crash may bring back only as a
        leftover that recovery clears."""
        if not durable and self.is_local:
            self._call(parts, lambda: self._local().remove(parts, sync=False))
            return
        self._call(parts, lambda: self._backend.remove(parts))

    def clear_squatter(self, *parts: str) -> bool:
        """On a local root, remove what another hand put at `parts` where nebula writes a
        file of its own, if it is not a regular file (a FIFO, a symbolic link, an empty
        folder): a create-only publish would take it for a file written first. Whether
        it removed one; False elsewhere (an object store's name is always a blob)."""
        return self._if_local(parts, lambda local: local.clear_squatter(parts), False)

    def sync_folder(self, *parts: str) -> None:
        """Make what was removed from (or added to) the folder `parts` durable: on a local
        disk the folder is fsynced; object stores have nothing to do (a request that
        returned is durable)."""
        if self.is_local:
            self._call(parts, lambda: self._local().sync_dir(parts))

    def remove_dir(self, *parts: str, files: Iterable[str] | None = None) -> None:
        """Remove a folder that holds only files (a tag folder); missing is not an error.
        `files`: its files as the caller has just listed them (a file added since makes
        the removal fail, as a folder not empty)."""
        for name in self.list_files(*parts) if files is None else files:
            self.remove(*parts, name, durable=False)
        self._call(parts, lambda: self._backend.remove_dir(parts))
