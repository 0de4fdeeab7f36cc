"""`nebula verify ROOT [TAG]`: re-read every copy of every item and check it."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from ..complete import complete_tag
from ..console import emit_json, stderr
from ..exits import EXIT_ERROR, handles_errors
from ..formatting import shown
from ..options import JsonOpt, QuietOpt, RootArg, StorageOpt, VerboseOpt
from ..progress import progress
from ..tables import print_table

TagArg = Annotated[
    str | None,
    typer.Argument(
        metavar="TAG",
        help="Only this checkpoint (default: every checkpoint).",
        autocompletion=complete_tag,
    ),
]

_STYLE = {
    "ok": "green",
    "corrupt": "bold red",
    "missing": "bold red",
    "differs": "bold red",
    "unchecked": "bold yellow",
    "unreadable": "bold red",
    "unsupported": "bold yellow",
}


@handles_errors
def verify_command(
    root: RootArg,
    tag: TagArg = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Re-read every item on every tier and check its size and checksum.

    Also reports manifests that are present but unreadable, and items that are missing
    or of the wrong size, and checkpoints it could not read (`unchecked`: a delete of it
    is claimed and did not end; `unreadable`: a tag folder this user may not read, the
    others checked; `unsupported`: a manifest of a schema a newer nebula wrote, which
    this one cannot read: not corrupt, not checked). Exit 1 on any of these, naming the
    file, the expected and the actual value; exit 3 when TAG does not exist. With --json,
    `expected` and `actual` are objects: {size_bytes, algo, checksum}.

    Example: nebula verify /mnt/checkpoints/run1 global_step500
    """
    import nebulaml as nm

    location = nm.check_root(root)
    with progress("verifying", quiet=quiet, transient=True) as report:
        results = nm.ops.verify_checkpoints(root, tag, progress=report)
    failures = [r for r in results if r["status"] != "ok"]
    if as_json:
        emit_json({"root": location, "ok": not failures, "results": [_json(r) for r in results]})
    else:
        print_table(_table(location, results, verbose))
    for r in failures:
        sys.stderr.write(f"nebula: error: {r['file']}: expected {r['expected']}, "
                         f"found {r['actual']}\n")  # fmt: skip
    if results and not as_json:
        tags = {r["tag"] for r in results}
        summary = f"verified {len(tags)} checkpoint(s), {len(results)} result(s): "
        summary += f"{len(failures)} failed" if failures else "all ok"
        stderr().print(summary, highlight=False)
    if not results:
        stderr().print("no committed checkpoints to verify", highlight=False)
    if failures:
        raise typer.Exit(EXIT_ERROR)


def _json(result: dict[str, Any]) -> dict[str, Any]:
    """A result as --json gives it: `expected` and `actual` as {size_bytes, algo,
    checksum} (null where there is none: no such file, a manifest), and `detail`, the
    failure in words (null when ok)."""
    ok = result["status"] == "ok"
    return {
        "tag": result["tag"],
        "tier": result["tier"],
        "item": result["item"],
        "file": result["file"],
        "status": result["status"],
        "expected": result.get("expected_checksum"),
        "actual": result.get("actual_checksum"),
        "detail": None if ok else f"expected {result['expected']}, found {result['actual']}",
    }


def _table(location: str, results: list[dict[str, Any]], verbose: bool) -> Table:
    """Every failure; the ok rows too, the first `ROWS_SHOWN` of them unless `verbose`."""
    ok_rows, left = shown([r for r in results if r["status"] == "ok"], verbose)
    kept = {id(r) for r in ok_rows}
    rows = [r for r in results if r["status"] != "ok" or id(r) in kept]
    caption = f"... and {left} more ok (--verbose: all)" if left else None
    table = Table(title=location, title_justify="left", caption=caption, caption_justify="left")
    for column in ("tag", "tier", "item", "status", "checksum"):
        table.add_column(column, no_wrap=True)
    for r in rows:
        # The checksum found (or the problem), shortened to what a human compares.
        found = r.get("actual_checksum") or {}
        detail = found.get("checksum") if r["status"] == "ok" else r["actual"]
        table.add_row(
            Text(r["tag"]),
            r["tier"],
            Text(r["item"] if r["item"] is not None else "(manifest)"),
            Text(r["status"], style=_STYLE.get(r["status"], "")),
            Text(detail or ""),
        )
    return table
