"""The junk campaign (#29): while a job trains, another hand plants junk in its live root:
names nebula reserves with odd digits or none, FIFOs and symbolic links where nebula's
files or folders go, folders where files go, holds and leases dated in the future or
naming pid 1, names that are not UTF-8. Nothing may hang, print a traceback, or lose a
checkpoint the job acknowledged; the operator's commands (`nebula ls`, `verify`,
`prune --dry-run`, `history`) must answer, with a clear error at worst.

Each round is a real training child (it saves a step, flushes it and journals it, then
the next) and a planter in this process; at the end the child exits by itself, and the
root is read back: the newest committed checkpoint is the last step journalled, and it
loads with that step's values.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import warm
from campaigns import Figures

from nebulaml.protocol.holds import HOLD_TTL_S

TIMEOUT_S = 120.0  # a child or a command that takes longer has hung

JOB = r"""
import os, sys, time, torch, nebulaml as nm
root, steps, journal = sys.argv[1], int(sys.argv[2]), sys.argv[3]
nm.init(root, persistent_time_interval=0, num_of_version_in_retention=3)
with open(journal, "a") as out:
    for step in range(1, steps + 1):
        time.sleep(0.2)  # the step's training: junk lands meanwhile, however fast the save
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.full((64,), float(step))})
        nm.flush_persistence()
        out.write(f"{step}\n")
        out.flush()
        os.fsync(out.fileno())
