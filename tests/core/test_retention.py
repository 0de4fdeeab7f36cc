"""Retention planning: a pure function, table-driven."""

from __future__ import annotations

import pytest

from nebulaml.protocol.retention import Version, plan_retention


def _v(step: int, *labels: str) -> Version:
    return Version(f"global_step{step}", f"2026-01-01T00:00:{step:02d}Z", tuple(labels))


@pytest.mark.parametrize(
    ("versions", "keep", "protected", "expected"),
    [
        ([], 2, (), []),
        ([_v(1)], 1, (), []),
        ([_v(1), _v(2), _v(3)], 2, (), ["global_step1"]),
        ([_v(3), _v(1), _v(2)], 1, (), ["global_step1", "global_step2"]),  # any input order
        ([_v(1, "best"), _v(2), _v(3)], 1, (), ["global_step2"]),  # labelled: kept, not counted
        ([_v(1), _v(2), _v(3)], 1, ("global_step1",), ["global_step2"]),  # being read/written
        ([_v(1), _v(2, "best")], 1, (), ["global_step1"]),  # the newest counts even labelled
        ([_v(1), _v(2), _v(3)], 5, (), []),
        ([_v(9), _v(10), _v(100)], 1, (), ["global_step9", "global_step10"]),  # numeric order
    ],
)
def test_plan_retention(versions, keep, protected, expected) -> None:
    assert plan_retention(versions, keep, protected) == expected


def test_the_newest_is_never_deleted_even_if_protected_elsewhere() -> None:
    versions = [_v(1), _v(2)]
    assert "global_step2" not in plan_retention(versions, 1, ())


def test_keep_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        plan_retention([_v(1)], 0)
