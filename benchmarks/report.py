"""Figures, the issue's target ratios, the tables on stdout and the JSON document.

Every figure is a median over the repeats, with min and max beside it. The targets
(issue #3) are checked for each nebula variant that ran:

  stall_vs_torch_save        nebula stall / torch.save+fsync stall            <= 0.03
  stall_vs_dcp_async_reused  nebula stall / dcp.async_save (reused) stall     <= 0.5
  loop_overhead              loop time with a save every N steps / without - 1 <= 0.02
  persist_vs_disk_write      persist GB/s / sequential write GB/s              >= 0.8
  resume_memory_speedup      torch.load from disk s / nebula memory load s      >= 2
  disk_load_vs_disk_read     nebula disk load GB/s / sequential read GB/s       >= 0.8
  peak_memory                peak extra bytes <= 2 x state bytes + 256 MiB

and the cold start's (issue #22), on the worse of the first two saves after a start (each
the median over the starts: nebula restarts for every repeat, the peers start once):

  cold_stall_vs_torch_save         worse cold stall / torch.save+fsync stall       <= 0.5
  cold_stall_vs_dcp_reused_cold    worse cold stall / dcp.async_save (reused)'s     <= 1

and issue #49's, the default save level with the best peers in the same run, on the
steady stall's median and its p90 (from the samples):

  stall_vs_dcp_reused_level, stall_p90_vs_dcp_reused_level  nebula / dcp.async_save (reused) <= 1
  stall_vs_dlrover, stall_p90_vs_dlrover                    nebula / DLRover memory save     <= 1

(DLRover's row comes from its own environment: dlrover_method.py.)

Each method's cold saves are figures of their own (`cold_saves`: save 1 and save 2),
never mixed into the steady-state ones. Persist GB/s is the bytes nebula wrote for one
checkpoint over the time from the end of the save call until durable (the background
persist; measured on the synchronous variant, whose background does nothing else). Load
GB/s is the bytes of the checkpoint read over the load time.

Not for: measuring (runner.py, limits.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from measure import summarize
from rich.console import Console
from rich.table import Table
from runner import MethodResult

MEMORY_SLACK_BYTES = 256 << 20
NEBULA_VARIANTS = ("nebula", "nebula_sync", "nebula_lazy")


def method_figures(result: MethodResult, state_bytes: int) -> dict[str, Any]:
    """Summaries (median, min, max) of one method's samples."""
    if result.unavailable is not None:
        return {"label": result.label, "unavailable": result.unavailable}
    saves = result.saves
    durable = [s.durable_s for s in saves]
    loads_disk = result.load_disk_s
    figures: dict[str, Any] = {
        "label": result.label,
        "stall_s": summarize([s.stall_s for s in saves]),
        "blocking_s": summarize([s.blocking_s for s in saves]),
        "fence_s": summarize([s.fence_s for s in saves]),
        "durable_s": summarize(durable),
        "background_s": summarize([s.background_s for s in saves]),
        "durable_gbps": summarize([state_bytes / d / 1e9 for d in durable]),
        "peak_extra_bytes": max(s.peak_extra_bytes for s in saves),
        "peak_anon_bytes": max(s.peak_anon_bytes for s in saves),
        "peak_shm_bytes": max(s.peak_shm_bytes for s in saves),
        "written_bytes": result.written_bytes,
        "load_fast_s": summarize(result.load_fast_s),
        "load_disk_s": summarize(loads_disk),
        "load_disk_gbps": summarize([result.written_bytes / s / 1e9 for s in loads_disk]),
        "load_disk_cache_resident": result.load_disk_cache_resident,
        "cold_saves": [_cold_figures(k, samples) for k, samples in enumerate(result.cold)],
        "samples": [_sample_dict(s) for s in saves],
        "loop": result.loop,
    }
    return figures


def _sample_dict(sample: Any) -> dict[str, Any]:
    return {k: getattr(sample, k) for k in sample.__slots__}


