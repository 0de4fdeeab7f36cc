"""Reading and summarising checkpointHistories.csv: types, order, filters, fsspec roots,
and every way a file can fail to be a history (never skipped silently)."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

import nebulaml as nm
from nebulaml.protocol.history import COLUMNS, HISTORY_FILE, HistoryRow, append_rows, make_row
from nebulaml.storage.store import Store

ISO = "%Y-%m-%dT%H:%M:%S.%fZ"
HEADER = ",".join(COLUMNS) + "\n"
T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)


def _row(tag: str, tier: str, minutes: float, *, failed: bool = False, rank: int = 0) -> HistoryRow:
    step = int(tag.removeprefix("global_step")) if tag.startswith("global_step") else None
    return make_row(
        tag=tag, step=step, tier=tier, rank=rank,
        started_at=(T0 + timedelta(minutes=minutes)).strftime(ISO),
        duration_s=9.0 if failed else 2.0 if tier == "persistent" else 0.5,
        blocking_s=0.0 if tier == "persistent" else 0.25 * (1 + minutes),
        size_bytes=4_000_000,
        error=OSError(5, "Input/output error\nat the disk") if failed else None,
    )  # fmt: skip


def test_rows_are_typed_and_ordered_by_start_time(tmp_path: Path) -> None:
    # Catches: columns left as text, naive or local datetimes, file order kept (ranks and
    # persists append out of start order), a tag without a step turned into 0 or NaN.
    rows = [
        _row("global_step1", "memory", 0),
        _row("global_step1", "persistent", 1, failed=True),
        _row("global_step2", "memory", 0.5, rank=1),  # appended late, started early
        _row("best", "memory", 2),
    ]
    append_rows(Store(tmp_path), rows)
    df = nm.read_history(str(tmp_path))
    assert list(df.columns) == list(COLUMNS)
    assert [str(t) for t in df.dtypes] == [
        "str", "Int64", "str", "int64", "datetime64[us, UTC]", "float64", "float64",
        "int64", "float64", "str", "str", "int64", "int64",
    ]  # fmt: skip
    assert list(df["tag"]) == ["global_step1", "global_step2", "global_step1", "best"]
    assert df["started_at"].iloc[1] == T0 + timedelta(minutes=0.5)
    assert df["step"].isna().tolist() == [False, False, False, True]
    assert df["error"].iloc[2] == "[Errno 5] Input/output error at the disk"  # one line, as written
    records = nm.history_records(df)
    assert records[3] == asdict(rows[3]) | {"step": None}
    assert records[0] == asdict(rows[0])
    assert json.loads(json.dumps(records)) == records


def test_a_header_written_twice_by_racing_writers_is_not_a_row(tmp_path: Path) -> None:
    # Two ranks that both found no file both write the header (append_rows checks, then
    # appends): the reader must not take the second header for a malformed row.
    a, b = _row("global_step1", "memory", 0), _row("global_step1", "memory", 0.1, rank=1)
    line = lambda r: ",".join("" if v is None else str(v) for v in asdict(r).values())  # noqa: E731
    (tmp_path / HISTORY_FILE).write_text(f"{HEADER}{line(a)}\n{HEADER}{line(b)}\n")
    df = nm.read_history(str(tmp_path))
    assert list(df["rank"]) == [0, 1]


def test_a_column_added_by_a_newer_nebula_is_kept(tmp_path: Path) -> None:
    # Catches: a strict header check that would make every older nebula refuse newer files.
    row = ",".join(
        "" if v is None else str(v) for v in asdict(_row("global_step1", "memory", 0)).values()
    )
    (tmp_path / HISTORY_FILE).write_text(f"{HEADER.strip()},host\n{row},node-7\n")
    df = nm.read_history(str(tmp_path))
    assert list(df.columns) == [*COLUMNS, "host"]
    assert nm.history_records(df)[0]["host"] == "node-7"


_GOOD = "global_step1,1,memory,0,2026-03-01T12:00:00.000000Z,0.5,0.25,10,0.1,ok,,10,0"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "the file is empty"),
        ("tag,step,tier\nglobal_step1,1,memory\n", "line 1: no column rank, started_at"),
        (HEADER + _GOOD + "\n" + _GOOD.replace(",1,memory", ",x,memory") + "\n",
         "line 3: step 'x' is not an integer or empty"),
        (HEADER + _GOOD.replace(",ok,", ",done,") + "\n",
         "line 2: status 'done' is not ok, failed or skipped"),
        (HEADER + _GOOD.replace("memory", "disk") + "\n", "line 2: tier 'disk' is not memory"),
        (HEADER + _GOOD.replace("2026-03-01T", "yesterday ") + "\n",
         "line 2: started_at 'yesterday 12:00:00.000000Z' is not an ISO-8601 time"),
        (HEADER + _GOOD.replace(",0.5,", ",fast,") + "\n", "line 2: duration_s 'fast' is not"),
        (HEADER + _GOOD + "\n" + _GOOD + ",extra\n", "Expected 13 fields in line 3, saw 14"),
        # pandas takes a first row with one field more for an index (a traceback, before)
        (HEADER + _GOOD + ",extra\n" + _GOOD + "\n", "line 2: 14 fields where the header has 13"),
        (HEADER + _GOOD + "\nglobal_step2,2,memo", "line 3: tier 'memo' is not memory"),
        (HEADER + "\udcff", "not UTF-8 text"),
    ],
    ids=["empty", "header", "step", "status", "tier", "time", "float", "fields",
         "fields-first-row", "torn", "bytes"],
)  # fmt: skip
def test_a_malformed_file_raises_naming_the_file_and_line(
    tmp_path: Path, text: str, why: str
) -> None:
    # Catches: bad lines skipped or turned into NaN silently, wrong line numbers, pandas'
    # own exceptions escaping (the CLI would print a traceback).
    data = text.encode("utf-8", errors="surrogateescape")
    (tmp_path / HISTORY_FILE).write_bytes(data)
    with pytest.raises(nm.HistoryFormatError) as caught:
        nm.read_history(str(tmp_path))
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / HISTORY_FILE}: not a readable checkpoint history: ")
    assert why in message


def test_a_missing_file_is_not_found(tmp_path: Path) -> None:
    # Catches: a plain StorageError (the CLI's exit 3 is for CheckpointNotFoundError).
    with pytest.raises(nm.HistoryNotFoundError) as caught:
        nm.read_history(str(tmp_path / "never-saved"))
    assert isinstance(caught.value, nm.CheckpointNotFoundError)
    assert str(caught.value).startswith(f"no {HISTORY_FILE} at {tmp_path / 'never-saved'} (")


def test_an_fsspec_root_is_read_through_the_store() -> None:
    # Catches: the file opened with plain open(), which cannot read URLs.
    memory_url = f"memory://history-{uuid.uuid4().hex}"  # fsspec's memory store is global
    append_rows(Store(memory_url), [_row("global_step1", "memory", 0)])
    assert list(nm.read_history(memory_url)["tag"]) == ["global_step1"]


def test_since_takes_an_aware_time_or_a_duration(tmp_path: Path) -> None:
    # Catches: --since compared the wrong way, timedelta ignored, naive times guessed.
    now = datetime.now(timezone.utc)
    rows = [
        make_row(tag=f"global_step{i}", step=i, tier="memory", rank=0,
                 started_at=(now - timedelta(hours=h)).strftime(ISO), duration_s=1.0,
                 blocking_s=1.0, size_bytes=1)
        for i, h in ((1, 5), (2, 3), (3, 1))
    ]  # fmt: skip
    append_rows(Store(tmp_path), rows)
    assert list(nm.read_history(str(tmp_path), since=timedelta(hours=4))["step"]) == [2, 3]
    in_tokyo = (now - timedelta(hours=2)).astimezone(timezone(timedelta(hours=9)))
    assert list(nm.read_history(str(tmp_path), since=in_tokyo)["step"]) == [3]
    assert list(nm.read_history(str(tmp_path), tag="global_step1")["step"]) == [1]
    with pytest.raises(nm.InvalidArgumentError, match="time zone"):
        nm.read_history(str(tmp_path), since=datetime(2026, 1, 1))


def test_summary_counts_and_quantiles(tmp_path: Path) -> None:
    # Catches: failed persists in persist_s or throughput, failed rows' bytes counted,
    # numpy scalars that json cannot write.
    rows = [_row(f"global_step{i}", "memory", i) for i in range(5)]
    rows += [_row(f"global_step{i}", "persistent", i + 0.5, failed=i == 4) for i in range(5)]
    append_rows(Store(tmp_path), rows)
    summary = nm.summarize_history(nm.read_history(str(tmp_path)))
    assert json.loads(json.dumps(summary)) == summary
    # stalls 0.25, 0.5, 0.75, 1.0, 1.25: p95 interpolates between the two largest
    assert summary["stall_s"] == {"p50": 0.75, "p95": 1.2, "max": 1.25}
    assert summary["persist_s"] == {"p50": 2.0, "p95": 2.0, "max": 2.0}
    assert summary["throughput_mb_s"] == {"p50": 2.0, "p95": 2.0, "max": 2.0}
    assert (summary["count"], summary["saves"], summary["persists"]) == (10, 5, 5)
    assert summary["failures"] == 1
    assert summary["bytes_total"] == 9 * 4_000_000
    assert summary["first_started_at"] == "2026-03-01T12:00:00.000000Z"
    assert summary["last_started_at"] == "2026-03-01T12:04:30.000000Z"


def test_summary_of_no_rows(tmp_path: Path) -> None:
    # Catches: NaN (not JSON) or an exception for an empty history or an empty filter.
    (tmp_path / HISTORY_FILE).write_text(HEADER)
    summary = nm.summarize_history(nm.read_history(str(tmp_path)))
    assert summary == {
        "count": 0, "saves": 0, "persists": 0, "skipped": 0, "failures": 0,
        "stall_s": {"p50": None, "p95": None, "max": None},
        "persist_s": {"p50": None, "p95": None, "max": None},
        "throughput_mb_s": {"p50": None, "p95": None, "max": None},
        "bytes_total": 0, "bytes_reused": 0, "first_started_at": None, "last_started_at": None,
    }  # fmt: skip


_SKIPPED = (
    "global_step2,2,persistent,0,2026-03-01T12:02:30.000000Z,0.0,0.0,0,0.0,skipped,"
    "superseded by global_step3,0,0"
)


def test_skipped_rows_are_read_and_counted_apart_from_persists(tmp_path: Path) -> None:
    # Catches: `skipped` rejected as a malformed status, skips counted as persists (or
    # their zero durations in persist_s and throughput), or not counted at all.
    append_rows(Store(tmp_path), [_row(f"global_step{i}", "memory", i) for i in (1, 2, 3)])
    append_rows(Store(tmp_path), [_row("global_step1", "persistent", 1.5)])
    with open(tmp_path / HISTORY_FILE, "a", encoding="utf-8") as f:
        f.write(_SKIPPED + "\n")
    append_rows(Store(tmp_path), [_row("global_step3", "persistent", 3.5, failed=True)])
    df = nm.read_history(str(tmp_path))
    assert list(df["status"]) == ["ok", "ok", "ok", "skipped", "ok", "failed"]
    (skipped,) = [r for r in nm.history_records(df) if r["status"] == "skipped"]
    assert skipped == {
        "tag": "global_step2", "step": 2, "tier": "persistent", "rank": 0,
        "started_at": "2026-03-01T12:02:30.000000Z", "duration_s": 0.0, "blocking_s": 0.0,
        "size_bytes": 0, "throughput_mb_s": 0.0, "status": "skipped",
        "error": "superseded by global_step3", "bytes_written": 0, "bytes_reused": 0,
    }  # fmt: skip
    summary = nm.summarize_history(df)
    assert json.loads(json.dumps(summary)) == summary
    assert (summary["count"], summary["saves"], summary["persists"]) == (6, 3, 2)
    assert (summary["skipped"], summary["failures"]) == (1, 1)
    assert summary["persist_s"] == {"p50": 2.0, "p95": 2.0, "max": 2.0}
    assert summary["throughput_mb_s"] == {"p50": 2.0, "p95": 2.0, "max": 2.0}
    assert summary["bytes_total"] == 4 * 4_000_000
    only = nm.summarize_history(nm.read_history(str(tmp_path), tag="global_step2"))
    assert (only["saves"], only["persists"], only["skipped"]) == (1, 0, 1)


def test_a_skipped_row_is_written_as_the_reader_reads_it(tmp_path: Path) -> None:
    # Catches: a writer and a reader that disagree on the skipped row's fields.
    from nebulaml.protocol.history import skipped_row

    row = skipped_row(
        tag="global_step2", step=2, rank=0, started_at="2026-03-01T12:02:30.000000Z",
        superseded_by="global_step3",
    )  # fmt: skip
    assert (row.status, row.error, row.tier) == (
        "skipped",
        "superseded by global_step3",
        "persistent",
    )
    append_rows(Store(tmp_path), [row])
    text = (tmp_path / HISTORY_FILE).read_text()
    assert text == HEADER + _SKIPPED + "\n"
    assert nm.history_records(nm.read_history(str(tmp_path))) == [asdict(row)]


# rotation ----------------------------------------------------------------------------------
def _rows_of(thread: int, count: int) -> list[HistoryRow]:
    # Started in order per thread; the tag says which row of which thread it is.
    return [_row(f"t{thread}-{i}", "memory", i + thread / 100) for i in range(count)]


def _kept(df: Any, thread: int) -> list[int]:
    """The numbers of `thread`'s rows that the history still holds, in order."""
    tags = [t for t in df["tag"] if t.startswith(f"t{thread}-")]
    return sorted(int(t.split("-")[1]) for t in tags)


