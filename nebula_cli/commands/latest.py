"""`nebula latest ROOT`: the newest committed tag, or an item's path, for scripts."""

from __future__ import annotations

from typing import Annotated

import typer

from ..output import JsonOpt, RootArg, StorageOpt, emit_json, handles_errors


@handles_errors
def latest_command(
    root: RootArg,
    path: Annotated[
        str | None,
        typer.Option(
            "--path",
            metavar="NAME",
            help="Print the path of item NAME in the newest checkpoint instead of its tag.",
        ),
    ] = None,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Print the newest committed checkpoint's tag (exit 3 when there is none).

    The output is the bare tag (or path) and a newline, so that it can be used in
    `$(...)`. The persistent copy's path is preferred over the memory tier's.

    Example: nebula latest /mnt/checkpoints/run1 --path model
    """
    import nebulaml as nm

    location = nm.check_root(root)
    latest = nm.get_latest_checkpoint(root)
    if latest is None:
        raise nm.CheckpointNotFoundError(location)
    item_path = None if path is None else nm.get_latest_checkpoint_path(path, root)
    if path is not None and item_path is None:  # the last one went away between the calls
        raise nm.CheckpointNotFoundError(location)
    if as_json:
        info = next((c for c in nm.list_checkpoints(root) if c["tag"] == latest.tag), None)
        doc = {"root": location, **(info or {"tag": latest.tag})}
        if path is not None:
            doc.update(item=path, path=item_path)
        emit_json(doc)
        return
    typer.echo(item_path if item_path is not None else latest.tag)
