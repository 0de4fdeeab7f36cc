"""`nebula inspect ROOT TAG`: a checkpoint's manifest, and what an item holds."""

from __future__ import annotations

from typing import Annotated, Any

from rich.table import Table
from rich.text import Text

from ..console import emit_json, stdout
from ..exits import handles_errors, warn
from ..formatting import human_age, human_bytes
from ..options import JsonOpt, RootArg, StorageOpt, TagArg, item_option
from ..tables import print_table


@handles_errors
def inspect_command(
    root: RootArg,
    tag: TagArg,
    item: Annotated[
        str | None, item_option("Also list the tensors and values inside item NAME.")
    ] = None,
    as_json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Show a checkpoint's manifest, its items, and the tensors inside an item.

    Lists the items with sizes and checksums and the tiers that hold the checkpoint, and
    for each item how many bytes its persist took from its previous version (and which
    tag's) instead of writing them. With --item, the tensors inside that item (names,
    dtypes, shapes, bytes), read without executing any pickle and without loading tensor
    data.

    Example: nebula inspect /mnt/checkpoints/run1 global_step500 --item optimizer
    """
    import nebulaml as nm

    doc = nm.ops.inspect_checkpoint(root, tag)
    entries = None if item is None else nm.ops.describe_item(root, tag, item)
    for copy in doc["copies"]:
        if copy["problem"]:
            warn(f"{copy['tier']} copy: {copy['problem']}")
    if as_json:
        if item is not None:
            manifest_item = next(i for i in doc["manifest"]["items"] if i["name"] == item)
            doc = {**doc, "item": manifest_item, "entries": entries}
        emit_json(doc)
        return
    out = stdout()
    print_table(_summary(doc), console=out)
    print_table(_items_table(doc["manifest"]["items"], doc["reused"]), console=out)
    if item is not None and entries is not None:
        print_table(_entries_table(item, entries), console=out)


def _summary(doc: dict[str, Any]) -> Table:
    manifest = doc["manifest"]
    producer = manifest["producer"]
    table = Table(title=f"{doc['root']} {doc['tag']}", title_justify="left", show_header=False,
                  box=None)  # fmt: skip
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("step", "" if manifest["step"] is None else str(manifest["step"])),
        ("tiers", ", ".join(doc["tiers"]) or "none committed"),
        ("created", manifest["created_at"]),
        ("committed", f"{manifest['committed_at']} ({human_age(manifest['committed_at'])} ago)"),
        ("world size", str(manifest["world_size"])),
        ("size", f"{human_bytes(manifest['total_bytes'])} ({manifest['total_bytes']} bytes)"),
        ("labels", ", ".join(manifest["labels"])),
        ("producer", f"nebula {producer['nebula_version']}, torch {producer['torch_version']}, "
                     f"host {producer['host']}"),
    ]  # fmt: skip
    for key, value in rows:
        table.add_row(key, Text(value))
    return table


def _items_table(items: list[dict[str, Any]], reused: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="items", title_justify="left")
    columns = ["name", "file", "rank", "size", "tensor bytes", "checksum"]
    if reused:  # what each item's persist took from its previous version
        columns += ["reused", "from"]
    for column in columns:
        right = column in ("rank", "size", "tensor bytes", "reused")
        table.add_column(column, justify="right" if right else "left", no_wrap=True)
    for i in items:
        cells: list[Text | str] = [
            Text(i["name"]),
            Text(i["file"]),
            str(i["rank"]),
            human_bytes(i["size_bytes"]),
            human_bytes(i["tensor_bytes"]),
            Text(f"{i['checksum']['algo']}:{i['checksum']['value']}"),
        ]
        if reused:
            entry = reused.get(i["name"])
            cells.append("" if entry is None else human_bytes(entry["bytes_reused"]))
            cells.append(Text((entry or {}).get("from_tag") or ""))
        table.add_row(*cells)
    return table


def _entries_table(item: str, entries: list[dict[str, Any]]) -> Table:
    tensors = [e for e in entries if e["kind"] == "tensor"]
    total = sum(e["size_bytes"] or 0 for e in tensors)
    table = Table(
        title=f"item {item}: {len(tensors)} tensor(s), {human_bytes(total)}",
        title_justify="left",
    )
    for column in ("path", "type", "dtype", "shape", "size / value"):
        table.add_column(column, no_wrap=True)
    for e in entries:
        if e["kind"] == "tensor":
            size = "?" if e["size_bytes"] is None else human_bytes(e["size_bytes"])
            shape = "[" + ", ".join(map(str, e["shape"])) + "]"
            row = (e["path"] or "(item)", e["type"], e["dtype"], shape, size)
        else:
            row = (e["path"] or "(item)", e["type"], "", "", e["value"] or "")
        table.add_row(*(Text(cell) for cell in row))
    return table
