"""Breaking a root's job hold by hand (`nebula unlock`): what holds it, and the removal.

A root is held by one job at a time (protocol/holds.py). A hold that cannot be trusted
expires by itself; one that still counts but whose job is known to be gone (a node
powered off, a hold copied in with a root) would keep every `init` out for its time to
live: an operator breaks it here, having been shown whose it was.

May import: every layer below ops. Not for: taking or renewing holds (protocol/holds.py,
runtime/job.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from nebulaml.errors import InvalidArgumentError, RootNotFoundError
from nebulaml.protocol.holds import HoldState, break_hold, current_hold
from nebulaml.runtime.locate import tiers_for

PathLike = str | os.PathLike[str]


@dataclass(frozen=True, slots=True)
class UnlockPlan:
    """A root's hold as shown to the operator: `execute_unlock` removes exactly that one.

    `live`: the hold still counts (its process runs, or it was renewed within its time
    to live); `running_here`: its process runs on this host (breaking it is refused
    without `force`: the job would put it back within seconds)."""

    root: str
    hold: str
    job: str | None
    host: str | None
    pid: int | None
    started_at: str | None
    renewed_at: str | None
    live: bool
    running_here: bool

    def describe(self) -> str:
        """Whose hold it is, in one line."""
        if self.job is None:
            return f"an unreadable hold ({self.hold})"
        since = f", since {self.started_at}" if self.started_at else ""
        renewed = f", renewed {self.renewed_at}" if self.renewed_at else ""
        return f"job {self.job} (pid {self.pid} on {self.host}{since}{renewed})"


def plan_unlock(root: PathLike) -> UnlockPlan | None:
    """The hold on `root` (its persistent root), or None when nothing holds it.

    Example:
        >>> import tempfile
        >>> plan_unlock(tempfile.mkdtemp()) is None
        True
    """
    store = tiers_for(root, "unlock").persistent
    assert store is not None  # a root was given
    if not store.exists():
        raise RootNotFoundError(store.url)
    state = current_hold(store)
    return None if state is None else _plan(store.url, state)


def execute_unlock(root: PathLike, plan: UnlockPlan, *, force: bool = False) -> list[str]:
    """Remove the hold `plan` shows (and older ones); the hold files removed. Refused
    (`InvalidArgumentError`) for a job running on this host unless `force`; a hold taken
    since the plan is left alone (`NebulaError`)."""
    if plan.running_here and not force:
        raise InvalidArgumentError(
            f"{plan.root} is held by {plan.describe()}, which runs on this host: stop it "
            f"first (it would put its hold back within seconds), or pass force"
        )
    store = tiers_for(root, "unlock").persistent
    assert store is not None
    return break_hold(store, plan.hold)


def _plan(url: str, state: HoldState) -> UnlockPlan:
    holder = state.holder
    return UnlockPlan(
        root=url,
        hold=state.name,
        job=holder.job if holder else None,
        host=holder.host if holder else None,
        pid=holder.pid if holder else None,
        started_at=(holder.started_at or None) if holder else None,
        renewed_at=(holder.renewed_at or None) if holder else None,
        live=state.live,
        running_here=state.running_here,
    )
