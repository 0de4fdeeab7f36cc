"""The elastic-restart campaign (issue #32): torchrun jobs of 2 gloo ranks, each rank saving
its 8 MB part of a checkpoint every step, whose ranks are SIGKILLed at random moments;
torchrun stops the survivor and restarts both, and every restart must resume where the job
left off.

Each job is `python -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --max-restarts K
--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 --local-addr 127.0.0.1` running
elastic_worker.py, with a persistent root, a memory tier (NEBULA_MEMORY_TIER_PATH, never
/dev/shm) and journals of its own under the campaign's folder. A killer thread waits for
each incarnation to start (and mostly to resume), SIGKILLs a random rank's worker (found by
the pid its journal recorded, checked to be a child of the torchrun agent) at a random
moment, times the survivor's exit and records what both tiers hold once it is gone (every
file's size, and the small JSON and CSV files); after K kills the job is let finish.

From each rank's own fsynced journal ("ack <N>" once `commit()` returned), for every
restart (invariants; any break is a failure, and the job's folder is kept under
ELASTIC_CAMPAIGN_KEEP, default /work/elastic-failures, with torchrun's output):
- both ranks resume the same step, and it is at or after the last step BOTH ranks
  acknowledged before the restart;
- no checkpoint is torn: at each resume every item of the latest checkpoint loads and is
  the state of its step (checked by the worker), and so is every committed checkpoint of
  the root after the job;
- the job finishes (exit 0) and its latest checkpoint is its last acknowledged one.
Figures: kills, restarts, restart time (from the kill to both ranks' "resumed" line) and
the survivor's exit (from the kill, and from torchrun's SIGTERM, as its log says). Each run
also leaves in the keep folder, under its start time: restarts.tsv (a row per restart),
figures.json and every job's torchrun output (logs/).

Not for: a single torchrun restart at a chosen point (tests/dist/test_generations.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import warm
from campaigns import Figures, keep_failed, median_max, utc_clock
from elastic_worker import check_loaded

import nebulaml as nm

WORKER = Path(__file__).with_name("elastic_worker.py")
WORLD_SIZE = 2
KILLS_PER_JOB = 3  # torchrun's --max-restarts of each job: every kill is a restart
MAX_STEP = 100_000  # a job stops at the campaign's word, long before this
PAUSE_S = 0.05  # between two steps
START_KILLS = 0.15  # of the kills: while the incarnation starts (init, recovery, resume)
WAIT_S = 240.0  # for an incarnation to start or resume
JOB_TIMEOUT_S = 1200.0


def keep_folder() -> Path:
    return Path(os.environ.get("ELASTIC_CAMPAIGN_KEEP", "/work/elastic-failures"))


# the journals ---------------------------------------------------------------------------
@dataclass
class Incarnation:
    """What the ranks of one incarnation (torchrun's restart count) journalled."""

    restart: int
    pids: dict[int, int] = field(default_factory=dict)
    started: dict[int, float] = field(default_factory=dict)
    resumed: dict[int, tuple[int, float]] = field(default_factory=dict)
    acks: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    done: dict[int, int] = field(default_factory=dict)


def read_journals(folder: Path) -> dict[int, Incarnation]:
    """Every rank's journal, by incarnation (a torn last line is ignored)."""
    incarnations: dict[int, Incarnation] = {}
    for rank in range(WORLD_SIZE):
        path = folder / f"rank{rank}.journal"
        if not path.exists():
            continue
        current: Incarnation | None = None
        for line in path.read_text(errors="replace").splitlines():
            word, *rest = line.split() or [""]
            try:
                if word == "start":
                    restart = int(rest[0])
                    current = incarnations.setdefault(restart, Incarnation(restart))
                    current.pids[rank], current.started[rank] = int(rest[1]), float(rest[2])
                elif current is None:
                    continue
                elif word == "resumed":
                    current.resumed[rank] = (int(rest[0]), float(rest[1]))
                elif word == "ack":
                    current.acks.setdefault(rank, []).append((int(rest[0]), float(rest[1])))
                elif word == "done":
                    current.done[rank] = int(rest[0])
            except (IndexError, ValueError):
                continue
    return incarnations


# one job ----------------------------------------------------------------------------------
@dataclass
class Kill:
    """One SIGKILL of the killer thread."""

    incarnation: int
    rank: int
    wanted: str  # "start" (while the incarnation starts) or "training"
    at: float  # wall clock
    survivor_pids: list[int]
    survivors_gone: float | None = None  # wall clock


@dataclass
class Job:
    name: str
    folder: Path
    kills_wanted: int
    rng: random.Random
    proc: subprocess.Popen[bytes] | None = None
    kills: list[Kill] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def root(self) -> Path:
        return self.folder / "root"

    @property
    def memory(self) -> Path:
        return self.folder / "mem"

    @property
    def journals(self) -> Path:
        return self.folder / "journal"

    @property
    def log(self) -> Path:
        return self.folder / "torchrun.log"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_for(self, what: str, ready: Callable[[], bool]) -> bool:
        """Until `ready()`; False (an error noted) if the job ended or WAIT_S passed first."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if ready():
                return True
            if not self.running():
                self.errors.append(f"the job ended before {what}")
                return False
            time.sleep(0.05)
        self.errors.append(f"{what}: not within {WAIT_S:.0f} s")
        return False


def _proc(pid: int) -> tuple[str, int, str] | None:
    """A process's state letter, parent pid and command line (from /proc); None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, UnicodeDecodeError):
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # the command name may hold spaces
    return fields[0], int(fields[1]), cmdline


def _gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie its parent has not reaped yet counts)."""
    proc = _proc(pid)
    return proc is None or proc[0] in ("Z", "X")


def _worker_of(job: Job, pid: int) -> bool:
    """Whether `pid` is a live worker of this job's torchrun agent (not a reused pid)."""
    assert job.proc is not None
    proc = _proc(pid)
    return proc is not None and proc[1] == job.proc.pid and "elastic_worker" in proc[2]


