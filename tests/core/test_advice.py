"""`nm.ops.advise`: Young/Daly's interval and the time lost, against values computed by hand;
what it measures from a history written by real saves (and by the real row writer, with
times chosen so that every number can be worked out by hand); the MTBF it estimates from a
job that went back to an earlier checkpoint and from a hold taken over from a dead job.
"""

from __future__ import annotations

import csv
import itertools
import math
import os
import statistics
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch
from advice_kit import at, persist_row, write_two_rank_history

import nebulaml as nm
from nebulaml.ops import daly_interval, expected_waste, parse_duration
from nebulaml.protocol.history import HISTORY_FILE, append_rows
from nebulaml.protocol.holds import Holder, lease_name
from nebulaml.storage.store import Store


# the formulas ------------------------------------------------------------------------------
def test_daly_interval_against_hand_computed_values() -> None:
    # Catches: Young's first-order sqrt(2CM) without Daly's terms, a term with the wrong
    # factor (1/3, 1/9), the "- C" left out, C >= 2M not answered with M.
    # C = 8 s, M = 4 h: sqrt(2*8*14400) = 480 exactly; C/2M = 8/28800 = 1/3600;
    # 480 * (1 + (1/60)/3 + (1/3600)/9) - 8 = 480 + 2.666667 + 0.014815 - 8 = 474.681481
    assert daly_interval(8, 14400) == pytest.approx(474.681481, abs=1e-6)
    # C = 50 s, M = 100 s: sqrt(10000) = 100; C/2M = 1/4: 100*(1 + 1/6 + 1/36) - 50 = 69.4444
    assert daly_interval(50, 100) == pytest.approx(69.444444, abs=1e-6)
    assert daly_interval(200, 100) == 100  # C = 2M: the interval is M
    assert daly_interval(0, 100) == 0  # a free checkpoint: as often as possible
    with pytest.raises(nm.InvalidArgumentError):
        daly_interval(1, 0)


def test_expected_waste_against_hand_computed_values() -> None:
    # Catches: a waste without rework (C/tau only), without checkpoints ((tau+C)/2M only),
    # the exponential's argument without C, a share that is not a fraction.
    # tau = 474.681481, C = 8, M = 14400: (tau + C)/M = 0.0335195473; its exp - 1 (the
    # series x + x^2/2 + x^3/6 + ...) = 0.0340876571; M * that = 490.862263;
    # 1 - 474.681481/490.862263 = 0.0329640
    assert expected_waste(474.681481, 8, 14400) == pytest.approx(0.0329640, abs=1e-7)
    # Small C/M: the first-order waste C/tau + (tau + C)/2M.
    first_order = 8 / 474.681481 + (474.681481 + 8) / (2 * 14400)
    assert expected_waste(474.681481, 8, 14400) == pytest.approx(first_order, rel=0.02)
    # Daly's interval is the least waste: a little shorter or longer loses more.
    best = daly_interval(8, 14400)
    assert expected_waste(best, 8, 14400) < expected_waste(best * 0.8, 8, 14400)
    assert expected_waste(best, 8, 14400) < expected_waste(best * 1.25, 8, 14400)
    assert expected_waste(0, 8, 14400) == 1.0
    with pytest.raises(nm.InvalidArgumentError):
        expected_waste(-1, 8, 14400)


def test_an_mtbf_far_below_the_stall_loses_all_time_without_overflow() -> None:
    # Catches: exp((tau + C)/M) overflowing (OverflowError) once (tau + C)/M passes ~709,
    # as `nebula advise ROOT --mtbf 0.01s` did with a 2 s stall.
    assert expected_waste(10, 2.25, 0.01) == 1.0
    assert expected_waste(0, 2.25, 0.01) == 1.0
    assert expected_waste(700 * 0.01, 0, 0.01) == pytest.approx(1.0, abs=1e-12)
    assert daly_interval(2.25, 0.01) == 0.01  # C >= 2M: the interval is M


def test_parse_duration() -> None:
    # Catches: a unit misread (m as months, d as ...), compound durations refused, a bare
    # number taken as some unit, zero accepted.
    assert parse_duration("6h") == 21600
    assert parse_duration("90m") == 5400
    assert parse_duration("2d") == 172800
    assert parse_duration("1h30m") == 5400
    assert parse_duration(" 1H 30M ") == 5400
    assert parse_duration("1.5w") == 907200
    for bad, why in (("6", "needs a unit"), ("6 hours", "not a duration"), ("", "not a"),
                     ("0h", "longer than zero"), ("-2h", "not a duration")):  # fmt: skip
        with pytest.raises(nm.InvalidArgumentError, match=why):
            parse_duration(bad)


