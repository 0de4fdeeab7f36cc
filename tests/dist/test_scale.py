"""Commit latency must not grow faster than linearly with the number of ranks."""

from __future__ import annotations

from benchmarks.scale import run
import pytest


@pytest.mark.slow
def test_commit_latency_grows_at_most_linearly() -> None:
    small, large = run([16, 128], repeats=3)
    growth = large["commit_latency_s"] / small["commit_latency_s"]
    # Linear growth is 8x here and a quadratic commit 64x; allow 2x noise over linear.
    assert growth <= 16, (small, large)
    assert large["manifest_bytes"] > 7 * small["manifest_bytes"]  # every rank is in it
