"""`nebula advise ROOT [--mtbf DURATION] [--json]`: the table and its one recommendation
line, JSON with numbers as numbers, and each error: no history, no root, a bad duration,
an MTBF it cannot estimate, a damaged history.

The histories: one written by real saves in this process, and a two-rank one written by
the real row writer with chosen times (tests/core/test_advice.py works its numbers out).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from advice_kit import write_two_rank_history
from cli_helpers import in_a_pipe

import nebulaml as nm
from nebulaml.protocol.history import HISTORY_FILE


def _real_history(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0)
    for step in (10, 20, 30):
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.ones(50_000)})
        nm.flush_persistence(timeout_s=60)
    nm.shutdown()


def test_the_table_and_the_recommendation(tmp_path: Path) -> None:
    # Catches: a table without the now/advised columns, steps or persistent interval
    # missing from the recommendation, a persistent_time_interval rounded above the save
    # interval (saves would be skipped), shares not in percent.
    write_two_rank_history(tmp_path)
    run = in_a_pipe("advise", str(tmp_path), "--mtbf", "1d")
    assert run.code == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == f"{tmp_path}: 8 saves, 4 persists"
    assert lines[1].split() == ["now", "advised"]
    table = {line[:29].strip(): line[29:].split() for line in lines[2:11]}
    assert table["save every"] == ["1m", "40s", "10m", "25s"]
    assert table["steps between saves"] == ["100", "635"]
    assert table["time lost (stalls + rework)"] == ["2.31%", "0.72%"]
    assert table["a lost node loses <="] == ["1m", "50s", "10m", "34s"]
    assert table["stall per save (mean)"] == ["2.250", "s"]
    assert table["persist time (p95)"] == ["9.700", "s"]
    assert table["MTBF (given)"] == ["1d", "00h"]
    assert lines[-1] == (
        "Save every 635 steps (about 10m 25s) and set persistent_time_interval=624: "
        "0.72% of training time lost instead of 2.31%."
    )
    assert run.stderr == ""


def test_an_estimated_mtbf_says_how(tmp_path: Path) -> None:
    write_two_rank_history(tmp_path)
    run = in_a_pipe("advise", str(tmp_path))
    assert run.code == 0, run.stderr
    assert "MTBF (estimated)" in run.stdout and "5m 25s" in run.stdout
    assert "MTBF: 2 interruptions in 10m 50s of running." in run.stdout
    assert "Save every 38 steps (about 39.5 s) and set persistent_time_interval=39" in run.stdout


def test_json_is_the_librarys_advice_with_numbers_as_numbers(tmp_path: Path) -> None:
    # Catches: values written as strings, a field left out, the root not the checked
    # location.
    write_two_rank_history(tmp_path)
    run = in_a_pipe("advise", str(tmp_path), "--mtbf", "90m", "--json")
    assert run.code == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc == {**nm.ops.advise(tmp_path, mtbf="90m").to_json(), "root": str(tmp_path)}
    assert doc["mtbf_s"] == 5400 and doc["mtbf_source"] == "given"
    assert isinstance(doc["stall_s"], float) and isinstance(doc["advised"]["steps"], int)
    assert [i["kind"] for i in doc["interruptions"]] == ["gap", "resumed"]
    assert 0 < doc["advised"]["waste"] < doc["now"]["waste"] < 1


def test_an_mtbf_it_cannot_estimate_is_asked_for(root: Path) -> None:
    # Catches: advice made up without an MTBF, exit 0 when none could be given, the
    # measurements withheld (the table and JSON still show them).
    _real_history(root)
    run = in_a_pipe("advise", str(root))
    assert run.code == 2
    assert run.stderr.startswith("nebula: error: cannot estimate the MTBF: no interruption in ")
    assert f"give it: nebula advise {root} --mtbf 24h" in run.stderr
    assert "MTBF (unknown)" in run.stdout and "Save every" not in run.stdout
    as_json = in_a_pipe("advise", str(root), "--json")
    assert as_json.code == 2
    doc = json.loads(as_json.stdout)
    assert doc["advised"] is None and doc["mtbf_s"] is None and doc["saves"] == 3
    given = in_a_pipe("advise", str(root), "--mtbf", "12h", "--json")
    assert given.code == 0 and json.loads(given.stdout)["advised"]["steps"] >= 1


def test_an_mtbf_shorter_than_a_save_says_no_interval_helps(tmp_path: Path) -> None:
    # Catches: OverflowError from exp((tau + C)/M) (a traceback, exit 1), and advice to
    # "save every 1 steps" as if it helped when a failure comes before a save ends.
    write_two_rank_history(tmp_path)  # a stall of 2.25 s per save
    run = in_a_pipe("advise", str(tmp_path), "--mtbf", "0.01s")
    assert run.code == 0, run.stderr
    table = {line[:29].strip(): line[29:].split() for line in run.stdout.splitlines()[2:11]}
    assert table["time lost (stalls + rework)"] == ["100.00%", "100.00%"]
    assert run.stdout.splitlines()[-1] == (
        "No checkpoint interval helps: a failure every 0.010 s on average is sooner than "
        "a save's stall (2.250 s); even at the best interval, 100.00% of training time is lost."
    )
    doc = json.loads(in_a_pipe("advise", str(tmp_path), "--mtbf", "0.01s", "--json").stdout)
    assert doc["advised"]["waste"] == 1.0 and doc["now"]["waste"] == 1.0


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--mtbf", "6"], 2, "'6' is not a duration (a number needs a unit)"),
        (["--mtbf", "soon"], 2, "give one like 6h, 90m, 2d or 1h30m"),
        (["--mtbf", "0m"], 2, "a duration longer than zero"),
    ],
)
def test_a_bad_duration_is_a_usage_error(tmp_path: Path, args: list[str], code: int,
                                         message: str) -> None:  # fmt: skip
    write_two_rank_history(tmp_path)
    run = in_a_pipe("advise", str(tmp_path), *args)
    assert run.code == code and run.stdout == ""
    assert run.stderr.startswith("nebula: error: invalid value for '--mtbf'")
    assert message in run.stderr


def test_roots_without_a_history(tmp_path: Path) -> None:
    # Catches: a traceback, or exit 1, for a root that has no history or does not exist.
    empty = tmp_path / "empty"
    empty.mkdir()
    run = in_a_pipe("advise", str(empty), "--mtbf", "6h")
    assert run.code == 3 and run.stdout == ""
    assert run.stderr == (
        f"nebula: error: no checkpointHistories.csv at {empty} (a job writes it at its "
        "persistent root, or at its memory tier when it has no persistent one)\n"
    )
    missing = in_a_pipe("advise", str(tmp_path / "nowhere"), "--mtbf", "6h")
    assert missing.code == 3
    assert missing.stderr == f"nebula: error: {tmp_path / 'nowhere'}: no such checkpoint root\n"


def test_a_history_without_saves_or_readable_rows(tmp_path: Path) -> None:
    # Catches: statistics of no saves raising, a damaged file read as an empty one.
    (tmp_path / HISTORY_FILE).write_text(
        "tag,step,tier,rank,started_at,duration_s,blocking_s,size_bytes,throughput_mb_s,"
        "status,error\n"
        "global_step1,1,persistent,0,2026-03-01T08:00:00.000000Z,1.5,0.0,10,0.0,ok,\n"
    )
    run = in_a_pipe("advise", str(tmp_path), "--mtbf", "6h")
    assert run.code == 1
    assert "its history holds no save to measure" in run.stderr
    (tmp_path / HISTORY_FILE).write_text("not,a,history\n1,2,3\n")
    damaged = in_a_pipe("advise", str(tmp_path), "--mtbf", "6h")
    assert damaged.code == 1
    assert "not a readable checkpoint history: line 1: no column" in damaged.stderr