def _cold_figures(k: int, samples: Sequence[Any]) -> dict[str, Any]:
    """The (k+1)-th saves after each start of a method: summaries and samples."""
    return {
        "save": k + 1,
        "stall_s": summarize([s.stall_s for s in samples]),
        "blocking_s": summarize([s.blocking_s for s in samples]),
        "fence_s": summarize([s.fence_s for s in samples]),
        "durable_s": summarize([s.durable_s for s in samples]),
        "peak_extra_bytes": max((s.peak_extra_bytes for s in samples), default=None),
        "samples": [_sample_dict(s) for s in samples],
    }


def cold_stall(figures: dict[str, Any], name: str) -> float | None:
    """The worse of `name`'s first two saves' stalls (each a median over its starts)."""
    method = figures.get(name)
    if not method or "unavailable" in method:
        return None
    stalls = [c["stall_s"]["median"] for c in method.get("cold_saves", []) if c["stall_s"]]
    return max(stalls) if stalls else None


def _median(figures: dict[str, Any], name: str, key: str) -> float | None:
    method = figures.get(name)
    if not method or "unavailable" in method or not method.get(key):
        return None
    return method[key]["median"]


# A loop overhead below this is no measurement of a checkpoint's cost (see target_ratios).
BIASED_BELOW = 0.01


def target_ratio(
    name: str, method: str, value: float | None, op: str, limit: float, target: str
) -> dict[str, Any]:
    """One target as the JSON and the tables hold it: `value op limit`, and whether it
    passed (None: not measured)."""
    passed = None if value is None else (value <= limit if op == "<=" else value >= limit)
    return {
        "name": name,
        "method": method,
        "value": value,
        "op": op,
        "limit": limit,
        "target": target,
        "pass": passed,
    }


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def p90(values: Sequence[float]) -> float | None:
    """The 0.9 quantile, linear between the nearest ranks (None for no values).

    Example:
        >>> p90([0.1, 0.2, 0.3]), p90([5.0]), p90([])
        (0.28, 5.0, None)
    """
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * 0.9
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 12)


def stall_p90(figures: dict[str, Any], name: str) -> float | None:
    """The 0.9 quantile of `name`'s steady-state stalls (from its samples)."""
    method = figures.get(name)
    if not method or "unavailable" in method:
        return None
    if "p90" in (method.get("stall_s") or {}):
        return float(method["stall_s"]["p90"])
    return p90([s["stall_s"] for s in method.get("samples", []) if s.get("saved", True)])


def _peer_ratios(figures: dict[str, Any], v: str, stall: float | None) -> list[dict[str, Any]]:
    """Issue #49: the default save level with the best peers' stall, median and p90, in
    the same run: DCP's reused stager and DLRover's memory save (`dlrover`, run in its
    own environment: dlrover_method.py)."""
    out = []
    for peer, label in (
        ("dcp_async_reused", "dcp.async_save (reused stager)"),
        ("dlrover", "DLRover memory save"),
    ):
        short = "dcp_reused_level" if peer == "dcp_async_reused" else peer
        out.append(
            target_ratio(
                f"stall_vs_{short}",
                v,
                _div(stall, _median(figures, peer, "stall_s")),
                "<=",
                1.0,
                f"nebula stall median <= {label}'s, same run (#49)",
            )
        )
        out.append(
            target_ratio(
                f"stall_p90_vs_{short}",
                v,
                _div(stall_p90(figures, v), stall_p90(figures, peer)),
                "<=",
                1.0,
                f"nebula stall p90 <= {label}'s, same run (#49)",
            )
        )
    return out


