"""Tables on stdout that never cut a cell.

Off a terminal (a pipe, a file) a table is plain aligned text at full width, one line a
row; on a terminal too narrow for the boxed table, a narrower layout is chosen (the
caller's, then one without borders, then one record a row). Every cell is `printable`.

May import: console.py, the standard library and rich.
Not for: what a cell says (formatting.py: sizes, ages) or how many rows a command shows
(formatting.py `shown`).
"""

from __future__ import annotations

from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from .console import printable, stdout


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
