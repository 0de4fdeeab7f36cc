"""How values read in a command's output: sizes in IEC units (KiB, MiB, GiB, and so is a
copy's progress rate, MiB/s), ages ('3h'), nebula's timestamps parsed, and long lists cut
to a screen without --verbose (`shown`; --json always has every row). The history's
throughput is MB/s, the unit its file records (`throughput_mb_s`): commands/history.py.

May import: the standard library only.
Not for: laying the values out (tables.py) or escaping them (console.py `printable`).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

ROWS_SHOWN = 20  # rows of one kind a command shows without --verbose


def shown(rows: list[Any], verbose: bool) -> tuple[list[Any], int]:
    """(the rows to show, how many are left out): all with `verbose`, else the first
    `ROWS_SHOWN`. A root of thousands of checkpoints prints a screen, not thousands of
    lines; `--json` always has every one.

    Example:
        >>> shown(list(range(25)), False)[1], shown(list(range(25)), True)[1]
        (5, 0)
    """
    if verbose or len(rows) <= ROWS_SHOWN:
        return rows, 0
    return rows[:ROWS_SHOWN], len(rows) - ROWS_SHOWN


def summarise_tags(tags: list[str], verbose: bool) -> str:
    """`tags` in one line: every one with `verbose` (or up to `ROWS_SHOWN`), else the
    first ones and how many more.

    Example:
        >>> summarise_tags([f"t{i}" for i in range(30)], False)[-32:]
        't19 and 10 more (--verbose: all)'
    """
    first, left = shown(tags, verbose)
    text = ", ".join(first)
    return f"{text} and {left} more (--verbose: all)" if left else text


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB' (IEC units, as everywhere in nebula's output).

    Example:
        >>> human_bytes(1536), human_bytes(12), human_bytes(210_500_000)
        ('1.5 KiB', '12 B', '200.7 MiB')
    """
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_time(iso: str) -> datetime:
    """Parse nebula's ISO-8601 UTC timestamps ('...Z')."""
    return datetime.fromisoformat(iso.replace("Z", "+00:00"))


def human_age(iso: str, now: datetime | None = None) -> str:
    """How long ago an ISO-8601 UTC time was: '42s', '5m', '3h', '2d'; '?' for a time
    that does not read as one (a damaged or foreign manifest's: it is shown as written
    beside), and '0s' for one in the future (a clock that was ahead).

    Example:
        >>> human_age("2026-01-01T00:00:00Z", parse_time("2026-01-01T03:10:00Z"))
        '3h'
        >>> human_age("yesterday"), human_age("2026-01-02", parse_time("2026-01-01T00:00Z"))
        ('?', '0s')
    """
    now = now or datetime.now(timezone.utc)
    try:
        then = parse_time(iso)
        if then.tzinfo is None:  # no offset written: nebula's times are UTC
            then = then.replace(tzinfo=timezone.utc)
        seconds = max(0.0, (now - then).total_seconds())
    except (TypeError, ValueError, AttributeError, OverflowError):
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"
