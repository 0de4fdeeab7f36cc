"""checkpointHistories.csv: one row per save (memory tier), per persist and per skipped
persist (a checkpoint superseded before its turn: status `skipped`, tier persistent).

The file sits at the persistent root (the memory root when there is no persistent tier)
and is only ever appended to, one batch of whole lines per write, by the persister thread,
so training never waits on it. On object stores (az://, memory://), which cannot append,
the file holds the header and each batch is an object of its own beside it, in
`.checkpointHistories.csv.d/` (`Store.append_text`); `read_history` (ops/history.py) reads
them together.

It is rotated (`Store.rotate_appended`): once it holds `HISTORY_MAX_BYTES` (4 MiB, about
19,000 rows), it becomes `checkpointHistories.csv.1` (`ROTATED_FILE`: one generation
kept, the one before removed) and a new file with the same header starts; on object
stores the oldest batches beyond twice that are removed instead. `read_history` reads
the rotated generation first, so summaries span the rotation.

Columns (also documented in docs/benchmarks.md):
    tag, step, tier, rank, started_at, duration_s, blocking_s, size_bytes,
    throughput_mb_s, status, error, bytes_written, bytes_reused
(a file started before the last two keeps its header, and its rows the first eleven).

This module holds the writing half: the row (`HistoryRow`, `make_row`, `skipped_row`),
the file's names and columns, and `append_rows` (which rotates the file).

May import: `nebulaml.errors` and `nebulaml.storage`. Not for: reading the file back and
summarising it (`read_history`, `summarize_history`: ops/history.py, for `nebula history`
and operators), or rendering (tables, CSV on stdout, plots: the CLI's `history` command).
"""

from __future__ import annotations

import contextlib
import csv
import io
import logging
from dataclasses import astuple, dataclass, fields

from nebulaml.errors import CommitConflictError, NebulaError
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")

HISTORY_FILE = "checkpointHistories.csv"
ROTATED_FILE = f"{HISTORY_FILE}.1"  # the generation before, once the file passed the bound
HISTORY_MAX_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class HistoryRow:
    """One save or persist, as it is written to checkpointHistories.csv."""

    tag: str
    step: int | None
    tier: str  # "memory" or "persistent"
    rank: int
    started_at: str  # ISO-8601 UTC
    duration_s: float  # wall time of the whole operation
    blocking_s: float  # time the training thread waited (0 for background persists)
    size_bytes: int
    throughput_mb_s: float  # size_bytes / duration_s / 1e6
    status: str  # "ok", "failed" or "skipped"
    error: str  # empty when "ok"; for "skipped", "superseded by <the newer tag>"
    bytes_written: int = 0  # what reached the tier (a save: the snapshot's bytes)
    bytes_reused: int = 0  # taken from the item's previous version instead (reuse.py)


COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(HistoryRow))
# The columns of files written before bytes_written and bytes_reused: such a file keeps
# its header, and its new rows these columns alone.
FIRST_COLUMNS: tuple[str, ...] = COLUMNS[:11]


def make_row(
    *,
    tag: str,
    step: int | None,
    tier: str,
    rank: int,
    started_at: str,
    duration_s: float,
    blocking_s: float,
    size_bytes: int,
    error: BaseException | None = None,
    bytes_written: int | None = None,
    bytes_reused: int = 0,
) -> HistoryRow:
    """Build a row, deriving throughput and status. `bytes_written` defaults to
    `size_bytes` (0 for a failed operation).

    Example:
        >>> make_row(tag="global_step1", step=1, tier="memory", rank=0, started_at="t",
        ...          duration_s=0.5, blocking_s=0.5, size_bytes=1_000_000).throughput_mb_s
        2.0
    """
    # A failed operation moved no checkpoint: its throughput would be a meaningless number.
    ok = error is None and duration_s > 0
    throughput = size_bytes / duration_s / 1e6 if ok else 0.0
    return HistoryRow(
        tag=tag,
        step=step,
        tier=tier,
        rank=rank,
        started_at=started_at,
        duration_s=round(duration_s, 6),
        blocking_s=round(blocking_s, 6),
        size_bytes=size_bytes,
        throughput_mb_s=round(throughput, 3),
        status="ok" if error is None else "failed",
        # One line: a newline inside an error message must not break the CSV's rows.
        error="" if error is None else " ".join(str(error).split())[:500],
        bytes_written=(size_bytes if bytes_written is None else bytes_written) if ok else 0,
        bytes_reused=bytes_reused if ok else 0,
    )


