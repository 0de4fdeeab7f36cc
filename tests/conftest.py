"""Shared fixtures of the test suite (the autouse isolation fixture is in ../conftest.py)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A persistent root on the local filesystem (not created: nebula creates it)."""
    return tmp_path / "persistent"


@pytest.fixture
def memory_url() -> str:
    """A unique fsspec memory:// root (fsspec's memory store is process-global)."""
    return f"memory://nebula-test-{uuid.uuid4().hex}"
