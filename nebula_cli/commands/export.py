"""`nebula export ROOT TAG DEST`: a checkpoint's items as plain .pt or .safetensors files."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from ..console import emit_json, stdout
from ..exits import handles_errors
from ..formatting import human_bytes
from ..options import JsonOpt, QuietOpt, RootArg, StorageOpt, TagArg, item_option
from ..progress import progress
from ..tables import print_table


class Format(str, Enum):
    pt = "pt"
    safetensors = "safetensors"


@handles_errors
def export_command(
    root: RootArg,
    tag: TagArg,
    dest: Annotated[
        str, typer.Argument(metavar="DEST", help="A local folder (created if missing).")
    ],
    format_: Annotated[
        Format,
        typer.Option(
            "--format",
            "-f",
            metavar="pt|safetensors",
            help="pt: each item's committed bytes (torch.load(path, weights_only=True) "
            "reads them); safetensors: its tensors by dotted path.",
            case_sensitive=False,
        ),
    ] = Format.pt,
    items: Annotated[
        list[str] | None, item_option("Only item NAME (repeatable; default: every item).")
    ] = None,
    drop_non_tensors: Annotated[
        bool,
        typer.Option(
            "--drop-non-tensors",
            help="With safetensors: leave out values that are not tensors (else they are refused).",
        ),
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace files already at DEST.")
    ] = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Write a checkpoint's items into DEST, one file per item, verified.

    --format pt writes ITEM.pt, the item's bytes as committed, checked against the
    manifest's size and checksum on the way (a rerun keeps the files already there and
    identical). --format safetensors writes ITEM.safetensors with the item's tensors by
    dotted path (layers.0.weight), read with weights-only loads after the same check; an
    item holding other values (a learning rate, a step) is refused unless
    --drop-non-tensors.

    Example: nebula export /mnt/ckpt/run1 global_step500 ./out -f safetensors
    """
    import nebulaml as nm

    with progress(f"exporting {tag}", quiet=quiet) as report:
        doc = nm.ops.export_checkpoint(
            root,
            tag,
            dest,
            format=format_.value,
            items=items or None,
            drop_non_tensors=drop_non_tensors,
            overwrite=overwrite,
            progress=report,
        )
    if as_json:
        emit_json(doc)
        return
    print_table(_table(doc))
    written = [f for f in doc["files"] if not f["reused"]]
    total = sum(f["size_bytes"] for f in doc["files"])
    stdout().print(
        Text(
            f"Exported {doc['tag']} to {doc['destination']}: {len(doc['files'])} file(s), "
            f"{human_bytes(total)}, verified"
            + (
                f"; {len(doc['files']) - len(written)} already there"
                if len(written) < len(doc["files"])
                else ""
            )
        )
    )


def _table(doc: dict[str, Any]) -> Table:
    table = Table(title=f"{doc['root']} {doc['tag']} -> {doc['destination']}", title_justify="left")
    for column in ("item", "file", "size", "tensors", "note"):
        table.add_column(column, justify="right" if column in ("size", "tensors") else "left",
                         no_wrap=True)  # fmt: skip
    for f in doc["files"]:
        notes = []
        if f["reused"]:
            notes.append("already there")
        if f["dropped"]:
            notes.append(f"dropped {len(f['dropped'])} non-tensor value(s)")
        table.add_row(
            Text(f["item"]),
            Text(f["path"]),
            human_bytes(f["size_bytes"]),
            "" if f["tensors"] is None else str(f["tensors"]),
            Text("; ".join(notes)),
        )
    return table
