"""Isolation for every test and doctest: a private memory tier, no inherited NEBULA_*
settings, and no nebula session left behind."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# The library's modules for an optional framework are not collected for doctests where
# that framework is not installed (tests/integrations skips, or fails under CI).
SHM = "/dev/shm"

collect_ignore = [
    f"core/nebulaml/{name}.py"
    for name in ("lightning", "pytorch_lightning")
    if importlib.util.find_spec(name) is None
]
# The Trainer needs Accelerate too: the Hugging Face modules go together.
if any(importlib.util.find_spec(name) is None for name in ("transformers", "accelerate")):
    collect_ignore += [
        f"core/nebulaml/{where}{name}.py"
        for name in ("transformers", "accelerate")
        for where in ("", "integrations/")
    ]


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM))
    except FileNotFoundError:
        return set()


@pytest.fixture(scope="session", autouse=True)
def leaves_nothing_in_shm() -> Iterator[None]:
    """The suite's teardown: nothing new left in /dev/shm (a memory tier is RAM)."""
    before = _shm_entries()
    yield
    left = sorted(_shm_entries() - before)
    if left:
        pytest.fail(f"the test suite left {left} in {SHM}", pytrace=False)


@pytest.fixture(autouse=True)
def memory_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private memory-tier base folder (never the user's real /dev/shm tiers)."""
    import nebulaml as nm
    from nebulaml.runtime import session as _session

    base = tmp_path / "memory-tier"
    monkeypatch.setenv("NEBULA_MEMORY_TIER_PATH", str(base))
    for var in (
        "NEBULA_PERSISTENT_STORAGE_PATH",
        "NEBULA_PERSISTENT_TIME_INTERVAL",
        "NEBULA_NUM_OF_VERSION_IN_RETENTION",
        "NEBULA_MEMORY_BUFFER_SIZE",
        "NEBULA_EXIT_TIMEOUT_S",
        "NEBULA_LAZY_SNAPSHOT",
        "NEBULA_KEEP_MEMORY_TIER",
        "NEBULA_RANK_TIMEOUT_S",
        "NEBULA_STORAGE_RETRIES",
        "NEBULA_STORAGE_RETRY_BASE_S",
        "NEBULA_STORAGE_RETRY_MAX_S",
        "NEBULA_JOB_ID",
    ):
        monkeypatch.delenv(var, raising=False)
    yield base
    # A test that provoked a background failure has already asserted on it.
    with contextlib.suppress(nm.NebulaError):
        _session.stop(timeout_s=30)
