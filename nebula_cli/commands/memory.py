"""`nebula memory`: this user's memory tiers on this node, what each holds, and whether a
job still needs it.

Not for: deciding or releasing (nebulaml.ops.plan_gc, `nebula gc`).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from ..console import emit_json, stdout
from ..exits import handles_errors
from ..formatting import human_bytes
from ..options import JsonOpt
from ..tables import print_table

if TYPE_CHECKING:
    from nebulaml.ops import MemoryTierInfo

_STATE_STYLES = {"ok": "green", "stale": "yellow", "orphaned": "yellow", "unknown": "yellow"}


@handles_errors
def memory_command(as_json: JsonOpt = False) -> None:
    """List this user's memory tiers on this node: root, state, newest checkpoint, size.

    A memory tier is RAM: one folder per persistent root under /dev/shm/nebula-USER (or
    NEBULA_MEMORY_TIER_PATH), holding that root's newest checkpoints. A job releases its
    own when it exits cleanly with everything persisted; one left behind (a crash, a
    memory-only job, keep_memory_tier, a root deleted since) holds RAM until released.

    States: ok (it belongs to its root, or to a job without one: "(memory only)"); stale
    (its root is gone, or was deleted and created again: nothing in it is used again);
    orphaned (no record of its root); unsafe (not yours alone: nebula never touches it);
    unknown (its root cannot be read from here). "persisted" says whether the newest
    checkpoint is committed on the root too; "writer" whether a live job holds the tier.
    "replicas": the replicas a tier keeps of other nodes' parts (peer_replicas=1), the
    newest of each rank, as "TAG (rank R)"; one marked "not persisted" is kept by gc
    (a restart of its job may restore a lost node from it).

    nebula gc releases the tiers no job needs. Persist an unpersisted checkpoint first
    with nebula flush ROOT (on this node).

    Example: nebula memory --json
    """
    import nebulaml as nm
    from nebulaml.ops import memory_tiers_folder as memory_base

    base = memory_base()
    tiers = nm.ops.list_memory_tiers()
    if as_json:
        emit_json({"base": base, "tiers": [t.to_json() for t in tiers]})
        return
    if not tiers:
        sys.stderr.write(f"No memory tiers under {base}\n")
        return
    out = stdout()
    title = f"memory tiers under {base}"
    print_table(tiers_table(tiers, title), tiers_table(tiers, title, stacked=True), out)
    for t in tiers:  # below the table, whole: they are long
        if t.note and t.state != "ok":
            out.print(Text(f"{t.state} {t.path}: {t.note}"))
    total = sum(t.size_bytes for t in tiers)
    out.print(f"{len(tiers)} tier(s), {human_bytes(total)}", highlight=False)


def root_cell(tier: MemoryTierInfo) -> str:
    """The root a tier belongs to, or what stands for one."""
    if tier.root:
        return tier.root
    return "(memory only)" if tier.state == "ok" else "(unknown)"


def persisted_cell(tier: MemoryTierInfo) -> str:
    if not tier.tags:
        return "-"  # nothing to persist
    if tier.persisted is None:
        return "?"  # cannot be told (a stale tier's root is gone, an unreadable root)
    return "yes" if tier.persisted else "no"


def replicas_cell(tier: MemoryTierInfo) -> Text:
    """The replicas a tier keeps of other nodes' parts: "TAG (rank R)" each, one a line;
    one whose checkpoint the root lacks is marked."""
    cell = Text()
    for i, replica in enumerate(tier.replicas):
        cell.append(("\n" if i else "") + f"{replica.tag} (rank {replica.rank})")
        if replica.persisted is not True:
            cell.append(" not persisted", style="yellow")
    return cell if tier.replicas else Text("-")


def tiers_table(tiers: list[MemoryTierInfo], title: str, *, stacked: bool = False) -> Table:
    """One row a tier; `stacked` (a narrow terminal): its path below its root, in one cell."""
    table = Table(title=title, title_justify="left")
    replicas = any(t.replicas for t in tiers)
    columns = ["root / path" if stacked else "root", "state", "newest", "persisted", "size"]
    columns += ["replicas"] if replicas else []
    columns += ["writer"] + ([] if stacked else ["path"])
    for column in columns:
        fold = column.startswith("root") or column in ("newest", "path", "replicas")
        table.add_column(
            column,
            justify="right" if column == "size" else "left",
            overflow="fold" if fold else "ellipsis",
            no_wrap=not fold,
        )
    for t in tiers:
        root = Text(root_cell(t))
        if stacked:
            root.append(f"\n{t.path}", style="dim")
        table.add_row(
            root,
            Text(t.state, style=_STATE_STYLES.get(t.state, "red")),
            Text(t.newest or "-"),
            persisted_cell(t),
            human_bytes(t.size_bytes),
            *([replicas_cell(t)] if replicas else []),
            Text("alive", style="green") if t.writer_alive else "-",
            *([] if stacked else [Text(t.path)]),
        )
    return table
