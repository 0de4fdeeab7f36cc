"""A root in an Azure container that does not exist (issue #48): said so, not only "no
such checkpoint root", which reads as a root never written to (a mistyped container)."""

from __future__ import annotations

import pytest
from azurite import Azurite
from typer.testing import CliRunner

from nebula_cli.app import app

CONTAINER = "nebula-tests"  # the one the suite's Azurite has (tests/conftest.py)


def test_a_missing_container_is_named(azurite: Azurite, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug caught: `nebula ls az://<mistyped container>/run1` said only "no such
    checkpoint root", as for a run never started in a container that exists."""
    monkeypatch.setenv("NEBULA_STORAGE_RETRIES", "1")
    option = ["--storage-option", f"connection_string={azurite.connection_string}"]
    runner = CliRunner()
    missing = runner.invoke(app, ["ls", "az://no-such-container/run1", *option])
    assert missing.exit_code == 3, missing.stderr
    assert "no such checkpoint root (its container 'no-such-container' does not exist)" in (
        missing.stderr
    )
    there = runner.invoke(app, ["ls", f"az://{CONTAINER}/never-written", *option])
    assert there.exit_code == 3, there.stderr
    assert there.stderr.rstrip().endswith("no such checkpoint root"), there.stderr
