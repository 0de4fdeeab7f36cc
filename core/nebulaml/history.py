"""checkpointHistories.csv: one row per save (memory tier) and per persist.

The file sits at the persistent root (the memory root when there is no persistent tier)
and is only ever appended to, one batch of whole lines per write, by the persister thread,
so training never waits on it.

Columns (also documented in the README):
    tag, step, tier, rank, started_at, duration_s, blocking_s, size_bytes,
    throughput_mb_s, status, error

Not for: reading and summarising the history (the CLI's `history` command does that).
"""

from __future__ import annotations

import csv
import io
from dataclasses import astuple, dataclass, fields

from .storage import Store

HISTORY_FILE = "checkpointHistories.csv"


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
    status: str  # "ok" or "failed"
    error: str  # empty when status is "ok"


COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(HistoryRow))


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
) -> HistoryRow:
    """Build a row, deriving throughput and status.

    Example:
        >>> make_row(tag="global_step1", step=1, tier="memory", rank=0, started_at="t",
        ...          duration_s=0.5, blocking_s=0.5, size_bytes=1_000_000).throughput_mb_s
        2.0
    """
    throughput = size_bytes / duration_s / 1e6 if duration_s > 0 else 0.0
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
    )


def append_rows(store: Store, rows: list[HistoryRow]) -> None:
    """Append rows to the root's history file, writing the header when it is new."""
    if not rows:
        return
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    if not store.exists(HISTORY_FILE):
        writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow(["" if v is None else v for v in astuple(row)])
    store.make_dir()
    store.append_text((HISTORY_FILE,), buf.getvalue())