def target_ratios(
    figures: dict[str, Any], limits: dict[str, Any], state_bytes: int
) -> list[dict[str, Any]]:
    """The issue's target ratios for each nebula variant that ran."""
    ratios = []
    variants = [v for v in NEBULA_VARIANTS if v in figures and "unavailable" not in figures[v]]
    persist_source = "nebula" if "nebula" in variants else (variants[0] if variants else None)
    for v in variants:
        stall = _median(figures, v, "stall_s")
        ratios.append(
            target_ratio(
                "stall_vs_torch_save",
                v,
                _div(stall, _median(figures, "torch_save", "stall_s")),
                "<=",
                0.03,
                "nebula stall <= 3% of torch.save+fsync",
            )
        )
        ratios.append(
            target_ratio(
                "stall_vs_dcp_async_reused",
                v,
                _div(stall, _median(figures, "dcp_async_reused", "stall_s")),
                "<=",
                0.5,
                "nebula stall <= 0.5 x dcp.async_save (reused stager) stall",
            )
        )
        ratios.extend(_peer_ratios(figures, v, stall))
        loop = figures[v].get("loop") or {}
        overhead = target_ratio(
            "loop_overhead",
            v,
            loop.get("overhead"),
            "<=",
            0.02,
            "loop time lost to checkpoints <= 2%",
        )
        if overhead["value"] is not None and overhead["value"] < -BIASED_BELOW:
            # A checkpoint cannot make training faster: the no-checkpoint segments around
            # these were slowed by something else (the reference is biased), not a pass.
            overhead["pass"] = None
        ratios.append(overhead)
        if v == persist_source:
            background = _median(figures, v, "background_s")
            written = figures[v]["written_bytes"]
            persist_gbps = _div(written / 1e9, background)
            ratios.append(
                target_ratio(
                    "persist_vs_disk_write",
                    v,
                    _div(persist_gbps, limits.get("disk_write_gbps")),
                    ">=",
                    0.8,
                    "persist GB/s >= 80% of sequential write (fsync) GB/s",
                )
            )
        ratios.append(
            target_ratio(
                "resume_memory_speedup",
                v,
                _div(
                    _median(figures, "torch_save", "load_disk_s"),
                    _median(figures, v, "load_fast_s"),
                ),
                ">=",
                2.0,
                "memory-tier resume >= 2x faster than torch.load from disk",
            )
        )
        ratios.append(
            target_ratio(
                "disk_load_vs_disk_read",
                v,
                _div(_median(figures, v, "load_disk_gbps"), limits.get("disk_read_gbps")),
                ">=",
                0.8,
                "load from disk GB/s >= 80% of sequential read GB/s",
            )
        )
        cold = cold_stall(figures, v)
        ratios.append(
            target_ratio(
                "cold_stall_vs_torch_save",
                v,
                _div(cold, _median(figures, "torch_save", "stall_s")),
                "<=",
                0.5,
                "worse of the first two saves' stall <= 0.5 x torch.save+fsync",
            )
        )
        ratios.append(
            target_ratio(
                "cold_stall_vs_dcp_reused_cold",
                v,
                _div(cold, cold_stall(figures, "dcp_async_reused")),
                "<=",
                1.0,
                "worse of the first two saves' stall <= dcp.async_save (reused stager)'s",
            )
        )
        peak = figures[v]["peak_extra_bytes"]
        ratios.append(
            target_ratio(
                "peak_memory",
                v,
                peak / state_bytes,
                "<=",
                (2 * state_bytes + MEMORY_SLACK_BYTES) / state_bytes,
                "peak extra memory <= 2 x state + 256 MiB (value: x state)",
            )
        )
    return ratios


def _fmt(summary: dict[str, float] | None, digits: int = 2) -> str:
    if not summary:
        return "-"
    med, lo, hi = summary["median"], summary["min"], summary["max"]
    return f"{med:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def _fmt_cold(fig: dict[str, Any], k: int) -> str:
    """The (k+1)-th save's stall: median [min-max] over the starts, or the one value."""
    colds = fig.get("cold_saves") or []
    summary = colds[k]["stall_s"] if k < len(colds) else None
    if summary and summary["n"] == 1:
        return f"{summary['median']:.3f}"
    return _fmt(summary, 3)


def _gb(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.2f}"


