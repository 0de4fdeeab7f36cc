"""`nebula gc`: release the memory tiers no job needs: plan, show, confirm, execute."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from ..confirm import confirm
from ..console import emit_json, stderr, stdout
from ..exits import fail, handles_errors
from ..formatting import human_bytes
from ..options import JsonOpt
from ..tables import print_table
from .memory import root_cell

if TYPE_CHECKING:
    from nebulaml.ops import GcAction


@handles_errors
def gc_command(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show the plan; release nothing.")
    ] = False,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Release without asking (needed off a terminal).")
    ] = False,
    discard_unpersisted: Annotated[
        bool,
        typer.Option(
            "--discard-unpersisted",
            help="Also release tiers of jobs that are gone whose newest checkpoint is not "
            "persisted (or whose root cannot be read from here): those checkpoints are lost.",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Release this user's memory tiers on this node that no job needs (RAM in /dev/shm).

    Released: stale tiers (their root is gone, or was created again), empty ones, and
    those of jobs that are gone whose newest checkpoint is persisted. Kept: a tier a live
    job holds, one that is not yours alone, and (unless --discard-unpersisted) one whose
    newest checkpoint is not persisted: persist it first with nebula flush ROOT. Shows
    the plan and asks first (or takes --yes); a tier that changed since the plan is kept,
    and then the exit status is 1 (4: the prompt answered no). See nebula memory for what
    each tier holds.

    Example: nebula gc --dry-run
    """
    import nebulaml as nm
    from nebulaml.ops import memory_tiers_folder as memory_base

    base = memory_base()
    actions = nm.ops.plan_gc(nm.ops.list_memory_tiers(), discard_unpersisted=discard_unpersisted)
    releases = [a for a in actions if a.release]
    doc: dict[str, Any] = {
        "base": base,
        "dry_run": dry_run,
        "discard_unpersisted": discard_unpersisted,
        "plan": [a.to_json() for a in actions],
        "results": [],
    }
    if not as_json and actions:
        print_table(_plan_table(actions, dry_run), _plan_table(actions, dry_run, stacked=True))
    if dry_run or not releases:
        if as_json:
            emit_json(doc)
        elif not actions:
            stderr().print(f"No memory tiers under {base}", highlight=False, markup=False)
        else:
            stderr().print("Dry run: nothing released." if dry_run else "Nothing to release.")
        return
    if not yes:
        lost = _unpersisted(releases)
        what = f"{len(releases)} memory tier(s) ({human_bytes(_size(releases))}"
        what += f", {lost} with an unpersisted checkpoint)" if lost else ")"
        confirm(
            f"Release {what} from {base}?",
            f"{base}: {what} to release; refusing to release without --yes when not on a "
            f"terminal (add --yes, or --dry-run to see the plan only)",
            "Nothing released.",
        )
    results = nm.ops.execute_gc(actions)
    doc["results"] = [r.to_json() for r in results]
    names = {a.tier.path: a.tier.root or a.tier.path for a in actions}  # the root, or the folder
    for r in results:
        if not r.released:
            stderr().print(Text.assemble(("kept ", "yellow"), f"{names[r.path]}: {r.reason}"))
    released = [r for r in results if r.released]
    if as_json:
        emit_json(doc)
    else:
        out = stdout()
        total = human_bytes(sum(r.size_bytes for r in released))
        colon = ":" if released else ""
        out.print(
            f"Released {len(released)} of {len(releases)} memory tier(s), {total}{colon}",
            highlight=False,
        )
        for r in released:
            tags = ", ".join(r.tags) or "no checkpoint"
            out.print(Text(f"  {names[r.path]}: {tags} ({human_bytes(r.size_bytes)})"))
    if len(released) < len(releases):  # not what was asked: say so in the exit status
        fail(f"{len(releases) - len(released)} of {len(releases)} memory tier(s) not released "
             "(each kept as said above)")  # fmt: skip


def _size(actions: list[GcAction]) -> int:
    return sum(a.tier.size_bytes for a in actions)


def _unpersisted(actions: list[GcAction]) -> int:
    """How many of the released tiers hold a checkpoint not known to be persisted (a stale
    tier's are of a root that is gone: nothing is lost)."""
    return sum(
        1 for a in actions if a.tier.tags and a.tier.state != "stale" and not a.tier.persisted
    )


def _plan_table(actions: list[GcAction], dry_run: bool, *, stacked: bool = False) -> Table:
    """One row a tier; `stacked` (a narrow terminal): the reason below the root."""
    title = "memory tiers: gc plan" + (" (dry run)" if dry_run else "")
    table = Table(title=title, title_justify="left")
    columns = ["root / reason" if stacked else "root", "newest", "size", "action"]
    for column in columns + ([] if stacked else ["reason"]):
        fold = column.startswith("root") or column in ("newest", "reason")
        table.add_column(
            column,
            justify="right" if column == "size" else "left",
            overflow="fold" if fold else "ellipsis",
            no_wrap=not fold,
        )
    for a in actions:
        root = Text(root_cell(a.tier))
        if stacked:
            root.append(f"\n{a.reason}", style="dim")
        table.add_row(
            root,
            Text(a.tier.newest or "-"),
            human_bytes(a.tier.size_bytes),
            Text("release", style="red") if a.release else Text("keep", style="green"),
            *([] if stacked else [Text(a.reason)]),
        )
    return table
