"""`make bench`'s DLRover row (issue #49, benchmarks/dlrover_method.py): the runner's JSON,
written in DLRover's own environment, becomes a row like the others; a missing or failing
environment is a row that says why, never a failed bench. DLRover itself is not needed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_module() -> ModuleType:
    # By path, under a name of its own: benchmarks/ is not put on sys.path (its model.py,
    # runner.py and report.py would shadow other modules of those names in this worker).
    spec = importlib.util.spec_from_file_location(
        "bench_dlrover_method", BENCHMARKS / "dlrover_method.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def runner_doc() -> dict[str, Any]:
    """What benchmarks/dlrover_peer.py writes, cut to three saves."""
    save = {"peak_extra_bytes": 250, "peak_anon_bytes": 4, "peak_shm_bytes": 246}
    stats = {"median": 0.031, "p90": 0.034, "min": 0.030, "max": 0.035, "n": 2}
    return {
        "schema": "nebula-bench-dlrover/1",
        "preset": "small",
        "versions": {"torch": "2.13.0+cpu", "dlrover": "0.6.1"},
        "run": "one process, no dlrover-run: DdpCheckpointer starts its saver process",
        "state_bytes": 195,
        "checkpointer_start_s": 0.2,
        "cold": [{"step": 1, "stall_s": 0.1, "saved": True, **save}] * 2,
        "saves": [
            {"step": 3, "stall_s": 0.030, "saved": True, **save},
            {"step": 4, "stall_s": 0.9, "saved": False, **save},  # skipped: not timed
            {"step": 5, "stall_s": 0.035, "saved": True, **save},
        ],
        "skipped_saves": 1,
        "stall_s": stats,
        "memory": {"shm": {"size": 246, "allocated": 248}, "saver": {"private": 100}},
        "load_memory_s": {"median": 0.003, "p90": 0.003, "min": 0.003, "max": 0.004, "n": 3},
        "load_memory_exact": True,
        "disk_saves": [{"step": 6, "stall_s": 0.04, "saved": True, "persisted_s": 0.2, **save}],
        "written_bytes": 247,
        "load_disk_s": {"median": 0.15, "p90": 0.16, "min": 0.14, "max": 0.16, "n": 3},
        "load_disk_exact": True,
        "aliasing": {"optimizer_tensors": 104, "optimizer_tensors_in_buffer": 104},
    }


def test_the_runners_json_becomes_a_row_beside_the_others() -> None:
    dm = load_module()
    fig = dm.dlrover_figures(runner_doc())
    assert fig["label"] == dm.LABEL and "unavailable" not in fig
    assert fig["stall_s"] == {"median": 0.031, "min": 0.030, "max": 0.035, "n": 2, "p90": 0.034}
    assert [c["stall_s"]["median"] for c in fig["cold_saves"]] == [0.1, 0.1]
    assert fig["peak_extra_bytes"] == 250 and fig["peak_shm_bytes"] == 246
    assert fig["load_fast_s"]["median"] == 0.003 and fig["load_disk_s"]["median"] == 0.15
    assert fig["load_disk_gbps"]["median"] == 247 / 0.15 / 1e9
    # A memory save is not durable and its disk save does not fsync: no durable figure.
    assert fig["durable_s"] == {} and fig["durable_gbps"] == {}
    assert fig["dlrover"]["aliasing"]["optimizer_tensors_in_buffer"] == 104
    assert fig["dlrover"]["disk_saves"][0]["persisted_s"] == 0.2


def test_another_json_is_refused() -> None:
    dm = load_module()
    doc = runner_doc() | {"schema": "nebula-bench/1"}
    try:
        dm.dlrover_figures(doc)
    except ValueError as exc:
        assert "schema" in str(exc)
    else:
        raise AssertionError("a JSON of another schema was read as the runner's")


def test_no_environment_or_a_failing_runner_is_an_unavailable_row(tmp_path: Path) -> None:
    dm = load_module()
    missing = dm.run_dlrover(
        tmp_path, preset="small", saves=1, load_repeats=1, python=tmp_path / "no-python"
    )
    assert missing["unavailable"].startswith("no .venv-dlrover")
    failing = tmp_path / "python"
    failing.write_text("#!/bin/sh\necho 'ModuleNotFoundError: dlrover' >&2\nexit 3\n")
    failing.chmod(0o755)
    failed = dm.run_dlrover(tmp_path, preset="small", saves=1, load_repeats=1, python=failing)
    assert failed["unavailable"] == "the runner failed (3): ModuleNotFoundError: dlrover"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["python"]
