"""What a storage backend does for `Store`: the `Backend` protocol, one set of primitives,
and the `Capabilities` each backend declares.

`Store` (store.py) is the facade every other layer uses; underneath it one backend per
root does the actual I/O, opened by the factory registered for the root's protocol
(registry.py; the built-in ones: builtins.py):

- `LocalBackend` (local.py): local disks, and the memory tier (a private, non-durable
  local root);
- `RemoteBackend` (remote.py): any other fsspec store (memory://, ...);
- `S3Backend` (s3.py): Amazon S3 and S3-compatible servers (MinIO, Ceph, R2) through s3fs;
- `GCSBackend` (gcs.py): Google Cloud Storage (and its emulators) through gcsfs;
- `AzureBackend` (azure.py): Azure Blob Storage and ADLS Gen2 through adlfs.

What a backend can do beyond the primitives is what it declares (`capabilities`), never
guessed from its class or its protocol's name: `Store` asks the capabilities, and uses the
wider protocols below (`LocalPathBackend`, `RangeCopyBackend`) only where they say so.

A backend's methods take a path inside the root as parts (`("global_step5", "model")`)
and raise its library's own exceptions (`OSError`, the Azure SDK's, ...): `Store` retries
them on network stores and translates them to `StorageError`, with secrets redacted. The
contract below (missing files, conflicts, appends) is what tests/core/test_store_contract.py
runs against every backend.

Not for: error translation or retries (store.py, failures.py, retry.py), nor any one
backend's specifics (local.py, remote.py, s3.py, gcs.py, azure.py). May import: `nebulaml.errors`,
and storage/'s mapped_reads.py for types only.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    from nebulaml.storage.mapped_reads import Lender, LocalRead

Parts = tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do beyond the primitives of `Backend`, as it declares it.

    - `atomic_create`: `publish(create_only=True)` is atomic: of two creates of one name
      exactly one succeeds, the other raises `FileExistsError` (a hard link; a conditional
      PUT with `If-None-Match: *`). The commit protocol relies on it; a persistent root
      whose backend does not declare it (or whose probe at init shows otherwise) is
      refused unless the user opts into single-writer mode (storage/atomic_probe.py).
    - `object_appends`: `append` keeps each append as an object of its own (an object
      store has no append), so concurrent writers lose none; otherwise the backend's
      own append is atomic (O_APPEND on a local disk).
    - `range_copy`: `write_ranges` can have the server copy unchanged ranges of an earlier
      file (Azure's Put Block From URL, S3's UploadPartCopy): the backend is a
      `RangeCopyBackend`.
    - `clones`: `write_ranges` can clone unchanged ranges of an earlier local file
      (`copy_file_range`, reflinks).
    - `local_path`: the root is a folder of this machine's filesystem: paths are OS
      paths, and the backend is a `LocalPathBackend` (durable writes, mapped reads,
      links, folder fsyncs).

    Example:
        >>> caps = Capabilities(atomic_create=True, object_appends=True)
        >>> caps.atomic_create, caps.local_path
        (True, False)
    """

    atomic_create: bool = False
    object_appends: bool = False
    range_copy: bool = False
    clones: bool = False
    local_path: bool = False


class Written(NamedTuple):
    """What a write by ranges did (`Store.write_ranges`): bytes written (sent, on a
    network store), bytes taken from the earlier file instead, and the store's name for
    the new file's version (an Azure or S3 ETag, a local file's `file_stamp`; None where
    the store has none).

    Example:
        >>> Written(10, 90).stamp is None
        True
    """

    written: int
    reused: int
    stamp: str | None = None


class Writer(Protocol):
    """A file being written by `Backend.open_write`."""

    def write(self, data: Any) -> int: ...

    def close(self) -> None:
        """Finish the file: whole (and durable, or committed) once this returns."""


