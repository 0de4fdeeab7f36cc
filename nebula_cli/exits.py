"""How a command fails: an expected failure (`nebulaml.NebulaError`) becomes one line,
`nebula: error: ...`, and an exit code: 1 for errors, 2 for usage, 3 for "not found",
with the closest names the root has when a tag or an item is not there; a warning is one
line too, `nebula: warning: ...`.

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

from .console import printable
from .options import parse_storage_options

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    """Print `nebula: error: message` on stderr and exit with `code`."""
    sys.stderr.write(f"nebula: error: {printable(message)}\n")
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

        from .logs import command_logging

        options = parse_storage_options(kwargs.get("storage_option"))
        quiet, verbose = bool(kwargs.get("quiet")), bool(kwargs.get("verbose"))
        try:
            with nm.using_storage_options(options), command_logging(quiet, verbose):
                return func(*args, **kwargs)
        except nm.RootNotFoundError as exc:
            fail(str(exc), EXIT_NOT_FOUND)
        except nm.CheckpointNotFoundError as exc:
            hint = ""
            if exc.tag and kwargs.get("root") is not None:
                with nm.using_storage_options(options):
                    hint = tag_hint(kwargs["root"], exc.tag)
            fail(str(exc) + hint, EXIT_NOT_FOUND)
        except nm.ItemNotFoundError as exc:
            fail(str(exc) + suggestion(exc.name, list(exc.available)), EXIT_NOT_FOUND)
        except nm.InvalidArgumentError as exc:  # a bad tag or item name: a usage error
            fail(str(exc), EXIT_USAGE)
        except nm.NebulaError as exc:
            fail(str(exc), EXIT_ERROR)

    return wrapper  # type: ignore[return-value]


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
