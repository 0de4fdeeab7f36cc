"""Starting children/jobs_child.py scenarios from a test: `JobChild` is crashkit's `Child`
(bounded waits on stdout, reaped by `kill`) on that script.

Not for: assertions; the tests make those.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import warm
from children.crashkit import Child

JOBS_CHILD = Path(__file__).parent / "children" / "jobs_child.py"


class JobChild(Child):
    """A child process running `jobs_child.py SCENARIO ARGS...` (see crashkit.Child)."""

    def __init__(self, scenario: str, *args: object, env: dict[str, str], stderr_path: Path):
        self._stderr_path = stderr_path
        with open(stderr_path, "wb") as err:
            self.proc = warm.Popen(
                [sys.executable, str(JOBS_CHILD), scenario, *map(str, args)],
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
            )
        self._out = b""


def job_env(memory_base: Path, **extra: str) -> dict[str, str]:
    """The environment of a child job sharing the test's memory tier; torchrun's and
    nebula's job variables cleared unless given."""
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_base), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")  # fmt: skip
    for var in ("NEBULA_JOB_ID", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT",
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # fmt: skip
        env.pop(var, None)
    env.update(extra)
    return env