# a history written by the real row writer, with times chosen ------------------------------
def test_advice_from_a_two_rank_history_worked_by_hand(tmp_path: Path) -> None:
    # Catches: the stall taken as the mean over rows instead of the slowest rank's per
    # checkpoint (1.625 here, not 2.25), failed saves or skipped persists counted, the
    # persist time not the slowest rank's, a p95 that is not interpolated, a stop or a
    # return to an earlier step not seen, the downtime counted as running time, steps
    # counted across an interruption.
    write_two_rank_history(tmp_path)
    advice = nm.ops.advise(tmp_path)
    assert (advice.saves, advice.persists) == (8, 4)
    assert advice.stall_s == pytest.approx(2.25)  # (4 + 7 * 2) / 8
    assert (advice.stall_p50_s, advice.stall_max_s) == (2.0, 4.0)
    # per checkpoint 10, 6, 7, 8; p95 of [6, 7, 8, 10]: 8 + 0.85 * (10 - 8)
    assert advice.persist_s == pytest.approx(9.7)
    assert advice.persist_max_s == 10
    assert [i.kind for i in advice.interruptions] == ["gap", "resumed"]
    assert advice.interruptions[0].at == at(1000)
    assert "global_step500 came 11m 40s after global_step400" in advice.interruptions[0].detail
    assert advice.interruptions[1].at == at(1150)
    # 100 * 3 + 100 (the stop: the usual spacing) + 100 + 50 + 100
    assert advice.running_s == pytest.approx(650)
    assert advice.mtbf_s == pytest.approx(325)  # 650 s over 2 interruptions
    assert advice.mtbf_source == "estimated"
    assert advice.mtbf_note == "2 interruptions in 10m 50s of running"
    # steady pairs 1-2, 2-3, 3-4, 5-6, 7-8: (100 - 4)/100 once, (100 - 2)/100 four times
    assert advice.seconds_per_step == pytest.approx(0.98)

    now = advice.now
    assert now is not None
    assert (now.interval_s, now.steps, now.persist_every_s) == (100, 100, 100)
    m, c = 325.0, 2.25
    assert now.waste == pytest.approx(1 - 97.75 / (m * math.expm1((97.75 + c) / m)), abs=1e-6)
    assert now.process_failure_loses_s == 100
    assert now.node_failure_loses_s == pytest.approx(109.7)  # a persist interval + p95

    # Daly: sqrt(2 * 2.25 * 325) = 38.242646; C/2M = 0.0034615; factor 1.0199966:
    # tau = 36.757; in steps of 0.98 s: 37.5 -> 38 steps = 37.24 s of compute.
    tau = math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (2 * m) / 9) - c
    assert tau == pytest.approx(36.757, abs=1e-3)
    advised = advice.advised
    assert advised is not None
    assert advised.steps == 38
    assert advised.interval_s == pytest.approx(38 * 0.98 + c, abs=1e-3)
    assert advised.persist_every_s == pytest.approx(38 * 0.98 + c, abs=1e-3)  # > p95
    assert advised.waste == pytest.approx(1 - 37.24 / (m * math.expm1((37.24 + c) / m)), abs=1e-6)
    assert advised.waste < now.waste
    assert advised.node_failure_loses_s == pytest.approx(38 * 0.98 + c + 9.7, abs=1e-3)


def test_a_given_mtbf_replaces_the_estimate(tmp_path: Path) -> None:
    # Catches: --mtbf ignored when the root shows interruptions, a timedelta or a number
    # read in another unit.
    write_two_rank_history(tmp_path)
    for given in ("2h", timedelta(hours=2), 7200):
        advice = nm.ops.advise(tmp_path, mtbf=given)
        assert (advice.mtbf_s, advice.mtbf_source) == (7200, "given")
        assert advice.advised is not None
        tau = advice.advised.interval_s - advice.stall_s
        assert tau == pytest.approx(round(daly_interval(2.25, 7200) / 0.98) * 0.98, abs=1e-3)
    with pytest.raises(nm.InvalidArgumentError):
        nm.ops.advise(tmp_path, mtbf=0)


def test_no_history_and_no_saves_are_clear_errors(tmp_path: Path) -> None:
    # Catches: an empty DataFrame's statistics raising a bare ValueError, a missing file
    # answered with something other than HistoryNotFoundError.
    with pytest.raises(nm.HistoryNotFoundError, match=r"no checkpointHistories\.csv"):
        nm.ops.advise(tmp_path)
    append_rows(Store(str(tmp_path)), [persist_row(100, 0, 0, 5.0)])
    with pytest.raises(nm.NebulaError, match="holds no save"):
        nm.ops.advise(tmp_path)


# histories written by real saves -----------------------------------------------------------
def _rows(root: Path) -> list[dict[str, str]]:
    with open(root / HISTORY_FILE, newline="", encoding="utf-8") as f:
        return sorted(csv.DictReader(f), key=lambda r: r["started_at"])


