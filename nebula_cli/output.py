"""What every command shares: the two consoles, JSON output, error exits, formatting.

Data goes to stdout (a rich table, or one JSON document with --json); progress, warnings
and hints go to stderr. An expected failure (`nebulaml.NebulaError`) becomes one line,
`nebula: error: ...`, and an exit code: 1 for errors, 3 for "not found".

Not for: checkpoint logic (nebulaml) or command options (each command's module).
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3

RootArg = Annotated[
    str,
    typer.Argument(
        metavar="ROOT",
        help="Checkpoint root: a path or an fsspec URL (its memory tier on this node is included).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
StorageOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--storage-option",
        metavar="KEY=VALUE",
        show_default=False,
        help="An fsspec storage option for URL roots, repeatable: e.g. account_name=ACCOUNT "
        "with sas_token=... or account_key=..., or connection_string=... (az://). Without "
        "it Azure credentials come from AZURE_STORAGE_CONNECTION_STRING, "
        "AZURE_STORAGE_ACCOUNT_NAME with _KEY or _SAS_TOKEN, else DefaultAzureCredential.",
    ),
]

F = TypeVar("F", bound=Callable[..., Any])


def stdout() -> Console:
    """The data console (built per call so that CliRunner's captured streams are used)."""
    return Console(file=sys.stdout, soft_wrap=True)


def stderr() -> Console:
    """The diagnostics console: progress, warnings, hints."""
    return Console(file=sys.stderr, soft_wrap=True)


def emit_json(doc: Any) -> None:
    """Write exactly one JSON document to stdout."""
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    """Print `nebula: error: message` on stderr and exit with `code`."""
    sys.stderr.write(f"nebula: error: {message}\n")
    raise typer.Exit(code)


def print_table(table: Table, narrow: Table | None = None, console: Console | None = None) -> None:
    """Print a table on stdout, never cutting a cell.

    Off a terminal (a pipe, a file) it is printed at its full width: one line a row. On a
    terminal too narrow for it, `narrow` is printed instead if given (the same rows with
    fewer columns: long cells stacked in one), fitted to the terminal; give the columns
    that hold roots, tags, paths or reasons `overflow="fold"` (folded, never cut).
    """
    out = console or stdout()
    full = Measurement.get(out, out.options.update_width(1 << 20), table).maximum
    if not out.is_terminal:
        out.width = max(out.width, full)
    elif narrow is not None and full > out.width:
        table = narrow
    out.print(table)


def confirm(question: str, refusal: str, declined: str) -> None:
    """Ask `question` (y/N, on stderr) before a command deletes or releases something.

    Off a terminal there is no one to ask: fail with `refusal` (`--yes` is needed there).
    A "no" prints `declined` and exits 1.

    Example: confirm("Release 2 memory tier(s)?", f"{base}: 2 memory tier(s) to release;
    refusing to release without --yes when not on a terminal (add --yes, or --dry-run to
    see the plan only)", "Nothing released.")
    """
    if not sys.stdin.isatty():
        fail(refusal)
    if not typer.confirm(question, default=False, err=True):
        stderr().print(declined, highlight=False)
        raise typer.Exit(EXIT_ERROR)


def parse_storage_options(items: list[str] | None) -> dict[str, str]:
    """`--storage-option KEY=VALUE` values as a dict (a later KEY wins).

    A malformed one is a usage error that never repeats what was given: it may hold a
    secret.

    Example:
        >>> parse_storage_options(["account_name=acct", "sas_token=sv=1&sig=x"])
        {'account_name': 'acct', 'sas_token': 'sv=1&sig=x'}
    """
    options: dict[str, str] = {}
    for number, item in enumerate(items or [], start=1):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():  # e.g. a key pasted without its name
            raise typer.BadParameter(
                f"storage option #{number} is not KEY=VALUE (KEY a name like account_name)",
                param_hint="--storage-option",
            )
        options[key] = value
    return options


def handles_errors(func: F) -> F:
    """Turn `NebulaError`s raised by a command into one stderr line and an exit code.

    A command that declares `storage_option: StorageOpt` runs with those options given to
    every root it opens by URL (`nebulaml.using_storage_options`).
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import nebulaml as nm

        options = parse_storage_options(kwargs.get("storage_option"))
        try:
            with nm.using_storage_options(options):
                return func(*args, **kwargs)
        except (nm.CheckpointNotFoundError, nm.ItemNotFoundError) as exc:
            fail(str(exc), EXIT_NOT_FOUND)
        except nm.InvalidArgumentError as exc:  # a bad tag or item name: a usage error
            fail(str(exc), EXIT_USAGE)
        except nm.NebulaError as exc:
            fail(str(exc), EXIT_ERROR)

    return wrapper  # type: ignore[return-value]


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'.

    Example:
        >>> human_bytes(1536), human_bytes(12)
        ('1.5 KiB', '12 B')
    """
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_time(iso: str) -> datetime:
    """Parse nebula's ISO-8601 UTC timestamps ('...Z')."""
    return datetime.fromisoformat(iso.replace("Z", "+00:00"))


def human_age(iso: str, now: datetime | None = None) -> str:
    """How long ago an ISO-8601 UTC time was: '42s', '5m', '3h', '2d'.

    Example:
        >>> human_age("2026-01-01T00:00:00Z", parse_time("2026-01-01T03:10:00Z"))
        '3h'
    """
    now = now or datetime.now(timezone.utc)
    seconds = max(0.0, (now - parse_time(iso)).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"
