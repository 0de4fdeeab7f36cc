"""`nebula history`: rows and summary from a real history, --json, --csv, --since, --tag,
--limit, --plot (with and without matplotlib), and errors.

The summary is checked against numbers computed here from the CSV with the standard
library, never with pandas (which the command itself uses).
"""

from __future__ import annotations

import csv
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch
import warm
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app
from nebulaml.protocol.history import COLUMNS, HISTORY_FILE, append_rows, make_row
from nebulaml.storage.store import Store

NEBULA = Path(sys.executable).parent / "nebula"
ISO = "%Y-%m-%dT%H:%M:%S.%fZ"


def _populate(root: Path) -> None:
    """Four real saves; the first three persist, the fourth's persist fails."""
    nm.init(str(root), persistent_time_interval=3600, num_of_version_in_retention=5)
    for step in (100, 200, 300, 400):
        nm.Checkpoint(f"global_step{step}", 1).save("model", {"w": torch.ones(250 * step)})
        if step == 400:
            # A file where the persist must create the tag's folder: a real storage fault.
            (root / "global_step400").write_text("in the way")
            with pytest.raises(nm.PersistError, match="global_step400"):
                nm.flush_persistence(timeout_s=60)  # no retry moves the file: said at once
        else:
            nm.flush_persistence(timeout_s=60)
    with pytest.raises(nm.PersistError, match="global_step400"):
        nm.shutdown(timeout_s=60)  # its last try failed too: not durable, said again
    # Every history row is written by now: global_step400's `failed` row once.


def _file_rows(root: Path) -> list[dict[str, str]]:
    with open(root / HISTORY_FILE, newline="", encoding="utf-8") as f:
        return sorted(csv.DictReader(f), key=lambda r: r["started_at"])


def _p95(values: list[float]) -> float:
    # Linear interpolation between closest ranks, as numpy's and pandas' default.
    return statistics.quantiles(values, n=100, method="inclusive")[94]


def _invoke(*args: str) -> object:
    return CliRunner().invoke(app, ["history", *args])


