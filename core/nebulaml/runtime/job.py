"""The job a session belongs to, and its hold on the root (issue #18: one job writes a
root at a time; the ranks of one job share it).

    job_identity  what tells this launch's ranks from another launch's
    claim_job     hold the root for the job: this node's memory tier, and the persistent
                  root (renewed by a heartbeat thread), or `RootInUseError`

A job is identified, first that applies:

1. `NEBULA_JOB_ID`, when set (a launcher nebula does not know);
2. torchrun's `TORCHELASTIC_RUN_ID` (not "none"): every rank, on every node, and every
   restart of the job has the same;
3. with several ranks, the rendezvous `MASTER_ADDR:MASTER_PORT` (a loopback address
   with this host's name): no two live jobs share one;
4. with several ranks and torch.distributed initialised, an id the first rank proposes
   through the process group's store (no collective);
5. with several ranks and none of those, the parent process on this host (ranks started
   side by side by one launcher);
6. one process: this process.

On this host a process that the holder's process started joins the holder's job, whatever
its own id (a launcher's first rank calls `init` before it knows it is one of several).

May import: every layer below runtime, `nebulaml.config`, runtime.outage and runtime.ranks.
Not for: the hold's files and who counts as alive (protocol/holds.py), or the session
(session.py).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
import threading
import uuid
from collections.abc import Callable

from nebulaml._threads import start as start_thread
from nebulaml.config import (
    ENV_ELASTIC_RUN_ID,
    ENV_JOB_ID,
    ENV_MASTER_ADDR,
    ENV_MASTER_PORT,
    job_env,
)
from nebulaml.errors import NebulaError, RootInUseError
from nebulaml.protocol.holds import RENEW_S, NodeClaim, RootLease
from nebulaml.protocol.tiers import TierSet
from nebulaml.runtime.outage import may_pass
from nebulaml.runtime.ranks import RankInfo
from nebulaml.storage.deadline import remaining, within

log = logging.getLogger("nebulaml")
JOB_KEY = "nebulaml/job"  # in the process group's store: the id the ranks agree on


def job_identity(ranks: RankInfo) -> str:
    """The id of this process's job (see the module docstring).

    Example:
        >>> import os
        >>> job_identity(RankInfo()) == f"process:{socket.gethostname()}:{os.getpid()}"
        True
    """
    env = job_env()
    if ENV_JOB_ID in env:
        return f"nebula:{env[ENV_JOB_ID]}"
    run = env.get(ENV_ELASTIC_RUN_ID)
    if run and run.lower() != "none":
        return f"torchelastic:{run}"
    host = socket.gethostname()
    if ranks.world_size > 1:
        addr, port = env.get(ENV_MASTER_ADDR), env.get(ENV_MASTER_PORT)
        if addr and port:
            where = f"{host}/{addr}" if _loopback(addr) else addr
            return f"rendezvous:{where}:{port}"
        agreed = _agreed_through_group()
        if agreed is not None:
            return f"group:{agreed}"
        return f"launcher:{host}:{os.getppid()}"
    return f"process:{host}:{os.getpid()}"


def _loopback(addr: str) -> bool:
    if addr.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _agreed_through_group() -> str | None:
    dist = sys.modules.get("torch.distributed")  # never import torch just to ask
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    try:
        from torch.distributed import distributed_c10d

        store = distributed_c10d._get_default_store()
        agreed = store.compare_set(JOB_KEY, "", uuid.uuid4().hex[:16])
    except Exception as exc:  # noqa: BLE001 - no store (another backend): not agreed
        log.debug("no job id agreed through the process group's store: %s", exc)
        return None
    return agreed.decode() if isinstance(agreed, bytes) else str(agreed)


class JobHold:
    """A session's hold on its root for its job: this node's claim on the memory tier and
    the lease on the persistent root, renewed every `renew_s` by a daemon thread while
    this process owns it. `on_lost(holder)` is called once if another job took the root
    over (this one was judged dead: not renewed within the lease's time)."""

    def __init__(
        self,
        claim: NodeClaim,
        lease: RootLease | None,
        *,
        renew_s: float | None = None,
        on_lost: Callable[[str], object] | None = None,
    ) -> None:
        self.claim = claim
        self.lease = lease
        self.job = claim.job
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renew_s = RENEW_S if renew_s is None else renew_s
        self._start(lease)

    def _start(self, lease: RootLease | None) -> None:
        self.lease = lease
        if lease is not None and lease.owner:
            self._thread = threading.Thread(
                target=self._heartbeat,
                args=(self._renew_s,),
                name="nebula-job-hold",
                daemon=True,
            )
            start_thread(self._thread)

    def take_lease(self, tiers: TierSet, ranks: RankInfo) -> None:
        """Hold the persistent root now (it did not answer when the job started: the
        session reaches it later, in the background). Raises `RootInUseError` naming the
        live job that holds it, and the store's error while it does not answer."""
        if self.lease is not None or tiers.persistent is None or self._stop.is_set():
            return
        self._start(_lease(tiers, self.job, ranks))

    def _heartbeat(self, renew_s: float) -> None:
        lease = self.lease
        assert lease is not None
        while not self._stop.wait(renew_s):
            try:
                with within(renew_s):  # a hung store: the next beat tries again
                    other = lease.renew()
            except NebulaError as exc:  # a storage hiccup: the next beat tries again
                log.warning("could not renew the hold on %s: %s", lease.store.url, exc)
                continue
            if other is not None:
                why = f"{lease.store.url} was taken over by {other.describe()}"
                log.error("nebula: %s", why)
                if self._on_lost is not None:
                    self._on_lost(why)
                return
            if not lease.owner:
                return  # the job's leader renews it now

    def close(self) -> None:
        """Stop renewing and let the root go (this process's part of the hold)."""
        self._stop.set()
        if self._thread is not None:
            # A beat in flight ends within its own deadline; the release below is bounded
            # by the caller's (session.close's), so nothing here waits on a hung store.
            left = remaining()
            self._thread.join(timeout=RENEW_S if left is None else min(left, RENEW_S))
        lease = self.lease
        try:
            if lease is not None:
                lease.release()
        except NebulaError as exc:
            assert lease is not None
            log.warning("could not release the hold on %s: %s", lease.store.url, exc)
        finally:
            self.claim.close()


def claim_job(
    tiers: TierSet,
    ranks: RankInfo,
    *,
    job: str | None = None,
    on_lost: Callable[[str], object] | None = None,
    reached: bool = True,
) -> JobHold:
    """Hold the root of `tiers` for this process's job (`job`, default `job_identity`):
    first this node's memory tier, then the persistent root (unless it was not `reached`:
    `JobHold.take_lease` once it is). Raises `RootInUseError` naming the live job that
    holds either."""
    claim = NodeClaim.take(tiers.memory, job or job_identity(ranks), where=tiers.display)
    try:
        lease = _lease(tiers, claim.job, ranks) if reached else None
        return JobHold(claim, lease, on_lost=on_lost)
    except BaseException:
        claim.close()
        raise


def _lease(tiers: TierSet, job: str, ranks: RankInfo) -> RootLease | None:
    persistent = tiers.persistent
    if persistent is None:
        return None
    try:
        return RootLease.take(persistent, job, leader=ranks.is_leader)
    except RootInUseError:
        raise
    except NebulaError as exc:
        if may_pass(exc):
            raise  # the store does not answer: tried again later (take_lease)
        # A root this job may not write (a read-only credential): its persists fail and
        # say so; without a hold another job is not kept out.
        log.warning("could not hold %s for this job: %s", persistent.url, exc)
        return None
