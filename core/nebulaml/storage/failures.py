"""What a storage backend's failure becomes: `StorageError` and its subclasses, redacted.

`translate_errors` maps a backend's exceptions to `StorageError` (and subclasses: a missing
file is `MissingFileError`, a full disk `StorageFullError`), with secrets redacted from the
message and from the chained exceptions; `describe` and `local_failure` say in one line
what went wrong.

May import: `nebulaml.errors` and storage/'s redaction.py, retry.py. Not for: the storage
operations themselves (store.py and its backends), retries (retry.py) or the streams whose
errors are translated (local_files.py, remote_streams.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

from nebulaml.errors import NebulaError, StorageError, StorageFullError
from nebulaml.storage.redaction import redact, scrub_exception
from nebulaml.storage.retry import is_transient

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


class MissingFileError(StorageError, FileNotFoundError):
    """A file or folder the caller asked for is not there."""


def describe(exc: BaseException) -> str:
    """One line about a backend error (an HTTP error's first line, status and code)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    status = getattr(exc, "status_code", None)
    code = getattr(exc, "error_code", None)
    extra = ", ".join(str(x) for x in (f"HTTP {status}" if status else None, code) if x)
    line = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return f"{line} ({extra})" if extra else line


@contextlib.contextmanager
def translate_errors(
    what: str, secrets: tuple[str, ...] = (), *, remote: bool = False, tries: int = 1
) -> Iterator[None]:
    """Map backend exceptions to `StorageError` (and subclasses) naming `what`.

    `remote`: every exception of the block is a storage library's (the block holds only
    backend calls), so anything not ours becomes a `StorageError`; `tries` is how many
    attempts were made, for the message of a transient error that outlived them.
    Messages are redacted, and so are the chained backend exceptions.
    """
    try:
        yield
    except NebulaError:
        raise  # already ours (a commit conflict is a FileExistsError too)
    except FileNotFoundError as exc:
        scrub_exception(exc, secrets)
        raise MissingFileError(redact(f"{what}: not found", secrets)) from exc
    except OSError as exc:
        scrub_exception(exc, secrets)
        if exc.errno in _FULL_ERRNOS:
            message = redact(f"{what}: storage is full ({exc.strerror})", secrets)
            raise StorageFullError(exc.errno, message) from exc
        failure = _failure(exc, remote, tries, what)
        raise StorageError(redact(f"{what}: {failure}", secrets)) from exc
    except Exception as exc:
        if not remote:
            raise
        scrub_exception(exc, secrets)
        raise StorageError(redact(f"{what}: {_failure(exc, remote, tries)}", secrets)) from exc


def _failure(exc: BaseException, remote: bool, tries: int, what: str = "") -> str:
    if not remote:
        return local_failure(exc, what) if isinstance(exc, OSError) else str(exc)
    text = describe(exc)
    if tries > 1 and is_transient(exc):
        text += (
            f"; gave up after {tries} tries (set storage option nebula_retries or "
            f"NEBULA_STORAGE_RETRIES for more)"
        )
    return text


def local_failure(exc: OSError, what: str = "") -> str:
    """What a local file operation's error says after the path it is about (`what`): the
    system's words without `[Errno N]` and without the path again (the file the system
    names is added when it is another); a permission refused says what to do.

    Example:
        >>> refused = PermissionError(13, "Permission denied", "/ckpt/run1")
        >>> local_failure(refused, "/ckpt/run1")  # doctest: +ELLIPSIS
        'permission denied to user ...; ask for access (ls -ld shows the owner and mode) or ...'
        >>> local_failure(NotADirectoryError(20, "Not a directory", "/ckpt/run1/x"), "/ckpt/run1")
        'Not a directory on /ckpt/run1/x'
    """
    text = exc.strerror or str(exc)
    named = os.fsdecode(exc.filename) if exc.filename is not None else ""
    where = f" on {named}" if named and named.rstrip("/") != what.rstrip("/") else ""
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (
            f"{text[:1].lower()}{text[1:]}{where} to user {_user()}; ask for access (ls -ld "
            "shows the owner and mode) or run as a user who has it"
        )
    return text + where


def _user() -> str:
    import pwd

    uid = os.geteuid()
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