print("DONE", flush=True)
"""


def _stamp(when: datetime) -> str:
    return when.strftime("%Y%m%dT%H%M%S%fZ")


def _plant(root: Path, rng: random.Random, outside: Path) -> str:
    """One piece of junk somewhere in `root`; what it was, for the figures."""
    tags = [p.name for p in root.iterdir() if p.name.startswith("global_step")] or ["x"]
    folder = root / rng.choice(tags) if rng.random() < 0.6 else root
    future = datetime.now(timezone.utc) + timedelta(days=rng.choice([1, 365, 3000]))
    kind = rng.choice(
        ["odd digits", "fifo", "link", "folder", "future hold", "future lease", "pid 1",
         "not utf-8", "junk file"]
    )  # fmt: skip
    name: str | bytes
    try:
        if kind == "odd digits":
            name = rng.choice([".nebula-job-².json", ".nebula-job-.json", ".rank-¹.json",
                               f".lease-read-{_stamp(future)}-²-ab-node.json",
                               ".nebula-writing-٣.lock"])  # fmt: skip
            (folder / name).write_text("{}")
        elif kind == "fifo":
            name = rng.choice(["manifest.json", ".rank-0.json", f"junk{rng.randrange(99)}",
                               ".nebula-sequence.json", ".nebula-job-00000099.json"])  # fmt: skip
            os.mkfifo(folder / name)
        elif kind == "link":
            name = rng.choice(["manifest.json", ".nebula-sequence.json", "model",
                               f"global_step{rng.randrange(10_000, 20_000)}"])  # fmt: skip
            os.symlink(outside, folder / name)
        elif kind == "folder":
            name = rng.choice(["manifest.json", ".rank-0.json", ".nebula-sequence.json"])
            (folder / name).mkdir()
        elif kind == "future hold":
            doc = {"job": "planted", "host": "elsewhere", "pid": 7, "pid_start": None,
                   "started_at": future.isoformat(), "renewed_at": future.isoformat()}  # fmt: skip
            name = f".nebula-job-{rng.randrange(1, 99_999_999):08d}.json"
            (root / name).write_text(json.dumps(doc))
            # Left by a job long gone whose clock ran ahead: by the store's clock it was
            # last written past the hold's time to live (a hold written just now counts
            # for that long, whatever its dates say: holds.lease_alive).
            gone = time.time() - 2 * HOLD_TTL_S
            os.utime(root / name, (gone, gone))
        elif kind == "future lease":
            lease = rng.choice(["read", "delete", "hold", "list"])
            name = f".lease-{lease}-{_stamp(future)}-4242-cafe-elsewhere.json"
            (folder / name).write_text("{}")
        elif kind == "pid 1":
            doc = {"job": "planted", "host": os.uname().nodename, "pid": 1, "pid_start": None,
                   "started_at": "", "renewed_at": ""}  # fmt: skip
            name = f".nebula-job-{rng.randrange(1, 99_999_999):08d}.json"
            (root / name).write_text(json.dumps(doc))
        elif kind == "not utf-8":
            name = b"global_step\xff" + str(rng.randrange(99)).encode()
            os.mkdir(os.path.join(os.fsencode(root), name))
        else:
            name = rng.choice(["checkpointHistories.csv.bak", "README", "global_step7.tmp"])
            (folder / name).write_bytes(os.urandom(rng.randrange(1, 64)))
    except (FileExistsError, FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return "collided"  # the folder went (retention) or the name is taken: no junk
    return kind


def _command(args: list[str], env: dict[str, str]) -> tuple[int | None, str]:
    """(exit code or None if it hung, stderr) of `nebula ARGS`."""
    nebula = [str(Path(sys.executable).with_name("nebula"))]
    try:
        done = warm.run([*nebula, *args], capture_output=True, env=env,
                              timeout=TIMEOUT_S, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return None, ""
    for stream, data in (("stdout", done.stdout), ("stderr", done.stderr)):
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:  # a name from disk printed raw, not escaped
            return done.returncode, f"Traceback-free, but raw bytes on {stream}: {data!r}"
    return done.returncode, done.stderr.decode()


def junk_campaign(work: Path, rounds: int, seed: int = 29) -> Figures:
    """`rounds` training jobs, each with junk planted in its root while it trains."""
    figures = Figures("junk")
    rng = random.Random(seed)
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(work / "memory"), PYTHONUNBUFFERED="1")
    outside = work / "outside"
    outside.mkdir(parents=True, exist_ok=True)
    (outside / "victim").write_text("never written through a link")
    for round_ in range(rounds):
        root, journal = work / f"root{round_}", work / f"journal{round_}"
        root.mkdir(parents=True)
        steps = rng.randint(6, 12)
        child = warm.Popen(
            [sys.executable, "-c", JOB, str(root), str(steps), str(journal)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        deadline = time.monotonic() + TIMEOUT_S
        while child.poll() is None and time.monotonic() < deadline:
            figures.add(f"planted {_plant(root, rng, outside / 'victim')}")
            time.sleep(rng.uniform(0.0, 0.05))
        try:
            out, err = child.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            out, err = child.communicate()
            figures.add("hangs")
            figures.failures.append(f"round {round_}: the training job hung; {err[-2000:]}")
            continue
        figures.add("jobs")
        if child.returncode != 0 or "DONE" not in out:
            figures.failures.append(f"round {round_}: exit {child.returncode}: {err[-2000:]}")
        if "Traceback" in err:
            figures.add("tracebacks")
            figures.failures.append(f"round {round_}: a traceback: {err[-2000:]}")
        acked = [int(x) for x in journal.read_text().split()] if journal.exists() else []
        figures.add("acknowledged", len(acked))
        _check_root(root, acked, figures, round_, env)
        if (outside / "victim").read_text() != "never written through a link":
            figures.failures.append(f"round {round_}: a file was written through a link")
    figures.counts.setdefault("hangs", 0)
    figures.counts.setdefault("tracebacks", 0)
    figures.counts.setdefault("acknowledged lost", 0)
    return figures


def _check_root(root: Path, acked: list[int], figures: Figures, round_: int,
                env: dict[str, str]) -> None:  # fmt: skip
    """In a fresh process: the newest checkpoint is the last acknowledged step and loads
    with its values; the operator's commands answer without a traceback or a hang."""
    check = (
        "import sys, torch, nebulaml as nm\n"
        "latest = nm.get_latest_checkpoint(sys.argv[1])\n"
        "print(latest.tag.removeprefix('global_step') if latest else 0, "
        "float(latest.load('model')['w'][0]) if latest else 0)\n"
    )
    done = warm.run([sys.executable, "-c", check, str(root)], capture_output=True,
                          text=True, env=env, timeout=TIMEOUT_S, check=False)  # fmt: skip
    try:
        step, value = done.stdout.split()
        ok = int(step) >= (acked[-1] if acked else 0) and float(value) == float(step)
    except ValueError:
        ok = False
    if not ok:  # the newest is at least the last acknowledged, and holds its own step
        figures.add("acknowledged lost")
        figures.failures.append(
            f"round {round_}: latest is {done.stdout.strip()!r}, last acknowledged "
            f"{acked[-1:]}: {done.stderr[-2000:]}"
        )
    for args in (["ls", str(root)], ["verify", str(root)], ["history", str(root)],
                 ["prune", str(root), "--keep", "1", "--dry-run"]):  # fmt: skip
        code, err = _command(args, env)
        figures.add("commands")
        if code is None:
            figures.add("hangs")
            figures.failures.append(f"round {round_}: nebula {args[0]} hung")
        elif "Traceback" in err or "raw bytes" in err:
            figures.add("tracebacks" if "Traceback" in err else "raw bytes printed")
            figures.failures.append(f"round {round_}: nebula {args[0]}: {err[-2000:]}")
        else:
            figures.add(f"nebula {args[0]} exit {code}")
