"""`nebula history ROOT`: recent saves and persists from checkpointHistories.csv, a summary
of stalls, persist times, throughput, skipped persists and failures; as a table, JSON, CSV
or a plot.

Not for: reading or summarising the file (nebulaml.ops.read_history,
nebulaml.ops.summarize_history).
"""

from __future__ import annotations

import csv
import sys
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from ..complete import complete_tag
from ..console import emit_json, printable, stdout
from ..exits import EXIT_NOT_FOUND, fail, handles_errors, suggestion
from ..formatting import human_bytes
from ..options import JsonOpt, RootArg, StorageOpt, since_option
from ..tables import print_table

if TYPE_CHECKING:
    import pandas as pd

DEFAULT_LIMIT = 20
PLOT_HINT = "--plot needs matplotlib: pip install 'nebula-checkpoint[plot]'"
# What --plot writes, by the file's suffix.
PLOT_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


@handles_errors
def history_command(
    root: RootArg,
    csv_: Annotated[
        bool, typer.Option("--csv", help="Write the rows as CSV to stdout (every row).")
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            metavar="FILE",
            dir_okay=False,
            help="Also draw stall, persist time and throughput over time into FILE: .png, "
            ".svg or .pdf, by its suffix (needs the 'plot' extra: matplotlib).",
        ),
    ] = None,
    since: Annotated[datetime | None, since_option("rows that started")] = None,
    tag: Annotated[
        str | None,
        typer.Option(
            "--tag",
            metavar="TAG",
            help="Only the rows of this tag (exit 3 when the history has none).",
            autocompletion=complete_tag,
        ),
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit",
            min=0,
            metavar="N",
            help=f"Show the N most recent rows (default {DEFAULT_LIMIT}; --csv writes every "
            "row unless --limit is given). The summary covers every row.",
        ),
    ] = None,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Show recent checkpoint saves and persists and summarise them.

    Reads ROOT's checkpointHistories.csv (written at the persistent root, or at the
    memory tier of a memory-only job), and checkpointHistories.csv.1, the rows it held
    before it passed 4 MiB and was rotated. The summary gives stall (how long training
    waited per save), persist time and throughput (p50, p95, max), bytes written,
    skipped persists (checkpoints superseded before their turn) and failures.

    Example: nebula history /mnt/checkpoints/run1 --since 2h --plot history.png
    """
    if csv_ and as_json:
        raise typer.BadParameter("--csv and --json cannot be used together", param_hint="--csv")
    if plot is not None and plot.suffix.lower() not in PLOT_FORMATS:
        raise typer.BadParameter(
            f"{plot}: name a .png, .svg or .pdf file (the suffix says which)", param_hint="--plot"
        )
    figure_cls = _figure_class() if plot is not None else None
    import nebulaml as nm

    df = nm.ops.read_history(root, since=since, tag=tag)
    if tag is not None and df.empty:
        _check_tag(nm, root, tag)
    if figure_cls is not None and plot is not None:
        _plot(figure_cls, df, plot)  # first: a plot that cannot be written leaves no output
        sys.stderr.write(f"nebula: wrote {plot}\n")
    if limit is None and not csv_:
        limit = DEFAULT_LIMIT  # --csv writes every row unless --limit is given
    shown = df if limit is None else df.tail(limit)
    if csv_:
        _write_csv(nm.ops.history_records(shown), list(df.columns))
    elif as_json:
        doc = {
            "root": nm.check_root(root),
            "summary": nm.ops.summarize_history(df),
            "rows": nm.ops.history_records(shown),
        }
        emit_json(doc)
    else:
        summary = nm.ops.summarize_history(df)
        _print_tables(nm.check_root(root), nm.ops.history_records(shown), summary)


def _check_tag(nm: Any, root: str, tag: str) -> None:
    """Exit 3 when the history has no row of `tag` at all (not only none since --since),
    with the closest tags it has."""
    every = nm.ops.read_history(root)
    tags = list(dict.fromkeys(every["tag"].tolist()))
    if tag not in tags:
        hint = suggestion(tag, tags[::-1], "")
        fail(f"{nm.check_root(root)}: no history rows of tag {tag!r}{hint}", EXIT_NOT_FOUND)


def _figure_class() -> Any:
    """matplotlib's Figure (no pyplot: no global state, no GUI backend), or a clear exit."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        if exc.name == "matplotlib":
            fail(PLOT_HINT)
        fail(f"--plot needs matplotlib, which failed to import: {exc}")
    return Figure