def render(
    console: Console,
    doc: dict[str, Any],
    order: Sequence[str],
) -> None:
    """The three tables: methods, machine limits, targets."""
    state = doc["state"]
    versions = doc["machine"]["versions"]
    title = (
        f"nebulaml {versions['nebulaml']} ({versions.get('nebulaml_commit') or '?'}), "
        f"torch {versions['torch']}; "
        f"preset {doc['preset']}: {state['num_params'] / 1e6:.0f}M parameters, "
        f"{state['state_bytes'] / 1e9:.2f} GB of state (fp32 + AdamW), "
        f"step {state['step_s']:.2f} s; median \\[min-max] of {doc['args']['repeats']} saves, "
        f"{doc['args'].get('load_repeats', doc['args']['repeats'])} loads; save 1 and 2: "
        f"the first two after each start (nebula: each repeat; the peers: once)"
    )
    table = Table(title=title, title_justify="left")
    for column in (
        "method",
        "save 1 stall s",
        "save 2 stall s",
        "stall s (3+)",
        "durable s",
        "GB/s",
        "peak extra GB (anon+shm)",
        "resume fast s",
        "resume disk s",
        f"loop +% (save every {doc['args']['every']})",
    ):
        table.add_column(column, justify="left" if column == "method" else "right")
    for name in order:
        fig = doc["methods"][name]
        if "unavailable" in fig:
            table.add_row(fig["label"], f"unavailable: {fig['unavailable']}", *[""] * 8)
            continue
        rounds = (fig.get("loop") or {}).get("overhead_per_round")
        overhead = "-"
        if rounds:
            pct = summarize([100 * x for x in rounds])
            overhead = f"{pct['median']:+.1f} [{pct['min']:+.0f}..{pct['max']:+.0f}]"
        table.add_row(
            fig["label"],
            _fmt_cold(fig, 0),
            _fmt_cold(fig, 1),
            _fmt(fig["stall_s"], 3),
            _fmt(fig["durable_s"]),
            f"{fig['durable_gbps']['median']:.2f}" if fig.get("durable_gbps") else "-",
            f"{_gb(fig['peak_extra_bytes'])} "
            f"({_gb(fig['peak_anon_bytes'])}+{_gb(fig['peak_shm_bytes'])})",
            _fmt(fig["load_fast_s"]),
            _fmt(fig["load_disk_s"]),
            overhead,
        )
    console.print(table)
    _render_best_peers(console, doc, order)

    lim = doc["limits"]
    limits = Table(title="this machine", title_justify="left")
    limits.add_column("limit")
    limits.add_column("GB/s", justify="right")
    limits.add_row("copy into a reused buffer", f"{lim['copy_reused_gbps']:.2f}")
    limits.add_row("copy into fresh pages", f"{lim['copy_fresh_gbps']:.2f}")
    writes, reads = lim["disk_write_runs_gbps"], lim["disk_read_runs_gbps"]
    limits.add_row(
        f"sequential write + fsync, {lim['disk_bytes'] >> 20} MiB in "
        f"{lim['disk_chunk_bytes'] >> 20} MiB writes: median of {len(writes)} runs "
        f"({min(writes):.2f}-{max(writes):.2f})",
        f"{lim['disk_write_gbps']:.2f}",
    )
    limits.add_row(
        f"sequential read, page cache dropped ({lim['read_cache_resident']:.0%} resident): "
        f"median of {len(reads)} runs ({min(reads):.2f}-{max(reads):.2f})",
        f"{lim['disk_read_gbps']:.2f}",
    )
    base = doc.get("loop_baseline") or {}
    if base:
        runs = base["segment_s"]
        limits.add_row(
            f"{base['steps_per_segment']} training steps, no checkpoint: median "
            f"{base['median_s']:.2f} s of {len(runs)} runs, {min(runs):.2f}-{max(runs):.2f} s "
            f"(spread {base['spread']:.0%}: the loop figures' noise); malloc: "
            f"{base.get('malloc', 'system')}",
            "-",
        )
    other = doc["machine"].get("other_cpu_share")
    if other is not None:
        limits.add_row(f"CPU used by other processes during the run: {other:.0%}", "-")
    console.print(limits)

    targets = Table(title="targets (issues #3, #22, #49)", title_justify="left")
    for column in ("ratio", "method", "value", "target", "result"):
        targets.add_column(column, justify="right" if column == "value" else "left")
    for r in doc["ratios"]:
        value = "-" if r["value"] is None else f"{r['value']:.3g}"
        verdict = {True: "[green]pass[/]", False: "[red]FAIL[/]", None: "n/a"}[r["pass"]]
        targets.add_row(r["name"], r["method"], value, f"{r['op']} {r['limit']:.3g}", verdict)
    console.print(targets)