def test_the_file_rotates_past_its_bound_and_reads_span_both(tmp_path: Path) -> None:
    # Catches: checkpointHistories.csv never trimmed (1.1 MB per 5,000 saves), a rotation
    # that keeps more than one generation or starts a file without its header, and a
    # reader that loses the rotated rows (a summary cut short at each rotation).
    store = Store(tmp_path)
    for row in _rows_of(0, 120):
        append_rows(store, [row], max_bytes=3000)
    current, rotated = tmp_path / HISTORY_FILE, tmp_path / f"{HISTORY_FILE}.1"
    assert sorted(p.name for p in tmp_path.iterdir()) == [HISTORY_FILE, rotated.name]
    assert current.stat().st_size < 3000 + 200 and 3000 <= rotated.stat().st_size < 3000 + 200
    for path in (current, rotated):
        assert path.read_text().startswith(HEADER)
    lines = len(current.read_text().splitlines()) + len(rotated.read_text().splitlines()) - 2
    df = nm.read_history(str(tmp_path))
    assert _kept(df, 0) == list(range(120 - lines, 120))  # the newest, none missing
    assert nm.summarize_history(df)["count"] == lines > 120 // 4


def test_an_older_files_header_is_kept_across_a_rotation(tmp_path: Path) -> None:
    # Catches: the new file started with today's columns while the writers that read the
    # old header go on appending rows of its eleven (refused as malformed at line 2).
    old_header = ",".join(COLUMNS[:11]) + "\n"
    (tmp_path / HISTORY_FILE).write_text(old_header)
    for row in _rows_of(0, 60):
        append_rows(Store(tmp_path), [row], max_bytes=2000)
    assert (tmp_path / HISTORY_FILE).read_text().startswith(old_header)
    assert (tmp_path / f"{HISTORY_FILE}.1").read_text().startswith(old_header)
    assert _kept(nm.read_history(str(tmp_path)), 0)[-1] == 59


