"""`nebula ls ROOT`: committed checkpoints, newest first, on every tier of the root."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from ..output import (
    JsonOpt,
    RootArg,
    StorageOpt,
    emit_json,
    handles_errors,
    human_age,
    human_bytes,
    print_table,
)


@handles_errors
def ls_command(
    root: RootArg,
    all_: Annotated[
        bool, typer.Option("--all", "-a", help="Also list incomplete (uncommitted) tags.")
    ] = False,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """List committed checkpoints, newest first, with the tiers that hold them.

    When ROOT is a persistent root, the memory tier of the same root on this node is
    listed beside it.

    Example: nebula ls /mnt/checkpoints/run1 --all
    """
    import nebulaml as nm

    location = nm.check_root(root)
    committed = nm.list_checkpoints(root, hold=False)
    incomplete = nm.list_incomplete(root) if all_ else []
    if as_json:
        doc = {"root": location, "checkpoints": committed}
        if all_:
            doc["incomplete"] = incomplete
        emit_json(doc)
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