def test_json_summary_agrees_with_the_file(root: Path) -> None:
    # Catches: stall taken from the wrong tier, failed persists counted as persist times,
    # a different quantile, failures not counted, failed rows' bytes counted as written.
    _populate(root)
    result = _invoke(str(root), "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    rows = _file_rows(root)
    saves = [r for r in rows if r["tier"] == "memory"]
    persists = [r for r in rows if r["tier"] == "persistent"]
    ok_persists = [r for r in persists if r["status"] == "ok"]
    stall = [float(r["blocking_s"]) for r in saves]
    persist = [float(r["duration_s"]) for r in ok_persists]
    speed = [float(r["throughput_mb_s"]) for r in ok_persists]
    assert (len(rows), len(saves), len(ok_persists)) == (8, 4, 3)

    summary = doc["summary"]
    assert doc["root"] == str(root)
    assert summary["count"] == 8
    assert (summary["saves"], summary["persists"], summary["failures"]) == (4, 4, 1)
    approx = lambda x: pytest.approx(x, abs=1e-6)  # noqa: E731 - the summary rounds to 1 µs
    assert summary["stall_s"] == {
        "p50": approx(statistics.median(stall)),
        "p95": approx(_p95(stall)),
        "max": approx(max(stall)),
    }
    assert summary["persist_s"] == {
        "p50": approx(statistics.median(persist)),
        "p95": approx(_p95(persist)),
        "max": approx(max(persist)),
    }
    assert summary["throughput_mb_s"] == {
        "p50": approx(statistics.median(speed)),
        "p95": approx(_p95(speed)),
        "max": approx(max(speed)),
    }
    ok = [r for r in rows if r["status"] == "ok"]
    assert summary["bytes_total"] == sum(int(r["bytes_written"]) for r in ok)
    assert summary["bytes_reused"] == sum(int(r["bytes_reused"]) for r in ok)
    assert isinstance(summary["bytes_total"], int)
    assert summary["first_started_at"] == rows[0]["started_at"]
    assert summary["last_started_at"] == rows[-1]["started_at"]
    failed = [r for r in doc["rows"] if r["status"] == "failed"]
    assert [(r["tag"], r["tier"]) for r in failed] == [("global_step400", "persistent")]
    assert "global_step400" in failed[0]["error"]


def test_the_table_gives_the_rates_json_and_csv_give(root: Path) -> None:
    # main: the table said MiB/s (its numbers converted) while --json and --csv said
    # throughput_mb_s in MB/s (the file's), and the summary's p95 throughput was blank.
    _populate(root)
    doc = json.loads(_invoke(str(root), "--json").stdout)
    lines = _invoke(str(root)).stdout.splitlines()
    header = next(line for line in lines if line.startswith("started (UTC)"))
    assert "MB/s" in header.split() and not any("MiB/s" in line for line in lines)
    rows = [line for line in lines if line[:4].isdigit()]
    persisted = [(r, line) for r, line in zip(doc["rows"], rows, strict=True)
                 if r["tier"] == "persistent" and r["status"] == "ok"]  # fmt: skip
    assert len(persisted) == 3
    for r, line in persisted:
        assert line.split()[-2:] == [f"{r['throughput_mb_s']:.1f}", "ok"], line
    speed = doc["summary"]["throughput_mb_s"]
    [summary] = [line for line in lines if line.startswith("persist MB/s ")]
    assert summary.split()[2:] == [f"{speed[q]:.1f}" for q in ("p50", "p95", "max")]


def test_limit_keeps_the_most_recent_rows_and_the_summary_covers_all(root: Path) -> None:
    # Catches: the first rows shown instead of the last, or the summary of the shown rows.
    _populate(root)
    doc = json.loads(_invoke(str(root), "--json", "--limit", "3").stdout)
    want = _file_rows(root)[-3:]
    assert [(r["tag"], r["tier"], r["started_at"]) for r in doc["rows"]] == [
        (r["tag"], r["tier"], r["started_at"]) for r in want
    ]
    assert doc["rows"][0]["step"] == int(want[0]["step"])
    assert doc["rows"][0]["size_bytes"] == int(want[0]["size_bytes"])
    assert doc["summary"]["count"] == 8


def test_csv_writes_every_row_back_unchanged(root: Path) -> None:
    # Catches: the default --limit applied to --csv, dropped columns, reformatted values.
    _populate(root)
    _timed_history(root, count=20)  # more rows than a table shows by default
    result = _invoke(str(root), "--csv")
    assert result.exit_code == 0, result.stderr
    reader = csv.DictReader(io.StringIO(result.stdout))
    assert reader.fieldnames == list(COLUMNS)
    assert list(reader) == _file_rows(root)


def _timed_history(root: Path, count: int = 0) -> datetime:
    """Rows written by the library's own writer at chosen times: 3 h, 90 min, 10 min ago
    (or `count` rows a day ago and earlier)."""
    now = datetime.now(timezone.utc)
    ages = [timedelta(hours=3), timedelta(minutes=90), timedelta(minutes=10)]
    if count:
        ages = [timedelta(days=1, minutes=count - i) for i in range(count)]
    rows = [
        make_row(tag=f"global_step{step}", step=step, tier="memory", rank=0,
                 started_at=(now - ago).strftime(ISO), duration_s=0.5, blocking_s=0.25,
                 size_bytes=1000 * step)
        for step, ago in enumerate(ages, start=1)
    ]  # fmt: skip
    append_rows(Store(root), rows)
    return now


@pytest.mark.parametrize(
    ("args", "tags"),
    [
        (["--since", "2h"], ["global_step2", "global_step3"]),
        (["--since", "100m"], ["global_step2", "global_step3"]),
        (["--since", "1h"], ["global_step3"]),
        (["--since", "1d"], ["global_step1", "global_step2", "global_step3"]),
        (["--tag", "global_step2"], ["global_step2"]),
        (["--tag", "global_step2", "--since", "1h"], []),
    ],
)
def test_since_and_tag_keep_matching_rows(root: Path, args: list[str], tags: list[str]) -> None:
    # Catches: --since or --tag ignored, a unit read wrongly (100m as seconds or months),
    # the cutoff compared the wrong way.
    _timed_history(root)
    result = _invoke(str(root), "--json", *args)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [r["tag"] for r in doc["rows"]] == tags
    assert doc["summary"]["count"] == len(tags)


@pytest.fixture
def local_time_east_of_utc() -> Iterator[None]:
    """This process's local time is 9 h ahead of UTC during the test."""
    old = os.environ.get("TZ")
    os.environ["TZ"] = "JST-9"
    time.tzset()
    try:
        yield
    finally:
        if old is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = old
        time.tzset()


@pytest.mark.usefixtures("local_time_east_of_utc")
def test_since_accepts_an_iso_time(root: Path) -> None:
    # Catches: offsets ignored (the time read as UTC), or naive times read as local time.
    now = _timed_history(root)
    cutoff = now - timedelta(minutes=100)
    as_utc = cutoff.strftime("%Y-%m-%dT%H:%M:%SZ")
    in_plus_two = cutoff.astimezone(timezone(timedelta(hours=2))).isoformat()
    naive = cutoff.strftime("%Y-%m-%dT%H:%M:%S")
    for when in (as_utc, in_plus_two, naive):
        doc = json.loads(_invoke(str(root), "--json", "--since", when).stdout)
        assert [r["tag"] for r in doc["rows"]] == ["global_step2", "global_step3"], when


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--since", "yesterday"], "--since"),
        (["--since", "5y"], "--since"),
        (["--csv", "--json"], "--csv and --json"),
        (["--limit", "-1"], "--limit"),
    ],
)
def test_bad_options_are_usage_errors(root: Path, args: list[str], needle: str) -> None:
    # Catches: a bad --since reaching the reader (exit 1 or a traceback), or ignored.
    _timed_history(root)
    result = _invoke(str(root), *args)
    assert result.exit_code == 2
    if "--json" in args:  # one JSON document on stdout, the error object
        assert json.loads(result.stdout)["error"]["kind"] == "usage"
    else:
        assert result.stdout == ""
    assert needle in result.stderr