def test_rotating_writers_take_turns(tmp_path: Path) -> None:
    # Catches: two writers that both found the file full both rotating it (the second
    # moving the first one's new file over the generation, or a file without a header).
    import threading

    def write(thread: int) -> None:
        for row in _rows_of(thread, 150):
            append_rows(Store(tmp_path), [row], max_bytes=4000)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    df = nm.read_history(str(tmp_path))  # both files whole, each with its header
    for n in range(4):
        kept = _kept(df, n)
        assert kept == list(range(150 - len(kept), 150)), n  # the newest, none missing


def test_a_writer_rotates_only_the_file_it_found_full(tmp_path: Path) -> None:
    # Catches: a rotator that does not wait for one already rotating (an exclusive flock
    # on the file), and then moves that one's new file over the generation it kept.
    import fcntl
    import threading

    current, rotated = tmp_path / HISTORY_FILE, tmp_path / f"{HISTORY_FILE}.1"
    full = HEADER + "".join(
        ",".join("" if v is None else str(v) for v in asdict(r).values()) + "\n"
        for r in _rows_of(0, 40)
    )
    current.write_text(full)
    other = os.open(current, os.O_WRONLY | os.O_APPEND)  # another writer, rotating
    fcntl.flock(other, fcntl.LOCK_EX)
    writer = threading.Thread(
        target=append_rows, args=(Store(tmp_path), _rows_of(1, 1)), kwargs={"max_bytes": 1000}
    )
    writer.start()
    writer.join(timeout=1.0)
    assert writer.is_alive()  # waits its turn
    os.link(current, rotated)  # the other writer's rotation: the file kept as generation 1
    fresh = tmp_path / "fresh"
    fresh.write_text(HEADER)
    os.replace(fresh, current)
    os.close(other)
    writer.join()
    assert rotated.read_text() == full  # not replaced by the new file
    df = nm.read_history(str(tmp_path))
    assert _kept(df, 0) == list(range(40)) and _kept(df, 1) == [0]


