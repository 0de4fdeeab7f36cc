"""Rank detection from the environment, and the seed's per-process memory budget."""

from __future__ import annotations

import pytest

import nebulaml as nm
from nebulaml.runtime.ranks import RankInfo, detect_ranks, memory_budget_bytes


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, RankInfo(0, 1, 0, 1)),
        ({"RANK": "3", "WORLD_SIZE": "4"}, RankInfo(3, 4, 3, 4)),  # one node by default
        (
            {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"},
            RankInfo(5, 8, 1, 4),
        ),
        ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2"}, RankInfo(5, 8, 1, 2)),
    ],
)
def test_detect_from_environment(monkeypatch, env: dict[str, str], expected: RankInfo) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert detect_ranks() == expected


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "not below the world size"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "must not be negative"),
    ],
)
def test_bad_environment_is_refused(monkeypatch, env: dict[str, str], match: str) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(nm.InvalidArgumentError, match=match):
        detect_ranks()


def test_memory_budget_is_half_divided_by_local_processes(monkeypatch) -> None:
    four_local = RankInfo(rank=5, world_size=8, local_rank=1, local_world_size=4)
    assert memory_budget_bytes(four_local) is None
    monkeypatch.setenv("NEBULA_MEMORY_BUFFER_SIZE", "200000000")  # the seed's example
    assert memory_budget_bytes(four_local) == 25_000_000
    assert memory_budget_bytes(RankInfo()) == 100_000_000