def _children(pid: int) -> list[int]:
    """The live child processes of `pid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (proc := _proc(int(entry.name))) and proc[1] == pid:
            out.append(int(entry.name))
    return out


def _snapshot(job: Job, dst: Path) -> None:
    """Both tiers as they are now: every file's size, and copies of the small records."""
    lines = []
    for tier, base in (("root", job.root), ("mem", job.memory)):
        for path in sorted(base.rglob("*")) if base.exists() else []:
            try:
                if not path.is_file():
                    continue
                rel = path.relative_to(base)
                lines.append(f"{tier}/{rel} {path.stat().st_size}")
                if path.suffix in (".json", ".csv") or ".checkpointHistories" in str(rel):
                    target = dst / tier / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, target)
            except OSError:
                continue  # deleted meanwhile
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "files.txt").write_text("\n".join(lines) + "\n")


def _killer(job: Job) -> None:
    """Kill a random rank of each incarnation at a random moment, `kills_wanted` times;
    then let the job finish (the stop file)."""
    rng = job.rng
    try:
        for k in range(job.kills_wanted):

            def started(k: int = k) -> bool:
                inc = read_journals(job.journals).get(k)
                return inc is not None and len(inc.pids) == WORLD_SIZE

            def resumed(k: int = k) -> bool:
                inc = read_journals(job.journals).get(k)
                return inc is not None and len(inc.resumed) == WORLD_SIZE

            if not job.wait_for(f"incarnation {k} started", started):
                return
            if rng.random() < START_KILLS:
                wanted = "start"
                time.sleep(rng.uniform(0.0, 2.5))
            else:
                wanted = "training"
                if not job.wait_for(f"incarnation {k} resumed", resumed):
                    return
                time.sleep(rng.uniform(0.0, 4.0))
            pids = read_journals(job.journals)[k].pids
            victim = rng.randrange(WORLD_SIZE)
            if not _worker_of(job, pids[victim]):
                job.errors.append(f"incarnation {k}: rank {victim} (pid {pids[victim]}) "
                                  "was not running when it was to be killed")  # fmt: skip
                return
            at = time.time()
            os.kill(pids[victim], signal.SIGKILL)
            kill = Kill(k, victim, wanted, at, [p for r, p in pids.items() if r != victim])
            job.kills.append(kill)
            deadline = time.monotonic() + 120
            while not all(map(_gone, kill.survivor_pids)) and time.monotonic() < deadline:
                time.sleep(0.01)
            if all(map(_gone, kill.survivor_pids)):
                kill.survivors_gone = time.time()
            _snapshot(job, job.folder / "snapshots" / f"kill{k}")
        if job.wait_for(f"incarnation {job.kills_wanted} resumed", lambda: len(
            read_journals(job.journals).get(job.kills_wanted, Incarnation(-1)).resumed
        ) == WORLD_SIZE):  # fmt: skip
            time.sleep(rng.uniform(1.0, 3.0))
    except Exception as exc:  # noqa: BLE001 - the killer's own failure is the job's failure
        job.errors.append(f"killer: {type(exc).__name__}: {exc}")
    finally:
        (job.journals / "stop").touch()