def test_a_symbolic_link_at_the_history_is_never_rotated(tmp_path: Path) -> None:
    # Catches: a rotation that renames, links or rewrites what a link there points to.
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere.csv"
    root.mkdir()
    elsewhere.write_text(HEADER + "x" * 5000 + "\n")
    (root / HISTORY_FILE).symlink_to(elsewhere)
    with pytest.raises(nm.StorageError, match="not a regular file"):
        append_rows(Store(root), [_row("global_step1", "memory", 0)], max_bytes=1000)
    assert (root / HISTORY_FILE).is_symlink()
    assert elsewhere.read_text() == HEADER + "x" * 5000 + "\n"
    assert sorted(p.name for p in root.iterdir()) == [HISTORY_FILE]


def test_an_object_store_keeps_the_newest_batches_within_twice_the_bound() -> None:
    # Catches: the appended objects of an object store never removed.
    from nebulaml.format.names import segments_folder

    url = f"memory://history-{uuid.uuid4().hex}"  # fsspec's memory store is global
    store = Store(url)
    for row in _rows_of(0, 200):
        append_rows(store, [row], max_bytes=2000)
    sizes = store.list_files(segments_folder(HISTORY_FILE))
    assert sum(sizes.values()) <= 2 * 2000 + 2000 // 16 + 200  # checked each 1/16 of it
    kept = _kept(nm.read_history(url), 0)
    assert kept == list(range(200 - len(kept), 200)) and len(kept) > 200 // 4
