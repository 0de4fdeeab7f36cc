"""Shared fixtures of the test suite (the autouse isolation fixture is in ../conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A persistent root on the local filesystem (not created: nebula creates it)."""
    return tmp_path / "persistent"