def _stop(job: Job) -> None:
    """End what is left of a job that overran: its workers, then the agent (by pid)."""
    assert job.proc is not None
    for pid in _children(job.proc.pid):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    job.proc.kill()
    job.proc.wait()


def _env(job: Job) -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT")  # fmt: skip
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in drop and not k.startswith(("TORCHELASTIC_", "NEBULA_"))
    }
    env.update(NEBULA_MEMORY_TIER_PATH=str(job.memory), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def run_job(job: Job) -> int | None:
    """Run one torchrun job under the killer; its exit status (None: it overran)."""
    job.journals.mkdir(parents=True)
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--nproc-per-node", str(WORLD_SIZE), "--max-restarts", str(job.kills_wanted),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
        "--rdzv-id", f"{job.name}-{os.getpid()}", "--local-addr", "127.0.0.1",
        "--monitor-interval", "0.5",
        str(WORKER), str(job.root), str(job.journals), str(MAX_STEP), str(PAUSE_S),
    ]  # fmt: skip
    with open(job.log, "wb") as out:
        job.proc = warm.Popen(argv, env=_env(job), stdout=out, stderr=subprocess.STDOUT)
        killer = threading.Thread(target=_killer, args=(job,), name=f"killer-{job.name}")
        killer.start()
        try:
            rc: int | None = job.proc.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
            _stop(job)
        killer.join()
    return rc


# torchrun's output ------------------------------------------------------------------------
_STAMP = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+) ")
_SIGTERM = re.compile(r"Sending process (\d+) closing signal SIGTERM")
_FORCED = re.compile(r"Unable to shutdown process (\d+) via")
_UNPERSISTED = re.compile(r"^nebula: checkpoint '[^']+' was not persisted", re.MULTILINE)
_BUSY = re.compile(r"^could not persist '[^']+' .* is being written by ", re.MULTILINE)
_EXCEPTION = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Exit)): ")


def _stamp(line: str) -> float | None:
    """The wall clock of a torch log line ("W1203 12:49:15.123456 pid file:line] ...")."""
    m = _STAMP.match(line)
    if m is None:
        return None
    month, day, hh, mm, ss, frac = m.groups()
    when = datetime(datetime.now().year, int(month), int(day), int(hh), int(mm), int(ss))
    return when.timestamp() + float(f"0.{frac}")


def read_log(text: str) -> tuple[dict[int, float], set[int], Counter[str], int]:
    """From torchrun's output: when each pid was sent SIGTERM, the pids torchrun had to
    SIGKILL, the exceptions printed (by type), and the number of tracebacks."""
    sigterms: dict[int, float] = {}
    forced: set[int] = set()
    exceptions: Counter[str] = Counter()
    for line in text.splitlines():
        if m := _SIGTERM.search(line):
            when = _stamp(line)
            if when is not None:
                sigterms[int(m.group(1))] = when
        elif m := _FORCED.search(line):
            forced.add(int(m.group(1)))
        elif m := _EXCEPTION.match(line):
            exceptions[m.group(1)] += 1
    return sigterms, forced, exceptions, text.count("Traceback (most recent call last)")


# the checks -------------------------------------------------------------------------------
@dataclass
class Timings:
    restart: list[float] = field(default_factory=list)  # kill -> both ranks resumed
    survivor: list[float] = field(default_factory=list)  # kill -> survivors gone
    after_sigterm: list[float] = field(default_factory=list)  # torchrun's SIGTERM -> gone
    start_to_resume: list[float] = field(default_factory=list)  # new processes -> resumed
    rows: list[str] = field(default_factory=list)