@runtime_checkable
class Backend(Protocol):
    """The primitive operations of one checkpoint root, implemented once per backend.

    A missing file or folder is never an error where the contract says what it gives
    instead (an empty listing, None, nothing to remove); elsewhere it raises
    `FileNotFoundError`.
    """

    root: str
    """The root's path in the backend (an absolute OS path, or `container/run1`)."""

    url: str
    """The root as nebula shows and compares it: a URL that parses back to the same root
    (`s3://bucket/run1`), or the OS path of a local root."""

    location: str
    """What this root is, whatever name reached it (a local root's real path; a remote
    one's protocol, endpoint and path, never a secret): two stores with one location are
    one root."""

    capabilities: Capabilities
    """What this backend can do beyond the primitives (see `Capabilities`)."""

    writer_retries: bool
    """`open_write`'s writer retries each request itself (Azure's block uploads), so its
    error is the last of the store's retries; otherwise a write is tried once."""

    aborted_write_may_leave_file: bool
    """A writer that is abandoned may have left a partial file, which `Store` removes."""

    def path(self, parts: Parts) -> str:
        """The backend path of `parts` under the root."""

    def exists(self, parts: Parts) -> bool:
        """Whether a file or folder is at `parts` (on local disks: the name itself, even a
        symbolic link)."""

    def list_folders(self, parts: Parts) -> list[str]:
        """Names of the folders directly inside `parts`, hidden ones (".x") excluded;
        empty if `parts` is missing. On object stores a folder exists while it holds a
        file."""

    def list_files(self, parts: Parts) -> dict[str, int]:
        """Files directly inside the folder `parts` (hidden ones included), with their
        sizes in bytes; empty if the folder is missing."""

    # Optional: `list_prefixed(parts, prefix)` (`PrefixListingBackend`). A backend without
    # it is listed whole and filtered by `Store.list_prefixed`.

    def modified_at(self, parts: Parts) -> datetime | None:
        """A file's modification time (UTC); None if the file is gone or the backend
        cannot tell."""

    def read_bytes(self, parts: Parts) -> bytes:
        """A whole file."""

    def open_read(self, parts: Parts) -> Any:
        """A binary stream of a file (read, readinto, seek, tell, close)."""

    def make_dir(self, parts: Parts) -> None:
        """Make the folder `parts` (and the root) exist, where the backend has folders."""

    def open_write(self, parts: Parts) -> Writer:
        """A new file at `parts` (replacing any), written through the returned writer;
        the caller closes it, or abandons it (`abort()` when it has one)."""

    def publish(self, parts: Parts, data: bytes, *, create_only: bool) -> None:
        """Make a small file appear whole, or not at all. Raises `FileExistsError` if
        `create_only` and a file is there already."""

    def append(self, parts: Parts, data: bytes, *, append_id: str) -> None:
        """Add `data` at the end of the file `parts` (created if missing), never losing
        what concurrent writers append. `append_id` (`new_append_id()`) is unique to this
        append and the same on each retry of it: a store that keeps each append as an
        object of its own names that object with it, so a retry never adds it twice."""

    def read_appended(self, parts: Parts) -> bytes | None:
        """Everything `append` added to a file, in order; None if it was never written."""

    def rotate_appended(self, parts: Parts, max_bytes: int, head: bytes) -> bool:
        """Bound what `append` keeps of the file `parts`: a file (with its appends) of
        `max_bytes` or more becomes `<file>.1`, replacing the one before, and a new file
        starts with `head`; a store that keeps each append as an object removes instead
        the oldest ones beyond `2 * max_bytes`. Whether it rotated or removed anything."""

    def remove(self, parts: Parts) -> None:
        """Remove one file (on local disks a symbolic link there: the name alone); a
        missing file is not an error."""

    def remove_dir(self, parts: Parts) -> None:
        """Remove the folder `parts`, emptied by the caller; a missing one is not an
        error."""


def new_append_id() -> str:
    """A name for one append: its UTC time, so that names sort in the order appends were
    made, and a random part, so that two writers never pick the same.

    Example:
        >>> a, b = new_append_id(), new_append_id()
        >>> len(a) == len(b) == 35 and a != b
        True
    """
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    return f"{stamp}-{uuid.uuid4().hex[:12]}"


