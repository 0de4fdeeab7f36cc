"""What a storage backend does for `Store`: the `Backend` protocol, one set of primitives.

`Store` (store.py) is the facade every other layer uses; underneath it one backend per
root does the actual I/O:

- `LocalBackend` (local.py): local disks, and the memory tier (a private, non-durable
  local root);
- `RemoteBackend` (remote.py): any other fsspec store (memory://, S3, GCS, ...);
- `AzureBackend` (azure.py): Azure Blob Storage and ADLS Gen2 through adlfs.

A backend's methods take a path inside the root as parts (`("global_step5", "model")`)
and raise its library's own exceptions (`OSError`, the Azure SDK's, ...): `Store` retries
them on network stores and translates them to `StorageError`, with secrets redacted. The
contract below (missing files, conflicts, appends) is what tests/core/test_store_contract.py
runs against every backend.

Not for: error translation or retries (store.py, failures.py, retry.py), nor any one
backend's specifics (local.py, remote.py, azure.py). May import: `nebulaml.errors`.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any, NamedTuple, Protocol, runtime_checkable

Parts = tuple[str, ...]


class Written(NamedTuple):
    """What a write by ranges did (`Store.write_ranges`): bytes written (sent, on a
    network store), bytes taken from the earlier file instead, and the store's name for
    the new file's version (an Azure ETag; None where the store has none).

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
