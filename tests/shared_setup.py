"""Set-up that the whole test run shares: made once, by whichever pytest-xdist worker
needs it first, while the others wait for it (an flock per key), then read by every worker.
For what costs a minute of two cores each time: the wheel built and installed, a
DeepSpeed or FSDP2 job whose results several tests check.

The value must be JSON (paths as strings). A set-up that failed fails every test that asks
for it, naming the worker's error, without running it again. The folders live in the run's
shared folder (the `shared_root` fixture), removed at the end of the run (../conftest.py).

Not for: per-worker set-up (Azurite: one per worker, a session fixture).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


def shared_root(basetemp: Path) -> Path:
    """The run's shared folder: beside the workers' own (pytest-xdist gives each worker
    `<run>/popen-gwN`), or in the run's folder without workers."""
    run = basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp
    return run / "shared"


def once(root: Path, key: str, make: Callable[[Path], Any]) -> Any:
    """`make(folder)`'s value for `key`, made once for the run in `root/key`.

    Example (not run here):
        wheel = once(shared_root, "wheel", lambda folder: build_into(folder))
    """
    root.mkdir(parents=True, exist_ok=True)
    folder, result = root / key, root / f"{key}.json"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if result.exists():
            done = json.loads(result.read_text(encoding="utf-8"))
            if "error" in done:
                pytest.fail(f"the shared set-up {key!r} failed: {done['error']}", pytrace=False)
            return done["value"]
        folder.mkdir(exist_ok=True)
        try:
            value = make(folder)
        except pytest.skip.Exception:
            raise  # each worker finds the same reason to skip by itself
        except BaseException as exc:
            result.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"[-4000:]}))
            raise
        result.write_text(json.dumps({"value": value}), encoding="utf-8")
        return value


@contextlib.contextmanager
def one_at_a_time(root: Path, what: str) -> Iterator[None]:
    """While the block runs, no other worker runs a block of the same `what`: for jobs that
    must not overlap on one node (DeepSpeed's CPU all-reduce works through shared memory,
    and two jobs at once starved a rank past its 60 s rank timeout)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{what}.serial.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
