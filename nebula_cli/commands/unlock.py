"""`nebula unlock ROOT`: break a root's job hold: show whose it is, confirm, remove."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.text import Text

from ..confirm import confirm
from ..console import emit_json, stderr, stdout
from ..exits import fail, handles_errors
from ..options import JsonOpt, RootArg, StorageOpt


@handles_errors
def unlock_command(
    root: RootArg,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Remove without asking (needed off a terminal).")
    ] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Also break the hold of a job that runs on this host (it puts its hold back "
            "within seconds unless it is stopped).",
        ),
    ] = False,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Break the job hold on ROOT, so that another job's nm.init may write it.

    One job writes a root at a time: nm.init of another is refused (RootInUseError)
    while the holder lives (its process on its host, or a hold renewed within 90 s from
    another host). A hold that cannot be trusted expires by itself. Break one by hand
    when you know its job is gone though its hold still counts (its node powered off, a
    root copied with its hold). Shows whose hold it is and asks first (or takes --yes).
    A job running on this host is refused without --force. Checkpoints are untouched.

    With --json: `root`, `hold` (null when nothing holds the root) with its `file`,
    `job`, `host`, `pid`, `started_at`, `renewed_at`, `live`, `running_here`, and
    `removed` (the hold files removed).

    Example: nebula unlock /mnt/checkpoints/run1
    """
    import nebulaml as nm

    plan = nm.ops.plan_unlock(root)
    if plan is None:
        if as_json:
            emit_json({"root": root, "hold": None, "removed": []})
        else:
            stderr().print(f"{root}: no job holds it. Nothing to do.")
        return
    doc = {
        "root": plan.root,
        "hold": {
            "file": plan.hold,
            "job": plan.job,
            "host": plan.host,
            "pid": plan.pid,
            "started_at": plan.started_at,
            "renewed_at": plan.renewed_at,
            "live": plan.live,
            "running_here": plan.running_here,
        },
        "removed": [],
    }
    state = "running on this host" if plan.running_here else "live" if plan.live else "expired"
    if plan.running_here and not force:
        fail(
            f"{plan.root} is held by {plan.describe()}, which runs on this host: stop it "
            "first (it puts its hold back within seconds), or add --force"
        )
    if not as_json:
        stderr().print(Text(f"{plan.root} is held by {plan.describe()}: {state}."))
    if not yes:
        confirm(
            f"Break this hold on {plan.root}?",
            f"{plan.root}: refusing to break its hold without --yes when not on a terminal",
            "Nothing removed.",
        )
    removed = nm.ops.execute_unlock(root, plan, force=force)
    doc["removed"] = removed
    if as_json:
        emit_json(doc)
    else:
        stdout().print(Text(f"Unlocked {plan.root}: removed the hold of {plan.describe()}."))
