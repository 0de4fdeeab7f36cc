"""The stale-root campaign: a job crashes, its root is deleted (and sometimes created again,
empty), and the same job starts again on that path. The memory tier the first run left
must never be seen by the second: not listed, not loaded, not persisted into the new root,
and released by the second run's `init`; the second run's clean exit gives its own back.

Each run is a real child process; the first is SIGKILLed at a random point after its
first commits (so its memory tier holds unpersisted checkpoints).
"""

from __future__ import annotations

import os
import random
import shutil
import sys
from pathlib import Path

import warm
from campaigns import Figures

import nebulaml as nm
from nebulaml.protocol.memory_tier import memory_root_for
from nebulaml.storage.store import Store

JOB = r"""
import os, random, signal, sys, torch, nebulaml as nm
root, run, steps, kill_after = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
nm.init(root, persistent_time_interval=3600)
latest = nm.get_latest_checkpoint()
print("LATEST", latest.tag if latest else None, flush=True)
if latest is not None:
    print("LATEST_RUN", int(latest.load("model")["run"]), flush=True)
for step in range(1, steps + 1):
    state = {"run": torch.tensor(run), "w": torch.full((256,), float(run * 1000 + step))}
    nm.Checkpoint(f"global_step{step}").save("model", state)
    if step == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
"""


def _run(root: Path, run: int, steps: int, kill_after: int, env: dict[str, str]) -> tuple:
    done = warm.run(
        [sys.executable, "-c", JOB, str(root), str(run), str(steps), str(kill_after)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    return done.returncode, done.stdout, done.stderr


def stale_root_campaign(work: Path, runs: int = 20, seed: int = 5) -> Figures:
    """`runs` crash / delete / restart cycles; returns the figures."""
    figures = Figures("stale roots")
    rng = random.Random(seed)
    base = work / "memory"
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(base), PYTHONUNBUFFERED="1")
    for cycle in range(runs):
        root = work / f"root{cycle % 3}"
        old, new = 2 * cycle + 1, 2 * cycle + 2
        steps = rng.randint(2, 5)
        code, _out, err = _run(root, old, steps, rng.randint(2, steps), env)
        if code != -9:
            figures.failures.append(f"cycle {cycle}: the first run exited {code}: {err[-500:]}")
            continue
        folder = _memory_folder(root, base)
        left = [p.name for p in folder.iterdir() if not p.name.startswith(".")]
        figures.add("memory tiers left by crashes", int(bool(left)))
        shutil.rmtree(root)
        if rng.random() < 0.5:
            root.mkdir()  # created again, empty: a new root all the same
            figures.add("roots created again empty")
        code, out, err = _run(root, new, rng.randint(1, 4), 0, env)
        figures.add("restarts")
        if code != 0:
            figures.failures.append(f"cycle {cycle}: the second run exited {code}: {err[-500:]}")
            continue
        if "LATEST None" not in out:
            figures.add("old checkpoints seen")
            figures.failures.append(f"cycle {cycle}: the second run saw {out.strip()!r}")
        figures.add("stale tiers released", int("released" in err))
        for info in nm.list_checkpoints(str(root)):
            run = int(nm.get_checkpoint(info["tag"], str(root)).load("model")["run"])
            if run != new:
                figures.add("old data in the new root")
                figures.failures.append(f"cycle {cycle}: {info['tag']} holds run {run}")
        if folder.exists():
            figures.add("tiers left after a clean exit")
            figures.failures.append(f"cycle {cycle}: {folder} left after a clean exit")
        shutil.rmtree(root)
    zero = ("old checkpoints seen", "old data in the new root", "tiers left after a clean exit")
    for key in zero:
        figures.counts.setdefault(key, 0)
    return figures


def _memory_folder(root: Path, base: Path) -> Path:
    """The memory tier folder of `root` under the children's base folder."""
    previous = os.environ.get("NEBULA_MEMORY_TIER_PATH")
    os.environ["NEBULA_MEMORY_TIER_PATH"] = str(base)
    try:
        return Path(memory_root_for(Store(str(root))))
    finally:
        if previous is None:
            del os.environ["NEBULA_MEMORY_TIER_PATH"]
        else:
            os.environ["NEBULA_MEMORY_TIER_PATH"] = previous
