"""What every command shares: the two consoles, tables, JSON output, error exits,
formatting (progress: progress.py; what is logged: logs.py).

Data goes to stdout (a table, or one JSON document with --json); progress, retries,
warnings and hints go to stderr. An expected failure (`nebulaml.NebulaError`) becomes one
line, `nebula: error: ...`, and an exit code: 1 for errors, 2 for usage, 3 for "not found".

Tables never cut a cell: off a terminal (a pipe, a file) they are plain aligned text at
full width, one line a row; on a terminal too narrow for the boxed table, a narrower
layout is chosen (the caller's, then one without borders, then one record a row). Sizes
are IEC (KiB, MiB, GiB) everywhere, and so is a copy's progress rate (MiB/s); the
history's throughput is MB/s, the unit its file records (`throughput_mb_s`).

Not for: checkpoint logic (nebulaml) or command options (each command's module).
"""

from __future__ import annotations

import difflib
import functools
import json
import sys
import unicodedata
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from .complete import complete_item, complete_tag

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3

RootArg = Annotated[
    str,
    typer.Argument(
        metavar="ROOT",
        help="Checkpoint root: a path or an fsspec URL (its memory tier on this node is included).",
    ),
]
TagArg = Annotated[
    str,
    typer.Argument(
        metavar="TAG",
        help="The checkpoint's tag, e.g. global_step500.",
        autocompletion=complete_tag,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
QuietOpt = Annotated[
    bool,
    typer.Option(
        "--quiet",
        "-q",
        help="No progress and no retry notices on stderr (warnings and errors still).",
    ),
]
ROWS_SHOWN = 20  # rows of one kind a command shows without --verbose
VerboseOpt = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help=f"Show every row and tag (else the first {ROWS_SHOWN} of a kind, and a count).",
    ),
]
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


def item_option(help_text: str) -> Any:
    """`--item NAME` (completed from the checkpoint's items), with this help text."""
    return typer.Option("--item", metavar="NAME", help=help_text, autocompletion=complete_item)


F = TypeVar("F", bound=Callable[..., Any])


def stdout() -> Console:
    """The data console (built per call so that CliRunner's captured streams are used)."""
    return Console(file=sys.stdout, soft_wrap=True)


def stderr() -> Console:
    """The diagnostics console: progress, warnings, hints."""
    return Console(file=sys.stderr, soft_wrap=True)


