"""Azure Blob Storage goes away in the middle of training (issue #27), on a real Azurite
of this test's own: stopped cleanly (its data survives) and started again on the same
port, or suspended with SIGSTOP (requests hang instead of failing) and resumed. Every save
during the outage returns within 3x a healthy save (or 2 s) and none raises;
`flush_persistence()` does not report success while the newest is only in RAM; once the
store is back the newest acknowledged checkpoint lands by itself and loads bit for bit.
"""

from __future__ import annotations

import time
import uuid

import pytest
from azurite import Azurite
from outage_kit import (
    assert_durable_and_loads,
    assert_memory_only,
    store_away,
    timed_save,
    wait_durable,
)

import nebulaml as nm

CONTAINER = "outage"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stopped", "suspended"])
def test_an_outage_never_stops_training_and_the_newest_lands_when_the_store_is_back(
    own_azurite: Azurite, how: str
) -> None:
    """Bugs caught (main): every save during the outage blocking 10-14 s and then raising
    StorageError (the save asked the store whether its tag was committed); a failed
    persist dropped, so the newest acknowledged checkpoint never reached the store."""
    url = f"az://{CONTAINER}/{uuid.uuid4().hex[:12]}"
    nm.init(url, persistent_time_interval=0, exit_timeout_s=60, on_persist_error="retry")
    healthy = [timed_save(step) for step in (1, 2, 3)]
    assert nm.flush_persistence(timeout_s=60) is True
    with store_away(own_azurite, how):
        during = []
        for step in range(4, 10):
            during.append(timed_save(step))
            time.sleep(0.1)
        assert max(during) < max(3 * max(healthy), 2.0), (healthy, during)
        assert nm.flush_persistence(timeout_s=1, raise_on_error=False) is False
        status = nm.persistence_status()
        assert status.pending and status.pending[-1] == "global_step9", status
        assert status.durable == "global_step3", status
    wait_durable("global_step9")  # no call but the status
    assert nm.persistence_status().ok
    nm.shutdown(timeout_s=60)  # all durable: the memory tier is released
    assert_durable_and_loads(url, {}, 9)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stopped", "suspended"])
def test_a_store_down_at_init_starts_memory_only_and_persists_once_it_is_back(
    own_azurite: Azurite, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Bugs caught (main): init raising StorageError after its retries (stopped) or
    hanging on them (suspended): the job could not even checkpoint to RAM."""
    url = f"az://{CONTAINER}/{uuid.uuid4().hex[:12]}"
    with store_away(own_azurite, how):
        t0 = time.perf_counter()
        nm.init(url, persistent_time_interval=0, exit_timeout_s=60)  # the default: retry
        took = time.perf_counter() - t0
        assert took < 10, took  # a bounded wait for the store, never its retries
        during = [timed_save(step) for step in range(1, 5)]
        assert max(during) < 2.0, during
        assert_memory_only("global_step4", caplog)
        status = nm.persistence_status()
        assert status.failing_since and status.last_error and not status.ok, status
    wait_durable("global_step4")
    nm.shutdown(timeout_s=60)
    assert_durable_and_loads(url, {}, 4)
