"""Transient errors on Azure are retried, bounded; then a StorageError, nothing half-done.

Faults come from a real HTTP proxy in front of a real Azurite (faultproxy.py): 503s,
reset connections, answers lost after Azurite acted on the request.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import aiohttp
import pytest
import torch
from azure.core.exceptions import (
    HttpResponseError,
    ResourceExistsError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azurite import KEY, Azurite
from faultproxy import Fault, FaultProxy

import nebulaml as nm
from nebulaml.storage.retry import RetryPolicy, is_transient
from nebulaml.storage.store import Store

CONTAINER = "nebula-tests"
RETRIES = 4


@pytest.fixture
def proxy(azure_env: Azurite) -> Iterator[FaultProxy]:
    server = FaultProxy(azure_env.port)
    yield server
    server.close()


@pytest.fixture
def options(proxy: FaultProxy) -> dict[str, object]:
    """Storage options that reach Azurite through the proxy, with short retries and small
    blocks (so that a 1 MB item is uploaded as 16 blocks)."""
    return {
        "connection_string": proxy.connection_string,
        "nebula_retries": RETRIES,
        "nebula_retry_base_s": 0.01,
        "nebula_retry_max_s": 0.05,
        "nebula_block_bytes": 64 << 10,
    }


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256 << 10,), float(step))}  # 1 MiB


def _save(step: int) -> None:
    nm.Checkpoint(f"global_step{step}").save("model", _state(step))


def test_transient_errors_during_a_persist_are_retried(
    az_url: str, proxy: FaultProxy, options: dict[str, object]
) -> None:
    # Catches: no retry at all (the first 503 fails the persist), a block that is not
    # retried on its own, or a retried block that is staged under a new ID and left out
    # of the committed list (the item would be short: its size check fails the load).
    nm.init(az_url, persistent_time_interval=3600, storage_options=options)
    _save(1)
    proxy.inject(Fault("status", 2, "PUT", "comp=block", status=503))
    proxy.inject(Fault("reset", 2, "PUT", "comp=block"))
    proxy.inject(Fault("status", 1, "PUT", "comp=blocklist", status=500))
    proxy.inject(Fault("reset", 1, "PUT", "manifest.json"))
    proxy.inject(Fault("status", 1, "GET", "comp=list", status=503))
    nm.flush_persistence()
    assert len(proxy.outcomes("status 503")) == 3 and len(proxy.outcomes("reset")) == 3
    assert len(proxy.outcomes("status 500")) == 1
    ckpt = nm.get_checkpoint("global_step1", persist_path=az_url)
    assert ckpt is not None
    persisted = [c for c in nm.list_checkpoints(az_url) if "persistent" in c["tiers"]]
    assert [c["tag"] for c in persisted] == ["global_step1"]
    with ckpt:  # its hold released while the proxy is there (not by a later finalizer)
        assert torch.equal(ckpt.load("model")["w"], _state(1)["w"])


def test_a_lost_answer_to_the_manifest_upload_is_not_a_conflict(
    az_url: str, proxy: FaultProxy, options: dict[str, object]
) -> None:
    # Catches: the retry of a create-only upload that Azurite did carry out, whose answer
    # was lost, taken for another writer's commit (a CommitConflictError for our own).
    nm.init(az_url, persistent_time_interval=3600, storage_options=options)
    _save(1)
    proxy.inject(Fault("drop_response", 1, "PUT", "manifest.json"))
    nm.flush_persistence()
    assert proxy.outcomes("drop_response")
    manifest_puts = [e for e in proxy.outcomes() if "manifest.json" in e[1] and e[0] == "PUT"]
    assert len(manifest_puts) == 2  # the lost one, and the retry that found it there
    ckpt = nm.get_checkpoint("global_step1", persist_path=az_url)
    assert ckpt is not None
    ckpt.release()


def test_retries_are_bounded_then_the_caller_gets_a_storage_error(
    az_url: str, proxy: FaultProxy, options: dict[str, object]
) -> None:
    # Catches: retrying forever (training hangs), a raw azure exception escaping the
    # boundary, a half-committed tag, and a persist failure that kills training.
    # The storage boundary's bound, seen through the opt-in contract (by default the
    # persister tries again after it: test_azure_outage.py).
    nm.init(
        az_url, persistent_time_interval=3600, storage_options=options, on_persist_error="raise"
    )
    _save(1)
    nm.flush_persistence()
    proxy.inject(Fault("status", 1000, "PUT", "global_step2/manifest.json", status=503))
    _save(2)
    started = time.monotonic()
    with pytest.raises(nm.PersistError) as caught:
        nm.flush_persistence()
    elapsed = time.monotonic() - started
    assert elapsed < 10
    cause = caught.value.__cause__
    assert isinstance(cause, nm.StorageError)
    message = str(caught.value)
    assert f"{az_url}/global_step2/manifest.json" in message
    assert f"gave up after {RETRIES + 1} tries" in message and "503" in message
    assert KEY not in message
    assert len(proxy.outcomes("status 503")) == RETRIES + 1
    # Nothing half-committed: global_step2 is not on the persistent tier; step 1 loads.
    tiers = {c["tag"]: c["tiers"] for c in nm.list_checkpoints(az_url)}
    assert tiers["global_step2"] == ["memory"] and "persistent" in tiers["global_step1"]
    assert "global_step2" not in Store(az_url, options).list_dirs() or not Store(
        az_url, options
    ).exists("global_step2", "manifest.json")
    # Training goes on: the next save and persist work once the store is healthy.
    proxy.clear()
    _save(3)
    nm.flush_persistence()
    latest = nm.get_latest_checkpoint(persist_path=az_url)
    assert latest is not None and latest.tag == "global_step3"
    with latest:
        assert torch.equal(latest.load("model")["w"], _state(3)["w"])


def test_an_error_that_a_retry_cannot_fix_is_raised_at_once(
    az_url: str, proxy: FaultProxy, options: dict[str, object]
) -> None:
    # Catches: 403 (or 404) retried like a 503: a wrong credential would stall every call
    # for the whole backoff before the user hears of it.
    store = Store(az_url, options)
    store.make_dir()
    store.write_bytes(("t", "a"), b"1")
    proxy.inject(Fault("status", 1000, "GET", "/t/a", status=403))
    with pytest.raises(nm.StorageError, match="HTTP 403") as caught:
        store.read_bytes("t", "a")
    assert "gave up" not in str(caught.value)
    assert len(proxy.outcomes("status 403")) == 1


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (ServiceRequestError("cannot connect"), True),
        (ServiceResponseError("connection reset"), True),
        (aiohttp.ServerDisconnectedError(), True),
        (aiohttp.ClientConnectorError.__new__(aiohttp.ClientConnectorError), True),
        (FileNotFoundError(), False),
        (PermissionError(), False),
        (ResourceNotFoundError("gone"), False),
        (ResourceExistsError("there"), False),
        (ValueError("bad option"), False),
        (nm.StorageError("ours"), False),
    ],
)
def test_what_counts_as_transient(exc: BaseException, transient: bool) -> None:
    # Catches: a classification that retries a 404/409/bug, or gives up on a reset.
    assert is_transient(exc) is transient


STATUSES = [(500, True), (503, True), (408, True), (429, True), (403, False), (412, False)]


@pytest.mark.parametrize(("status", "transient"), STATUSES)
def test_http_statuses(status: int, transient: bool) -> None:
    # Catches: throttling (429) or a timeout (408) not retried; a 4xx answer retried.
    exc = HttpResponseError(message=f"HTTP {status}")
    exc.status_code = status
    assert is_transient(exc) is transient


def test_a_wrapped_transient_error_is_transient() -> None:
    # Catches: adlfs's wrappers (ValueError/RuntimeError raised from the SDK's error)
    # hiding a dropped connection from the classifier.
    try:
        try:
            raise ServiceRequestError("connection refused")
        except ServiceRequestError as inner:
            raise RuntimeError("Failed to upload block") from inner
    except RuntimeError as outer:
        assert is_transient(outer)


def test_the_retry_policy_comes_from_options_then_environment() -> None:
    # Catches: options ignored, the environment ignored, or a bad value accepted.
    env = {"NEBULA_STORAGE_RETRIES": "7", "NEBULA_STORAGE_RETRY_BASE_S": "0.25"}
    assert RetryPolicy.from_options({}, env) == RetryPolicy(retries=7, base_s=0.25, max_s=8.0)
    assert RetryPolicy.from_options({"nebula_retries": "2"}, env).retries == 2
    assert RetryPolicy.from_options({}, {}) == RetryPolicy()
    delays = list(RetryPolicy(retries=6, base_s=0.5, max_s=2.0).delays())
    assert len(delays) == 6 and all(0.25 <= d <= 2.0 for d in delays)
    with pytest.raises(nm.InvalidArgumentError, match="nebula_retries must be a int"):
        RetryPolicy.from_options({"nebula_retries": "many"}, {})
