"""`nebula latest ROOT`: the newest committed tag, or an item's path, for scripts."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from ..complete import complete_item
from ..console import emit_json
from ..exits import EXIT_NOT_FOUND, fail, handles_errors
from ..options import JsonOpt, QuietOpt, RootArg, StorageOpt
from ..progress import progress


def cache_dir() -> Path:
    """Where `--local` keeps downloaded items: $XDG_CACHE_HOME/nebula, else
    ~/.cache/nebula."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nebula"


def _cache_folder(location: str, tag: str) -> Path:
    """One folder a root (by its location) and tag: `<name>-<hash>/<tag>`."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", location.rstrip("/").rsplit("/", 1)[-1])
    digest = hashlib.sha256(location.encode()).hexdigest()[:12]
    return cache_dir() / f"{name.lstrip('.')[:40] or 'root'}-{digest}" / tag


@handles_errors
def latest_command(
    root: RootArg,
    item: Annotated[
        str | None,
        typer.Option(
            "--item",
            "--path",
            metavar="NAME",
            help="Print the path of item NAME in the newest checkpoint instead of its tag "
            "(--path NAME is the same).",
            autocompletion=complete_item,
        ),
    ] = None,
    local: Annotated[
        bool,
        typer.Option(
            "--local",
            help="With --item: when the item is remote (az://...), download it, verified, "
            "into the cache ($XDG_CACHE_HOME/nebula or ~/.cache/nebula) and print that path.",
        ),
    ] = False,
    label: Annotated[
        str | None,
        typer.Option(
            "--label",
            "-l",
            metavar="LABEL",
            help="The newest checkpoint labelled LABEL (e.g. best) instead of the newest.",
        ),
    ] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Print the newest committed checkpoint's tag (exit 3 when there is none).

    The output is the bare tag (or path) and a newline, so that it can be used in
    `$(...)`. The persistent copy's path is preferred over the memory tier's. A remote
    root's item path is a URL, which torch.load cannot open: --local downloads the item
    (once: a cached copy that verifies is used again) and prints a local path.

    Example: nebula latest az://backup/run1 --item model --local
    """
    import nebulaml as nm

    if local and item is None:
        raise typer.BadParameter("--local needs --item NAME", param_hint="--local")
    location = nm.check_root(root)
    if label is not None:
        tag, item_path = _labelled(nm, root, location, label, item)
    else:
        latest = nm.get_latest_checkpoint(root)
        if latest is None:
            raise nm.CheckpointNotFoundError(location)
        tag = latest.tag
        item_path = None if item is None else nm.get_latest_checkpoint_path(item, root)
    if item is not None and item_path is None:  # the last one went away between the calls
        raise nm.CheckpointNotFoundError(location)
    local_path = None
    if local and item is not None and item_path is not None:
        if os.path.isfile(item_path):
            local_path = item_path
        else:
            with progress(f"downloading {item} of {tag}", quiet=quiet) as report:
                folder = _cache_folder(location, tag)
                doc = nm.ops.export_checkpoint(
                    root, tag, folder, items=[item], overwrite=True, progress=report
                )
            local_path = doc["files"][0]["path"]
    if as_json:
        listed = nm.list_checkpoints(root, hold=False)
        info = next((c for c in listed if c["tag"] == tag), None)
        out = {"root": location, **(info or {"tag": tag})}
        if item is not None:
            out.update(item=item, path=item_path)
        if local:
            out.update(local_path=local_path)
        emit_json(out)
        return
    if item_path is not None and local_path is None and not os.path.isfile(item_path):
        typer.echo(
            f"nebula: hint: {item_path} is not a local file (torch.load cannot open it); "
            "add --local to download it",
            err=True,
        )
    typer.echo(local_path or item_path or tag)


def _labelled(nm: Any, root: str, location: str, label: str, item: str | None
              ) -> tuple[str, str | None]:  # fmt: skip
    """The newest checkpoint labelled `label`, and the path of its `item` (None without
    one); exit 3 when no checkpoint carries the label."""
    chosen = nm.ops.select_checkpoints(nm.list_checkpoints(root), labels=[label], limit=1)
    if not chosen:
        fail(f"{location}: no checkpoint labelled {label!r}", EXIT_NOT_FOUND)
    tag = chosen[0]["tag"]
    return tag, None if item is None else nm.ops.checkpoint_item_path(root, tag, item)