def printable(text: str) -> str:
    """`text` with every control or format character escaped (`\\x1b`, `\\u202e`), and
    each byte of a name that is not UTF-8 as `\\xff`, line breaks and tabs kept: what a
    file someone else wrote says (a label, a host, a tag) never reaches the terminal as
    an escape sequence or raw bytes.

    Example:
        >>> printable("best\\x1b[2J") == "best\\\\x1b[2J"
        True
    """
    if text.isprintable():
        return text
    out = []
    for c in text:
        category = unicodedata.category(c)
        if 0xDC80 <= ord(c) <= 0xDCFF:  # a byte of a name that is not UTF-8 (surrogateescape)
            out.append(f"\\x{ord(c) - 0xDC00:02x}")
        elif c in "\n\t" or category not in ("Cc", "Cf", "Cs"):
            out.append(c)
        else:
            out.append(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
    return "".join(out)


def emit_json(doc: Any) -> None:
    """Write exactly one JSON document to stdout."""
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    """Print `nebula: error: message` on stderr and exit with `code`."""
    sys.stderr.write(f"nebula: error: {printable(message)}\n")
    raise typer.Exit(code)


def warn(message: str) -> None:
    """Print `nebula: warning: message` on stderr."""
    sys.stderr.write(f"nebula: warning: {printable(message)}\n")


# Tables ------------------------------------------------------------------------------------
def print_table(
    table: Table,
    narrow: Table | None = None,
    console: Console | None = None,
    *,
    headline: int = 1,
) -> None:
    """Print a table on stdout, never cutting a cell.

    Off a terminal (a pipe, a file) it is plain aligned text at full width: the title, the
    header, one line a row, no borders, no colour. On a terminal, the first layout that
    fits its width with no cell folded: the boxed table; `narrow` if given (the caller's
    layout for a narrow terminal, such as long cells stacked in one); the same columns
    without borders; else one record a row (the first `headline` cells on a line of their
    own, the others as `header: value` below them, each whole).
    """
    out = console or stdout()
    for each in (table, narrow):
        if each is not None:
            _printable_cells(each)
    if not out.is_terminal:
        out.file.write(plain_table(table))
        out.file.flush()
        return
    for layout in (table, narrow, _compact(table)):
        if layout is not None and _width(out, layout) <= out.width:
            out.print(layout)
            return
    out.print(_records(table, out.width, headline), soft_wrap=True)


def _printable_cells(table: Table) -> None:
    """Escape the control characters of every cell and the title (`printable`), in place."""
    if isinstance(table.title, str):
        table.title = printable(table.title)
    for column in table.columns:
        cells = column._cells  # rich keeps a column's cells here; none are added after
        for i, cell in enumerate(cells):
            if isinstance(cell, str) and not cell.isprintable():
                cells[i] = printable(cell)
            elif isinstance(cell, Text) and not cell.plain.isprintable():
                cells[i] = Text(printable(cell.plain), style=cell.style)


def _width(out: Console, table: Table) -> int:
    return Measurement.get(out, out.options.update_width(1 << 20), table).maximum


def _cell_text(cell: Any) -> Text:
    if isinstance(cell, Text):
        text = cell.copy()
    elif isinstance(cell, str):
        text = Text.from_markup(cell)
    else:
        text = Text(str(cell))
    if "\n" in text.plain:
        text = Text(" ").join(text.split("\n"))
    return text


def _rows(table: Table) -> list[list[Text]]:
    columns = [[_cell_text(cell) for cell in column.cells] for column in table.columns]
    return [list(row) for row in zip(*columns, strict=False)] if columns else []


def _title(table: Table) -> str:
    return _cell_text(table.title).plain if table.title else ""


def plain_table(table: Table) -> str:
    """`table` as plain aligned text: title, header, one line a row, two spaces between
    columns, right-aligned where the column is, no trailing spaces.

    Example:
        >>> t = Table(title="root"); t.add_column("tag"); t.add_column("size", justify="right")
        >>> t.add_row("global_step5", "1.5 KiB"); t.add_row("[red]x[/red]", "12 B")
        >>> print(plain_table(t), end="")
        root
        tag              size
        global_step5  1.5 KiB
        x                12 B
    """
    rows = [[cell.plain for cell in row] for row in _rows(table)]
    headers = [_cell_text(column.header).plain for column in table.columns]
    shown = ([headers] if table.show_header else []) + rows
    widths = [max((cell_len(row[i]) for row in shown), default=0) for i in range(len(headers))]
    lines = [_title(table)] if table.title else []
    for row in shown:
        cells = []
        for i, (cell, column) in enumerate(zip(row, table.columns, strict=False)):
            pad = " " * (widths[i] - cell_len(cell))
            cells.append(pad + cell if column.justify == "right" else cell + pad)
        lines.append("  ".join(cells).rstrip())
    if isinstance(table.caption, str) and table.caption:
        lines.append(table.caption)
    return "".join(line + "\n" for line in lines)


def _compact(table: Table) -> Table:
    """The same table without borders: two spaces between columns, nothing folded."""
    compact = Table(
        title=table.title,
        title_justify="left",
        box=None,
        pad_edge=False,
        padding=(0, 1),
        show_header=table.show_header,
        header_style="bold underline",
        caption=table.caption,
        caption_justify="left",
    )
    for column in table.columns:
        compact.add_column(column.header, justify=column.justify, no_wrap=True)
    for row in _rows(table):
        compact.add_row(*row)
    return compact


def _records(table: Table, width: int, headline: int = 1) -> Text:
    """One record a row: the first `headline` cells on a line of their own, then
    `header: value` for the others (empty ones left out), as many on a line as fit, never
    split."""
    headers = [_cell_text(column.header).plain for column in table.columns]
    out = Text()
    if table.title:
        out.append(_title(table) + "\n", style="bold")
    for row in _rows(table):
        out.append(Text("  ").join(row[:headline]))
        out.append("\n")
        line_len = 0
        for header, cell in zip(headers[headline:], row[headline:], strict=False):
            if not cell.plain:
                continue
            part = Text.assemble((f"{header}: " if header else "", "dim"), cell)
            if line_len and line_len + 2 + part.cell_len > width:
                out.append("\n")
                line_len = 0
            out.append("    " if line_len == 0 else "  ")
            out.append(part)
            line_len += (4 if line_len == 0 else 2) + part.cell_len
        if line_len:
            out.append("\n")
    if isinstance(table.caption, str) and table.caption:
        out.append(table.caption + "\n")
    out.rstrip()
    return out


def shown(rows: list[Any], verbose: bool) -> tuple[list[Any], int]:
    """(the rows to show, how many are left out): all with `verbose`, else the first
    `ROWS_SHOWN`. A root of thousands of checkpoints prints a screen, not thousands of
    lines; `--json` always has every one.

    Example:
        >>> shown(list(range(25)), False)[1], shown(list(range(25)), True)[1]
        (5, 0)
    """
    if verbose or len(rows) <= ROWS_SHOWN:
        return rows, 0
    return rows[:ROWS_SHOWN], len(rows) - ROWS_SHOWN


def summarise_tags(tags: list[str], verbose: bool) -> str:
    """`tags` in one line: every one with `verbose` (or up to `ROWS_SHOWN`), else the
    first ones and how many more.

    Example:
        >>> summarise_tags([f"t{i}" for i in range(30)], False)[-32:]
        't19 and 10 more (--verbose: all)'
    """
    first, left = shown(tags, verbose)
    text = ", ".join(first)
    return f"{text} and {left} more (--verbose: all)" if left else text


def confirm(question: str, refusal: str, declined: str) -> None:
    """Ask `question` (y/N, on stderr) before a command deletes or releases something.

    Off a terminal there is no one to ask: fail with `refusal` (`--yes` is needed there).
    A "no" (or Ctrl-D) prints `declined` and exits 1; Ctrl-C ends the command as anywhere
    else (`nebula: interrupted`, exit 130).

    Example: confirm("Release 2 memory tier(s)?", f"{base}: 2 memory tier(s) to release;
    refusing to release without --yes when not on a terminal (add --yes, or --dry-run to
    see the plan only)", "Nothing released.")
    """
    if not sys.stdin.isatty():
        fail(refusal)
    try:
        answer = typer.confirm(question, default=False, err=True)
    except typer.Abort as exc:  # the prompt turns Ctrl-C and Ctrl-D into Abort
        sys.stderr.write("\n")  # the prompt's line is left open
        if isinstance(exc.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt from None  # app.main: `nebula: interrupted`, 130
        answer = False
    if not answer:
        stderr().print(declined, highlight=False)
        raise typer.Exit(EXIT_ERROR)


# Fields of an Azure connection string: given without `connection_string=`, the first one
# would otherwise pass for an option's name.
_CONNECTION_STRING_FIELDS = (
    "DefaultEndpointsProtocol",
    "AccountName",
    "AccountKey",
    "BlobEndpoint",
    "SharedAccessSignature",
    "EndpointSuffix",
    "UseDevelopmentStorage",
)


def parse_storage_options(items: list[str] | None) -> dict[str, str]:
    """`--storage-option KEY=VALUE` values as a dict (a later KEY wins).

    A malformed one is a usage error that never repeats what was given: it may hold a
    secret. An Azure connection string given without `connection_string=` is refused
    (its first field would pass for a KEY).

    Example:
        >>> parse_storage_options(["account_name=acct", "sas_token=sv=1&sig=x"])
        {'account_name': 'acct', 'sas_token': 'sv=1&sig=x'}
    """
    options: dict[str, str] = {}
    for number, item in enumerate(items or [], start=1):
        key, sep, value = item.partition("=")
        key = key.strip()
        if key in _CONNECTION_STRING_FIELDS or (
            key != "connection_string" and any(f"{f}=" in value for f in _CONNECTION_STRING_FIELDS)
        ):
            raise typer.BadParameter(
                f"storage option #{number} looks like an Azure connection string; give it "
                "as connection_string=... (quoted)",
                param_hint="--storage-option",
            )
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


# Formatting ---------------------------------------------------------------------------------
def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB' (IEC units, as everywhere in nebula's output).

    Example:
        >>> human_bytes(1536), human_bytes(12), human_bytes(210_500_000)
        ('1.5 KiB', '12 B', '200.7 MiB')
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
    """How long ago an ISO-8601 UTC time was: '42s', '5m', '3h', '2d'; '?' for a time
    that does not read as one (a damaged or foreign manifest's: it is shown as written
    beside), and '0s' for one in the future (a clock that was ahead).

    Example:
        >>> human_age("2026-01-01T00:00:00Z", parse_time("2026-01-01T03:10:00Z"))
        '3h'
        >>> human_age("yesterday"), human_age("2026-01-02", parse_time("2026-01-01T00:00Z"))
        ('?', '0s')
    """
    now = now or datetime.now(timezone.utc)
    try:
        then = parse_time(iso)
        if then.tzinfo is None:  # no offset written: nebula's times are UTC
            then = then.replace(tzinfo=timezone.utc)
        seconds = max(0.0, (now - then).total_seconds())
    except (TypeError, ValueError, AttributeError, OverflowError):
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"
