"""What the outage tests share (tests/core/test_outage.py, tests/azure/test_azure_outage*.py,
tests/s3/test_s3_outage.py, tests/gcs/test_gcs_outage.py): a 1 MiB state per step, a timed
save of it, waiting, through the status call alone, until a checkpoint is durable, a store
taken away for a block (stopped, or suspended): an Azurite itself, or a server behind a
proxy (`Proxied`, `behind_a_proxy`), what a job shows while its store is away
(`assert_memory_only`), and the outage tests of a store behind a proxy, whatever the store
(`outage_during_training`, `down_at_init`: S3's and GCS's run them).

May import: tests/faultproxy.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any, Protocol

import pytest
import torch
from faultproxy import FaultProxy

import nebulaml as nm

MB = 1 << 20
# The environment of a test whose store goes away: short retries, and 1 s a call.
QUICK_RETRIES = {
    "NEBULA_STORAGE_RETRIES": "3",
    "NEBULA_STORAGE_RETRY_BASE_S": "0.05",
    "NEBULA_STORAGE_RETRY_MAX_S": "0.2",
    "NEBULA_STORAGE_CALL_TIMEOUT_S": "1",
}
# A refused connection is said at once, whatever a call's deadline: with a store stopped,
# the tests give each call this long (the storage option `nebula_call_timeout_s`), so that
# a client's own retries inside nebula's (botocore's, gcsfs's) show as a wait.
PATIENT_CALL_S = 10.0


def state(step: int) -> dict[str, torch.Tensor]:
    """1 MiB of `step`, and the step."""
    return {"w": torch.full((MB // 4,), float(step)), "step": torch.tensor(step)}


def timed_save(step: int) -> float:
    """Save `global_step<step>` (one item, "model"); how long the call took (s)."""
    t0 = time.perf_counter()
    nm.Checkpoint(f"global_step{step}").save("model", state(step))
    return time.perf_counter() - t0


def wait_durable(tag: str, timeout_s: float = 90) -> None:
    """Until `nm.persistence_status()` says `tag` is the newest durable checkpoint (no other
    call into nebula: the persister gets there by itself)."""
    deadline = time.monotonic() + timeout_s
    while nm.persistence_status().durable != tag:
        assert time.monotonic() < deadline, nm.persistence_status()
        time.sleep(0.05)


class Server(Protocol):
    """A store's server that can go away: stopped with its data kept and started again on
    its port (`stop`, `restart`), and its process group (`proc`: for SIGSTOP). Azurite
    (tests/azurite.py) is one; `Proxied` makes one of a server behind a proxy."""

    @property
    def proc(self) -> subprocess.Popen[bytes] | None: ...

    def stop(self) -> None: ...

    def restart(self) -> Any: ...


class Proxied:
    """The server of process `proc`, reached through `proxy` (tests/faultproxy.py): stopped
    at the proxy (connections refused, those in flight reset; the server keeps its data,
    as a real store does through an outage: moto's forgets every object when it stops),
    suspended in the server itself (SIGSTOP).

    Example (not run here: it needs a server):
        with store_away(Proxied(moto.proc, FaultProxy(moto.port)), "stopped"): ...
    """

    def __init__(self, proc: subprocess.Popen[bytes] | None, proxy: FaultProxy) -> None:
        self._proc = proc
        self.proxy = proxy

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self._proc

    def stop(self) -> None:
        self.proxy.refuse()

    def restart(self) -> Proxied:
        self.proxy.listen()
        return self


def resume(server: Server) -> None:
    """SIGCONT a server's process group that a failed test may have left suspended."""
    if server.proc is not None and server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGCONT)


@contextlib.contextmanager
def behind_a_proxy(
    proc: subprocess.Popen[bytes] | None, port: int, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Proxied]:
    """The server of process `proc`, listening on `port`, behind a proxy of the test's own,
    with `QUICK_RETRIES` in the environment; after the block it is resumed (a failed test
    may leave it suspended: the next tests need it) and the proxy closed."""
    for var, value in QUICK_RETRIES.items():
        monkeypatch.setenv(var, value)
    proxy = FaultProxy(port)
    server = Proxied(proc, proxy)
    try:
        yield server
    finally:
        resume(server)
        proxy.close()


def assert_memory_only(newest: str, caplog: pytest.LogCaptureFixture) -> None:
    """What a job shows while its persistent tier is away: "memory tier only" said once,
    `flush_persistence` False within its 1 s, `newest` pending and nothing durable."""
    said = [r.getMessage() for r in caplog.records if "memory tier only" in r.getMessage()]
    assert len(said) == 1, said
    assert nm.flush_persistence(timeout_s=1, raise_on_error=False) is False
    status = nm.persistence_status()
    assert status.pending[-1] == newest and status.durable is None, status