def test_missing_history_is_not_found(tmp_path: Path) -> None:
    # Catches: a missing file reported as a storage error (exit 1) or a traceback.
    result = _invoke(str(tmp_path), "--json")
    assert result.exit_code == 3
    assert json.loads(result.stdout)["error"]["exception"] == "HistoryNotFoundError"
    lines = result.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"nebula: error: no {HISTORY_FILE} at {tmp_path} ")


def test_malformed_history_is_an_error_naming_file_and_line(root: Path) -> None:
    # Catches: bad lines skipped silently, or pandas' exception escaping as a traceback.
    _timed_history(root)
    with open(root / HISTORY_FILE, "a", encoding="utf-8") as f:
        f.write("global_step4,four,memory,0,2026-01-01T00:00:00Z,1,1,10,0.1,ok,,10,0\n")
    result = _invoke(str(root))
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == (
        f"nebula: error: {root / HISTORY_FILE}: not a readable checkpoint history: "
        "line 5: step 'four' is not an integer or empty\n"
    )


def test_table_and_summary_as_a_real_command(root: Path, memory_tier: Path) -> None:
    # Catches: a command that works in CliRunner but not installed, output on stderr,
    # failures missing from the table, the summary missing.
    _populate(root)
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier), COLUMNS="200")
    out = warm.run([NEBULA, "history", str(root)], capture_output=True, text=True,
                         env=env, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    for tag in ("global_step100", "global_step200", "global_step300", "global_step400"):
        assert tag in out.stdout
    assert "failed" in out.stdout and "persisting checkpoint 'global_step400'" in out.stdout
    assert "summary" in out.stdout and "p95" in out.stdout
    assert "8 rows: 4 saves, 4 persists, 1 failed" in out.stdout


def test_plot_writes_a_png(root: Path, tmp_path: Path) -> None:
    # Catches: no file written, or not a PNG (a GUI backend, a wrong format).
    pytest.importorskip("matplotlib")
    _populate(root)
    png = tmp_path / "history.png"
    result = _invoke(str(root), "--plot", str(png), "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["summary"]["count"] == 8
    assert result.stderr == f"nebula: wrote {png}\n"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000  # three panels of axes, lines and labels, not an empty image

    unwritable = tmp_path / "no-such-folder" / "history.png"
    result = _invoke(str(root), "--plot", str(unwritable))
    assert result.exit_code == 1
    assert result.stdout == ""  # the plot comes first: a failure leaves no half output
    assert result.stderr.startswith(f"nebula: error: {unwritable}: cannot write the plot")


# A child `nebula` in which importing matplotlib fails as if it were not installed.
_WITHOUT_MATPLOTLIB = """
import sys

class NoMatplotlib:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "matplotlib":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoMatplotlib())
from nebula_cli.app import main
sys.argv = ["nebula", *sys.argv[1:]]
main()
"""


def test_plot_without_matplotlib_says_how_to_install_it(root: Path, tmp_path: Path) -> None:
    # Catches: a traceback, a generic message, or a plot attempted after the table.
    _timed_history(root)
    png = tmp_path / "history.png"
    out = warm.run(
        [sys.executable, "-c", _WITHOUT_MATPLOTLIB, "history", str(root), "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stdout == ""
    assert out.stderr == (
        "nebula: error: --plot needs matplotlib: pip install 'nebula-checkpoint[plot]'\n"
    )
    assert not png.exists()


def test_skipped_persists_are_shown_and_counted(root: Path) -> None:
    # Catches: a history with skipped rows refused as malformed, skips counted as
    # persists, or the skipped count missing from the summary line and the JSON.
    nm.init(str(root), persistent_time_interval=3600)
    for step in (1, 2, 3):
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.ones(100 * step)})
        if step == 1:
            nm.flush_persistence(timeout_s=60)
    nm.shutdown(timeout_s=60)  # global_step2 waited for the interval; 3 superseded it
    result = CliRunner().invoke(app, ["history", str(root)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    (line,) = [r for r in result.stdout.splitlines() if "global_step2" in r and "persist" in r]
    assert "skipped" in line
    assert "6 rows: 3 saves, 2 persists, 1 skipped, 0 failed" in result.stdout
    doc = json.loads(_invoke(str(root), "--json").stdout)
    summary = doc["summary"]
    assert (summary["saves"], summary["persists"], summary["skipped"]) == (3, 2, 1)
    assert summary["failures"] == 0
    skipped = [r for r in doc["rows"] if r["status"] == "skipped"]
    assert [(r["tag"], r["tier"], r["error"]) for r in skipped] == [
        ("global_step2", "persistent", "superseded by global_step3")
    ]


def _forge_history(root: Path) -> tuple[str, str]:
    """A history whose header names a newer nebula's column and whose last row, written
    by hand, carries escape sequences, BEL and a C1 control in its tag, error and that
    column; returns the forged tag and error."""
    tag, error = "evil\x1b[2J\x07", "boom\x1b]0;pwned\x07 \x9b31m"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / HISTORY_FILE, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow([*COLUMNS, "note\x1b[31m"])
        writer.writerow(["global_step1", 1, "memory", 0, "2026-01-01T00:00:00Z", 0.5, 0.2,
                         10, 0.0, "ok", "", 10, 0, "fine"])  # fmt: skip
        writer.writerow([tag, 2, "persistent", 0, "2026-01-01T00:00:01Z", 1.0, 0.0, 10, 0.0,
                         "failed", error, 0, 0, "\x1b[8m\x07"])  # fmt: skip
    return tag, error


def _controls(text: str) -> set[str]:
    """The control characters of `text` other than a line break."""
    return {c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) < 0xA0}


@pytest.mark.parametrize("args", [[], ["--csv"]], ids=["table", "csv"])
def test_forged_rows_print_no_control_characters(root: Path, args: list[str]) -> None:
    # Catches: the failure lines below the table and every --csv field printed raw, so a
    # row someone wrote into checkpointHistories.csv could clear the screen, retitle the
    # terminal or ring its bell (ls, inspect and verify escape what they print).
    tag, error = _forge_history(root)
    result = CliRunner().invoke(app, ["history", str(root), *args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    assert _controls(result.stdout) == set()
    assert "evil\\x1b[2J\\x07" in result.stdout  # escaped, not dropped
    assert "boom\\x1b]0;pwned\\x07 \\x9b31m" in result.stdout
    on_a_terminal = CliRunner().invoke(
        app, ["history", str(root), *args],
        env={"COLUMNS": "200", "TTY_COMPATIBLE": "1", "TERM": "xterm", "NO_COLOR": "1"},
    )  # fmt: skip
    assert on_a_terminal.exit_code == 0, on_a_terminal.stderr
    for forged in ("\x07", "\x9b", "\x1b]", "\x1b[2J", "\x1b[8m"):
        assert forged not in on_a_terminal.stdout
    doc = json.loads(_invoke(str(root), "--json").stdout)  # JSON escapes them itself
    assert _controls(_invoke(str(root), "--json").stdout) == set()
    assert (doc["rows"][-1]["tag"], doc["rows"][-1]["error"]) == (tag, error)


def test_history_reads_the_rotated_generation_too(root: Path) -> None:
    # Catches: `nebula history` reading checkpointHistories.csv alone, so that its summary
    # lost every row before the last rotation.
    now = datetime.now(timezone.utc)
    store = Store(root)
    for step in range(1, 81):
        row = make_row(tag=f"global_step{step}", step=step, tier="memory", rank=0,
                       started_at=(now - timedelta(minutes=90 - step)).strftime(ISO),
                       duration_s=0.5, blocking_s=0.25, size_bytes=1000)  # fmt: skip
        append_rows(store, [row], max_bytes=4000)
    assert (root / f"{HISTORY_FILE}.1").exists()
    rotated = (root / f"{HISTORY_FILE}.1").read_text(encoding="utf-8")
    rows = [*csv.DictReader(io.StringIO(rotated)), *_file_rows(root)]
    doc = json.loads(_invoke(str(root), "--json", "--limit", "1000").stdout)
    assert doc["summary"]["count"] == len(rows) == len(doc["rows"])
    assert [r["tag"] for r in doc["rows"]] == [r["tag"] for r in rows]
    assert doc["rows"][-1]["tag"] == "global_step80"
    result = _invoke(str(root), "--csv")
    assert list(csv.DictReader(io.StringIO(result.stdout))) == rows
