"""`nebula copy ROOT TAG DEST` (or `--latest`): a verified, resumable copy with progress."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.text import Text

from ..complete import complete_copy_source, complete_dest
from ..console import emit_json, stdout
from ..exits import handles_errors
from ..formatting import human_bytes
from ..options import ROOT_POSITIONALS, JsonOpt, QuietOpt, RootArg, StorageOpt
from ..progress import phases

# With ROOT: ROOT TAG DEST, or ROOT DEST with --latest (ROOT left out: the environment's).
ROOT_POSITIONALS["copy"] = lambda options: 2 if options.get("latest") else 3


@handles_errors
def copy_command(
    root: RootArg,
    tag: Annotated[
        str | None,
        typer.Argument(
            metavar="TAG",
            help="The checkpoint to copy (omit it with --latest).",
            autocompletion=complete_copy_source,
        ),
    ] = None,
    dest: Annotated[
        str | None,
        typer.Argument(
            metavar="DEST",
            help="A root path or URL, or 'memory' / 'persistent' for ROOT's own tiers.",
            autocompletion=complete_dest,
        ),
    ] = None,
    latest: Annotated[
        bool, typer.Option("--latest", help="Copy the newest committed checkpoint.")
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace a different committed copy at DEST.")
    ] = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Copy a checkpoint to DEST, verify every item there, and commit it there last.

    The source is whichever tier of ROOT holds TAG: this node's memory tier of ROOT, or
    ROOT itself. DEST is another root, or `memory` (this node's memory tier of ROOT) or
    `persistent` (ROOT itself); write ./memory for a folder of that name. A rerun after
    an interruption skips the items already copied and verified. Progress counts the
    bytes the destination has confirmed, then (verifying) the bytes read back from it;
    each retry of a storage call is a line on stderr.

    Example: nebula copy /mnt/checkpoints/run1 global_step500 az://backup/run1
    """
    import nebulaml as nm

    if latest:
        if dest is not None:
            raise typer.BadParameter("give TAG or --latest, not both", param_hint="TAG")
        tag, dest = None, tag
    elif tag is None:
        raise typer.BadParameter("give the checkpoint to copy, or --latest", param_hint="TAG")
    if dest is None:
        raise typer.BadParameter("give the destination root", param_hint="DEST")
    what = tag or "the newest checkpoint"
    labels = [f"copying {what}", f"verifying {what}"]
    with phases(labels, quiet=quiet) as (copied, verified):
        report = nm.ops.copy_checkpoint(root, tag, dest, overwrite=overwrite, progress=copied,
                                    verify_progress=verified)  # fmt: skip
    if as_json:
        emit_json(report)
    else:
        stdout().print(Text(_summary(report)))


def _summary(report: dict[str, Any]) -> str:
    where = f"{report['source_tier']} tier {report['source']} to {report['destination']}"
    if report["unchanged"]:
        return f"{report['tag']} is already committed at {report['destination']}; nothing copied"
    line = (
        f"Copied {report['tag']} from the {where}: {len(report['copied_items'])} item(s), "
        f"{human_bytes(report['copied_bytes'])}, verified and committed"
    )
    if report["skipped_items"]:
        line += (
            f"; {len(report['skipped_items'])} item(s) "
            f"({human_bytes(report['skipped_bytes'])}) were already there and verified"
        )
    return line
