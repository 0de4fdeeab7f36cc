"""DLRover's Flash Checkpoint as a row of the peer benchmark (issue #49), run apart.

DLRover lives in an environment of its own (`.venv-dlrover`, made by `make venv-dlrover`,
a prerequisite of `make bench`: it is kept out of the main environment),
so its row is not a `peers.Method` timed in this process: bench.py runs
benchmarks/dlrover_peer.py with that environment's python, on the same preset's state
(model.py, same seed), after the other methods' saves and loads, and reads the JSON it
writes. `run_dlrover` turns that into the figures every row has (`dlrover_figures`), so
that report.py shows it beside nebula and DCP's reused stager and checks the issue's
ratios against it; where the environment is missing or the runner fails, the row says
"unavailable: <why>" and the bench goes on.

The row's columns: save 1 and 2 stall, stall (3+) (DLRover's memory save:
`save_checkpoint(..., storage_type=StorageType.MEMORY)`; the copy into its shared-memory
buffer is done when the call returns, so there is no fence), peak extra (the runner's
anonymous RSS above the level before the save, plus the buffer in /dev/shm), resume fast
(`load_checkpoint()` from the buffer: views of it, nothing copied) and disk (`torch.load`
of its newest file, page cache dropped). No durable figure: a memory save is not
durable, and its disk save (from the call until its tracker file names the step) does
not fsync the checkpoint file, unlike every other row's. Those disk saves and the
runner's own figures (the buffer's size, the saver process's memory, bit-exact checks,
what a resume from memory aliases) are kept under `dlrover`.

Not for: running DLRover (dlrover_peer.py) or rendering (report.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
from collections import deque
from pathlib import Path
from typing import Any

NAME = "dlrover"
LABEL = "DLRover flash ckpt (memory save)"
REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-dlrover"
RUNNER = Path(__file__).resolve().parent / "dlrover_peer.py"
SCHEMA = "nebula-bench-dlrover/1"


def unavailable(reason: str) -> dict[str, Any]:
    return {"label": LABEL, "unavailable": reason}


def _summary(stats: dict[str, Any] | None) -> dict[str, float]:
    """The runner's statistics as the other rows' summaries (median, min, max, n; p90
    kept)."""
    if not stats:
        return {}
    return {k: stats[k] for k in ("median", "min", "max", "n", "p90") if k in stats}


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    xs = sorted(values)
    mid = len(xs) // 2
    median = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
    return {"median": median, "min": xs[0], "max": xs[-1], "n": len(xs)}


def _gbps(nbytes: int, seconds: dict[str, Any]) -> dict[str, float]:
    """GB/s of `nbytes` over each of a summary of times (the slowest is the min GB/s)."""
    if not nbytes or not seconds:
        return {}
    rate = {k: nbytes / seconds[k] / 1e9 for k in ("median", "min", "max")}
    return {"median": rate["median"], "min": rate["max"], "max": rate["min"], "n": seconds["n"]}


def dlrover_figures(doc: dict[str, Any]) -> dict[str, Any]:
    """The runner's JSON (`doc`) as one row of the benchmark's figures.

    Example:
        >>> doc = {"schema": SCHEMA, "state_bytes": 100, "stall_s": {"median": 0.03,
        ...   "p90": 0.04, "min": 0.02, "max": 0.05, "n": 3},
        ...   "saves": [{"stall_s": 0.03, "saved": True, "peak_extra_bytes": 130,
        ...              "peak_anon_bytes": 0, "peak_shm_bytes": 130}],
        ...   "cold": [{"stall_s": 0.1}, {"stall_s": 0.04}], "disk_saves": [],
        ...   "load_memory_s": {"median": 0.003, "min": 0.003, "max": 0.003, "n": 1},
        ...   "load_disk_s": {}, "written_bytes": 0, "memory": {}, "aliasing": {}}
        >>> fig = dlrover_figures(doc)
        >>> fig["stall_s"]["p90"], fig["cold_saves"][0]["stall_s"]["median"], fig["durable_s"]
        (0.04, 0.1, {})
    """
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"not the DLRover runner's JSON (schema {doc.get('schema')!r})")
    saves = [s for s in doc["saves"] if s["saved"]]
    written = int(doc.get("written_bytes") or 0)
    loads_disk = doc.get("load_disk_s") or {}
    return {
        "label": LABEL,
        "stall_s": _summary(doc["stall_s"]),
        "blocking_s": _summary(doc["stall_s"]),
        "fence_s": _stats([0.0 for _ in saves]),
        # A memory save is never durable; its disk save (kept under "dlrover") is not
        # fsynced: no figure here to set beside the others' fsynced "durable".
        "durable_s": {},
        "background_s": {},
        "durable_gbps": {},
        "peak_extra_bytes": max((s["peak_extra_bytes"] for s in saves), default=0),
        "peak_anon_bytes": max((s["peak_anon_bytes"] for s in saves), default=0),
        "peak_shm_bytes": max((s["peak_shm_bytes"] for s in saves), default=0),
        "written_bytes": written,
        "load_fast_s": _summary(doc.get("load_memory_s")),
        "load_disk_s": _summary(loads_disk),
        "load_disk_gbps": _gbps(written, loads_disk),
        "load_disk_cache_resident": None,
        "cold_saves": [
            {"save": k + 1, "stall_s": _stats([c["stall_s"]]), "samples": [c]}
            for k, c in enumerate(doc.get("cold", []))
        ],
        "samples": doc["saves"],
        "loop": {},
        "dlrover": {
            key: doc.get(key)
            for key in (
                "versions",
                "run",
                "state_bytes",
                "checkpointer_start_s",
                "skipped_saves",
                "memory",
                "load_memory_exact",
                "load_disk_exact",
                "aliasing",
                "disk_saves",
            )
        },
    }


def run_dlrover(
    work: Path,
    *,
    preset: str,
    saves: int,
    load_repeats: int,
    progress: Any = None,
    timeout_s: float = 1800,
    python: Path | None = None,
) -> dict[str, Any]:
    """Run the DLRover row in its own environment; its figures, or why it is unavailable.
    Never raises for a failure of DLRover's side."""
    python = python or VENV / "bin" / "python"
    if not python.exists():
        return unavailable(f"no {VENV.name} (make venv-dlrover)")
    out = work / "dlrover.json"
    cmd = [
        str(python),
        str(RUNNER),
        "--preset",
        preset,
        "--saves",
        str(saves),
        "--load-repeats",
        str(load_repeats),
        "--work",
        str(work),
        "--json",
        str(out),
    ]
    tail: deque[str] = deque(maxlen=5)
    # The runner's DLRover names its buffer and sockets after this (dlrover_peer.py); its
    # saver is a child of the runner, in the runner's own session: one kill stops both.
    run_id = f"nebula-bench-dlrover-{os.getpid()}"
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, TORCHELASTIC_RUN_ID=run_id),
            start_new_session=True,
        )
    except OSError as exc:
        return unavailable(f"cannot start {python}: {exc}")

    def kill_group() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    watchdog = threading.Timer(timeout_s, kill_group)
    watchdog.start()
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # DLRover logs much at INFO: only the runner's lines go on
            line = line.rstrip()
            if line.startswith("[dlrover"):
                if progress is not None:
                    progress(line)
            elif line:
                tail.append(line)
        rc = proc.wait()
    finally:
        watchdog.cancel()
    if rc != 0:  # what the runner's own clean-up did not reach
        kill_group()
        Path("/dev/shm", f"{run_id}_ckpt_shm_0").unlink(missing_ok=True)
        shutil.rmtree(Path("/tmp/ckpt_sock", run_id), ignore_errors=True)
    if rc != 0 or not out.exists():
        why = tail[-1] if tail else f"exit status {rc}"
        return unavailable(f"the runner failed ({rc}): {why[:200]}")
    try:
        return dlrover_figures(json.loads(out.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        return unavailable(f"unreadable runner output: {exc!r}")
    finally:
        out.unlink(missing_ok=True)
