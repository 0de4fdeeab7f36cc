"""How a command fails: an expected failure (`nebulaml.NebulaError`) becomes one line,
`nebula: error: ...`, and an exit code: 1 for errors (a command that did not do what it
was asked included), 2 for usage, 3 for "not found", with the closest names the root has
when a tag or an item is not there, 4 for a prompt answered no; a warning is one line too,
`nebula: warning: ...`. A command given --json that fails before it wrote its document
writes an error object instead (`json_error`): stdout holds one JSON document either way.

`handles_errors` runs each command: its storage options given to every root it opens by
URL, the library's log on stderr (logs.py), and its errors turned into those lines.

May import: console.py, options.py, logs.py, the standard library and typer; nebulaml
inside the functions that call it (`nebula --help` imports no torch).
Not for: usage errors of the command line itself (help.py) or the options (options.py).
"""

from __future__ import annotations

import difflib
import functools
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import typer

from .console import JSON_STATE, emit_json, printable
from .options import parse_storage_options

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_DECLINED = 0, 1, 2, 3, 4
# What --json's error object calls each exit code (`kind`).
KINDS = {EXIT_ERROR: "error", EXIT_USAGE: "usage", EXIT_NOT_FOUND: "not_found",
         EXIT_DECLINED: "declined"}  # fmt: skip

F = TypeVar("F", bound=Callable[..., Any])


def json_error(message: str, code: int, exception: str | None = None) -> None:
    """With --json, when the command has written no document: write the error object,
    `{"error": {"kind", "exit_code", "message", "exception"}}` (`exception`: the
    library's error class, e.g. "CheckpointNotFoundError", or null)."""
    state = JSON_STATE.get()
    if state is None or not state["wanted"] or state["written"]:
        return
    kind = KINDS.get(code, "error")
    emit_json({"error": {"kind": kind, "exit_code": code, "message": message,
                         "exception": exception}})  # fmt: skip


def fail(message: str, code: int = EXIT_ERROR, exception: str | None = None) -> NoReturn:
    """Print `nebula: error: message` on stderr (and, with --json, the error object on
    stdout: `json_error`) and exit with `code`."""
    sys.stderr.write(f"nebula: error: {printable(message)}\n")
    json_error(message, code, exception)
    raise typer.Exit(code)


def warn(message: str) -> None:
    """Print `nebula: warning: message` on stderr."""
    sys.stderr.write(f"nebula: warning: {printable(message)}\n")


def handles_errors(func: F) -> F:
    """Turn `NebulaError`s raised by a command into one stderr line and an exit code.

    A command that declares `storage_option: StorageOpt` runs with those options given to
    every root it opens by URL (`nebulaml.using_storage_options`). While it runs, storage
    retries are reported on stderr (unless it was given `quiet`), and so are the library's
    warnings; the storage SDKs' own log is not, unless it was given `verbose` (logs.py).
    A tag that is not there is answered with the closest tags the root has.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import nebulaml as nm

        state = JSON_STATE.set({"wanted": bool(kwargs.get("as_json")), "written": False})
        try:
            return _run(nm, func, args, kwargs)
        finally:
            JSON_STATE.reset(state)

    return wrapper  # type: ignore[return-value]


def _run(nm: Any, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
    """`func(*args, **kwargs)` as `handles_errors` runs it."""
    from .logs import command_logging

    options = parse_storage_options(kwargs.get("storage_option"))
    quiet, verbose = bool(kwargs.get("quiet")), bool(kwargs.get("verbose"))
    try:
        with nm.using_storage_options(options), command_logging(quiet, verbose):
            return func(*args, **kwargs)
    except nm.NebulaError as exc:
        name = type(exc).__name__
        if isinstance(exc, nm.RootNotFoundError):
            fail(str(exc), EXIT_NOT_FOUND, name)
        if isinstance(exc, nm.CheckpointNotFoundError):
            hint = ""
            if exc.tag and kwargs.get("root") is not None:
                with nm.using_storage_options(options):
                    hint = tag_hint(kwargs["root"], exc.tag)
            fail(str(exc) + hint, EXIT_NOT_FOUND, name)
        if isinstance(exc, nm.ItemNotFoundError):
            fail(str(exc) + suggestion(exc.name, list(exc.available)), EXIT_NOT_FOUND, name)
        if isinstance(exc, nm.InvalidArgumentError):  # a bad tag or item name: a usage error
            fail(str(exc), EXIT_USAGE, name)
        fail(str(exc), EXIT_ERROR, name)


def tag_hint(root: str, tag: str) -> str:
    """`; did you mean 'global_step300'?` (the closest committed tags of `root`), or a
    pointer to `nebula ls`; empty when the root cannot be listed."""
    import nebulaml as nm

    try:
        tags = [c["tag"] for c in nm.list_checkpoints(root, hold=False)]
    except nm.NebulaError:
        return ""
    return suggestion(tag, tags, f"; see nebula ls {root}")


def suggestion(word: str, choices: list[str], otherwise: str = "") -> str:
    """`; did you mean 'x'?` for the closest of `choices`, else `otherwise`.

    Example:
        >>> suggestion("global_step30", ["global_step300", "global_step200", "best"])
        "; did you mean 'global_step300' or 'global_step200'?"
    """
    close = difflib.get_close_matches(word, choices, n=3, cutoff=0.6)
    if not close:
        return otherwise if choices else ""
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?"
