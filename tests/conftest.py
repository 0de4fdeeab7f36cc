"""Shared fixtures of the test suite (the autouse isolation fixture is in ../conftest.py)."""

from __future__ import annotations

import os
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


def child_env(memory_base: Path) -> dict[str, str]:
    """Environment for a child Python process that uses nebula in a test."""
    env = dict(os.environ)
    env["NEBULA_MEMORY_TIER_PATH"] = str(memory_base)
    env["PYTHONUNBUFFERED"] = "1"
    return env
