"""Reading checkpointHistories.csv back: a typed DataFrame, a summary and JSON records.

`read_history` reads a root's history (the generation rotated out,
`checkpointHistories.csv.1`, then the file; on object stores, the header file and the
batches appended beside it, `Store.read_appended`) into a typed pandas DataFrame, oldest
first, and refuses anything that is not nebula's history, naming the line (`HistoryFormatError`;
`HistoryNotFoundError` when there is none). `summarize_history` gives stalls, persist
times, throughput and counts; `history_records` the rows as JSON-ready dicts. They serve
`nebula history` and operators (`nm.ops.read_history`, `nm.ops.summarize_history`); pandas is
imported only when they run.

May import: `nebulaml.errors`, `nebulaml.storage` and `nebulaml.protocol.history` (the
file's name and columns). Not for: writing rows (protocol/history.py: the persister
appends them), or rendering (tables, CSV on stdout, plots: the CLI's `history` command).
"""

from __future__ import annotations

import csv
import io
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from nebulaml.errors import CheckpointNotFoundError, InvalidArgumentError, NebulaError
from nebulaml.protocol.history import COLUMNS, FIRST_COLUMNS, HISTORY_FILE, ROTATED_FILE
from nebulaml.storage.store import Store

if TYPE_CHECKING:
    import pandas as pd

TIERS = ("memory", "persistent")
STATUSES = ("ok", "failed", "skipped")
_ISO_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"


class HistoryNotFoundError(CheckpointNotFoundError):
    """A root without checkpointHistories.csv (no job has saved there yet, or not here)."""

    def __init__(self, root: str) -> None:
        NebulaError.__init__(
            self,
            f"no {HISTORY_FILE} at {root} (a job writes it at its persistent root, or at its "
            f"memory tier when it has no persistent one)",
        )
        self.root, self.tag = root, None


