"""GCS goes away in the middle of training, as S3 does in tests/s3/test_s3_outage.py (whose
checks these run, from tests/outage_kit.py): the suite's gcp-storage-emulator, reached
through a proxy of the test's own (tests/faultproxy.py), stopped at the proxy (connections
refused, those in flight reset: the emulator keeps its objects, as GCS does through an
outage, where a stopped emulator would forget them all) or suspended with SIGSTOP
(requests hang) and resumed. Saves during the outage return within 1 s;
`flush_persistence()` says False (or raises) while the newest is only in RAM, within its
deadline; the newest acknowledged checkpoint lands by itself once the store is back and
loads bit for bit; `init` with the store down returns at once, memory only.

The emulator ignores `ifGenerationMatch`, so its roots run in single-writer mode
(tests/gcs/test_gcs.py); one test at a time writes each root.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gcsserver
import pytest
from outage_kit import Proxied, behind_a_proxy, down_at_init, outage_during_training


@pytest.fixture
def gcs_away(
    gcs_server: gcsserver.GCSEmulator, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Proxied]:
    """The suite's emulator behind a proxy of this test's own (its storage options are
    `gcs_options`), with short retries and a 1 s deadline a call."""
    with behind_a_proxy(gcs_server.proc, gcs_server.port, monkeypatch) as server:
        yield server


def gcs_options(server: Proxied) -> dict[str, Any]:
    """The storage options that reach the emulator through its proxy, single-writer."""
    return {"endpoint_url": server.proxy.endpoint, "token": "anon",
            "project": gcsserver.PROJECT, "nebula_single_writer": True}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stopped", "suspended"])
def test_a_gcs_outage_never_stops_training_and_the_newest_lands_when_it_is_back(
    gcs_away: Proxied, gcs_url: str, how: str
) -> None:
    # Catches: a save that asks GCS something on the training thread (blocks for the
    # retries or the hang), a flush that says True (or waits past its deadline) while the
    # newest is in RAM only, a persist that hangs without a deadline (never reported as
    # failing), and a failed persist dropped: the newest never reaching GCS.
    outage_during_training(gcs_away, gcs_url, gcs_options(gcs_away), how)


@pytest.mark.slow
def test_gcs_down_at_init_starts_memory_only_and_persists_once_it_is_back(
    gcs_away: Proxied, gcs_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Catches: init waiting out its deadline for a store that refuses the connection
    # (gcsfs's own retries, up to six with backoff, inside nebula's); the job not
    # checkpointing to RAM at once; what it saved never persisted after.
    down_at_init(gcs_away, gcs_url, gcs_options(gcs_away), caplog)
