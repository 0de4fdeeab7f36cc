"""How often to checkpoint (`nebula advise`): the interval that loses the least training
time to checkpoints and to rework after failures, from what a root's history measured.

A job that fails on average every M seconds (its MTBF) and waits C seconds per checkpoint
loses the least time at a compute time between checkpoints of (Young 1974; Daly 2006, "A
higher order estimate of the optimum checkpoint interval for restart dumps")

    tau = sqrt(2*C*M) * (1 + sqrt(C/(2*M))/3 + C/(2*M)/9) - C     when C < 2*M, else M

and the share of its wall time lost, at any tau, to checkpoints and to the work redone
after a failure (Poisson failures; the restart's own downtime does not depend on tau and
is left out) is

    1 - tau / (M * (exp((tau + C) / M) - 1))

C is what the training loop waits per save: nebula's stall (`blocking_s` of the memory
tier's rows, the slowest rank's per checkpoint), not the background persist. The persist
time bounds how often a checkpoint can reach durable storage: `persistent_time_interval`
is advised no shorter than it.

M is given, or estimated: the job's running time over the interruptions the root shows.
An interruption is a save of a step at or below one saved before (the job resumed from an
earlier checkpoint), a save more than `GAP_FACTOR` times the usual spacing (and at least
`GAP_MIN_S`) after the one before (the job stopped and started again), or a job that took
the root's hold over from a dead one (its generation: protocol/holds.py). A root that shows
none gives no MTBF.

May import: `nebulaml.errors`, `nebulaml.storage`, `nebulaml.protocol` and ops.history.
Not for: reading the history file (ops/history.py), or rendering (the CLI's `advise`).
"""

from __future__ import annotations

import itertools
import math
import os
import re
import statistics
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from nebulaml.errors import InvalidArgumentError, NebulaError
from nebulaml.ops.history import read_history
from nebulaml.protocol.holds import HoldState, current_hold
from nebulaml.storage.store import Store

if TYPE_CHECKING:
    import pandas as pd

PathLike = str | os.PathLike[str]

# A save more than this many times the median spacing after the one before marks a stop,
# if it also came at least GAP_MIN_S after it: a restarted job starts Python, imports torch
# and initialises, never in under a few seconds; a shorter pause is the job's own jitter
# (a load, an evaluation, a busy machine), whatever its saves' usual spacing.
GAP_FACTOR = 3.0
GAP_MIN_S = 5.0
PERSIST_QUANTILE = 0.95  # the persist time the persistent interval must not be below
# exp(x) overflows a double past x = 709.78; from x = 700 on, 1 - x*exp(-x) is 1 exactly.
_EXP_LIMIT = 700.0

_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"(?:\d+(?:\.\d+)?[smhdw])+")
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


# the formulas --------------------------------------------------------------------------------
def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """The compute time between checkpoints that loses the least time (Daly's higher-order
    estimate): `sqrt(2CM) * (1 + sqrt(C/2M)/3 + (C/2M)/9) - C` for C < 2M, else M.

    Example (C = 2 s, M = 1 h: sqrt(2*2*3600) = 120, C/2M = 1/3600, so
    120 * (1 + 1/180 + 1/32400) - 2 = 118.6704):
        >>> round(daly_interval(2, 3600), 4)
        118.6704
        >>> daly_interval(10, 4)      # a checkpoint dearer than two MTBFs: M itself
        4
    """
    if cost_s < 0 or mtbf_s <= 0:
        raise InvalidArgumentError(f"cost {cost_s} s, MTBF {mtbf_s} s: need C >= 0 and M > 0")
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost_s