def _save_steps(steps: tuple[int, ...], *, overwrite: bool = False) -> None:
    for step in steps:
        ckpt = nm.Checkpoint(f"global_step{step}", overwrite=overwrite)
        ckpt.save("model", {"w": torch.full((50_000,), float(step))})
        nm.flush_persistence(timeout_s=60)


def test_advice_from_real_saves_agrees_with_the_file(root: Path) -> None:
    # Catches: the stall read from the persist rows (the background copy, not what
    # training waits for), the persist time from the saves, a spacing not measured from
    # the saves' starts, the advised interval not Daly's for the measured stall.
    nm.init(str(root), persistent_time_interval=0)
    _save_steps((10, 20, 30, 40))
    nm.shutdown()
    rows = _rows(root)
    saves = [r for r in rows if r["tier"] == "memory"]
    persists = [r for r in rows if r["tier"] == "persistent" and r["status"] == "ok"]
    assert (len(saves), len(persists)) == (4, 4)
    stall = statistics.fmean(float(r["blocking_s"]) for r in saves)
    persist = [float(r["duration_s"]) for r in persists]
    p95 = statistics.quantiles(persist, n=100, method="inclusive")[94]
    starts = [datetime.fromisoformat(r["started_at"].replace("Z", "+00:00")) for r in saves]
    spacing = statistics.median((b - a).total_seconds() for a, b in itertools.pairwise(starts))

    advice = nm.ops.advise(root, mtbf="6h")
    assert (advice.saves, advice.persists) == (4, 4)
    assert advice.stall_s == pytest.approx(stall, abs=1e-6)
    assert advice.persist_s == pytest.approx(p95, abs=1e-6)
    assert advice.interruptions == ()
    assert advice.now is not None and advice.advised is not None
    assert advice.now.interval_s == pytest.approx(spacing, abs=1e-3)
    assert advice.now.steps == 10
    per_step = advice.seconds_per_step
    assert per_step is not None and per_step > 0
    steps = max(1, round(daly_interval(advice.stall_s, 21600) / per_step))
    assert advice.advised.steps == steps
    assert advice.advised.interval_s == pytest.approx(steps * per_step + advice.stall_s, abs=2e-3)
    # Without an MTBF and without any interruption there is no advice, and it says why.
    unknown = nm.ops.advise(root)
    assert unknown.advised is None and unknown.mtbf_s is None and unknown.mtbf_source is None
    assert unknown.mtbf_note.startswith("no interruption in ")


def test_a_job_that_went_back_to_an_earlier_checkpoint_gives_an_mtbf(root: Path) -> None:
    # Catches: a save of an earlier step (the job resumed from an older checkpoint and
    # redid the work) not counted as an interruption; the saves after it taken for more.
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10)
    _save_steps((10, 20, 30))
    nm.get_checkpoint("global_step10").load("model")  # back to step 10, and on from there
    _save_steps((20, 30), overwrite=True)
    nm.shutdown()
    advice = nm.ops.advise(root)
    assert [(i.kind, i.at) for i in advice.interruptions] == [
        ("resumed", advice.interruptions[0].at)
    ]
    assert "global_step20 saved after step 30" in advice.interruptions[0].detail
    assert advice.saves == 5
    assert advice.mtbf_source == "estimated"
    assert advice.mtbf_s == pytest.approx(advice.running_s, abs=1e-3)  # one interruption
    assert advice.advised is not None


def test_a_hold_taken_over_from_a_dead_job_gives_an_mtbf(root: Path) -> None:
    # Catches: the root's hold not consulted: a job that took the root over from a dead
    # one is a failure the saves alone may not show.
    root.mkdir()
    old = (datetime.now(timezone.utc) - timedelta(hours=1)).isoformat()
    dead = Holder("job-that-died", "node-gone", 4242, None, old, old)
    (root / lease_name(1)).write_bytes(dead.to_bytes())
    gone = time.time() - 3600  # last written an hour ago, by the store's clock too
    os.utime(root / lease_name(1), (gone, gone))
    nm.init(str(root), persistent_time_interval=0)  # takes it over: generation 2
    assert (root / lease_name(2)).exists()
    _save_steps((10, 20, 30))
    advice = nm.ops.advise(root)  # while this job holds the root
    takeovers = [i for i in advice.interruptions if i.kind == "takeover"]
    assert [(i.count, i.at) for i in takeovers] == [(1, takeovers[0].at)]
    assert "1 job(s) died holding the root" in takeovers[0].detail
    assert advice.mtbf_source == "estimated"
    assert advice.mtbf_s == pytest.approx(advice.running_s, abs=1e-3)
    nm.shutdown()
    # Its clean exit released the hold: the root shows nothing any more.
    assert nm.ops.advise(root).mtbf_source is None