def _write_csv(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """The rows as CSV, each text field (and a newer nebula's column names) `printable`:
    a forged row's escape sequences never reach the terminal."""
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow([printable(name) for name in columns])
    for row in rows:
        values = (row.get(name) for name in columns)
        writer.writerow(["" if v is None else printable(v) if isinstance(v, str) else v
                         for v in values])  # fmt: skip


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _speed(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


_STATUS_CELLS = {"ok": "ok", "failed": "[red]failed[/red]", "skipped": "[yellow]skipped[/yellow]"}


def _print_tables(location: str, records: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    out = stdout()
    title = f"{location}: the {len(records)} most recent of {summary['count']} rows"
    if not records:
        title = f"{location}: no rows" + (f" (of {summary['count']})" if summary["count"] else "")
    rows = Table(title=title, title_justify="left")
    with_rank = any(r["rank"] != 0 for r in records)  # a column of zeros only takes room
    columns = ["started (UTC)", "tag", "step", "tier", *(["rank"] * with_rank)]
    # MB/s (10**6 bytes a second): the unit and number of throughput_mb_s in the file,
    # --json and --csv; sizes are IEC.
    columns += ["time s", "stall s", "size", "MB/s", "status"]
    for column in columns:
        left = column in ("started (UTC)", "tag", "tier", "status")
        rows.add_column(column, justify="left" if left else "right", no_wrap=True)
    for r in records:
        failed = r["status"] == "failed"
        skipped = r["status"] == "skipped"  # nothing written: no time, size or speed
        cells = [
            r["started_at"][:19].replace("T", " "),
            escape(r["tag"]),
            "" if r["step"] is None else str(r["step"]),
            r["tier"],
            *([str(r["rank"])] * with_rank),
            "" if skipped else _seconds(r["duration_s"]),
            _seconds(r["blocking_s"]) if r["tier"] == "memory" else "",
            "" if skipped else human_bytes(r["size_bytes"]),
            "" if failed or skipped else _speed(r["throughput_mb_s"]),
            _STATUS_CELLS.get(r["status"], escape(r["status"])),
        ]
        rows.add_row(*cells)
    print_table(rows, console=out, headline=2)
    for r in records:  # errors below the table, whole: they are long
        if r["status"] == "failed":
            where = f"{r['tag']} ({r['tier']}, {r['started_at']})"
            line = f"{escape(printable(where))}: {escape(printable(r['error']))}"
            out.print(f"[red]failed[/red] {line}", highlight=False)

    stats = Table(title="summary", title_justify="left")
    for column in ("", "p50", "p95", "max"):
        stats.add_column(column, justify="right" if column else "left")
    for label, key in (("stall s", "stall_s"), ("persist s", "persist_s")):
        values = summary[key]
        stats.add_row(label, *(_seconds(values[q]) for q in ("p50", "p95", "max")))
    speed = summary["throughput_mb_s"]
    stats.add_row("persist MB/s", *(_speed(speed[q]) for q in ("p50", "p95", "max")))
    print_table(stats, console=out)
    failures, skipped = summary["failures"], summary["skipped"]
    span = (  # on a line of its own: the two times are what a reader copies
        f"\nfrom {summary['first_started_at']} to {summary['last_started_at']}"
        if summary["count"]
        else ""
    )
    out.print(
        f"{summary['count']} rows: {summary['saves']} saves, {summary['persists']} persists, "
        + (f"[yellow]{skipped} skipped[/yellow], " if skipped else "")
        + (f"[red]{failures} failed[/red]" if failures else "0 failed")
        + f"; {human_bytes(summary['bytes_total'])} written"
        + (
            f", {human_bytes(summary['bytes_reused'])} reused from earlier versions"
            if summary["bytes_reused"]
            else ""
        )
        + span,
        highlight=False,
    )


def _plot(figure_cls: Any, df: pd.DataFrame, path: Path) -> None:
    """Stall, persist time and throughput over time, one panel each, into a PNG, SVG or
    PDF file (by its suffix)."""
    # matplotlib takes naive datetime64 values; the axis says they are UTC.
    when = df["started_at"].dt.tz_localize(None)
    memory = df["tier"] == "memory"
    persisted = (df["tier"] == "persistent") & (df["status"] == "ok")
    failed = (df["tier"] == "persistent") & (df["status"] == "failed")
    fig = figure_cls(figsize=(10, 8), layout="constrained")
    stall, persist, speed = fig.subplots(3, 1, sharex=True)
    stall.plot(when[memory], df.loc[memory, "blocking_s"], "o-", markersize=3)
    stall.set_ylabel("stall (s)")
    stall.set_title("training stall per save (memory tier)")
    persist.plot(when[persisted], df.loc[persisted, "duration_s"], "o-", markersize=3)
    if failed.any():
        persist.plot(when[failed], df.loc[failed, "duration_s"], "x", color="red", label="failed")
        persist.legend()
    persist.set_ylabel("persist (s)")
    persist.set_title("persist time (persistent tier)")
    speed.plot(when[persisted], df.loc[persisted, "throughput_mb_s"], "o-", markersize=3)
    speed.set_ylabel("MB/s")
    speed.set_title("persist throughput")
    speed.set_xlabel("started at (UTC)")
    for axes in (stall, persist, speed):
        axes.grid(True, alpha=0.3)
        axes.set_ylim(bottom=0)
    fig.autofmt_xdate()
    try:
        fig.savefig(path, format=PLOT_FORMATS[path.suffix.lower()], dpi=100)
    except OSError as exc:
        fail(f"{path}: cannot write the plot: {exc.strerror or exc}")
