"""Fixtures of the subprocess crash and exit tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from children import crashkit


def child_env(memory_base: Path) -> dict[str, str]:
    """Environment for a child Python process that uses nebula in a test."""
    return dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_base), PYTHONUNBUFFERED="1")


@pytest.fixture
def start_child(memory_tier: Path, tmp_path: Path) -> Iterator[Callable[..., crashkit.Child]]:
    """Start a scenario of nebula_child.py sharing this test's memory tier; all are reaped."""
    started: list[crashkit.Child] = []

    def start(scenario: str, *args: object) -> crashkit.Child:
        child = crashkit.Child(
            scenario,
            *args,
            env=child_env(memory_tier),
            stderr_path=tmp_path / f"child-{len(started)}-{scenario}.stderr",
        )
        started.append(child)
        return child

    yield start
    for child in started:
        child.kill()