def expected_waste(interval_s: float, cost_s: float, mtbf_s: float) -> float:
    """The expected share of wall time lost to checkpoints and rework, with `interval_s` of
    compute between checkpoints that each cost `cost_s`, failures every `mtbf_s` on
    average: `1 - tau / (M * (exp((tau + C)/M) - 1))`.

    Example (tau = 118.6704, C = 2, M = 3600: (tau + C)/M = 0.0335196, exp(.) - 1 =
    0.0340877, so 1 - 118.6704 / 122.7157 = 3.30 %; to first order C/tau + (tau + C)/2M
    = 1.69 % + 1.68 %):
        >>> round(expected_waste(118.6704, 2, 3600), 4)
        0.033
        >>> expected_waste(0, 2, 3600)    # nothing but checkpoints
        1.0
        >>> expected_waste(10, 2, 0.01)   # failures far more often than saves: all lost
        1.0
    """
    if interval_s < 0 or cost_s < 0 or mtbf_s <= 0:
        raise InvalidArgumentError(
            f"interval {interval_s} s, cost {cost_s} s, MTBF {mtbf_s} s: need tau, C >= 0, M > 0"
        )
    if interval_s + cost_s == 0:
        return 0.0
    exponent = (interval_s + cost_s) / mtbf_s
    if exponent > _EXP_LIMIT:  # tau / (M (exp(x) - 1)) <= x exp(-x): 0 to a double
        return 1.0
    return 1.0 - interval_s / (mtbf_s * math.expm1(exponent))


def parse_duration(text: str) -> float:
    """Seconds in a duration such as `6h`, `90m`, `2d`, `1h30m`, `45s` or `1.5w` (units s, m,
    h, d, w); `InvalidArgumentError` for anything else, a bare number included.

    Example:
        >>> parse_duration("1h30m"), parse_duration("2d"), parse_duration("0.5h")
        (5400.0, 172800.0, 1800.0)
    """
    compact = "".join(str(text).split()).lower()
    if not _DURATION.fullmatch(compact):
        unit = " (a number needs a unit)" if re.fullmatch(r"\d+(\.\d+)?", compact) else ""
        raise InvalidArgumentError(
            f"{text!r} is not a duration{unit}: give one like 6h, 90m, 2d or 1h30m "
            "(units s, m, h, d, w)"
        )
    seconds = sum(float(n) * _UNITS_S[unit] for n, unit in _PART.findall(compact))
    if not 0 < seconds < math.inf:
        raise InvalidArgumentError(f"{text!r}: a duration longer than zero")
    return seconds


# the result --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Interruption:
    """One sign that the job stopped: `kind` is "resumed" (a save of a step at or below one
    saved before), "gap" (a save long after the one before) or "takeover" (jobs that took
    the root's hold over from dead ones, and a dead holder: `count` of them); `at` the
    ISO-8601 UTC time of the save, or when the holder started ("" when unknown)."""

    kind: str
    at: str
    detail: str
    count: int = 1


@dataclass(frozen=True, slots=True)
class Schedule:
    """A checkpoint schedule and what it costs.

    `interval_s`: between two saves' starts; `steps`: training steps between saves (None
    when the tags name no step); `persist_every_s`: between persists (advised: the
    `persistent_time_interval`; now: as measured); `waste`: the expected share of time
    lost to checkpoints and rework (None without an MTBF); `process_failure_loses_s`: the
    most a failed process loses (the node's memory tier keeps the newest save);
    `node_failure_loses_s`: the most a failure that takes the node's memory tier loses
    (back to the newest durable checkpoint; None without persists).
    """

    interval_s: float
    steps: int | None
    persist_every_s: float | None
    waste: float | None
    process_failure_loses_s: float
    node_failure_loses_s: float | None


@dataclass(frozen=True, slots=True)
class Advice:
    """What `advise` measured on a root and the schedule it advises.

    `saves`: checkpoints saved (a tag saved by several ranks counts once), `persists`: those
    persisted; `stall_s`: the mean time training waited per save (the slowest rank's), the C
    of the formulas, with `stall_p50_s` and `stall_max_s`; `persist_s`: the 95th percentile
    of the persist time (None without persists) and `persist_max_s`; `seconds_per_step`
    (None when the tags name no step); `mtbf_s` and where it came from, `mtbf_source`
    ("given", "estimated" or None: unknown) with `mtbf_note` (how, or why not);
    `running_s`: the time the history shows the job running; `interruptions`; `now`: the
    job's schedule as measured (None with a single save); `advised`: the schedule to use
    (None without an MTBF).
    """

    root: str
    saves: int
    persists: int
    stall_s: float
    stall_p50_s: float
    stall_max_s: float
    persist_s: float | None
    persist_max_s: float | None
    seconds_per_step: float | None
    mtbf_s: float | None
    mtbf_source: str | None
    mtbf_note: str
    running_s: float
    interruptions: tuple[Interruption, ...]
    now: Schedule | None
    advised: Schedule | None

    def to_json(self) -> dict[str, Any]:
        """The advice as JSON data: the fields, seconds as numbers, lists for tuples (see
        `advise` for an example)."""
        doc = asdict(self)
        doc["interruptions"] = list(doc["interruptions"])
        return doc


