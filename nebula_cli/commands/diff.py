"""`nebula diff ROOT TAG_A TAG_B`: what changed between two checkpoints, tensor by tensor.
Exit status 0 when they are the same, 1 when they differ (as `diff` and `git diff
--exit-code`)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from ..complete import complete_tag
from ..console import emit_json, stdout
from ..exits import EXIT_ERROR, handles_errors
from ..options import JsonOpt, RootArg, StorageOpt, item_option
from ..tables import print_table

_STYLE = {
    "added": "green",
    "removed": "red",
    "changed": "yellow",
    "shape_changed": "bold red",
    "dtype_changed": "bold red",
    "identical": "dim",
}


@handles_errors
def diff_command(
    root: RootArg,
    tag_a: Annotated[
        str,
        typer.Argument(
            metavar="TAG_A", help="The checkpoint to compare from.", autocompletion=complete_tag
        ),
    ],
    tag_b: Annotated[
        str,
        typer.Argument(
            metavar="TAG_B", help="The checkpoint to compare to.", autocompletion=complete_tag
        ),
    ],
    item: Annotated[str | None, item_option("Only item NAME.")] = None,
    all_: Annotated[
        bool,
        typer.Option("--all", "-a", help="Also list the tensors and values that are identical."),
    ] = False,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Compare two checkpoints of ROOT: per tensor, added, removed, shape or dtype changed,
    identical or changed, with the largest absolute and the relative L2 difference of
    changed floating tensors (||B - A|| / ||A||).

    Items with the same committed bytes are identical without being read; the others are
    read one at a time, verified, with weights-only reads, and compared in chunks. The
    table lists what differs (--all: everything); --json gives every leaf.

    Exit status: 0 the checkpoints (or the --item) are the same, 1 they differ, as with
    diff and git diff --exit-code. An error is a line on stderr with its own status: 1,
    2 usage, 3 not found.

    Example: nebula diff /mnt/ckpt/run1 global_step400 global_step500 --item model
    """
    import nebulaml as nm

    doc = nm.ops.diff_checkpoints(root, tag_a, tag_b, item=item)
    if as_json:
        emit_json(doc)
    else:
        print_table(_table(doc, all_), headline=2)
        stdout().print(Text(_summary_line(doc)))
    if doc["summary"]["items_changed"]:
        raise typer.Exit(EXIT_ERROR)


def _table(doc: dict[str, Any], all_: bool) -> Table:
    table = Table(title=f"{doc['root']}: {doc['tag_a']} -> {doc['tag_b']}", title_justify="left")
    for column in ("item", "path", "status", "dtype", "shape / value", "max abs", "rel L2"):
        right = column in ("max abs", "rel L2")
        table.add_column(column, justify="right" if right else "left", no_wrap=True)
    for each in doc["items"]:
        if not each["entries"]:  # the whole item: added, removed, or the same bytes
            if each["status"] != "identical" or all_:
                status = (
                    "identical (same bytes)" if each["status"] == "identical" else each["status"]
                )
                table.add_row(Text(each["item"]), "(item)", _status(each["status"], status),
                              "", "", "", "")  # fmt: skip
            continue
        for e in each["entries"]:
            if e["status"] == "identical" and not all_:
                continue
            table.add_row(
                Text(each["item"]),
                Text(e["path"]),
                _status(e["status"]),
                Text(_pair(e["dtype_a"], e["dtype_b"])),
                Text(
                    _pair(_shape(e["shape_a"]), _shape(e["shape_b"]))
                    if e["kind"] == "tensor"
                    else _pair(_value(e, "value_a"), _value(e, "value_b"))
                ),
                _number(e["max_abs_diff"]),
                _number(e["rel_l2_diff"]),
            )
    return table


def _status(status: str, text: str | None = None) -> Text:
    return Text(text or status.replace("_", " "), style=_STYLE.get(status, ""))


def _shape(shape: list[int] | None) -> str | None:
    return None if shape is None else "[" + ", ".join(map(str, shape)) + "]"


def _pair(a: str | None, b: str | None) -> str:
    if a is None or b is None or a == b:
        return a or b or ""
    return f"{a} -> {b}"


def _value(entry: dict[str, Any], key: str) -> str | None:
    """A leaf value as the table shows it (a string as it is, None as `None`); None where
    the leaf is missing on that side."""
    side = entry[key]
    missing = entry["status"] == ("added" if key == "value_a" else "removed")
    if missing:
        return None
    return side if isinstance(side, str) else repr(side)


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def _summary_line(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    parts = [f"{s[key]} {key.replace('_', ' ')}" for key in ("changed", "shape_changed",
             "dtype_changed", "added", "removed", "identical") if s[key]]  # fmt: skip
    leaves = ", ".join(parts) or "no tensors or values compared"
    return f"{s['items_changed']} of {s['items']} item(s) differ; {leaves}"
