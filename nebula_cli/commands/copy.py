"""`nebula copy ROOT TAG DEST` (or `--latest`): a verified, resumable copy with progress."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from ..output import (
    JsonOpt,
    RootArg,
    StorageOpt,
    emit_json,
    handles_errors,
    human_bytes,
    stderr,
    stdout,
)


@handles_errors
def copy_command(
    root: RootArg,
    tag: Annotated[
        str | None,
        typer.Argument(metavar="TAG", help="The checkpoint to copy (omit it with --latest)."),
    ] = None,
    dest: Annotated[
        str | None,
        typer.Argument(
            metavar="DEST",
            help="A root path or URL, or 'memory' / 'persistent' for ROOT's own tiers.",
        ),
    ] = None,
    latest: Annotated[
        bool, typer.Option("--latest", help="Copy the newest committed checkpoint.")
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace a different committed copy at DEST.")
    ] = False,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Copy a checkpoint to DEST, verify every item there, and commit it there last.

    The source is whichever tier of ROOT holds TAG: this node's memory tier of ROOT, or
    ROOT itself. DEST is another root, or `memory` (this node's memory tier of ROOT) or
    `persistent` (ROOT itself); write ./memory for a folder of that name. A rerun after
    an interruption skips the items already copied and verified.

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
    with _progress_bar(tag or "the newest checkpoint") as progress:
        report = nm.copy_checkpoint(root, tag, dest, overwrite=overwrite, progress=progress)
    if as_json:
        emit_json(report)
    else:
        stdout().print(_summary(report), highlight=False)


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


@contextmanager
def _progress_bar(label: str) -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar on stderr (bytes, rate, ETA), fed by the copy's callback.

    It appears with the first bytes, so that an error found before the copy starts
    (no such tag, say) is the only line on stderr.
    """
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TaskID,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=stderr(),
    )
    task: list[TaskID] = []

    def advance(done: int, total: int) -> None:
        if not task:
            bar.start()
            task.append(bar.add_task(f"copying {label}", total=total))
        bar.update(task[0], completed=done, total=total)

    try:
        yield advance
    finally:
        if task:
            bar.stop()