# measuring ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Save:
    tag: str
    step: int | None
    started_s: float  # POSIX seconds
    started_at: str
    stall_s: float


def advise(
    root: PathLike,
    *,
    mtbf: float | timedelta | str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Advice:
    """Advise how often to checkpoint at ROOT, from its checkpointHistories.csv.

    `mtbf`: the job's mean time between failures, in seconds, as a `timedelta` or as a
    duration (`"6h"`, `"2d"`); None estimates it from the interruptions the root shows
    (`Advice.mtbf_source` is None, and `advised` too, when it shows none). Raises
    `HistoryNotFoundError` without a history, `HistoryFormatError` for a damaged one,
    `NebulaError` when it holds no save, and `InvalidArgumentError` for a bad `mtbf`.

    Example:
        >>> import nebulaml as nm, tempfile, torch
        >>> root = tempfile.mkdtemp()
        >>> nm.init(root, persistent_time_interval=0)
        >>> for step in (100, 200, 300):
        ...     nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.ones(4)})
        >>> nm.shutdown()
        >>> advice = nm.ops.advise(root, mtbf="6h")
        >>> advice.saves, advice.mtbf_s, advice.advised.interval_s > advice.stall_s
        (3, 21600.0, True)
        >>> advice.to_json()["mtbf_source"], advice.now.steps
        ('given', 100)
    """
    mtbf_s = _mtbf_seconds(mtbf)
    store = Store(root, storage_options)
    df = read_history(os.fspath(root), storage_options=storage_options)
    saves = _saves(df)
    if not saves:
        raise NebulaError(
            f"{store.url}: its history holds no save to measure (a job's saves write rows "
            "at its memory tier, then at the persistent root)"
        )
    persist_times, persist_starts = _persists(df)
    stalls = [s.stall_s for s in saves]
    # The figures the advice is computed from are those it reports (to the microsecond):
    # the advice can be worked out again from them.
    cost = round(statistics.fmean(stalls), 6)
    persist_p = _quantile(persist_times, PERSIST_QUANTILE) if persist_times else None
    spacings = [b.started_s - a.started_s for a, b in itertools.pairwise(saves)]
    usual = statistics.median(spacings) if spacings else None
    interruptions, broken, running = _interruptions(saves, spacings, usual)
    steady = _steady(saves, broken)
    seconds_per_step = _seconds_per_step(steady)
    if seconds_per_step is not None:
        seconds_per_step = round(seconds_per_step, 6) or None
    held = _hold(store)
    if held is not None:
        interruptions.append(held)

    if mtbf_s is not None:
        source: str | None = "given"
        note = "given"
    else:
        mtbf_s, note = _estimate(interruptions, running, len(saves))
        source = "estimated" if mtbf_s is not None else None

    now = None
    if usual is not None:
        persist_every = (
            statistics.median(b - a for a, b in itertools.pairwise(persist_starts))
            if len(persist_starts) > 1
            else None
        )
        tau = max(usual - cost, 0.0)  # the compute between two saves: the spacing less C
        now = _schedule(usual, _median_steps(steady), persist_every, persist_p, cost, tau, mtbf_s)
    advised = None if mtbf_s is None else _advise(cost, mtbf_s, seconds_per_step, persist_p)
    return Advice(
        root=store.url,
        saves=len(saves),
        persists=len(persist_times),
        stall_s=round(cost, 6),
        stall_p50_s=round(statistics.median(stalls), 6),
        stall_max_s=round(max(stalls), 6),
        persist_s=None if persist_p is None else round(persist_p, 6),
        persist_max_s=max(persist_times) if persist_times else None,
        seconds_per_step=None if seconds_per_step is None else round(seconds_per_step, 6),
        mtbf_s=mtbf_s,
        mtbf_source=source,
        mtbf_note=note,
        running_s=round(running, 3),
        interruptions=tuple(interruptions),
        now=now,
        advised=advised,
    )


def _advise(
    cost: float, mtbf_s: float, seconds_per_step: float | None, persist_p: float | None
) -> Schedule:
    """Daly's interval for the stall and the MTBF, in whole steps where steps are known;
    every save persisted, unless a persist takes longer than the save interval."""
    tau = daly_interval(cost, mtbf_s)
    steps = None
    if seconds_per_step:
        steps = max(1, round(tau / seconds_per_step))
        tau = steps * seconds_per_step  # what saving every `steps` steps gives
    interval = tau + cost
    persist_every = None if persist_p is None else max(interval, persist_p)
    return _schedule(interval, steps, persist_every, persist_p, cost, tau, mtbf_s)


def _mtbf_seconds(mtbf: float | timedelta | str | None) -> float | None:
    if mtbf is None:
        return None
    if isinstance(mtbf, str):
        return parse_duration(mtbf)
    seconds = mtbf.total_seconds() if isinstance(mtbf, timedelta) else float(mtbf)
    if not 0 < seconds < math.inf:
        raise InvalidArgumentError(f"mtbf={mtbf!r}: a time longer than zero")
    return seconds


def _checkpoints(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per checkpoint: the rows of one tag saved by several ranks go together (the
    k-th save of a tag by each rank is one checkpoint: a tag may be saved again)."""
    rows = rows.assign(nth=rows.groupby(["rank", "tag"]).cumcount())
    return rows.groupby(["tag", "nth"], sort=False).agg(
        step=("step", "first"),
        started_at=("started_at", "min"),
        blocking_s=("blocking_s", "max"),
        duration_s=("duration_s", "max"),
    )


def _saves(df: pd.DataFrame) -> list[_Save]:
    import pandas as pd

    rows = df[(df["tier"] == "memory") & (df["status"] == "ok")]
    if rows.empty:
        return []
    found = _checkpoints(rows).sort_values("started_at", kind="stable")
    saves = []
    for (tag, _nth), row in found.iterrows():
        started = row["started_at"]
        saves.append(_Save(
            tag=str(tag),
            step=None if pd.isna(row["step"]) else int(row["step"]),
            started_s=started.timestamp(),
            started_at=started.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            stall_s=float(row["blocking_s"]),
        ))  # fmt: skip
    return saves


def _persists(df: pd.DataFrame) -> tuple[list[float], list[float]]:
    """(persist times, persist starts in POSIX seconds, in order) of the successful persists."""
    rows = df[(df["tier"] == "persistent") & (df["status"] == "ok")]
    if rows.empty:
        return [], []
    found = _checkpoints(rows).sort_values("started_at", kind="stable")
    return (
        [float(v) for v in found["duration_s"]],
        [ts.timestamp() for ts in found["started_at"]],
    )


def _quantile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's and pandas' default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _interruptions(
    saves: list[_Save], spacings: list[float], usual: float | None
) -> tuple[list[Interruption], set[int], float]:
    """The interruptions the saves show, the indices of the saves that show them, and the
    time the job ran: every spacing, except that an interrupted one counts as at most the
    usual spacing (the rest was downtime)."""
    found: list[Interruption] = []
    broken: set[int] = set()
    running = 0.0
    highest: int | None = None  # the highest step saved since the job last went back
    for i, save in enumerate(saves):
        went_back = save.step is not None and highest is not None and save.step <= highest and i > 0
        if i:
            spacing = spacings[i - 1]
            before = saves[i - 1]
            assert usual is not None
            if went_back:
                found.append(Interruption("resumed", save.started_at, (
                    f"{save.tag} saved after step {highest} was: the job went back to an "
                    "earlier checkpoint")))  # fmt: skip
                broken.add(i)
                running += min(spacing, usual)
            elif spacing > max(GAP_FACTOR * usual, GAP_MIN_S):
                found.append(Interruption("gap", save.started_at, (
                    f"{save.tag} came {format_duration(spacing)} after {before.tag} "
                    f"(usually {format_duration(usual)})")))  # fmt: skip
                broken.add(i)
                running += usual
            else:
                running += spacing
        if save.step is not None:
            highest = save.step if highest is None or went_back else max(highest, save.step)
    return found, broken, running


def _steady(saves: list[_Save], broken: set[int]) -> list[tuple[_Save, _Save]]:
    """Consecutive saves with no interruption between them, both naming a step, forward."""
    return [
        (a, b)
        for i, (a, b) in enumerate(itertools.pairwise(saves), 1)
        if i not in broken and a.step is not None and b.step is not None and b.step > a.step
    ]


def _steps(a: _Save, b: _Save) -> int:
    assert a.step is not None and b.step is not None
    return b.step - a.step


def _seconds_per_step(steady: list[tuple[_Save, _Save]]) -> float | None:
    """The median compute time per step between steady saves: their spacing, less the
    stall of the first, over the steps between them."""
    per_step = [(b.started_s - a.started_s - a.stall_s) / _steps(a, b) for a, b in steady]
    positive = [v for v in per_step if v > 0]
    return statistics.median(positive) if positive else None


def _median_steps(steady: list[tuple[_Save, _Save]]) -> int | None:
    return round(statistics.median(_steps(a, b) for a, b in steady)) if steady else None


def _hold(store: Store) -> Interruption | None:
    """A takeover the root's hold shows: generation n means n - 1 jobs died holding it
    (since the last job that ended cleanly), and a dead holder is one more."""
    try:
        hold: HoldState | None = current_hold(store)
    except NebulaError:
        return None  # no hold to read (a memory-only job's folder, a store refusing)
    if hold is None:
        return None
    dead = 0 if hold.live else 1
    count = hold.generation - 1 + dead
    if count <= 0:
        return None
    holder = hold.holder
    since = holder.started_at if holder is not None and holder.started_at else ""
    what = f"{hold.name}: {hold.generation - 1} job(s) died holding the root before this one"
    if dead:
        what = f"{hold.name}: the job holding the root is gone" + (
            f", after {hold.generation - 1} before it" if hold.generation > 1 else ""
        )
    return Interruption("takeover", since, what, count)


def _failures(interruptions: list[Interruption]) -> int:
    """Interruptions the saves show, or the hold's count where that is higher (the hold's
    takeovers are interruptions the saves may show too)."""
    seen = sum(i.count for i in interruptions if i.kind != "takeover")
    held = sum(i.count for i in interruptions if i.kind == "takeover")
    return max(seen, held)


def _estimate(
    interruptions: list[Interruption], running_s: float, saves: int
) -> tuple[float | None, str]:
    failures = _failures(interruptions)
    if running_s <= 0:
        return None, (
            f"{saves} save{'s' if saves != 1 else ''}: too few to tell how long the job ran"
        )
    if failures == 0:
        return None, (
            f"no interruption in {format_duration(running_s)} of saves: the MTBF is longer "
            "than that"
        )
    mtbf = running_s / failures
    return round(mtbf, 3), (
        f"{failures} interruption{'s' if failures != 1 else ''} in "
        f"{format_duration(running_s)} of running"
    )


def _schedule(
    interval: float,
    steps: int | None,
    persist_every: float | None,
    persist_s: float | None,
    cost: float,
    tau: float,
    mtbf_s: float | None,
) -> Schedule:
    node_loss = None
    if persist_every is not None and persist_s is not None:
        # The newest durable checkpoint is at most a persist interval and a persist old;
        # when persists skip saves, the one a persist takes may be a save interval old too.
        node_loss = persist_every + persist_s + (interval if persist_every > interval else 0)
    return Schedule(
        interval_s=round(interval, 3),
        steps=steps,
        persist_every_s=None if persist_every is None else round(persist_every, 3),
        waste=None if mtbf_s is None else round(expected_waste(tau, cost, mtbf_s), 6),
        process_failure_loses_s=round(interval, 3),
        node_failure_loses_s=None if node_loss is None else round(node_loss, 3),
    )


def format_duration(seconds: float) -> str:
    """A duration for people, as `advise`'s notes and `nebula advise` write it: `0.120 s`,
    `42.0 s`, `3m 28s`, `2h 05m`, `1d 04h`.

    Example:
        >>> [format_duration(s) for s in (0.12, 42, 208.4, 7500, 100800)]
        ['0.120 s', '42.0 s', '3m 28s', '2h 05m', '1d 04h']
    """
    if seconds < 10:
        return f"{seconds:.3f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h {whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d {whole % 86400 // 3600:02d}h"