def check_job(job: Job, rc: int | None, figures: Figures, timings: Timings) -> list[str]:
    """The invariants of one job, from its journals, results, root and torchrun's output;
    the failures (also added to `figures`)."""
    failures = [f"{job.name}: {e}" for e in job.errors]
    incs = read_journals(job.journals)
    text = job.log.read_text(errors="replace")
    sigterms, forced, exceptions, tracebacks = read_log(text)
    figures.add("tracebacks in torchrun's output", tracebacks)
    for name, n in exceptions.items():
        figures.add(f"printed: {name}", n)
    figures.add("survivors SIGKILLed by torchrun", len(forced))
    # nebula's own words at exit: a checkpoint an exit left unpersisted (the memory tier
    # keeps it for the next incarnation), and persists refused for a writer taken as live.
    figures.add("exits that left a checkpoint unpersisted", len(_UNPERSISTED.findall(text)))
    figures.add("persist tries refused: 'being written'", len(_BUSY.findall(text)))
    if rc != 0:
        figures.add("jobs failed")
        failures.append(f"{job.name}: torchrun exited {rc}: {text[-3000:]}")
    figures.add("jobs")
    kills = {kill.incarnation: kill for kill in job.kills}
    figures.add("kills", len(kills))
    for killed in kills.values():
        figures.add(f"kills of rank {killed.rank}")
    acked = dict.fromkeys(range(WORLD_SIZE), 0)  # the last step each rank acked so far
    for k in sorted(incs):
        inc = incs[k]
        if k > 0:
            figures.add("restarts")
        kill = kills.get(k - 1)
        both = min(acked.values())
        if len(inc.resumed) == WORLD_SIZE:
            steps = {r: step for r, (step, _when) in inc.resumed.items()}
            resumed = min(steps.values())
            where = (f"{job.name} restart {k}: both ranks acked step {both} (rank acks "
                     f"{acked}), resumed {steps}")  # fmt: skip
            if k > 0:
                figures.add("restarts checked")
            if len(set(steps.values())) > 1:
                figures.add("ranks resumed different steps")
                failures.append(f"{where}: the ranks disagree")
            if resumed < both:
                figures.add("resumed behind an acknowledged step")
                failures.append(f"{where}: behind the acknowledged step {both}")
            elif resumed < max(acked.values()):
                figures.add("resumed behind one rank's ack (not both)")
            if kill is not None:
                back = max(when for _step, when in inc.resumed.values())
                timings.restart.append(back - kill.at)
                timings.start_to_resume.append(back - min(inc.started.values()))
        elif k < max(incs):
            figures.add("incarnations killed before resuming")
        if kill is not None:
            victim_resumed = incs.get(k - 1, Incarnation(-1)).resumed.get(kill.rank)
            phase = "training" if victim_resumed and victim_resumed[1] < kill.at else "start"
            figures.add(f"kills while {phase}")
            survivor = kill.survivors_gone - kill.at if kill.survivors_gone else math.nan
            if kill.survivors_gone is not None:
                timings.survivor.append(survivor)
                for pid in kill.survivor_pids:
                    if pid in sigterms:
                        timings.after_sigterm.append(kill.survivors_gone - sigterms[pid])
            back_s = (max(w for _s, w in inc.resumed.values()) - kill.at
                      if len(inc.resumed) == WORLD_SIZE else math.nan)  # fmt: skip
            timings.rows.append(
                f"{job.name}\t{k - 1}\t{kill.rank}\t{utc_clock(kill.at)}\t{phase}\t{both}\t"
                f"{sorted(s for s, _w in inc.resumed.values())}\t{back_s:.2f}\t{survivor:.2f}\t"
                f"{'SIGKILL' if set(kill.survivor_pids) & forced else 'exited'}"
            )
        for r, acks in inc.acks.items():
            acked[r] = max([acked[r], *(step for step, _when in acks)])
    figures.add("acknowledged steps (all jobs)", max(acked.values()))
    for rank in range(WORLD_SIZE):
        path = job.journals / f"results-rank{rank}.txt"
        for line in path.read_text().splitlines() if path.exists() else []:
            if line.startswith("FAIL"):
                figures.add("torn or failed resumes" if "torn" in line else "worker failures")
                failures.append(f"{job.name} rank {rank}: {line}")
            elif line.startswith("OK"):
                figures.add("resumes loaded and checked")
    failures += _check_root(job, max(acked.values()), figures)
    return failures


