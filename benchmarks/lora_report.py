"""The LoRA fine-tune workload's tables: one row per method, and its targets (PASS/FAIL).

Every figure is a median over the timed saves (with min and max beside the times and the
bytes sent); sizes in MB (10^6 bytes) per checkpoint. The disk columns (the rows that
persist to the work folder): this process's `write_bytes` per checkpoint and its ratio to
the changed bytes; "not counted" where the kernel does not count them, "-" for a row that
persists elsewhere. What each figure is: lora.py.

Not for: measuring (lora.py) or the GPT-2 workload's tables (report.py).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

MB = 1e6


def _fmt(summary: dict[str, float] | None, digits: int = 3, scale: float = 1.0) -> str:
    if not summary:
        return "-"
    med, lo, hi = (summary[k] / scale for k in ("median", "min", "max"))
    return f"{med:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def _median_mb(summary: dict[str, float] | None) -> str:
    return "-" if not summary else f"{summary['median'] / MB:.1f}"


def _disk(fig: dict[str, Any], key: str, digits: int, scale: float) -> str:
    if "disk_bytes" not in fig:
        return "-"  # persisted elsewhere: Azurite's and moto's writes are their own
    summary = fig[key]
    return "not counted" if summary is None else f"{summary['median'] / scale:.{digits}f}"


def render_lora(console: Console, lora: dict[str, Any]) -> None:
    """The workload's table and its targets."""
    state = lora["state"]
    shape = state["shape"]
    n = lora["rounds"] * lora["saves_per_round"]
    title = (
        f"LoRA fine-tune (issue #30): {state['state_bytes'] / MB:.0f} MB of state (model + "
        f"Adam), {state['frozen_bytes'] / MB:.0f} MB frozen "
        f"({state['frozen_bytes'] / state['state_bytes']:.0%}; {shape['n_layer']} layers of "
        f"{shape['d']}x{shape['d']}, adapter rank {shape['rank']}); changed per step "
        f"{state['changed_bytes'] / MB:.1f} MB (adapter + Adam state); step "
        f"{state['step_s']:.2f} s; median \\[min-max] of {n} saves, each after a step "
        f"({lora['saves_per_round']} in each of {lora['rounds']} rounds; Azurite, S3: the first); "
        f"every row saves the frozen-base state but the all-changed control"
    )
    table = Table(title=title, title_justify="left")
    for column in (
        "method",
        "stall s",
        "durable s",
        "MB sent / ckpt",
        "x changed",
        "MB reused / ckpt",
        "MB copied / save",
        "disk MB / ckpt (write_bytes)",
        "disk x changed",
    ):
        table.add_column(column, justify="left" if column == "method" else "right")
    for name in lora["order"]:
        fig = lora["methods"][name]
        label = fig["label"]
        if "unavailable" in fig:
            table.add_row(label, f"unavailable: {fig['unavailable']}")
            continue
        table.add_row(
            label,
            _fmt(fig["stall_s"]),
            _fmt(fig["durable_s"], 2),
            _fmt(fig["bytes_written"], 1, MB),
            f"{fig['written_vs_changed']['median']:.2f}",
            _median_mb(fig.get("bytes_reused")),
            _median_mb(fig.get("copied_bytes")),
            _disk(fig, "disk_bytes", 1, MB),
            _disk(fig, "disk_vs_changed", 2, 1.0),
        )
    console.print(table)
    resumed = [
        f"{fig['label']}: "
        + ("yes" if fig["resume_exact"] else f"NO {fig['resume_mismatches'][:3]}")
        for fig in (lora["methods"][n] for n in lora["order"])
        if "resume_exact" in fig
    ]
    if lora.get("memory_tier_writes_counted"):
        console.print("the memory tier is not on tmpfs: nebula's disk figures include its writes")
    if resumed:
        console.print(
            "resume from the persistent tier, bit-exact: " + "; ".join(resumed), markup=False
        )

    targets = Table(title="LoRA targets (issue #30)", title_justify="left")
    for column in ("ratio", "method", "value", "target", "result", "what"):
        targets.add_column(column, justify="right" if column == "value" else "left")
    for r in lora["ratios"]:
        value = "-" if r["value"] is None else f"{r['value']:.3g}"
        verdict = {True: "[green]PASS[/]", False: "[red]FAIL[/]", None: "n/a"}[r["pass"]]
        targets.add_row(
            r["name"], r["method"], value, f"{r['op']} {r['limit']:.3g}", verdict, r["target"]
        )
    console.print(targets)
