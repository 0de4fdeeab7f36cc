"""`nebula verify ROOT [TAG]`: re-read every copy of every item and check it."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from ..output import (
    EXIT_ERROR,
    JsonOpt,
    RootArg,
    StorageOpt,
    emit_json,
    handles_errors,
    stderr,
    stdout,
)

TagArg = Annotated[
    str | None, typer.Argument(help="Only this checkpoint (default: every checkpoint).")
]

_STYLE = {"ok": "green", "corrupt": "bold red", "missing": "bold red", "differs": "bold red"}


@handles_errors
def verify_command(
    root: RootArg,
    tag: TagArg = None,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Re-read every item on every tier and check its size and checksum.

    Also reports manifests that are present but unreadable, and items that are missing
    or of the wrong size. Exit 1 on any failure, naming the file, the expected and the
    actual value; exit 3 when TAG does not exist.

    Example: nebula verify /mnt/checkpoints/run1 global_step500
    """
    import nebulaml as nm

    location = nm.check_root(root)
    with _progress_bar() as progress:
        results = nm.verify_checkpoints(root, tag, progress=progress)
    failures = [r for r in results if r["status"] != "ok"]
    if as_json:
        emit_json({"root": location, "ok": not failures, "results": results})
    else:
        stdout().print(_table(location, results))
    for r in failures:
        sys.stderr.write(f"nebula: error: {r['file']}: expected {r['expected']}, "
                         f"found {r['actual']}\n")  # fmt: skip
    if not results:
        stderr().print("no committed checkpoints to verify", highlight=False)
    if failures:
        raise typer.Exit(EXIT_ERROR)


@contextlib.contextmanager
def _progress_bar() -> Iterator[Callable[[int, int], None] | None]:
    """A bytes / rate / ETA bar on stderr when it is a terminal; nothing otherwise."""
    console = stderr()
    if not console.is_terminal:
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (TextColumn("verifying"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("verify", total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _table(location: str, results: list[dict[str, Any]]) -> Table:
    table = Table(title=location, title_justify="left")
    for column in ("tag", "tier", "item", "status", "checksum"):
        table.add_column(column)
    for r in results:
        # The checksum found (or the problem), shortened to what a human compares.
        detail = r["actual"] if r["status"] != "ok" else r["actual"].rsplit(" ", 1)[-1]
        table.add_row(
            Text(r["tag"]),
            r["tier"],
            Text(r["item"] if r["item"] is not None else "(manifest)"),
            Text(r["status"], style=_STYLE.get(r["status"], "")),
            Text(detail),
        )
    return table