def _check_root(job: Job, last_acked: int, figures: Figures) -> list[str]:
    """After the job: every committed checkpoint of the root loads whole, as its step's
    state; the latest is the last acknowledged; no memory tier is left behind."""
    failures = []
    os.environ["NEBULA_MEMORY_TIER_PATH"] = str(job.memory)
    try:
        tier = Path(nm.memory_tier_path(str(job.root)))
        if tier.exists() and any(p.is_dir() for p in tier.iterdir()):
            figures.add("memory tiers left after the final exit")
        listed = nm.list_checkpoints(str(job.root), hold=False)
        if not listed or listed[0]["step"] != last_acked:
            figures.add("latest is not the last acknowledged")
            newest = listed[0]["tag"] if listed else None
            failures.append(f"{job.name}: after the job the latest is {newest}, "
                            f"the last acknowledged step {last_acked}")  # fmt: skip
        for info in listed:
            handle = nm.get_checkpoint(info["tag"], persist_path=str(job.root))
            if handle is None:
                continue
            with handle:
                problems = check_loaded(handle, int(info["step"]), WORLD_SIZE)
            figures.add("checkpoints checked after the job")
            if problems:
                figures.add("torn checkpoints after the job")
                failures.extend(f"{job.name}: {p}" for p in problems)
    finally:
        os.environ.pop("NEBULA_MEMORY_TIER_PATH", None)
    return failures


def _keep(job: Job, stamp: str, failures: list[str]) -> None:
    """A failed job's folder (roots, memory tier, journals, snapshots, torchrun's output)
    under the keep folder, for diagnosis."""
    kills = [
        f"incarnation {k.incarnation}: rank {k.rank} SIGKILLed at {utc_clock(k.at)} "
        f"(aimed at its {k.wanted}); survivors {k.survivor_pids} gone at "
        f"{utc_clock(k.survivors_gone) if k.survivors_gone else 'never'}"
        for k in job.kills
    ]
    keep_failed(job.folder, keep_folder() / stamp / job.name, failures, {"kills.txt": kills})


def elastic_campaign(work: Path, restarts: int, seed: int = 0) -> Figures:
    """torchrun jobs SIGKILLed `restarts` times in all; see the module docstring."""
    figures = Figures("elastic restarts")
    rng = random.Random(seed)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    timings = Timings()
    n_jobs = math.ceil(restarts / KILLS_PER_JOB)
    for n in range(n_jobs):
        kills = min(KILLS_PER_JOB, restarts - n * KILLS_PER_JOB)
        job = Job(f"job{n}", work / f"job{n}", kills, random.Random(rng.random()))
        rc = run_job(job)
        failures = check_job(job, rc, figures, timings)
        figures.failures.extend(failures)
        if failures:
            _keep(job, stamp, failures)
        with contextlib.suppress(OSError):  # torchrun's output, for the report
            (keep_folder() / stamp / "logs").mkdir(parents=True, exist_ok=True)
            shutil.copy2(job.log, keep_folder() / stamp / "logs" / f"{job.name}.log")
        shutil.rmtree(job.folder, ignore_errors=True)
    median_max(figures, "restart", timings.restart)
    median_max(figures, "survivor exit after the kill", timings.survivor)
    median_max(figures, "survivor exit after SIGTERM", timings.after_sigterm)
    median_max(figures, "new incarnation start to resume", timings.start_to_resume)
    for key in ("resumed behind an acknowledged step", "ranks resumed different steps",
                "torn or failed resumes", "torn checkpoints after the job", "jobs failed",
                "latest is not the last acknowledged"):  # fmt: skip
        figures.counts.setdefault(key, 0)
    table = keep_folder() / stamp / "restarts.tsv"
    try:
        table.parent.mkdir(parents=True, exist_ok=True)
        header = ("job\tkilled incarnation\tvictim\tkilled at (UTC)\tphase\tacked by both\t"
                  "resumed\trestart s\tsurvivor exit s\tsurvivor\n")  # fmt: skip
        table.write_text(header + "\n".join(timings.rows) + "\n")
        (table.parent / "figures.json").write_text(json.dumps(figures.counts, indent=1))
    except OSError:
        pass
    return figures