def skipped_row(
    *, tag: str, step: int | None, rank: int, started_at: str, superseded_by: str
) -> HistoryRow:
    """The row of a persist that never happened: `tag` was superseded by the newer commit
    `superseded_by` before its turn (the interval). Nothing was written: sizes and times
    are 0; `started_at` is when it was superseded.

    Example:
        >>> row = skipped_row(tag="global_step1", step=1, rank=0, started_at="t",
        ...                   superseded_by="global_step2")
        >>> row.status, row.error
        ('skipped', 'superseded by global_step2')
    """
    return HistoryRow(
        tag=tag,
        step=step,
        tier="persistent",
        rank=rank,
        started_at=started_at,
        duration_s=0.0,
        blocking_s=0.0,
        size_bytes=0,
        throughput_mb_s=0.0,
        status="skipped",
        error=f"superseded by {superseded_by}",
    )


def append_rows(
    store: Store, rows: list[HistoryRow], *, max_bytes: int = HISTORY_MAX_BYTES
) -> None:
    """Append rows to the root's history file, writing the header when it is new. A file
    started with `FIRST_COLUMNS` gets rows of those columns (its readers' header). A file
    of `max_bytes` or more is rotated first (`ROTATED_FILE`; the new one keeps its header);
    on object stores the batches beyond twice that are removed, looked for once this
    process has appended a sixteenth of it since it last looked (a listing each time)."""
    if not rows:
        return
    store.make_dir()
    if not store.exists(HISTORY_FILE):
        header = io.StringIO()
        csv.writer(header, lineterminator="\n").writerow(COLUMNS)
        # Create-only: of several ranks starting the file at once, one writes the header.
        with contextlib.suppress(CommitConflictError):
            store.publish((HISTORY_FILE,), header.getvalue().encode())
        _widths.pop(store.url, None)
    width = _widths.get(store.url)
    if width is None:
        width = _widths[store.url] = _header_width(store)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for row in rows:
        writer.writerow(["" if v is None else v for v in astuple(row)[:width]])
    text = buf.getvalue()
    unchecked = _unchecked.get(store.url)
    if store.is_local or unchecked is None or unchecked >= max_bytes // 16:
        header = io.StringIO()
        csv.writer(header, lineterminator="\n").writerow(COLUMNS[:width])
        if store.rotate_appended((HISTORY_FILE,), max_bytes, header.getvalue()):
            log.info("%s passed %d bytes: rotated", store.display(HISTORY_FILE), max_bytes)
        unchecked = 0
    _unchecked[store.url] = unchecked + len(text)
    store.append_text((HISTORY_FILE,), text)


_HEADER_READ_BYTES = 4096
_widths: dict[str, int] = {}  # by the store's URL: the columns its file's rows get
_unchecked: dict[str, int] = {}  # by the store's URL: bytes appended since it was last checked


def _header_width(store: Store) -> int:
    """How many columns the rows appended to the store's history file get: those of its
    header when it names `FIRST_COLUMNS` only, else all (an unreadable header too: the
    reader says what is wrong with it)."""
    try:
        with store.open_read(HISTORY_FILE) as f:
            first = f.read(_HEADER_READ_BYTES).split(b"\n", 1)[0]
        names = next(csv.reader([first.decode("utf-8", "replace").strip()]), [])
    except (OSError, NebulaError):
        return len(COLUMNS)
    return len(FIRST_COLUMNS) if tuple(names) == FIRST_COLUMNS else len(COLUMNS)