class OpenRequest:
    """What `Store` gives a backend factory (registry.py) to open one root.

    `url` is the root as the user gave it, `protocol` its protocol (None for a plain
    path), `options` its storage options (nebula's own retry options taken out); `durable`
    and `private` are `Store`'s (for a local root: fsync, and this user's alone); `policy`
    is the retry policy (a backend that retries each request itself uses it); `name(parts)`
    names a file in a log line and `describe(exc)` says what went wrong, both without
    secrets. A factory that knows of secrets the options do not show (a credential from
    the environment) adds them with `add_secrets` before it does anything that may fail,
    so that no message shows them.

    Example:
        >>> request = OpenRequest("memory://run1", "memory", {})
        >>> request.add_secrets(["s3cret"]); request.secrets
        ['s3cret']
    """

    def __init__(
        self,
        url: str,
        protocol: str | None,
        options: dict[str, Any],
        *,
        durable: bool = True,
        private: bool = False,
        policy: Any = None,
        secrets: list[str] | None = None,
        name: Callable[[Parts], str] | None = None,
        describe: Callable[[BaseException], str] | None = None,
    ) -> None:
        self.url, self.protocol, self.options = url, protocol, options
        self.durable, self.private, self.policy = durable, private, policy
        self.secrets: list[str] = secrets if secrets is not None else []
        self.name: Callable[[Parts], str] = name or (lambda parts: "/".join([url, *parts]))
        self.describe: Callable[[BaseException], str] = describe or str

    def add_secrets(self, values: Iterable[str | None]) -> None:
        """Mask `values` (the non-empty strings among them) in every message about this
        root, from now on."""
        for value in values:
            if isinstance(value, str) and value and value not in self.secrets:
                self.secrets.append(value)


class LocalPathBackend(Backend, Protocol):
    """A backend whose root is a local folder (`Capabilities.local_path`): what `Store`
    does there beyond the primitives (local.py's `LocalBackend` is the one)."""

    durable: bool
    private: bool

    def open_write(self, parts: Parts, *, durable: bool = True) -> Any: ...

    def make_new_dir(self, parts: Parts) -> bool: ...

    def link(self, source: Parts, parts: Parts) -> bool: ...

    def list_file_names(self, parts: Parts) -> list[str]: ...

    def list_non_files(self, parts: Parts) -> list[str]: ...

    def file_identity(self, parts: Parts) -> tuple[int, int, int] | None: ...

    def file_stamp(self, parts: Parts) -> str | None: ...

    def folder_identity(self, parts: Parts) -> tuple[int, int] | None: ...

    def map_read(
        self, parts: Parts, lend: Lender | None
    ) -> contextlib.AbstractContextManager[memoryview | None]: ...

    def read_local(
        self, parts: Parts, *, algo: str | None
    ) -> contextlib.AbstractContextManager[LocalRead | None]: ...

    def write_view(
        self,
        parts: Parts,
        view: memoryview,
        each: Callable[[memoryview], None],
        sent: Callable[[int], None] | None,
    ) -> None: ...

    def write_ranges(
        self,
        parts: Parts,
        view: memoryview,
        ranges: Iterable[tuple[int, int, bool]],
        base: Parts | None,
        sent: Callable[[int], None] | None = None,
        base_stamp: str | None = None,
    ) -> Written: ...

    def remove(self, parts: Parts, *, sync: bool = True) -> None: ...

    def clear_squatter(self, parts: Parts) -> bool: ...

    def sync_dir(self, parts: Parts) -> None: ...


@runtime_checkable
class PrefixListingBackend(Backend, Protocol):
    """A backend that lists a folder's files by the start of their names its own cheap
    way: what `Store.list_prefixed` asks where the backend has it (every built-in one
    does: a local folder's names filtered before any per-name work, one prefix listing
    with a delimiter on S3, GCS and Azure); a backend without it (a plugin's) has its
    folder listed whole by `list_files` and filtered instead, which is correct but costs
    as much as the folder holds."""

    def list_prefixed(self, parts: Parts, prefix: str) -> dict[str, int]:
        """The files directly inside the folder `parts` whose names begin with `prefix`
        (a name, no "/"; hidden ones included), with their sizes in bytes: what
        `list_files` gives of those names, never a folder (nor, on local disks, anything
        but a regular file); empty if the folder is missing or none matches."""


class RangeCopyBackend(Backend, Protocol):
    """A backend whose server copies ranges of an earlier file (`Capabilities.range_copy`):
    `write_ranges` writes `view` as `parts`, the ranges marked reused copied from `base`
    while it is still the version `base_stamp`, the rest uploaded; each request retried
    by the backend itself (azure.py's `AzureBackend` and s3.py's `S3Backend` are)."""

    def write_ranges(
        self,
        parts: Parts,
        view: memoryview,
        ranges: list[tuple[int, int, bool]],
        base: Parts | None,
        base_stamp: str | None,
        sent: Callable[[int], None] | None = None,
    ) -> Written: ...
