"""`nebula prune ROOT --keep N`: plan, show, confirm, execute."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from ..confirm import confirm
from ..console import emit_json, stderr, stdout
from ..exits import fail, handles_errors
from ..formatting import shown, summarise_tags
from ..options import JsonOpt, RootArg, StorageOpt, VerboseOpt
from ..tables import print_table

if TYPE_CHECKING:
    from nebulaml.ops import PrunePlan


def _at_least_one(value: int) -> int:
    if value < 1:
        raise typer.BadParameter(f"must be at least 1 (the newest is always kept), not {value}")
    return value


def _not_negative(value: float) -> float:
    if value < 0:
        raise typer.BadParameter(f"must be 0 or more seconds, not {value:g}")
    return value


@handles_errors
def prune_command(
    root: RootArg,
    keep: Annotated[
        int,
        typer.Option(
            "--keep",
            metavar="N",
            help="How many of the newest committed checkpoints to keep (at least 1).",
            callback=_at_least_one,
        ),
    ],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show the plan; delete nothing.")
    ] = False,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Delete without asking (needed off a terminal).")
    ] = False,
    include_labelled: Annotated[
        bool,
        typer.Option("--include-labelled", help="Treat labelled checkpoints like the others."),
    ] = False,
    incomplete: Annotated[
        bool,
        typer.Option("--incomplete", help="Also remove leftovers of crashed saves (see --grace)."),
    ] = False,
    grace: Annotated[
        float,
        typer.Option(
            "--grace",
            metavar="SECONDS",
            help="With --incomplete: leave leftovers written to within this many seconds.",
            callback=_not_negative,
        ),
    ] = 3600.0,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Delete old checkpoints from ROOT, keeping the newest N.

    Shows the plan, asks before deleting (or takes --yes), then deletes each checkpoint
    manifest first. Never deleted: the newest committed checkpoint, one being written, a
    labelled one (unless --include-labelled), or a folder without nebula's markers.
    --incomplete also removes what crashed saves left, once no writer on this host is
    alive and nothing was written for --grace seconds. Acts on ROOT only, not on its
    memory tier.

    With --json: `delete` and `incomplete` (what the plan removes), `kept` (kept by the
    count), `protected` (never deleted, each with its reason), `deleted` and `skipped`.
    Exit 1 when any delete of the plan was refused at the time (`skipped`: being read,
    labelled since, ...), 4 when the prompt is answered no.

    Example: nebula prune /mnt/checkpoints/run1 --keep 3 --dry-run
    """
    import nebulaml as nm

    listing = nm.ops.list_prune_candidates(root, incomplete=incomplete)
    plan = nm.ops.plan_prune(listing, keep, include_labelled=include_labelled, grace_s=grace)
    doc = _plan_json(plan, dry_run)
    if not as_json:
        _show_plan(plan, dry_run, verbose)
    count = len(plan.delete) + len(plan.incomplete)
    if dry_run or count == 0:
        if as_json:
            emit_json(doc)
        else:
            stderr().print("Dry run: nothing deleted." if dry_run else "Nothing to delete.")
        return
    if not yes:
        _confirm(plan)
    result = nm.ops.execute_prune(root, plan)
    for skipped in result.skipped:
        stderr().print(Text.assemble(("kept ", "yellow"), f"{skipped.tag}: {skipped.reason}"))
    doc["deleted"] = list(result.deleted)
    doc["skipped"] = [{"tag": s.tag, "reason": s.reason} for s in result.skipped]
    if as_json:
        emit_json(doc)
    else:
        deleted = summarise_tags(list(result.deleted), verbose)
        tail = f": {deleted}" if result.deleted else "."
        stdout().print(Text(f"Deleted {len(result.deleted)} of {count}{tail}"))
    if result.skipped:  # not what was asked: a script (a cron cleanup) must learn it
        fail(f"{len(result.skipped)} of {count} checkpoint(s) not deleted (each kept as said "
             "above)")  # fmt: skip


def _plan_json(plan: PrunePlan, dry_run: bool) -> dict[str, Any]:
    """The plan as --json gives it: kept by the count and protected apart."""

    def rows(decisions: Any) -> list[dict[str, Any]]:
        return [{"tag": d.tag, "reason": d.reason, "committed": d.committed} for d in decisions]

    return {
        "root": plan.root,
        "dry_run": dry_run,
        "keep": plan.keep_last,
        "include_labelled": plan.include_labelled,
        "grace_s": plan.grace_s,
        "delete": rows(plan.delete),
        "incomplete": rows(plan.incomplete),
        "kept": rows(plan.keep),
        "protected": rows(plan.protected),
        "deleted": [],
        "skipped": [],
    }


def _what(plan: PrunePlan) -> str:
    parts = []
    if plan.delete:
        parts.append(f"{len(plan.delete)} checkpoint(s)")
    if plan.incomplete:
        parts.append(f"{len(plan.incomplete)} incomplete tag(s)")
    return " and ".join(parts)


def _confirm(plan: PrunePlan) -> None:
    """Ask on a terminal (prompt on stderr); off a terminal, refuse without --yes."""
    confirm(
        f"Delete {_what(plan)} from {plan.root}?",
        f"{plan.root}: {_what(plan)} to delete; refusing to delete without --yes when not on "
        f"a terminal (add --yes, or --dry-run to see the plan only)",
        "Nothing deleted.",
    )


def _show_plan(plan: PrunePlan, dry_run: bool, verbose: bool) -> None:
    """The plan as a table: every row with `verbose`, else the first `ROWS_SHOWN` of each
    action and a count of the rest."""
    title = f"{plan.root}: prune plan, keep {plan.keep_last}" + (" (dry run)" if dry_run else "")
    table = Table(title=title, title_justify="left")
    for column in ("tag", "action", "reason"):
        table.add_column(column, no_wrap=True)
    more: list[str] = []

    def some(decisions: Any, action: str) -> Any:
        rows, left = shown(list(decisions), verbose)
        if left:
            more.append(f"{left} more to {action}")
        return rows

    for d in some(plan.delete, "delete"):
        table.add_row(Text(d.tag), Text("delete", style="red"), Text(d.reason))
    for d in some(plan.incomplete, "remove"):
        table.add_row(Text(d.tag, style="yellow"), Text("remove", style="red"), Text(d.reason))
    for d in some(plan.keep, "keep"):
        table.add_row(Text(d.tag), "keep", Text(d.reason))
    for d in some(plan.protected, "protect"):
        tag = Text(d.tag, style="" if d.committed else "yellow")
        table.add_row(tag, Text("protected", style="green"), Text(d.reason))
    if more:
        table.caption = f"... and {', '.join(more)} (--verbose: all)"
        table.caption_justify = "left"
    print_table(table)