@contextlib.contextmanager
def store_away(server: Server, how: str) -> Iterator[None]:
    """The store away for the block: stopped cleanly (its data survives) and started
    again on the same port after it, or suspended (SIGSTOP: requests hang) and resumed."""
    proc = server.proc
    assert proc is not None
    if how == "stopped":
        server.stop()
    else:
        os.killpg(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if how == "stopped":
            server.restart()
        else:
            os.killpg(proc.pid, signal.SIGCONT)


def assert_durable_and_loads(url: str, options: dict[str, Any], step: int) -> None:
    """`global_step<step>` is the newest under `url` (reached with `options`), on the store
    alone (the memory tier released), and loads bit for bit."""
    tag = f"global_step{step}"
    with nm.using_storage_options(options):
        listed = nm.list_checkpoints(url, hold=False)
        assert listed[0]["tag"] == tag and listed[0]["tiers"] == ["persistent"], listed
        latest = nm.get_latest_checkpoint(url)
        assert latest is not None and latest.tag == tag
        with latest:
            loaded = latest.load("model")
    assert torch.equal(loaded["w"], state(step)["w"]) and int(loaded["step"]) == step


def outage_during_training(server: Server, url: str, options: dict[str, Any], how: str) -> None:
    """A job on `url` saves through an outage of its store (`how`: "stopped" or
    "suspended"): each save returns within 1 s, `flush_persistence` says False (or raises)
    within its deadline, the persister reports the outage (a hang as "no answer"), and once
    the store is back the newest lands by itself and loads bit for bit. Run with
    `QUICK_RETRIES` in the environment (a stopped store's calls `PATIENT_CALL_S`)."""
    if how == "stopped":
        options = {**options, "nebula_call_timeout_s": PATIENT_CALL_S}
    nm.init(url, persistent_time_interval=0, exit_timeout_s=60, on_persist_error="retry",
            storage_options=options)  # fmt: skip
    timed_save(1)
    assert nm.flush_persistence(timeout_s=60) is True
    with store_away(server, how):
        away = datetime.now(timezone.utc)
        during = []
        for step in range(2, 6):
            during.append(timed_save(step))
            time.sleep(0.05)
        assert max(during) < 1.0, during
        started = time.monotonic()
        assert nm.flush_persistence(timeout_s=1, raise_on_error=False) is False
        with pytest.raises(nm.NebulaError):
            nm.flush_persistence(timeout_s=0.5)
        assert time.monotonic() - started < 4, "a flush waited past its deadline"
        while nm.persistence_status().failing_since is None:  # reported, hanging or not
            assert time.monotonic() - started < 15, nm.persistence_status()
            time.sleep(0.1)
        status = nm.persistence_status()
        if how == "stopped":  # refused: failing at once, not after a client's own retries
            since = datetime.fromisoformat(str(status.failing_since))
            assert (since - away).total_seconds() < 3, (away, status)
        assert status.pending and status.pending[-1] == "global_step5", status
        assert status.durable == "global_step1" and status.last_error and not status.ok
        if how == "suspended":
            assert "no answer" in status.last_error, status
    wait_durable("global_step5")  # no call but the status
    assert nm.persistence_status().ok
    assert nm.flush_persistence(timeout_s=30) is True
    nm.shutdown(timeout_s=60)  # all durable: the memory tier is released
    assert_durable_and_loads(url, options, 5)


def down_at_init(
    server: Server, url: str, options: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """`init` on `url` with its store stopped returns at once, memory only (said once);
    saves return within 1 s, `flush_persistence` says False, and what was saved lands once
    the store is back and loads bit for bit. Run with `QUICK_RETRIES` in the environment
    (its calls `PATIENT_CALL_S` here: init's own deadline, `CONNECT_WAIT_S`, is no excuse)."""
    options = {**options, "nebula_call_timeout_s": PATIENT_CALL_S}
    with store_away(server, "stopped"):
        started = time.perf_counter()
        nm.init(url, persistent_time_interval=0, exit_timeout_s=60,  # the default: retry
                storage_options=options)  # fmt: skip
        took = time.perf_counter() - started
        assert took < 1.5, took  # at once: a refused connection says enough
        during = [timed_save(step) for step in range(1, 4)]
        assert max(during) < 1.0, during
        assert_memory_only("global_step3", caplog)
    wait_durable("global_step3")
    nm.shutdown(timeout_s=60)
    assert_durable_and_loads(url, options, 3)