def _render_best_peers(console: Console, doc: dict[str, Any], order: Sequence[str]) -> None:
    """Issue #49's comparison: the steady stall's median and p90 of nebula, DCP's reused
    stager and DLRover's memory save, and what DLRover's row alone measures (its buffer,
    its saver process, its resume)."""
    methods = doc["methods"]
    shown = [
        n
        for n in ("nebula", "nebula_sync", "nebula_lazy", "dcp_async_reused", "dlrover")
        if n in order
    ]
    dl = methods.get("dlrover") or {}
    if "dlrover" not in shown or "unavailable" in dl:
        return
    state_bytes = doc["state"]["state_bytes"]
    table = Table(
        title="issue #49: steady save() stall, same run (DLRover in its own environment)",
        title_justify="left",
    )
    for column in ("method", "stall median s", "stall p90 s", "saves", "memory"):
        table.add_column(column, justify="left" if column == "method" else "right")
    extra = dl.get("dlrover") or {}
    memory = extra.get("memory") or {}
    shm = (memory.get("shm") or {}).get("allocated")
    saver = (memory.get("saver") or {}).get("private")
    for name in shown:
        fig = methods[name]
        if "unavailable" in fig or not fig.get("stall_s"):
            continue
        peak = fig.get("peak_extra_bytes") or 0
        keeps = f"peak extra {peak / 1e9:.2f} GB ({peak / state_bytes:.2f} x state)"
        if name == "dlrover" and shm:
            keeps = f"buffer {shm / 1e9:.2f} GB ({shm / state_bytes:.2f} x state)"
            if saver:
                keeps += f"; its saver process {saver / 1e9:.2f} GB private"
        median, q90 = fig["stall_s"]["median"], stall_p90(methods, name)
        table.add_row(
            fig["label"],
            f"{median:.3f}",
            "-" if q90 is None else f"{q90:.3f}",
            str(fig["stall_s"]["n"]),
            keeps,
        )
    console.print(table)
    alias = extra.get("aliasing") or {}
    disk = [d for d in extra.get("disk_saves") or [] if d.get("saved")]
    disk_note = (
        f"its disk save: stall {min(d['stall_s'] for d in disk):.3f}-"
        f"{max(d['stall_s'] for d in disk):.3f} s, tracker file written after "
        f"{min(d['persisted_s'] for d in disk):.2f}-{max(d['persisted_s'] for d in disk):.2f} s "
        f"(the checkpoint file not fsynced); "
        if disk
        else ""
    )
    console.print(
        f"DLRover {((extra.get('versions') or {}).get('dlrover'))}: {extra.get('run')}; "
        f"{disk_note}"
        f"resume from memory bit-exact: {extra.get('load_memory_exact')}, from disk: "
        f"{extra.get('load_disk_exact')}; skipped saves: {extra.get('skipped_saves')}; after "
        f"a resume from memory, {alias.get('optimizer_tensors_in_buffer')} of "
        f"{alias.get('optimizer_tensors')} optimizer tensors are views of its buffer, and "
        f"one step without a save changed its memory copy: "
        f"{alias.get('memory_copy_changed_by_a_step_without_save')}",
        highlight=False,
    )
