"""A checkpoint history of two ranks written by the real row writer (protocol/history.py),
with times chosen so that everything `nebula advise` derives from it can be worked out by
hand (tests/core/test_advice.py does; tests/cli/test_advise.py prints it).

Not for: assertions.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

from nebulaml.protocol.history import HistoryRow, append_rows, make_row, skipped_row
from nebulaml.storage.store import Store

T0 = datetime(2026, 3, 1, 8, 0, tzinfo=timezone.utc)


def at(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def save_row(
    tag: int, t: float, rank: int, stall: float, error: BaseException | None = None
) -> HistoryRow:
    return make_row(tag=f"global_step{tag}", step=tag, tier="memory", rank=rank,
                    started_at=at(t), duration_s=stall, blocking_s=stall,
                    size_bytes=1000, error=error)  # fmt: skip


def persist_row(tag: int, t: float, rank: int, seconds: float) -> HistoryRow:
    return make_row(tag=f"global_step{tag}", step=tag, tier="persistent", rank=rank,
                    started_at=at(t), duration_s=seconds, blocking_s=0.0,
                    size_bytes=1000)  # fmt: skip


def write_two_rank_history(root: Path) -> None:
    """Two ranks' rows: saves every 100 s, a stop (700 s), a return to step 500 after 600.

        checkpoint  step  at (s)  stalls r0, r1   persists r0, r1 (s)
        1           100      0    1.0, 4.0        5, 10   (at 1)
        2           200    100    1.0, 2.0        6, 1    (at 101)
        3           300    200    1.0, 2.0        7, 1    (at 201)
        4           400    300    1.0, 2.0        8, 1    (at 301)
        5           500   1000    1.0, 2.0        -       a gap: 700 > 3 x 100
        6           600   1100    1.0, 2.0
        7           500   1150    1.0, 2.0        -       resumed: 500 after 600
        8           600   1250    1.0, 2.0

    plus rows that must not count: a failed save and a skipped persist.
    """
    times = {100: 0, 200: 100, 300: 200, 400: 300}
    rows = []
    for i, (step, t) in enumerate([*times.items(), (500, 1000), (600, 1100), (500, 1150),
                                   (600, 1250)]):  # fmt: skip
        rows.append(save_row(step, t, 0, 1.0))
        rows.append(save_row(step, t + 0.01, 1, 4.0 if i == 0 else 2.0))
    for (step, t), r0, r1 in zip(times.items(), (5, 6, 7, 8), (10, 1, 1, 1), strict=True):
        rows.append(persist_row(step, t + 1, 0, r0))
        rows.append(persist_row(step, t + 1, 1, r1))
    rows.append(save_row(150, 50, 0, 30.0, error=RuntimeError("disk full")))
    rows.append(skipped_row(tag="global_step500", step=500, rank=0, started_at=at(1001),
                            superseded_by="global_step600"))  # fmt: skip
    append_rows(Store(str(root)), rows)
