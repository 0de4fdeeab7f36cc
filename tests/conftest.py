"""Shared fixtures: every test gets its own memory tier and persistent root, and leaves
no nebula session behind."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import nebulaml as nm
from nebulaml import session as _session


@pytest.fixture(autouse=True)
def memory_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private memory-tier base folder (never the user's real /dev/shm tiers)."""
    base = tmp_path / "memory-tier"
    monkeypatch.setenv("NEBULA_MEMORY_TIER_PATH", str(base))
    for var in (
        "NEBULA_PERSISTENT_STORAGE_PATH",
        "NEBULA_PERSISTENT_TIME_INTERVAL",
        "NEBULA_NUM_OF_VERSION_IN_RETENTION",
        "NEBULA_MEMORY_BUFFER_SIZE",
    ):
        monkeypatch.delenv(var, raising=False)
    yield base
    try:
        _session.stop(timeout_s=30)
    except nm.NebulaError:
        pass  # a test that provoked a background failure has already asserted on it


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
