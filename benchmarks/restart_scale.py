"""What a restart costs against the number of checkpoints on a root (issue #47).

    python benchmarks/restart_scale.py [--quick] [--local 100 1000 10000] [--azure 100 1000]
        [--repeats 5] [--json FILE]

For each N, builds a persistent root of N committed checkpoints as metadata_scale.py does
(`global_step1` saved through the API, `global_step2` .. `global_stepN` its clones, each
with its entry in the root's commit index, as this version's commits write them), then
times, each in a fresh process (`--repeats` of them, the median):

  restart             `nm.init(root)` + `nm.get_latest_checkpoint()` + `.load("model")`
                      (the imports of torch and nebulaml not counted: a job has them),
                      checked to return global_stepN
  nebula latest       the `nebula latest ROOT` console script (wall time, a process:
                      Python's and nebula's imports included)

Prints the table with each figure's ratio to the smallest root of its backend in the same
run, and the targets of #47: a restart at 10,000 local tags within 2x of 100, at 1,000
Azurite tags within 2x of 100. Writes benchmarks/results/restart-scale.json
(`-quick` with `--quick`: 100 and 1,000 local tags only). Azure roots are on an Azurite
this script starts (`make azurite` installs it). Everything is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from metadata_scale import (  # the builders of the roots
    CpuShare,
    build_local,
    code_commit,
    measure_all,
    progress,
    render_footer,
    run_worker,
    time_cli,
    write_results,
)

RESULTS = Path(__file__).resolve().parent / "results"
LOCAL_SIZES = [100, 1_000, 10_000]
AZURE_SIZES = [100, 1_000]
QUICK_SIZES = [100, 1_000]
RATIO_MAX = 2.0  # #47: a restart at the largest root within 2x of the smallest


def _restart(spec: dict[str, Any]) -> dict[str, Any]:
    """One restart in this (fresh) process: init, the latest, one load (torch imported
    first, as a training job has)."""
    import torch  # noqa: F401 - a job's import, not the restart's

    import nebulaml as nm

    start = time.perf_counter()
    nm.init(spec["root"], storage_options=spec.get("storage_options") or {})
    init_s = time.perf_counter() - start
    latest = nm.get_latest_checkpoint()
    if latest is None or latest.tag != f"global_step{spec['n']}":
        raise SystemExit(f"the latest is {latest!r}, not global_step{spec['n']}")
    latest.load("model")
    total = time.perf_counter() - start
    latest.release()
    nm.shutdown()
    return {"restart_s": total, "init_s": init_s}


def measure(backend: str, n: int, args: argparse.Namespace, work: Path, azure: Any) -> dict:
    col: dict[str, Any] = {"backend": backend, "n": n, "errors": {}}
    t0 = time.perf_counter()
    if backend == "local":
        root_path = work / f"root-{n}"
        build_local(root_path, n, work, args.timeout)
        root, options = str(root_path), {}
    else:
        azure.build(f"root-{n}", n, work, args.timeout)
        root, options = azure.url(f"root-{n}"), azure.options
    col["build_s"] = time.perf_counter() - t0
    progress(f"{backend} {n}: built in {col['build_s']:.1f} s; timing")
    spec = {"root": root, "storage_options": options, "n": n}
    samples, inits, latest = [], [], []
    for _ in range(args.repeats):
        one = run_worker("restart", spec, work, args.timeout, __file__)
        if "error" in one:
            col["errors"]["restart"] = one["error"]
            break
        samples.append(one["restart_s"])
        inits.append(one["init_s"])
        cli = time_cli(["latest", root], args.timeout)
        if "error" in cli:
            col["errors"]["latest"] = cli["error"]
        elif cli["s"] is not None:
            latest.append(cli["s"])
    col["restart_samples_s"], col["init_samples_s"], col["latest_samples_s"] = (
        samples,
        inits,
        latest,
    )
    for key, values in (("restart_s", samples), ("init_s", inits), ("cli_latest_s", latest)):
        col[key] = statistics.median(values) if values else None
    progress(f"{backend} {n}: restart {col['restart_s']}, nebula latest {col['cli_latest_s']}")
    if backend == "local":
        shutil.rmtree(root_path)
    else:
        azure.fs.rm(f"metadata/root-{n}", recursive=True)
    return col


ROWS = [
    ("restart_s", "init + latest + load (median)"),
    ("init_s", "  of which nm.init"),
    ("cli_latest_s", "nebula latest (process)"),
]


def ratios(columns: list[dict[str, Any]]) -> None:
    """Each figure's ratio to the smallest root of its backend in this run."""
    for backend in {c["backend"] for c in columns}:
        mine = sorted((c for c in columns if c["backend"] == backend), key=lambda c: c["n"])
        base = mine[0]
        for c in mine:
            c["ratio"] = {
                key: (c[key] / base[key] if c.get(key) and base.get(key) else None)
                for key, _ in ROWS
            }


