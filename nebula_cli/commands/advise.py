"""`nebula advise ROOT [--mtbf DURATION]`: how often to checkpoint, from the root's measured
save stalls and persist times and the job's mean time between failures; as a table and one
recommendation line, or JSON.

Not for: measuring or the formulas (nebulaml.ops.advise, daly_interval, expected_waste).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from ..console import emit_json, stdout
from ..exits import EXIT_USAGE, fail, handles_errors
from ..options import JsonOpt, RootArg, StorageOpt
from ..tables import print_table

if TYPE_CHECKING:
    from nebulaml.ops import Advice, Schedule

MTBF_EXAMPLE = "24h"


def parse_mtbf(text: str) -> float:
    """`--mtbf`: a duration (6h, 90m, 2d, 1h30m) in seconds, or a usage error."""
    from nebulaml import InvalidArgumentError
    from nebulaml.ops import parse_duration

    try:
        return parse_duration(text)
    except InvalidArgumentError as exc:
        raise typer.BadParameter(str(exc)) from None


@handles_errors
def advise_command(
    root: RootArg,
    mtbf: Annotated[
        float | None,
        typer.Option(
            "--mtbf",
            metavar="DURATION",
            parser=parse_mtbf,
            help="The job's mean time between failures: 6h, 90m, 2d, 1h30m (your cluster's "
            "failure rate, or the job's history). Default: estimated from the interruptions "
            "ROOT shows; without any, the command asks for it.",
        ),
    ] = None,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Advise how often to checkpoint, from what ROOT's history measured.

    Each save stalls training for C seconds (the save stall checkpointHistories.csv
    records, the slowest rank's); each failure loses the work since the last save. Saving
    often costs stalls, saving rarely costs rework: with failures every M seconds on
    average (the MTBF), the least time is lost saving every sqrt(2*C*M) seconds or so
    (Young and Daly's interval, with Daly's correction). The table compares the job's
    schedule now (the spacing of its saves) with the advised one: the interval between
    saves (and in steps, when tags name them: global_step500), the expected share of
    training time lost to stalls and rework, and what a failure loses. A failed process
    loses the work since the last save (the node's memory tier keeps it); a failure that
    takes the node loses the work since the last persist, so persistent_time_interval is
    advised no shorter than the persist time (p95).

    Without --mtbf, the MTBF is the time the job ran over the interruptions ROOT shows
    (a step saved again after a later one, a save long after the one before, a job that
    took the root over from a dead one); a root that shows none needs --mtbf (exit 2).

    With --json: `root`, `saves`, `persists`, `stall_s` (the C used), `persist_s` (p95),
    `seconds_per_step`, `mtbf_s`, `mtbf_source` (given, estimated or null), `mtbf_note`,
    `running_s`, `interruptions`, and `now` and `advised`, each with `interval_s`, `steps`,
    `persist_every_s`, `waste` (a fraction), `process_failure_loses_s` and
    `node_failure_loses_s`.

    Example: nebula advise /mnt/checkpoints/run1 --mtbf 12h
    """
    import nebulaml as nm
    from nebulaml.ops import advise

    location = nm.check_root(root)
    advice = advise(root, mtbf=mtbf)
    if as_json:
        emit_json({**advice.to_json(), "root": location})
    else:
        _print(location, advice)
    if advice.advised is None:
        fail(
            f"cannot estimate the MTBF: {advice.mtbf_note}; give it: "
            f"nebula advise {root} --mtbf {MTBF_EXAMPLE}",
            EXIT_USAGE,
        )


def duration(seconds: float | None) -> str:
    """A duration for a table cell (nebulaml.ops.format_duration), `-` for none.

    Example:
        >>> duration(208.4), duration(None)
        ('3m 28s', '-')
    """
    from nebulaml.ops import format_duration

    return "-" if seconds is None else format_duration(seconds)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.2f}%"


def _steps(value: int | None) -> str:
    return "-" if value is None else str(value)


def save_every(steps: int | None, every: str) -> str:
    """The recommendation's first words: steps where the tags name them.

    Example:
        >>> save_every(635, "10m 25s"), save_every(1, "2.1 s"), save_every(None, "40 s")
        ('Save every 635 steps (about 10m 25s)', 'Save every step (about 2.1 s)', 'Save every 40 s')
    """
    if not steps:
        return f"Save every {every}"
    return f"Save every {'step' if steps == 1 else f'{steps} steps'} (about {every})"


def setting(seconds: float, interval_s: float) -> str:
    """A `persistent_time_interval` as one writes it (whole seconds from 10 s up, else
    hundredths): rounded down while it is the save interval (each save persisted), up
    when it is the persist time (never shorter).

    Example:
        >>> setting(208.7, 208.7), setting(208.2, 100.0), setting(2.3456, 2.3456)
        ('208', '209', '2.34')
    """
    scale = 1 if seconds >= 10 else 100
    rounding = math.floor if seconds <= interval_s else math.ceil
    return f"{rounding(seconds * scale) / scale:g}"


def _print(location: str, a: Advice) -> None:
    out = stdout()
    source = a.mtbf_source or "unknown"
    title = f"{location}: {a.saves} saves, {a.persists} persists"
    table = Table(title=title, title_justify="left")
    for column in ("", "now", "advised"):
        table.add_column(column, justify="right" if column else "left", no_wrap=True)
    now, advised = a.now, a.advised
    rows: list[tuple[str, Callable[[Schedule], str]]] = [
        ("save every", lambda s: duration(s.interval_s)),
        ("steps between saves", lambda s: _steps(s.steps)),
        ("persist every", lambda s: duration(s.persist_every_s)),
        ("time lost (stalls + rework)", lambda s: _share(s.waste)),
        ("a failed process loses <=", lambda s: duration(s.process_failure_loses_s)),
        ("a lost node loses <=", lambda s: duration(s.node_failure_loses_s)),
    ]
    for label, cell in rows:
        if label.startswith("steps") and a.seconds_per_step is None:
            continue  # the tags name no step
        table.add_row(label, *("-" if s is None else cell(s) for s in (now, advised)))
    table.add_row("stall per save (mean)", duration(a.stall_s), "")
    table.add_row("persist time (p95)", duration(a.persist_s), "")
    table.add_row(f"MTBF ({source})", duration(a.mtbf_s), "")
    print_table(table, console=out)
    if a.mtbf_source == "estimated":
        out.print(f"MTBF: {a.mtbf_note}.", highlight=False, markup=False)
    if advised is None:
        return
    if a.mtbf_s is not None and a.mtbf_s <= a.stall_s:
        out.print(
            f"No checkpoint interval helps: a failure every {duration(a.mtbf_s)} on average "
            f"is sooner than a save's stall ({duration(a.stall_s)}); even at the best interval, "
            f"{_share(advised.waste)} of training time is lost.",
            highlight=False,
            markup=False,
        )
        return
    what = save_every(advised.steps, duration(advised.interval_s))
    persist = (
        f" and set persistent_time_interval={setting(advised.persist_every_s, advised.interval_s)}"
        if advised.persist_every_s is not None
        else ""
    )
    instead = (
        f" instead of {_share(now.waste)}" if now is not None and now.waste is not None else ""
    )
    out.print(
        f"{what}{persist}: {_share(advised.waste)} of training time lost{instead}.",
        highlight=False,
        markup=False,
    )
