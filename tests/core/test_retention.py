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


# Issue #18, case 1: "newest" is the step a tag names, then the commit sequence; the commit
# time (`committed_at`, a wall clock that may step) only breaks ties.
def _s(tag: str, sequence: int, committed_at: str, *labels: str) -> Version:
    return Version(tag, committed_at, tuple(labels), sequence)


AN_HOUR_BACK = [("before", 1, "2026-01-01T01:00:00Z"), ("after", 2, "2026-01-01T00:00:00Z")]
A_DAY_AHEAD = [
    ("warmup", 1, "2026-01-02T00:00:00Z"),
    ("run-1", 2, "2026-01-01T00:01:00Z"),
    ("run-2", 3, "2026-01-01T00:02:00Z"),
]


@pytest.mark.parametrize(
    ("versions", "keep", "expected"),
    [
        (AN_HOUR_BACK, 1, ["before"]),  # main deleted "after", the newer
        (A_DAY_AHEAD, 2, ["warmup"]),  # main kept "warmup" for ever
        (A_DAY_AHEAD, 1, ["warmup", "run-1"]),
        (  # Lightning's step, whatever the clock said
            [
                ("epoch=0-step=100", 0, "2026-01-01T01:00:00Z"),
                ("epoch=1-step=200", 0, "2026-01-01T00:00:00Z"),
            ],
            1,
            ["epoch=0-step=100"],
        ),
        (  # a step beats the sequence
            [("global_step9", 7, "2026-01-03Z"), ("global_step10", 6, "2026-01-01Z")],
            1,
            ["global_step9"],
        ),
        ([("schema1", 0, "2026-06-01Z"), ("schema2", 1, "2026-01-01Z")], 1, ["schema1"]),
        ([("a", 3, "2026-01-01Z"), ("b", 3, "2026-01-02Z")], 1, ["a"]),  # then the time
    ],
    ids=["hour-back", "day-ahead", "day-ahead-keep-1", "lightning", "step", "schema-1", "tie"],
)
def test_retention_follows_the_commit_sequence_not_the_clock(versions, keep, expected) -> None:
    assert plan_retention([_s(*v) for v in versions], keep) == expected


def test_retention_never_deletes_a_version_newer_than_one_it_keeps() -> None:
    import random

    rng = random.Random(18)
    for _ in range(2000):
        versions = [
            _s(
                rng.choice([f"global_step{rng.randint(0, 5)}-{i}", f"tag-{i}"]),
                rng.randint(0, 6),
                f"2026-01-0{rng.randint(1, 9)}T00:00:00Z",
                *(["best"] if rng.random() < 0.2 else []),
            )
            for i in range(rng.randint(1, 8))
        ]
        protected = {v.tag for v in versions if rng.random() < 0.1}
        keep = rng.randint(1, 4)
        deleted = set(plan_retention(versions, keep, protected))
        ordinary = [v for v in versions if not v.labels and v.tag not in protected]
        kept = [v for v in ordinary if v.tag not in deleted]
        for gone in (v for v in versions if v.tag in deleted):
            assert not gone.labels and gone.tag not in protected
            assert all(gone.sort_key < v.sort_key for v in kept), (versions, keep, gone)
        newest = max(versions, key=lambda v: v.sort_key)
        assert newest.tag not in deleted
        assert len(kept) >= min(keep, len(ordinary)) - (newest not in ordinary)