def targets(columns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for backend, n in (("local", 10_000), ("azure", 1_000)):
        col = next((c for c in columns if c["backend"] == backend and c["n"] == n), None)
        value = None if col is None else col["ratio"]["restart_s"]
        out.append(
            {
                "target": f"restart at {n:,} {backend} tags / at the smallest",
                "value": value,
                "limit": RATIO_MAX,
                "unit": "x",
                "pass": None if value is None else value <= RATIO_MAX,
            }
        )
    return out


def _fmt(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def render(doc: dict[str, Any]) -> None:
    columns = doc["columns"]
    width = max(len(label) for _, label in ROWS) + 2
    print(
        f"\nrestart at scale ({doc['machine']['cpus']} CPUs, nebulaml {doc['machine']['commit']})"
    )
    print(
        f"{'':<{width}}"
        + "".join(f"{c['backend'] + ' ' + format(c['n'], ','):>20}" for c in columns)
    )
    for key, label in ROWS:
        cells = []
        for c in columns:
            ratio = c["ratio"][key]
            cells.append(_fmt(c.get(key)) + ("" if ratio is None else f" ({ratio:.2f}x)"))
        print(f"{label:<{width}}" + "".join(f"{cell:>20}" for cell in cells))
    render_footer(doc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 and 1,000 local tags only")
    parser.add_argument("--local", type=int, nargs="*", help="local root sizes")
    parser.add_argument("--azure", type=int, nargs="*", help="Azurite root sizes")
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per root")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per command")
    parser.add_argument("--work", type=Path, help="where the roots go (default: $TMPDIR)")
    parser.add_argument("--json", type=Path, help="where to write the figures")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.spec)
        Path(spec["out"]).write_text(json.dumps(_restart(spec)))
        return 0
    local = args.local if args.local is not None else (QUICK_SIZES if args.quick else LOCAL_SIZES)
    azure_sizes = args.azure if args.azure is not None else ([] if args.quick else AZURE_SIZES)
    work = Path(tempfile.mkdtemp(prefix="nebula-restart-", dir=args.work))
    os.environ["NEBULA_MEMORY_TIER_PATH"] = str(work / "memory-tier")
    cpu = CpuShare()
    import nebulaml

    source = Path(nebulaml.__file__).resolve().parents[2]
    doc: dict[str, Any] = {
        "schema": "nebula-restart-scale/1",
        "args": {"local": local, "azure": azure_sizes, "repeats": args.repeats},
        "machine": {"cpus": os.cpu_count(), "commit": code_commit(source)},
        "columns": [],
    }
    try:
        doc["columns"] = measure_all(measure, local, azure_sizes, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios(doc["columns"])
    doc["targets"] = targets(doc["columns"])
    doc["machine"]["other_cpu_share"] = cpu.other_share()
    render(doc)
    write_results(doc, args.json or RESULTS / f"restart-scale{'-quick' if args.quick else ''}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
