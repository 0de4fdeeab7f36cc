"""`nebula ls ROOT`: committed checkpoints, newest first, on every tier of the root; for a
root with none, a hint on stderr (a checkpoint folder given for its root is named so)."""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from ..console import emit_json, printable
from ..exits import handles_errors
from ..formatting import human_age, human_bytes
from ..options import JsonOpt, RootArg, StorageOpt, since_option
from ..tables import print_table

SORTS = ("newest", "oldest", "committed", "size", "tag")  # nebulaml.ops.listing.SORTS


def _positive(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise typer.BadParameter(f"must be at least 1, not {value}")
    return value


def _sort(value: str) -> str:
    if value not in SORTS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(SORTS)}")
    return value


@handles_errors
def ls_command(
    root: RootArg,
    all_: Annotated[
        bool, typer.Option("--all", "-a", help="Also list incomplete (uncommitted) tags.")
    ] = False,
    sort: Annotated[
        str,
        typer.Option(
            "--sort",
            metavar="KEY",
            callback=_sort,
            help="Order by newest (nebula's order: the step, then the commit sequence), "
            "oldest, committed (commit time, latest first), size (largest first) or tag.",
        ),
    ] = "newest",
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit", "-n", metavar="N", callback=_positive, help="Only the first N, as sorted."
        ),
    ] = None,
    since: Annotated[datetime | None, since_option("those committed")] = None,
    label: Annotated[
        list[str] | None,
        typer.Option(
            "--label", "-l", metavar="LABEL", help="Only those labelled LABEL (repeat: each one)."
        ),
    ] = None,
    quiet: Annotated[
        bool,
        typer.Option("--quiet", "-q", help="Print the tags only, one a line (for scripts)."),
    ] = False,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """List committed checkpoints, newest first, with the tiers that hold them.

    When ROOT is a persistent root, the memory tier of the same root on this node is
    listed beside it, and the replicas that memory tier keeps of other nodes' parts
    (peer_replicas=1): each a row of the tier "replica (rank R)", R the rank whose part
    it is ("replicas" in --json). --sort, --limit, --since and --label choose among the
    committed checkpoints; -q prints their tags alone.

    Example: nebula ls /mnt/checkpoints/run1 --label best --since 2d -n 5
    """
    import nebulaml as nm

    if quiet and (as_json or all_):
        raise typer.BadParameter("not with --json or --all (it prints tags only)", param_hint="-q")
    location = nm.check_root(root)
    committed = nm.ops.select_checkpoints(
        nm.list_checkpoints(root, hold=False), sort=sort, since=since, labels=label or (),
        limit=limit,
    )  # fmt: skip
    if quiet:
        for c in committed:
            typer.echo(printable(c["tag"]))
        return
    chosen = since is not None or bool(label)  # replicas and leftovers carry no label
    incomplete = nm.list_incomplete(root) if all_ and not chosen else []
    replicas = [] if chosen else nm.ops.list_replicas(root)
    if as_json:
        doc = {"root": location, "checkpoints": committed}
        if all_:
            doc["incomplete"] = incomplete
        doc["replicas"] = [r.to_json() for r in replicas]
        emit_json(doc)
        return
    if not committed and not incomplete and not replicas:  # a header alone says nothing
        hint = f"No checkpoints under {location} match" if chosen else None
        sys.stderr.write(printable(hint or _empty_hint(nm, root, location, all_)) + "\n")
        return
    table = Table(title=location, title_justify="left")
    for column in ("tag", "step", "tiers", "size", "items", "age", "labels"):
        right = column in ("step", "size", "items")
        table.add_column(column, justify="right" if right else "left", no_wrap=True)
    for c in committed:
        table.add_row(
            Text(c["tag"]),
            "" if c["step"] is None else str(c["step"]),
            ",".join(c["tiers"]),
            human_bytes(c["size_bytes"]),
            str(len(c["items"])),
            human_age(c["committed_at"]),
            Text(",".join(c["labels"])),
        )
    for r in replicas:
        table.add_row(
            Text(r.tag),
            "" if r.step is None else str(r.step),
            f"replica (rank {r.rank})",
            human_bytes(r.size_bytes),
            "",
            human_age(r.received_at),
            "" if r.persisted is not False else Text("not persisted", style="yellow"),
        )
    for c in incomplete:
        started = [w["started_at"] for w in c["writers"] if isinstance(w.get("started_at"), str)]
        table.add_row(
            Text(c["tag"], style="yellow"),
            "",
            c["tier"],
            human_bytes(c["size_bytes"]),
            str(len(c["files"])),
            human_age(min(started)) if started else "",
            Text("incomplete", style="yellow"),
        )
    print_table(table)


def _empty_hint(nm: Any, root: str, location: str, all_: bool) -> str:
    """Why ROOT lists nothing: a checkpoint folder of the root above it (given for the
    root), checkpoints not yet committed (without --all), or none at all."""
    parent, _, name = location.rstrip("/").rpartition("/")
    if parent and name and not parent.endswith(":/") and _may_be_a_checkpoint(location):
        try:
            committed = {c["tag"] for c in nm.list_checkpoints(parent, hold=False)}
            incomplete = {c["tag"] for c in nm.list_incomplete(parent)}
        except nm.NebulaError:
            committed, incomplete = set(), set()
        if name in committed:
            return (
                f"{location} is a checkpoint folder, not a root: checkpoint {name!r} of the "
                f"root {parent} (nebula ls {parent})"
            )
        if name in incomplete:
            return (
                f"{location} is a checkpoint folder, not a root: incomplete checkpoint "
                f"{name!r} of the root {parent} (nebula ls --all {parent})"
            )
    if not all_:
        pending = nm.list_incomplete(root)
        if pending:
            return (
                f"No committed checkpoints under {location}; {len(pending)} incomplete "
                f"(being written, or left by a crash): nebula ls --all {root}"
            )
    return f"No checkpoints under {location}"


def _may_be_a_checkpoint(location: str) -> bool:
    """Whether the folder holds what a checkpoint folder holds (its manifest, a rank's or
    a writer's marker), so that the root above it is worth listing; a URL's is asked of
    that root."""
    if "://" in location:
        return True
    folder = Path(location)
    markers = (".rank-*.json", ".writer-*.json")
    return (folder / "manifest.json").is_file() or any(any(folder.glob(m)) for m in markers)
