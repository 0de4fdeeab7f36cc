"""What the outage tests share (tests/core/test_outage.py, tests/azure/test_azure_outage*.py,
tests/s3/test_s3_outage.py): a 1 MiB state per step, a timed save of it, waiting, through
the status call alone, until a checkpoint is durable, and a store taken away for a block
(stopped, or suspended): an Azurite itself, or a server behind a proxy (`Proxied`).

May import: tests/faultproxy.py (for its type)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

import nebulaml as nm

if TYPE_CHECKING:
    from faultproxy import FaultProxy

MB = 1 << 20


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