class HistoryFormatError(NebulaError):
    """A checkpointHistories.csv that cannot be read as nebula's history (never skipped)."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: not a readable checkpoint history: {why}")
        self.where, self.why = where, why


def read_history(
    root: str,
    *,
    since: datetime | timedelta | None = None,
    tag: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> pd.DataFrame:
    """The rows of ROOT's checkpointHistories.csv as a typed DataFrame, oldest first:
    those of the generation rotated out (`checkpointHistories.csv.1`) too.

    Columns: `tag`, `tier`, `status`, `error` (str); `step` (nullable Int64); `rank`,
    `size_bytes`, `bytes_written`, `bytes_reused` (int64); `duration_s`, `blocking_s`,
    `throughput_mb_s` (float64); `started_at` (UTC datetimes). A file written before
    `bytes_written` and `bytes_reused` reads with a successful row's size and 0 for them.
    Columns a newer nebula added are kept, as text.
    `since` keeps rows that started at or after a time (timezone-aware) or within a
    duration back from now; `tag` keeps the rows of one tag. Raises `HistoryNotFoundError`
    when there is no history file and `HistoryFormatError` when it is not one.

    Example:
        >>> import nebulaml as nm, tempfile
        >>> nm.ops.read_history(tempfile.mkdtemp())
        Traceback (most recent call last):
        ...
        nebulaml.ops.history.HistoryNotFoundError: no checkpointHistories.csv at ...
    """
    cutoff = _cutoff(since)
    store = Store(root, storage_options)
    # The generation rotated out first, then the file; on object stores each with the rows
    # appended beside it (see Store.append_text). Each has its own header.
    frames = []
    for name in (ROTATED_FILE, HISTORY_FILE):
        data = store.read_appended(name)
        if data is not None:
            frames.append(_parse(data, store.display(name)))
    if not frames:
        raise HistoryNotFoundError(store.url)
    df = frames[0] if len(frames) == 1 else _joined(frames)
    if cutoff is not None:
        df = df[df["started_at"] >= cutoff]
    if tag is not None:
        df = df[df["tag"] == tag]
    return df.reset_index(drop=True)


def _cutoff(since: datetime | timedelta | None) -> datetime | None:
    if since is None:
        return None
    if isinstance(since, timedelta):
        if since < timedelta(0):
            raise InvalidArgumentError(f"since={since!r}: a duration back from now is positive")
        return datetime.now(timezone.utc) - since
    if since.tzinfo is None or since.utcoffset() is None:
        raise InvalidArgumentError(
            f"since={since!r} has no time zone; give e.g. datetime(..., tzinfo=timezone.utc)"
        )
    return since.astimezone(timezone.utc)


def _check_first_row(text: str, where: str) -> None:
    """pandas takes a first row with one field more than the header for an index column
    (and later rows' line numbers for labels): that row is refused here, as pandas refuses
    any later row whose fields do not match."""
    records = csv.reader(io.StringIO(text))
    header = next(records, None)
    first = next(records, None)
    if header is not None and first is not None and len(first) != len(header):
        raise HistoryFormatError(
            where, f"line 2: {len(first)} fields where the header has {len(header)}"
        )


def _parse(data: bytes, where: str) -> pd.DataFrame:
    """Parse and type the file's bytes; anything that does not fit raises, naming the line."""
    import pandas as pd

    try:
        text = data.decode("utf-8")
        _check_first_row(text, where)
        raw = pd.read_csv(
            io.StringIO(text), dtype=str, keep_default_na=False, na_filter=False, index_col=False
        )
    except UnicodeDecodeError as exc:
        raise HistoryFormatError(where, f"not UTF-8 text ({exc.reason})") from exc
    except pd.errors.EmptyDataError as exc:
        raise HistoryFormatError(where, "the file is empty (no header line)") from exc
    except pd.errors.ParserError as exc:
        raise HistoryFormatError(where, str(exc).replace("Error tokenizing data. ", "")) from exc
    missing = [name for name in FIRST_COLUMNS if name not in raw.columns]
    if missing:
        raise HistoryFormatError(
            where, f"line 1: no column {', '.join(missing)} (expected {','.join(COLUMNS)})"
        )
    # A file started before these two columns, or a row an older nebula appended to a
    # newer file (its fields end early): what it wrote is what it moved.
    if "bytes_written" not in raw.columns:
        raw["bytes_written"] = ""
    if "bytes_reused" not in raw.columns:
        raw["bytes_reused"] = ""
    unknown = raw["bytes_written"] == ""
    raw.loc[unknown, "bytes_written"] = raw["size_bytes"].where(raw["status"] == "ok", "0")
    raw.loc[raw["bytes_reused"] == "", "bytes_reused"] = "0"
    # Two writers that both found no file both wrote a header: those lines are not rows.
    raw = raw[~((raw["tag"] == "tag") & (raw["tier"] == "tier") & (raw["status"] == "status"))]

    def reject(bad: pd.Series, column: str, what: str) -> None:
        if bad.any():
            label = bad.idxmax()  # read_csv's index: 0 is line 2 (no row spans lines)
            value = raw.at[label, column]
            raise HistoryFormatError(where, f"line {label + 2}: {column} {value!r} is not {what}")

    reject(raw["tag"] == "", "tag", "a tag")
    reject(~raw["tier"].isin(TIERS), "tier", " or ".join(TIERS))
    statuses = f"{', '.join(STATUSES[:-1])} or {STATUSES[-1]}"
    reject(~raw["status"].isin(STATUSES), "status", statuses)
    for column in ("rank", "size_bytes", "bytes_written", "bytes_reused"):
        reject(~raw[column].str.fullmatch(r"-?\d+"), column, "an integer")
    reject(~raw["step"].str.fullmatch(r"(-?\d+)?"), "step", "an integer or empty")
    floats = {c: pd.to_numeric(raw[c], errors="coerce") for c in _FLOAT_COLUMNS}
    for column, values in floats.items():
        reject(values.isna(), column, "a number")
    started_at = pd.to_datetime(raw["started_at"], utc=True, format="ISO8601", errors="coerce")
    reject(started_at.isna(), "started_at", "an ISO-8601 time")

    step = pd.Series(pd.NA, index=raw.index, dtype="Int64")
    has_step = raw["step"] != ""
    step[has_step] = raw.loc[has_step, "step"].astype("int64")
    typed = {
        "tag": raw["tag"],
        "step": step,
        "tier": raw["tier"],
        "rank": raw["rank"].astype("int64"),
        "started_at": started_at,
        "duration_s": floats["duration_s"].astype("float64"),
        "blocking_s": floats["blocking_s"].astype("float64"),
        "size_bytes": raw["size_bytes"].astype("int64"),
        "throughput_mb_s": floats["throughput_mb_s"].astype("float64"),
        "status": raw["status"],
        "error": raw["error"],
        "bytes_written": raw["bytes_written"].astype("int64"),
        "bytes_reused": raw["bytes_reused"].astype("int64"),
    }
    extra = {name: raw[name] for name in raw.columns if name not in typed}
    df = pd.DataFrame({**typed, **extra}, index=raw.index)
    # Rows are appended as operations end, by every rank: order them by when they started.
    return df.sort_values("started_at", kind="stable").reset_index(drop=True)


_FLOAT_COLUMNS = ("duration_s", "blocking_s", "throughput_mb_s")


def _joined(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Typed frames of two generations as one, oldest first; a newer nebula's column that
    one of them lacks is empty text there."""
    import pandas as pd

    df = pd.concat(frames, ignore_index=True)
    for name in df.columns:
        if name not in _TYPED_COLUMNS:
            df[name] = df[name].fillna("")
    return df.sort_values("started_at", kind="stable").reset_index(drop=True)


_TYPED_COLUMNS = frozenset(COLUMNS)


# summarising -------------------------------------------------------------------------------
def summarize_history(df: pd.DataFrame) -> dict[str, Any]:
    """A JSON-serialisable summary of history rows (as `read_history` returns them).

    `count` rows: `saves` (memory tier), `persists` (persistent tier, done or failed),
    `skipped` (persists skipped: superseded before their turn), `failures`.
    `stall_s` is the time training waited per save (`blocking_s` of the saves);
    `persist_s` the time a successful persist took (`duration_s`), and `throughput_mb_s`
    its speed in MB/s (10**6 bytes a second, as the file records it); each has `p50`,
    `p95` (linear interpolation) and `max`, or None without
    rows. `bytes_total` is what successful rows wrote, on every tier (`bytes_written`),
    and `bytes_reused` what their persists took from an item's earlier version instead
    of writing it. `first_started_at` and `last_started_at` are ISO-8601 UTC, or None.

    Example:
        >>> import nebulaml as nm, pandas as pd
        >>> nm.ops.summarize_history(pd.DataFrame(columns=COLUMNS))["count"]
        0
    """
    memory = df["tier"] == "memory"
    skipped = df["status"] == "skipped"
    persistent = (df["tier"] == "persistent") & ~skipped
    ok = df["status"] == "ok"
    persisted = df[persistent & ok]
    started = df["started_at"]
    return {
        "count": len(df),
        "saves": int(memory.sum()),
        "persists": int(persistent.sum()),
        "skipped": int(skipped.sum()),
        "failures": int((df["status"] == "failed").sum()),
        "stall_s": _quantiles(df.loc[memory, "blocking_s"]),
        "persist_s": _quantiles(persisted["duration_s"]),
        "throughput_mb_s": _quantiles(persisted["throughput_mb_s"]),
        "bytes_total": int(df.loc[ok, "bytes_written"].sum()),
        "bytes_reused": int(df.loc[ok, "bytes_reused"].sum()),
        "first_started_at": None if df.empty else _iso(started.min()),
        "last_started_at": None if df.empty else _iso(started.max()),
    }


def _quantiles(values: pd.Series) -> dict[str, float | None]:
    keys = ("p50", "p95", "max")
    if values.empty:
        return dict.fromkeys(keys)
    found = {"p50": values.quantile(0.5), "p95": values.quantile(0.95), "max": values.max()}
    return {key: round(float(found[key]), 6) for key in keys}


def _iso(ts: Any) -> str:
    return str(ts.strftime(_ISO_FORMAT))


def history_records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """History rows as JSON-serialisable dicts, one per row, keys in the file's column order
    (`step` None when the tag has none, `started_at` ISO-8601 UTC).

    Example:
        >>> import nebulaml as nm, pandas as pd
        >>> nm.ops.history_records(pd.DataFrame(columns=COLUMNS))
        []
    """
    import pandas as pd

    columns: dict[str, list[Any]] = {}
    for name in df.columns:
        values = df[name]
        if name == "started_at":
            columns[name] = [_iso(ts) for ts in values]
        elif name == "step":
            columns[name] = [None if pd.isna(v) else int(v) for v in values]
        else:
            columns[name] = values.tolist()  # Python ints, floats and strs
    names = list(columns)
    return [dict(zip(names, row, strict=True)) for row in zip(*columns.values(), strict=True)]
